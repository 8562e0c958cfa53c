"""``kv_placement=host`` as the backends drive it (issue 54): the K/V write of a step, the page
summaries in vLLM's shrunk page, the top-k decode over placed pages, and (CUDA) dense prefill rows
over K/V gathered from the pool. The CPU twin keeps vLLM's page whole and the summaries beside it
(:class:`HostKV` ``summaries_in_page=False``).

vLLM's page of each layer is shrunk (:func:`.._compat.summary_page_spec`) to what the top-k
selection scores: one key min and max per block and KV head. vLLM binds it to the layer as its
logical ``[blocks, Hkv, states, content]`` view, here ``[blocks, Hkv, 1, 2 x D]`` in the model's
dtype: the first D values are the min, the last D the max (:func:`summary_views`). The full K/V
of every block go to the worker's one :class:`.HostPlacement`, which holds every layer (a pool
entry per vLLM block id), made at the first write, once vLLM's block count is known.

Pure torch and plain tensors: a test drives it without a running vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import ConfigError
from ..settings import SparseSettings
from ..decode.placed import fold_page_summaries, topk_decode_placed
from ..decode.topk import TopkDecodeBudget
from ..kv_placement.base import KVLayout
from ..kv_placement.host import HostPlacement, pool_block_bytes
from ..prefill.placed import dense_prefill_placed


@dataclass(frozen=True)
class SummaryViews:
    """Key min / max ``[blocks, Hkv, D]`` of one layer: views into vLLM's shrunk page (what the
    top-k selection reads as :class:`..decode.topk.PageSummaries`)."""

    min: torch.Tensor
    max: torch.Tensor


def summary_views(kv_cache: torch.Tensor) -> SummaryViews:
    """The min and max halves of vLLM's shrunk page ``[blocks, Hkv, 1, 2 x D]`` (no copy)."""
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] % 2:
        raise ValueError(f"vLLM's page {tuple(kv_cache.shape)} is not a page summary [blocks, Hkv, 1, 2 x head_size]: "
                         f"kv_placement=host needs the backend's customize_spec applied (vLLM with customize_spec)")
    d = kv_cache.shape[3] // 2
    return SummaryViews(kv_cache[:, :, 0, :d], kv_cache[:, :, 0, d:])


def pinned_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                  budget: TopkDecodeBudget) -> list[int]:
    """The block ids of every running sequence's sink and recent pages (what each of its decode
    steps selects whatever the scores): read back to the host."""
    table, lens = block_table.cpu().long(), seq_lens.cpu().long()
    blocks: set[int] = set()
    for row, seq_len in zip(table, lens.tolist()):
        pages = -(-seq_len // page_size)
        ends = list(range(min(budget.sink_pages, pages))) + list(range(max(pages - budget.recent_pages, 0), pages))
        blocks.update(row[ends].tolist())
    return sorted(blocks)


class HostKV:
    """One worker's host placement and the map from vLLM's layer names to its layers.

    ``layer_names``: every attention layer of the model this backend serves (vLLM gives each the
    same block ids); ``page_size``: tokens per vLLM block. ``summaries_in_page``: the summaries
    are vLLM's shrunk page (CUDA); False keeps them in tensors of their own beside vLLM's full
    page (the CPU twin, whose own kernel still reads that page)."""

    def __init__(self, settings: SparseSettings, layer_names: Sequence[str], page_size: int,
                 summaries_in_page: bool = True):
        self.settings = settings
        self.page_size = page_size
        self.layer_of = {name: i for i, name in enumerate(layer_names)}
        self.budget = TopkDecodeBudget.from_settings(settings)
        self.summaries_in_page = summaries_in_page
        self.placement: HostPlacement | None = None  # made at the first write (vLLM's cache exists then)
        self.own_summaries: list[SummaryViews] = []  # per layer, where not in vLLM's page

    def layer(self, layer_name: str) -> int:
        index = self.layer_of.get(layer_name)
        if index is None:
            raise ValueError(f"layer {layer_name} is not among the {len(self.layer_of)} attention layers the host "
                             f"KV pool was made for")
        return index

    def placement_for(self, kv_cache: torch.Tensor, key: torch.Tensor) -> HostPlacement:
        """The placement, made on the first call from vLLM's cache (its block count) and the
        step's keys (heads, head size, dtype, device). Every vLLM block id must have its pool
        entry, so that a block's write never finds the pool full: ConfigError naming
        ``--num-gpu-blocks-override`` otherwise."""
        if self.placement is None:
            if self.summaries_in_page and (not kv_cache.dtype.is_floating_point or kv_cache.element_size() < 2):
                raise ConfigError(f"kv_placement=host: vLLM's KV cache dtype {kv_cache.dtype} cannot hold the page "
                                  f"summaries; run with the model's dtype (--kv-cache-dtype auto)")
            layout = KVLayout(num_layers=len(self.layer_of), num_blocks=kv_cache.shape[0], page_size=self.page_size,
                              num_kv_heads=key.shape[1], head_size=key.shape[2], dtype=key.dtype, device=key.device)
            check_pool_holds_vllm_blocks(self.settings, layout)
            self.placement = HostPlacement(self.settings, layout)
            if not self.summaries_in_page:
                shape = (layout.num_blocks, layout.num_kv_heads, layout.head_size)
                self.own_summaries = [SummaryViews(torch.zeros(shape, dtype=key.dtype, device=key.device),
                                                   torch.zeros(shape, dtype=key.dtype, device=key.device))
                                      for _ in range(layout.num_layers)]
        return self.placement

    def summaries(self, layer: int, kv_cache: torch.Tensor) -> SummaryViews:
        return summary_views(kv_cache) if self.summaries_in_page else self.own_summaries[layer]

    def write(self, layer_name: str, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """What ``do_kv_cache_update`` does for a layer: the step's new tokens ``[n, Hkv, D]`` at
        vLLM's ``slot_mapping`` into the host pool, their keys folded into the page summaries."""
        placement = self.placement_for(kv_cache, key)
        # key / value may carry padding rows past the slot mapping (vLLM pads them for CUDA graphs)
        n = slot_mapping.shape[0]
        key, value = key[:n], value[:n]
        layer = self.layer(layer_name)
        placement.write_tokens(layer, key, value, slot_mapping)
        summaries = self.summaries(layer, kv_cache)
        fold_page_summaries(summaries.min, summaries.max, key, slot_mapping, self.page_size)

    def decode(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """Top-k decode attention of one query token per sequence over the placed pages, into
        ``out``; the batch's sink and recent pages are pinned in the hot cache first."""
        if self.placement is None:
            raise RuntimeError("kv_placement=host: a decode step before any K/V was written")
        self.placement.set_pinned(pinned_blocks(block_table, seq_lens, self.page_size, self.budget))
        layer = self.layer(layer_name)
        # the host placement reads its resident pages, not vLLM's page
        topk_decode_placed(query, None, None, self.summaries(layer, kv_cache), block_table, seq_lens, self.budget,
                           scale, out, placement=self.placement, layer=layer)

    def prefill(self, layer_name: str, query: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                block_table: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """A step with prefill rows, into ``out``: every row dense over its whole K/V gathered from
        the pool (:func:`..prefill.placed.dense_prefill_placed`; host lists of the step)."""
        if self.placement is None:
            raise RuntimeError("kv_placement=host: a prefill step before any K/V was written")
        layer, placement = self.layer(layer_name), self.placement
        dense_prefill_placed(query, query_start_loc, seq_lens, block_table, self.page_size, scale, out,
                             lambda blocks: placement.gather(layer, blocks))


def check_pool_holds_vllm_blocks(settings: SparseSettings, layout: KVLayout) -> None:
    """ConfigError unless ``host_kv_pool_bytes`` holds a pool entry for every block id vLLM
    made (``layout.num_blocks``), naming the flag that caps vLLM's blocks."""
    block_bytes = pool_block_bytes(layout, settings.host_kv_dtype)
    holds = (settings.host_kv_pool_bytes or 0) // block_bytes
    if layout.num_blocks > holds:
        raise ConfigError(f"kv_placement=host: vLLM made {layout.num_blocks} KV-cache blocks but host_kv_pool_bytes="
                          f"{settings.host_kv_pool_bytes} holds {holds} (one block of all {layout.num_layers} layers "
                          f"takes {block_bytes} bytes); start vLLM with --num-gpu-blocks-override {holds} or raise "
                          f"host_kv_pool_bytes")
