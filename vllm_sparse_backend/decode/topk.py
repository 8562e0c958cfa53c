"""One decode step of the opt-in top-k decode mode (issue 8): metadata -> summaries -> pages -> attention.

Backend-agnostic glue between a step's paged-cache metadata and the kernels of
``vllm_sparse_kernels/decode/topk_decode.py``:

1. the pages the step's slots were written to get their key summaries (per-page min / max per
   KV head) recomputed, so summaries follow the cache through prefill and decode alike;
2. each decode query scores every page of its sequence by the Quest bound and keeps the sink
   and recent pages plus the ``budget_pages`` best others (one selection per KV head, its query
   heads' bounds summed);
3. attention over those pages only (optionally only the ``topk_tokens`` best keys of them).

Every width is a host int fixed by the settings and the block table's width, and nothing reads
the device back, so a uniform decode batch can be captured in a CUDA graph. The summaries live
beside vLLM's cache (:class:`PageSummaries`): 2 x head_dim values per page and KV head, 1/page
of the KV cache's size (1/16 at vLLM's default page of 16 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..settings import SparseSettings
from ..kernels import topk_decode as kernels
from .memory import EmptyTensor, StateLayout, empty_on


@dataclass(frozen=True)
class TopkDecodeBudget:
    sink_pages: int
    recent_pages: int
    budget_pages: int
    topk_tokens: int = 0

    @classmethod
    def from_settings(cls, cfg: SparseSettings) -> "TopkDecodeBudget":
        return cls(cfg.decode.sink_pages, cfg.decode.recent_pages, cfg.decode.budget_pages, cfg.decode.topk.tokens)


def summaries_layout(num_pages: int, num_kv_heads: int, head_size: int, kv_dtype: torch.dtype) -> StateLayout:
    """The tensors of :class:`PageSummaries` for a cache of ``num_pages`` pages: key min and max
    ``[num_pages, Hkv, D]`` in the cache's dtype (the kernels' ``allocate_page_summaries``)."""
    shape = (num_pages, num_kv_heads, head_size)
    return [(shape, kv_dtype), (shape, kv_dtype)]


class PageSummaries:
    """Per-page key min / max of one layer's cache, indexed by physical page like the cache."""

    def __init__(self, key_cache: torch.Tensor, cfg: SparseSettings | None = None,
                 empty: EmptyTensor | None = None):
        """``empty``: where the tensors come from (default: a plain allocation beside the cache)."""
        self.key_cache_ptr = key_cache.data_ptr()  # the cache they describe (vLLM binds it once)
        self.budget = TopkDecodeBudget.from_settings(cfg or SparseSettings())
        num_pages, _, hkv, d = key_cache.shape
        empty = empty or empty_on(key_cache.device)
        self.min, self.max = (empty(shape, dtype) for shape, dtype in summaries_layout(num_pages, hkv, d,
                                                                                        key_cache.dtype))
        # a page not summarised yet (written before these existed) bounds to 0: neither always
        # chosen nor never; every page written from now on gets its real summary
        self.min.zero_()
        self.max.zero_()

    @property
    def nbytes(self) -> int:
        return self.min.nbytes + self.max.nbytes

    def update(self, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After the cache update of a step: re-summarise the pages ``slot_mapping`` wrote to."""
        kernels.update_page_summaries(key_cache, self.min, self.max, slot_mapping)

    def prefill(self, query, key, key_cache, segments, block_table, scale) -> None:
        """Nothing to do after a prefill: :meth:`update` already followed the written pages."""

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        return topk_decode(query, key_cache, value_cache, self, block_table, seq_lens, self.budget, scale, out)


class TopkDecode:
    """decode_mode=topk as the backend drives it (backends/decode.py): nothing to plan per step
    (the summaries follow the written slots), :class:`PageSummaries` per layer."""

    name = "topk"
    plans_steps = False

    def __init__(self, cfg: SparseSettings):
        self.cfg = cfg

    def plan_step(self, query_start_loc: list[int], seq_lens: list[int], page_size: int, device) -> None:
        return None

    def unsupported_page_size(self, page_size: int) -> str | None:
        return None

    def state_layout(self, num_pages: int, num_kv_heads: int, head_size: int, kv_dtype: torch.dtype) -> StateLayout:
        return summaries_layout(num_pages, num_kv_heads, head_size, kv_dtype)

    def allocate(self, key_cache: torch.Tensor, empty: EmptyTensor | None = None) -> PageSummaries:
        return PageSummaries(key_cache, self.cfg, empty)


def topk_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                summaries: PageSummaries, block_table: torch.Tensor, seq_lens: torch.Tensor,
                budget: TopkDecodeBudget, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Decode attention of one query token per sequence over its top-k pages, into ``out``.

    query / out: ``[batch, H, D]``; key_cache / value_cache: ``[num_pages, page, Hkv, D]`` views;
    block_table: int32 ``[batch, max_pages]``; seq_lens: int32 ``[batch]`` (the query's own key
    included; 0 for a padded slot, whose output is zeros). The summaries must be current
    (:meth:`PageSummaries.update` of this step's slots already ran)."""
    page = key_cache.shape[1]
    selected, counts = kernels.select_pages(query, summaries.min, summaries.max, block_table, seq_lens, page,
                                    sink_pages=budget.sink_pages, recent_pages=budget.recent_pages,
                                    num_pages_budget=budget.budget_pages)
    return kernels.topk_decode_attention(query, key_cache, value_cache, block_table, seq_lens, selected, counts, scale,
                                         out, topk_tokens=budget.topk_tokens, sink_pages=budget.sink_pages,
                                         recent_pages=budget.recent_pages)
