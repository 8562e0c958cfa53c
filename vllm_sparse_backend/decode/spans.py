"""One step of the opt-in span-retrieval decode mode (issue 8, item 2): metadata -> spans -> pages -> attention.

Backend-agnostic glue between a step's paged-cache metadata and the kernels of
``vllm_sparse_kernels/decode/span_decode.py`` (Ltri-LLM, mapped onto vLLM's pages; the module doc there has
the algorithm):

1. every step, the pages its slots wrote get a fallback span key (their mean key times
   ``decode_span_min_index``), and pages written from their first slot lose their persistent flag;
2. steps with prefill rows (more than one query token) divide each row's chunk into spans from the
   chunk's local attention maps and write every page's span key (the sum of its span's index
   keys), then flag the ``decode_persist_pages`` pages the chunk's last ``last_q`` queries
   retrieve: the last chunk of a prompt leaves its retrieval for the whole decode. With
   ``decode_span_persist=attention`` (the default) those are the pages the queries attend to
   most (their exact softmax over the cached context), in runs of ``1 + decode_persist_next``
   pages; with ``index`` the pages their summed query scores highest by span key;
3. pure decode batches score every page by ``q . span_key`` and attend to the sink, recent and
   flagged pages plus the ``decode_budget_pages`` best others (one selection per KV head), with
   the top-k decode attention kernel.

The segment plan of a step (:func:`plan_span_segments`, host planning over the step's lengths) is
built once by the metadata builder (through :class:`SpanDecode`) and shared by the layers. Decode
has fixed widths and no host reads, so it runs inside vLLM's CUDA graphs. The state lives beside
vLLM's cache (:class:`SpanIndex`), indexed by physical page: one fp32 vector per page and KV head
(1/16 of a bf16 KV cache at 16-token pages) and one flag byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..settings import SparseSettings
from ..kernels import span_decode, topk_decode
from .memory import EmptyTensor, StateLayout, empty_on


@dataclass(frozen=True)
class SpanDecodeBudget:
    sink_pages: int
    recent_pages: int
    persist_pages: int
    budget_pages: int
    persist_next: int = 0

    @classmethod
    def from_settings(cls, cfg: SparseSettings) -> "SpanDecodeBudget":
        d = cfg.decode
        return cls(d.sink_pages, d.recent_pages, d.spans.persist_pages, d.budget_pages,
                   d.spans.persist_next if d.spans.persist == "attention" else 0)


def span_params(cfg: SparseSettings):
    spans = cfg.decode.spans
    return span_decode.SpanParams(theta_quantile=spans.theta, iou=spans.iou, lam=spans.index_lambda,
                                  min_index=spans.min_index, max_index=spans.max_index, index=spans.index)


# Host planning over the step's lengths, copied to the device once per step; the kernels only read
# the tables it builds (span_decode.SpanSegments).
def plan_span_segments(query_start_loc: list[int], seq_lens: list[int], page_size: int, segment_tokens: int,
                       last_q: int, device) -> span_decode.SpanSegments | None:
    """Segments of the rows with more than one query token (host lists of the step). Row ``r`` has
    queries ``query_start_loc[r] .. [r + 1]`` at positions ``seq_lens[r] - q_len .. seq_lens[r]``.
    Only whole pages written by this chunk are divided (plus its last, possibly partial, page): a
    page begun by an earlier chunk has no queries here. None if no row qualifies."""
    tables, n_tok = [], []
    p_seg, p_idx, p_row, p_lp = [], [], [], []
    per_seg = segment_tokens // page_size
    persist_row, persist_tok, persist_weight, persist_len, persist_host = [], [], [], [], []
    for r in range(len(seq_lens)):
        q0, q1 = query_start_loc[r], query_start_loc[r + 1]
        q_len = q1 - q0
        if q_len <= 1:
            continue
        c1 = seq_lens[r]
        c0 = c1 - q_len
        n_last = min(last_q, q_len)
        persist_row.append(r)
        persist_tok.append([q1 - n_last + min(i, n_last - 1) for i in range(last_q)])
        persist_weight.append([1.0 if i < n_last else 0.0 for i in range(last_q)])
        persist_len.append(c1)
        persist_host.append((r, q0, q1, c1))
        first_page = -(-c0 // page_size)
        end_page = -(-c1 // page_size)
        for s in range(first_page, end_page, per_seg):
            pages = min(per_seg, end_page - s)
            tok_start = q0 + s * page_size - c0
            tokens = min((s + pages) * page_size, c1) - s * page_size
            seg = len(tables)
            tables.append((r, tok_start, tokens, s, pages))
            n_tok.append(tokens)
            p_seg += [seg] * pages
            p_idx += list(range(pages))
            p_row += [r] * pages
            p_lp += list(range(s, s + pages))
    if not persist_row:
        return None

    def dev(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype).pin_memory().to(device, non_blocking=True) if str(device).startswith(
            "cuda") else torch.tensor(x, dtype=dtype, device=device)

    table = dev(tables or [[0] * span_decode.SEGMENT_COLUMNS], torch.int32)[: len(tables)]
    return span_decode.SpanSegments(table, tuple(n_tok), dev(p_seg), dev(p_idx), dev(p_row), dev(p_lp),
                                    dev(persist_row), dev(persist_tok), dev(persist_weight, torch.float32),
                                    dev(persist_len, torch.int32), segment_tokens, tuple(persist_host))


def plan_step_segments(query_start_loc: list[int], seq_lens: list[int], page_size: int, cfg: SparseSettings,
                       device):
    """Host-side segment plan of a step's prefill rows (None when it has none)."""
    return plan_span_segments(query_start_loc, seq_lens, page_size, span_params(cfg).segment_tokens,
                              cfg.patterns.vertical_slash.last_q, device)


def span_index_layout(num_pages: int, num_kv_heads: int, head_size: int) -> StateLayout:
    """The tensors of :class:`SpanIndex` for a cache of ``num_pages`` pages (the kernels'
    ``allocate_span_index``): span keys fp32 ``[num_pages + 1, Hkv, D]`` and persistent flags uint8
    ``[num_pages + 1, Hkv]``, the extra row a write sink for padded entries."""
    return [((num_pages + 1, num_kv_heads, head_size), torch.float32), ((num_pages + 1, num_kv_heads), torch.uint8)]


class SpanIndex:
    """Span keys and persistent flags of one layer's cache, indexed by physical page like the cache."""

    def __init__(self, key_cache: torch.Tensor, cfg: SparseSettings, empty: EmptyTensor | None = None):
        """``empty``: where the tensors come from (default: a plain allocation beside the cache)."""
        self.key_cache_ptr = key_cache.data_ptr()  # the cache they describe (vLLM binds it once)
        self.page_size = key_cache.shape[1]
        self.params = span_params(cfg)
        self.budget = SpanDecodeBudget.from_settings(cfg)
        self.persist_by = cfg.decode.spans.persist
        # a page written before these existed scores 0 until it is written again
        num_pages, _, hkv, d = key_cache.shape
        empty = empty or empty_on(key_cache.device)
        self.keys, self.flags = (empty(shape, dtype).zero_() for shape, dtype in span_index_layout(num_pages, hkv, d))

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.flags.nbytes

    def update(self, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After the cache update of a step: fallback keys for the written pages."""
        span_decode.update_span_keys(key_cache, self.keys, self.flags, slot_mapping, self.params.fallback_count)

    def prefill(self, query: torch.Tensor, key: torch.Tensor, key_cache: torch.Tensor, segments,
                block_table: torch.Tensor, scale: float) -> None:
        """Spans, span keys and persistent flags of the step's prefill rows (after :meth:`update`).
        query ``[tokens, H, D]`` / key ``[tokens, Hkv, D]``: the step's new tokens; key_cache
        holds them already."""
        if segments.num_segments:
            span_decode.build_span_keys(query, key, segments, self.keys, block_table, self.page_size, scale, self.params)
        b = self.budget
        widths = dict(sink_pages=b.sink_pages, recent_pages=b.recent_pages, persist_pages=b.persist_pages)
        if self.persist_by == "attention":
            span_decode.mark_persistent_pages_by_attention(query, key_cache, self.flags, block_table, segments,
                                                           self.page_size, scale, next_pages=b.persist_next,
                                                           **widths)
        else:
            span_decode.mark_persistent_pages(query, self.keys, self.flags, block_table, segments, self.page_size,
                                              **widths)

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Decode attention of one query token per sequence over its retrieved pages, into ``out``."""
        b = self.budget
        selected, counts = span_decode.select_span_pages(query, self.keys, self.flags, block_table, seq_lens, self.page_size,
                                             sink_pages=b.sink_pages, recent_pages=b.recent_pages,
                                             persist_pages=b.persist_pages, num_pages_budget=b.budget_pages)
        return topk_decode.topk_decode_attention(query, key_cache, value_cache, block_table, seq_lens, selected,
                                                 counts, scale, out)


class SpanDecode:
    """decode_mode=spans as the backend drives it (backends/decode.py): the segments of each step's
    prefill rows planned once for every layer (:func:`plan_step_segments`), :class:`SpanIndex` per
    layer."""

    name = "spans"
    plans_steps = True

    def __init__(self, cfg: SparseSettings):
        self.cfg = cfg

    def plan_step(self, query_start_loc: list[int], seq_lens: list[int], page_size: int,
                  device) -> span_decode.SpanSegments | None:
        return plan_step_segments(query_start_loc, seq_lens, page_size, self.cfg, device)

    def unsupported_page_size(self, page_size: int) -> str | None:
        return span_decode.unsupported_page_size(page_size)

    def state_layout(self, num_pages: int, num_kv_heads: int, head_size: int, kv_dtype: torch.dtype) -> StateLayout:
        return span_index_layout(num_pages, num_kv_heads, head_size)

    def allocate(self, key_cache: torch.Tensor, empty: EmptyTensor | None = None) -> SpanIndex:
        return SpanIndex(key_cache, self.cfg, empty)
