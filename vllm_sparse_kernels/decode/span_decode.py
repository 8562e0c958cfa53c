"""Ltri-LLM span retrieval for decode over vLLM's paged KV cache: span index, page selection.

Kernel layer of the opt-in ``decode_mode=spans`` (issue 8, item 2), driven by
``vllm_sparse_backend/decode/spans.py``. The paper (``shared/seeds/ltri-llm.txt``) splits the
context into semantic spans where the attention map shows triangles, keeps a few index vectors per
span, and retrieves spans per decode step by the similarity of the query to those vectors. Here
that is mapped onto vLLM's pages, so that the state follows the cache through vLLM's own memory
management (freeing, preemption, prefix caching) without any per-request bookkeeping:

1. **Local maps** (:func:`local_attention_maps`, Triton): every prefill chunk is cut into segments
   of ``segment_tokens`` (default 1024) page-aligned tokens. Per segment the causal attention of
   its queries over its own keys is taken with a *local* softmax (the segment's keys only, as the
   paper's streaming local map), summed over all query heads (Eq. 4 sums heads), and reduced to
   page x page sums ``maps[s, a, b]`` plus per-key column sums (the InfLLM "votes", Eq. 6).
2. **Division** (:func:`divide_segments`, two Triton launches: one program per segment does all
   of the following but the last item on the segment's ``[n, n]`` page tables, a second launch
   ranks the index tokens per block of tokens):
   - the baseline ``theta`` of Eq. 5 is a quantile (``theta_quantile``, the paper's "90th
     percentile") of the per-cell mean attention of the page tiles, and at least the segment's
     mean cell value (else, with attention concentrated in a few tiles, the whole segment scores
     highest and NMS keeps it alone);
   - the triangle score of every page interval ``[x, y]`` is ``sum over x <= b <= a <= y`` of
     ``maps[a, b] - theta * cells[a, b]`` (two cumulative sums);
   - candidates are the best interval of each anti-diagonal ``x + y`` (the paper's Appendix E
     filter), kept by greedy non-maximum suppression at IoU ``iou`` if their score is positive;
   - every page belongs to one span: the first kept interval covering it, else the run of
     uncovered pages around it (a gap is a span too, so every page stays retrievable, as every
     InfLLM block is);
   - the span's number of index vectors is ``L * exp(-lambda * (1 - r_a))`` clamped to
     ``[min_index, max_index]`` (Eq. 7), ``L`` its tokens and ``r_a`` the share of its rows'
     attention that stays inside the span (the "row" ratio: inside / (inside + row neighbours));
   - its index tokens are its ``n`` most-voted keys.
3. **Span keys**: one fp32 vector per physical page and KV head, the sum of its span's index keys
   (every page of a span holds the same vector). The paper's similarity ``sum_m q . k_m`` (Eq. 8)
   of one decode query is ``q . sum_m k_m``, so one dot product per page scores the span. Pages
   written by decode (no map) and pages before a chunk's first full page get a fallback vector,
   ``min_index`` times their mean key (:func:`update_span_keys`, run for every written slot before
   the division overwrites the chunk's pages). ``index="page"`` (:func:`page_top_keys`; issue 24)
   keys every page by its own most-voted token instead (InfLLM's representative token at page
   granularity; fallback: 1 x the mean key): measured on a real model
   (issue 24's probe, docs/decode-modes.md), a needle sits inside a kept span of 4-32 pages whose
   at most 24 index tokens miss it, so no span-level key ranks its page within the budget.
4. **Persistent pages**: the paper keeps the last prefill chunk's retrieval for the whole decode.
   Per prefill chunk, the ``persist_pages`` best pages of the row (sink and recent pages excluded)
   get a flag per KV head, after every flag of the row is cleared, so the last chunk's choice is
   what decode sees. "Best" is either by the index (:func:`mark_persistent_pages`: the chunk's
   last ``last_q`` queries, summed, score the pages' span keys, as decode does) or by attention
   (:func:`mark_persistent_pages_by_attention`: the attention mass those queries give each page,
   their exact softmax over the row's cached context). The paper's chunk retrieves through the
   index because its context sits in CPU memory; here the whole cache stays on the GPU, so what
   the last chunk attends to can be read exactly (issue 24: with the index the needles' pages were
   never among the persistent ones).
5. **Selection** (:func:`select_span_pages`, Triton scores + :func:`topk_select.topk_ascending`):
   per sequence and KV head, sink, recent and flagged pages are forced, and the ``budget_pages``
   best-scoring other pages (``sum over the group's query heads of q . span_key``) are added; the
   output has the format of ``topk_decode.select_pages``, so ``topk_decode.topk_decode_attention``
   attends to them.

Everything at decode has shapes fixed by host ints (CUDA-graph capturable). The prefill side uses
host-built segment tables (built once per step, shared by the layers) and no host sync.

Imports nothing from vLLM. Its float64 torch references, written independently of the kernels
for tests, are in :mod:`vllm_sparse_kernels.reference.span_decode`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..prefill.estimate import representative_scores
from .paged_cache import check_cache, last_written_slot, page_key_tile, top_pages

TILE = 64  # query and key rows of a local-map tile; segments and pages must divide into it
SEGMENT_COLUMNS = 5  # int32 columns of a segment table: row, first token, tokens, first page, pages


@dataclass(frozen=True)
class SpanParams:
    """Span division settings (the paper's defaults for RULER: theta at the 90th percentile, NMS
    IoU 0.01, lambda 3, 6 to 24 index vectors per span; Table 5)."""

    theta_quantile: float = 0.9
    iou: float = 0.01
    lam: float = 3.0
    min_index: int = 6
    max_index: int = 24
    segment_tokens: int = 1024
    # "span": every page holds its span's key (the sum of the span's index keys, Eq. 8); "page":
    # every page holds the key of its own most-voted token (Eq. 6 votes at page granularity; issue
    # 24: spans of 4-32 pages keyed by at most 24 tokens never rank a needle's page within budget)
    index: str = "span"

    @property
    def fallback_count(self) -> int:
        """Multiple of a page's mean key that a page without a division (decode-written) holds:
        min_index index keys' worth for summed span keys, 1 for page keys."""
        return self.min_index if self.index == "span" else 1

    def __post_init__(self):
        if not 0.0 <= self.theta_quantile <= 1.0:
            raise ValueError(f"theta_quantile={self.theta_quantile} must be in [0, 1]")
        if not 0.0 <= self.iou <= 1.0:
            raise ValueError(f"iou={self.iou} must be in [0, 1]")
        if self.lam < 0:
            raise ValueError(f"lam={self.lam} must be >= 0")
        if not 1 <= self.min_index <= self.max_index:
            raise ValueError(f"need 1 <= min_index ({self.min_index}) <= max_index ({self.max_index})")
        if self.index not in ("span", "page"):
            raise ValueError(f"index={self.index!r} must be 'span' or 'page'")
        if self.segment_tokens < TILE or self.segment_tokens % TILE:
            raise ValueError(f"segment_tokens={self.segment_tokens} must be a multiple of {TILE}")


def unsupported_page_size(page_size: int) -> str | None:
    """Why span division cannot tile pages of this size, or None."""
    if page_size > TILE or TILE % page_size:
        return f"page size {page_size} (spans need a power of two up to {TILE})"
    return None


# --------------------------------------------------------------------------------------------
# State beside the cache
# --------------------------------------------------------------------------------------------

def allocate_span_index(key_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed span keys (fp32 ``[num_pages + 1, Hkv, D]``) and persistent flags (uint8
    ``[num_pages + 1, Hkv]``) for a ``[num_pages, page, Hkv, D]`` key cache. The extra last row is a
    write sink for padded entries, so that masked writes need no host-side compaction."""
    num_pages, _, hkv, d = key_cache.shape
    keys = torch.zeros(num_pages + 1, hkv, d, dtype=torch.float32, device=key_cache.device)
    flags = torch.zeros(num_pages + 1, hkv, dtype=torch.uint8, device=key_cache.device)
    return keys, flags


@triton.jit
def _update_span_keys_kernel(k_ptr, sk_ptr, flag_ptr, slot_ptr, num_slots, fallback_count,
                             s_kp, s_kt, s_kh, s_kd, s_sp, s_sh, s_sd, s_fp, s_fh,
                             PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per (written slot, KV head): the last slot of a page in this call sets the page's span key to
    ``fallback_count`` x the mean of its valid keys; a slot at offset 0 (a page starting afresh:
    new or reused) clears the page's persistent flag."""
    i = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    slot, page, offset, n_valid = last_written_slot(slot_ptr, i, num_slots, PAGE)
    k, valid, offs_d, d_ok = page_key_tile(k_ptr, page, n_valid, kvh, s_kp, s_kt, s_kh, s_kd, PAGE, HEAD_DIM, BLOCK_D)
    vec = tl.sum(k, 0) * (fallback_count / tl.maximum(n_valid, 1).to(tl.float32))
    store_ok = d_ok & ((offs_d * 0 + n_valid) > 0)  # vector form (the interpreter mis-types scalar & vector)
    tl.store(sk_ptr + page * s_sp + kvh * s_sh + offs_d * s_sd, vec, mask=store_ok)
    fresh = (slot >= 0) & (offset == 0)
    tl.store(flag_ptr + page * s_fp + kvh * s_fh, tl.zeros((), dtype=tl.uint8), mask=fresh)


def update_span_keys(key_cache: torch.Tensor, span_keys: torch.Tensor, flags: torch.Tensor,
                     slot_mapping: torch.Tensor, fallback_count: int) -> None:
    """After the cache update of a step: fallback span keys for the pages ``slot_mapping`` wrote
    (``fallback_count`` x mean key, over the page's filled prefix) and cleared flags for pages
    written from offset 0. slot_mapping: int ``[num_tokens]``, -1 = padding; a page's slots in one
    call are consecutive (vLLM)."""
    page, hkv, d = check_cache(key_cache)
    n = slot_mapping.shape[0]
    if n == 0:
        return
    _update_span_keys_kernel[(n, hkv)](
        key_cache, span_keys, flags, slot_mapping, n, float(fallback_count),
        *key_cache.stride(), *span_keys.stride(), *flags.stride(),
        PAGE=page, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
    )


# --------------------------------------------------------------------------------------------
# 1. Local attention maps of prefill segments
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpanSegments:
    """Segments of the prefill rows of one step (host-built, shared by every layer).

    ``table``: int32 ``[S, 5]`` on the device: batch row, first token (index into the step's
    query/key tensors), tokens, first logical page, pages; the first token is page-aligned in the
    sequence. ``page_seg`` / ``page_idx`` / ``page_row`` / ``page_lp``: int64 ``[P]`` the pages the
    division writes (segment, page within it, batch row, logical page). ``persist_*``: one entry
    per prefill row: the row, the token indices of its last ``last_q`` queries with their weights
    (0 for the repeats that pad a shorter chunk), the sequence length after the chunk."""

    table: torch.Tensor
    n_tokens_host: tuple[int, ...]
    page_seg: torch.Tensor
    page_idx: torch.Tensor
    page_row: torch.Tensor
    page_lp: torch.Tensor
    persist_row: torch.Tensor
    persist_tok: torch.Tensor  # int64 [R, last_q]: token indices of each row's last queries
    persist_weight: torch.Tensor  # fp32 [R, last_q]: 1, or 0 for padding (rows with fewer queries)
    persist_seq_len: torch.Tensor  # int32 [R]
    segment_tokens: int
    # host copy of the persist rows: (batch row, first query token, end token, sequence length)
    persist_host: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def num_segments(self) -> int:
        return len(self.n_tokens_host)


@triton.jit
def _score_tile(q, k_ptr, tok0, offs_n, n_tok, kvh, offs_d, d_ok, s_kt, s_kh, s_kd, qk_scale,
                DOT_PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """Scaled scores (log2 units) of the stacked query rows against the segment's keys ``offs_n``."""
    kt = tl.load(k_ptr + (tok0 + offs_n)[None, :] * s_kt + kvh * s_kh + offs_d[:, None] * s_kd,
                 mask=(offs_n < n_tok)[None, :] & d_ok[:, None], other=0.0)
    if not NATIVE_DOT:
        kt = kt.to(tl.float32)
    return tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale


@triton.jit
def _local_map_kernel(q_ptr, k_ptr, seg_ptr, map_ptr, vote_ptr,
                      s_qt, s_qh, s_qd, s_kt, s_kh, s_kd, s_ms, s_ma, s_vs, qk_scale,
                      GROUP: tl.constexpr, HPP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """One (segment, 64-query tile, block of HPP query heads of one KV head): the rows' local
    softmax over the segment's causal keys (pass 1: row max and sum; pass 2: probabilities), summed
    over the heads into the segment's page x page map and the keys' column sums (atomics: the
    layer's head blocks add into the same map). The HPP heads are stacked as HPP * 64 rows, so each
    K tile is loaded once for all of them and feeds one larger product."""
    ROWS: tl.constexpr = HPP * 64
    seg = tl.program_id(0)
    rb = tl.program_id(1)
    hb = tl.program_id(2)
    blocks_per_kv: tl.constexpr = (GROUP + HPP - 1) // HPP
    kvh = hb // blocks_per_kv
    tok0 = tl.load(seg_ptr + seg * 5 + 1).to(tl.int64)
    n_tok = tl.load(seg_ptr + seg * 5 + 2)
    if rb * 64 < n_tok:
        offs_r = tl.arange(0, ROWS)
        head_in_group = (hb % blocks_per_kv) * HPP + offs_r // 64
        head = kvh * GROUP + head_in_group
        offs_m = rb * 64 + offs_r % 64  # query position of each stacked row
        offs_n0 = tl.arange(0, 64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        m_ok = (offs_m < n_tok) & (head_in_group < GROUP)
        q = tl.load(q_ptr + (tok0 + offs_m)[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        m_i = tl.full((ROWS,), float("-inf"), tl.float32)
        l_i = tl.zeros((ROWS,), tl.float32)
        for kb in range(0, rb + 1):
            offs_n = kb * 64 + offs_n0
            s = _score_tile(q, k_ptr, tok0, offs_n, n_tok, kvh, offs_d, d_ok, s_kt, s_kh, s_kd, qk_scale,
                            DOT_PRECISION, NATIVE_DOT)
            ok = (offs_n[None, :] <= offs_m[:, None]) & (offs_n < n_tok)[None, :]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
        m_i = tl.where(m_ok, m_i, 0.0)
        inv_l = tl.where(m_ok, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
        offs_a = tl.arange(0, 64 // PAGE)
        for kb in range(0, rb + 1):
            offs_n = kb * 64 + offs_n0
            s = _score_tile(q, k_ptr, tok0, offs_n, n_tok, kvh, offs_d, d_ok, s_kt, s_kh, s_kd, qk_scale,
                            DOT_PRECISION, NATIVE_DOT)
            ok = (offs_n[None, :] <= offs_m[:, None]) & (offs_n < n_tok)[None, :] & m_ok[:, None]
            p = tl.where(ok, tl.exp2(s - m_i[:, None]) * inv_l[:, None], 0.0)
            pooled = tl.sum(tl.sum(tl.sum(tl.reshape(p, (HPP, 64 // PAGE, PAGE, 64 // PAGE, PAGE)), 4), 2), 0)
            cell = map_ptr + seg * s_ms + (rb * (64 // PAGE) + offs_a)[:, None] * s_ma + kb * (64 // PAGE) + offs_a[None, :]
            tl.atomic_add(cell, pooled)
            tl.atomic_add(vote_ptr + seg * s_vs + offs_n, tl.sum(p, 0), mask=offs_n < n_tok)


def local_attention_maps(query: torch.Tensor, key: torch.Tensor, segments: SpanSegments, page_size: int,
                         scale: float, heads_per_program: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Page x page maps ``[S, n, n]`` (n = segment_tokens / page_size; ``maps[s, a, b]`` = the local
    attention of the segment's page-``a`` queries on its page-``b`` keys, summed over query heads)
    and column sums ``[S, segment_tokens]`` (votes), both fp32. query ``[T, H, D]``, key ``[T, Hkv,
    D]``: the step's tensors (any strides). ``heads_per_program``: query heads of one KV head stacked
    in a program (a power of two; capped at the group size rounded up)."""
    seg_tok = segments.segment_tokens
    n = seg_tok // page_size
    s_count = segments.num_segments
    h, d = query.shape[1:]
    hkv = key.shape[1]
    group = h // hkv
    maps = torch.zeros(s_count, n, n, dtype=torch.float32, device=query.device)
    votes = torch.zeros(s_count, seg_tok, dtype=torch.float32, device=query.device)
    if s_count == 0:
        return maps, votes
    hpp = min(triton.next_power_of_2(group), heads_per_program)
    # fp16/bf16 products on the tensor cores with fp32 sums (2x the fp32 rate); fp32 inputs (and
    # Triton's interpreter, whose bf16 dots are wrong) take exact fp32 dots
    native = query.dtype in (torch.float16, torch.bfloat16) and query.is_cuda
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _local_map_kernel[(s_count, seg_tok // TILE, hkv * triton.cdiv(group, hpp))](
        query, key, segments.table, maps, votes,
        *query.stride(), *key.stride(), maps.stride(0), maps.stride(1), votes.stride(0),
        float(scale) * 1.4426950408889634,
        GROUP=group, HPP=hpp, PAGE=page_size, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PRECISION=precision, NATIVE_DOT=native, num_warps=8 if hpp >= 4 else 4,
    )
    return maps, votes


# --------------------------------------------------------------------------------------------
# 2. Division: triangle scores, NMS, spans, index tokens
# --------------------------------------------------------------------------------------------

@triton.jit
def _greedy_nms(xs, ys, alive, order, num_steps, IOU: tl.constexpr):
    """Keep mask of greedy NMS over candidates ``[xs, ys]`` visited by ``order`` (0 first; the
    alive ones within the first ``num_steps``): an alive candidate is kept and suppresses the later
    ones that it overlaps with IoU above ``IOU`` (float64 product, as :func:`vllm_sparse_kernels.reference.span_decode.reference_nms`)."""
    keep = order < 0
    for i in range(0, num_steps):
        me = order == i
        # scalars of candidate i, broadcast back as vectors (the interpreter mis-types scalar & vector)
        a_i = (order * 0 + tl.sum(tl.where(me & alive, 1, 0), 0)) > 0
        x_i = order * 0 + tl.sum(tl.where(me, xs, 0), 0)
        y_i = order * 0 + tl.sum(tl.where(me, ys, 0), 0)
        inter = tl.maximum(tl.minimum(ys, y_i) - tl.maximum(xs, x_i) + 1, 0).to(tl.float64)
        union = ((y_i - x_i + 1) + (ys - xs + 1)).to(tl.float64) - inter
        suppress = (inter > IOU * union) & (order > i) & a_i
        keep = keep | (me & a_i)
        alive = alive & (~suppress)
    return keep


@triton.jit
def _nms_kernel(x_ptr, y_ptr, score_ptr, keep_ptr, num_cand, IOU: tl.constexpr, BLOCK_C: tl.constexpr):
    """One segment's candidates, already sorted by score (descending), through :func:`_greedy_nms`
    (candidates with a positive score and ``y >= x`` are alive)."""
    seg = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < num_cand
    base = seg * num_cand
    xs = tl.load(x_ptr + base + offs, mask=ok, other=0)
    ys = tl.load(y_ptr + base + offs, mask=ok, other=-1)
    sc = tl.load(score_ptr + base + offs, mask=ok, other=0.0)
    keep = _greedy_nms(xs, ys, ok & (sc > 0.0) & (ys >= xs), offs, num_cand, IOU)
    tl.store(keep_ptr + base + offs, keep.to(tl.int8), mask=ok)


def span_nms(x: torch.Tensor, y: torch.Tensor, score: torch.Tensor, iou: float) -> torch.Tensor:
    """Keep flags (bool ``[S, C]``) of candidates ``[x, y]`` (int32 ``[S, C]``, sorted by ``score``
    descending per segment): the NMS of :func:`divide_segments`' kernel on given candidates (one
    program per segment, C sequential steps)."""
    s_count, c = x.shape
    keep = torch.zeros(s_count, c, dtype=torch.int8, device=x.device)
    if s_count and c:
        _nms_kernel[(s_count,)](x.contiguous(), y.contiguous(), score.float().contiguous(), keep, c,
                                IOU=float(iou), BLOCK_C=triton.next_power_of_2(c))
    return keep.bool()


@triton.jit
def _kth_smallest_key(keys, k):
    """The k-th smallest (from 0) of the int64 ``keys`` [BLOCK, BLOCK], by bisection (64 halvings
    cover the int64 range; the midpoint is overflow-free)."""
    lo = tl.min(tl.min(keys, 1), 0)
    hi = tl.max(tl.max(keys, 1), 0)
    for _ in range(64):
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        enough = tl.sum(tl.sum((keys <= mid).to(tl.int32), 1), 0) > k
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    return lo


@triton.jit
def _round_half_even(x):
    """``torch.round`` of non-negative ``x`` (ties to even), as int32."""
    whole = x.to(tl.int32)
    frac = x - whole.to(x.dtype)
    up = (frac > 0.5) | ((frac == 0.5) & (whole % 2 == 1))
    return whole + up.to(tl.int32)


@triton.jit
def _divide_kernel(map_ptr, ntok_ptr, table_ptr, span_ptr, count_ptr, theta_ptr,
                   n, num_heads, s_ms, s_ma, s_mb, s_nt,
                   PAGE: tl.constexpr, BLOCK: tl.constexpr, QUANTILE: tl.constexpr, IOU: tl.constexpr,
                   LAM: tl.constexpr, MIN_INDEX: tl.constexpr, MAX_INDEX: tl.constexpr):
    """One segment's spans from its page map (module doc, step 2), in the map's dtype: theta,
    triangle scores, the best interval of every anti-diagonal, NMS, every page's span (id: its first
    page) and every span's index-vector count. ``table_ptr``: the segment's scratch of three
    [BLOCK, BLOCK] tables (triangle scores, triangle sums, prefix sums), read back at computed
    positions after a barrier."""
    seg = tl.program_id(0).to(tl.int64)
    dt = map_ptr.dtype.element_ty
    n_tok = tl.load(ntok_ptr + seg * s_nt).to(tl.int32)
    n_pages = (n_tok + PAGE - 1) // PAGE
    page = tl.arange(0, BLOCK)
    rows = page[:, None]  # query page a, or interval end y
    cols = page[None, :]  # key page b, or interval start x
    in_pages = page < n_pages
    tokens = tl.minimum(tl.maximum(n_tok - page * PAGE, 0), PAGE)

    # causal (query, key) pairs x heads of each tile: p_a p_b below the diagonal, p_a (p_a + 1) / 2 on it
    pa = tokens[:, None]
    cells = tl.where(cols < rows, pa * tokens[None, :], tl.where(cols == rows, pa * (pa + 1) // 2, 0)) * num_heads
    valid = cells > 0
    cells = cells.to(dt)
    mapped = tl.load(map_ptr + seg * s_ms + rows * s_ma + cols * s_mb, mask=valid, other=0.0)

    # theta: torch.quantile of the valid cells' means (linear interpolation between the order
    # statistics at floor and ceil of q (m - 1), torch.lerp's two forms), the order statistics found
    # on integer keys that sort as the values do; at least the segment's mean cell value
    means = tl.where(valid, mapped / tl.maximum(cells, 1.0), float("inf"))
    bits = means.to(tl.float64).to(tl.int64, bitcast=True)
    keys = tl.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
    n_valid = tl.sum(tl.sum(valid.to(tl.int32), 1), 0)
    rank = tl.maximum(QUANTILE * (n_valid - 1).to(dt), 0.0)
    k_low = rank.to(tl.int32)
    k_high = k_low + (rank > k_low.to(dt)).to(tl.int32)
    weight = rank - k_low.to(dt)
    low_key = _kth_smallest_key(keys, k_low)
    low = tl.max(tl.max(tl.where(keys <= low_key, means, float("-inf")), 1), 0)
    next_up = tl.min(tl.min(tl.where(keys > low_key, means, float("inf")), 1), 0)
    high = tl.where(tl.sum(tl.sum((keys <= low_key).to(tl.int32), 1), 0) > k_high, low, next_up)
    quantile = tl.where(weight < 0.5, low + weight * (high - low), high - (high - low) * (1.0 - weight))
    quantile = tl.where(n_valid > 0, quantile, 0.0)
    average = tl.sum(tl.sum(mapped, 1), 0) / tl.maximum(tl.sum(tl.sum(cells, 1), 0), 1.0)
    theta = tl.maximum(quantile, average)
    tl.store(theta_ptr + seg, theta)

    # tables: score_tri[y, x] / inside_tri[y, x] = sum over a <= y, b >= x of (maps - theta cells) /
    # maps; prefix[y, x] = sum over a <= y, b <= x of maps
    shifted = tl.where(valid, mapped - theta * cells, 0.0)
    tables = table_ptr + seg * (3 * BLOCK * BLOCK)
    tile = rows * BLOCK + cols
    tl.store(tables + tile, tl.cumsum(tl.cumsum(shifted, 0), 1, reverse=True))
    tl.store(tables + BLOCK * BLOCK + tile, tl.cumsum(tl.cumsum(mapped, 0), 1, reverse=True))
    tl.store(tables + 2 * BLOCK * BLOCK + tile, tl.cumsum(tl.cumsum(mapped, 1), 0))
    tl.debug_barrier()

    # candidates: the best interval [x, d - x] of each anti-diagonal d (ties: smallest x)
    diag = tl.arange(0, 2 * BLOCK)
    cand_y = diag[:, None] - cols
    on_diag = (cand_y >= cols) & (cand_y < n_pages)
    cand = tl.load(tables + cand_y * BLOCK + cols, mask=on_diag, other=float("-inf"))
    best = tl.max(cand, 1)
    best_x = tl.min(tl.where(on_diag & (cand == best[:, None]), cols, BLOCK), 1)
    best_y = diag - best_x
    # visiting order: score descending, ties to the smaller d (a stable descending sort)
    ahead = (best[:, None] > best[None, :]) | ((best[:, None] == best[None, :]) & (diag[:, None] < diag[None, :]))
    order = tl.sum(ahead.to(tl.int32), 0)
    alive = best > 0.0  # positive scores come first in the order
    keep = _greedy_nms(best_x, best_y, alive, order, tl.sum(alive.to(tl.int32), 0), IOU)

    # owner of each page: the first kept candidate (in order) covering it; span id: the owner's
    # smallest page; uncovered pages: runs between owned pages, id = the run's first page
    cover = keep[:, None] & (best_x[:, None] <= cols) & (cols <= best_y[:, None])  # [candidate, page]
    owner = tl.min(tl.where(cover, order[:, None], 2 * BLOCK), 0)
    owned = owner < 2 * BLOCK
    mine = cover & (order[:, None] == owner[None, :])
    owner_x = tl.sum(tl.where(mine, best_x[:, None], 0), 0)
    owner_y = tl.sum(tl.where(mine, best_y[:, None], 0), 0)
    first_owned = tl.min(tl.where(owned[None, :] & (owner[None, :] == owner[:, None]), cols, BLOCK), 1)
    gap_start = tl.max(tl.where(owned[None, :] & (cols <= rows), cols, -1), 1) + 1
    gap_end = tl.minimum(tl.min(tl.where(owned[None, :] & (cols >= rows), cols, BLOCK), 1) - 1, n_pages - 1)
    span = tl.where(in_pages, tl.where(owned, first_owned, gap_start), -1)
    sx = tl.where(owned, owner_x, gap_start)
    sy = tl.where(owned, owner_y, gap_end)

    # index vectors of the span [sx, sy] (Eq. 7): inside = triangle sum, row neighbours = the
    # rows' sums left of sx (prefix[sy, sx - 1] - prefix[sx - 1, sx - 1])
    inside = tl.load(tables + BLOCK * BLOCK + sy * BLOCK + sx, mask=in_pages, other=0.0)
    has_left = in_pages & (sx > 0)
    rows_left = tl.load(tables + 2 * BLOCK * BLOCK + sy * BLOCK + sx - 1, mask=has_left, other=0.0)
    above = tl.load(tables + 2 * BLOCK * BLOCK + (sx - 1) * BLOCK + sx - 1, mask=has_left, other=0.0)
    total = inside + (rows_left - above)
    ratio = tl.where(total > 0, inside / tl.maximum(total, 1e-30), 1.0)
    span_tokens = tl.sum(tl.where((span[:, None] == span[None, :]) & in_pages[None, :], tokens[None, :], 0), 1)
    share = tl.exp((-LAM * (1.0 - ratio)).to(tl.float64)).to(dt)  # fp64: Triton's fp32 exp is approximate on GPUs
    want = tl.minimum(tl.maximum(_round_half_even(span_tokens.to(dt) * share), MIN_INDEX), MAX_INDEX)
    # per span id: the count at the span's first page (the page whose id is itself)
    count = tl.where(span == page, tl.minimum(want, span_tokens), 0)
    tl.store(span_ptr + seg * n + page, span.to(tl.int64), mask=page < n)
    tl.store(count_ptr + seg * n + page, count.to(tl.int64), mask=page < n)


@triton.jit
def _index_tokens_kernel(vote_ptr, ntok_ptr, span_ptr, count_ptr, sel_ptr, n, seg_tok, s_vs, s_vt, s_nt,
                         PAGE: tl.constexpr, BLOCK_T: tl.constexpr):
    """BLOCK_T tokens of one segment: a token is an index token if fewer than its span's count of
    the span's tokens rank before it (higher vote, or equal vote and lower position)."""
    seg = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n_tok = tl.load(ntok_ptr + seg * s_nt).to(tl.int32)
    mine = t < n_tok
    vote = tl.load(vote_ptr + seg * s_vs + t * s_vt, mask=mine, other=0.0)
    span = tl.load(span_ptr + seg * n + t // PAGE, mask=mine, other=-1)
    ahead = tl.zeros((BLOCK_T,), tl.int32)
    for u0 in range(0, n_tok, BLOCK_T):
        u = u0 + tl.arange(0, BLOCK_T)
        theirs = u < n_tok
        vote_u = tl.load(vote_ptr + seg * s_vs + u * s_vt, mask=theirs, other=0.0)
        span_u = tl.load(span_ptr + seg * n + u // PAGE, mask=theirs, other=-2)
        before = (vote_u[None, :] > vote[:, None]) | ((vote_u[None, :] == vote[:, None]) & (u[None, :] < t[:, None]))
        ahead += tl.sum((before & (span_u[None, :] == span[:, None])).to(tl.int32), 1)
    count = tl.load(count_ptr + seg * n + span, mask=mine, other=0)
    tl.store(sel_ptr + seg * seg_tok + t, (mine & (ahead < count)).to(tl.int8), mask=t < seg_tok)


@dataclass(frozen=True)
class SpanDivision:
    """Per segment: ``span_of_page`` int64 ``[S, n]`` (the span's first page; -1 past the
    segment's pages), ``selected`` bool ``[S, segment_tokens]`` (the index tokens), and for tests
    and statistics ``theta`` ``[S]`` and ``index_count`` int64 ``[S, n]`` (per span id)."""

    span_of_page: torch.Tensor
    selected: torch.Tensor
    theta: torch.Tensor
    index_count: torch.Tensor


def divide_segments(maps: torch.Tensor, votes: torch.Tensor, n_tokens: torch.Tensor, page_size: int,
                    num_heads: int, params: SpanParams) -> SpanDivision:
    """Spans and index tokens of every segment from its page map ``[S, n, n]`` and votes ``[S,
    segment_tokens]`` (module doc, step 2); ``n_tokens``: int ``[S]`` (any stride). Two launches, no
    host sync: the division kernel (one program per segment; n <= 64 pages fit its registers), then
    the index-token kernel (one program per block of a segment's tokens). float32 or float64 maps,
    computed in their dtype. Sized for n <= 64 (larger n works, with large register tiles)."""
    if maps.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"maps dtype {maps.dtype} not supported (float32, float64)")
    s_count, n, _ = maps.shape
    seg_tok = votes.shape[1]
    dev = maps.device
    span_of_page = torch.empty(s_count, n, dtype=torch.int64, device=dev)
    count = torch.empty(s_count, n, dtype=torch.int64, device=dev)
    theta = torch.empty(s_count, dtype=maps.dtype, device=dev)
    selected = torch.empty(s_count, seg_tok, dtype=torch.int8, device=dev)
    if s_count:
        block = triton.next_power_of_2(n)
        tables = torch.empty(s_count, 3, block, block, dtype=maps.dtype, device=dev)
        _divide_kernel[(s_count,)](
            maps, n_tokens, tables, span_of_page, count, theta, n, num_heads, *maps.stride(), n_tokens.stride(0),
            PAGE=page_size, BLOCK=block, QUANTILE=float(params.theta_quantile), IOU=float(params.iou),
            LAM=float(params.lam), MIN_INDEX=params.min_index, MAX_INDEX=params.max_index,
            num_warps=4 if block <= 32 else 8,
        )
        block_t = 64
        _index_tokens_kernel[(s_count, triton.cdiv(seg_tok, block_t))](
            votes, n_tokens, span_of_page, count, selected, n, seg_tok, *votes.stride(), n_tokens.stride(0),
            PAGE=page_size, BLOCK_T=block_t,
        )
    return SpanDivision(span_of_page, selected.view(torch.bool), theta, count)


def span_page_keys(keys: torch.Tensor, division: SpanDivision, page_size: int) -> torch.Tensor:
    """fp32 ``[S, n, Hkv, D]``: for every page the sum of its span's index keys. keys: the
    segments' keys ``[S, segment_tokens, Hkv, D]`` (any float dtype; rows past a segment ignored)."""
    s_count, seg_tok, hkv, d = keys.shape
    n = division.span_of_page.shape[1]
    t = torch.arange(seg_tok, device=keys.device)
    tok_span = division.span_of_page.gather(1, (t // page_size)[None, :].expand(s_count, -1))  # [S, T]
    onehot = (tok_span[:, None, :] == torch.arange(n, device=keys.device)[None, :, None]) & division.selected[:, None, :]
    k = torch.where(division.selected[:, :, None, None], keys.float(), 0.0).view(s_count, seg_tok, hkv * d)
    per_span = torch.bmm(onehot.float(), k)  # [S, id, Hkv * D]
    return per_span.gather(1, division.span_of_page.clamp(0, n - 1)[:, :, None].expand(-1, -1, hkv * d)).view(
        s_count, n, hkv, d)


def page_top_keys(keys: torch.Tensor, votes: torch.Tensor, n_tokens: torch.Tensor, page_size: int) -> torch.Tensor:
    """fp32 ``[S, n, Hkv, D]``: for every page the key of its most-voted token (ties: the first),
    ``index="page"``. keys ``[S, segment_tokens, Hkv, D]``, votes ``[S, segment_tokens]``, n_tokens
    ``[S]`` (tokens past it are never chosen)."""
    s_count, seg_tok, hkv, d = keys.shape
    t = torch.arange(seg_tok, device=keys.device)
    v = votes.float().masked_fill(t[None, :] >= n_tokens.to(keys.device)[:, None], float("-inf"))
    best = v.view(s_count, seg_tok // page_size, page_size).argmax(-1)  # first maximum
    tok = best + torch.arange(0, seg_tok, page_size, device=keys.device)[None, :]
    return keys.gather(1, tok[:, :, None, None].expand(-1, -1, hkv, d)).float()


def build_span_keys(query: torch.Tensor, key: torch.Tensor, segments: SpanSegments, span_keys: torch.Tensor,
                    block_table: torch.Tensor, page_size: int, scale: float, params: SpanParams) -> SpanDivision:
    """Divide the step's prefill segments and write their pages' span keys (after
    :func:`update_span_keys` of the same step). query ``[T, H, D]``, key ``[T, Hkv, D]``: the step's
    new tokens; block_table int32 ``[batch, max_pages]``."""
    maps, votes = local_attention_maps(query, key, segments, page_size, scale)
    n_tok = segments.table[:, 2]
    division = divide_segments(maps, votes, n_tok, page_size, query.shape[1], params)
    seg_tok = segments.segment_tokens
    t = torch.arange(seg_tok, device=key.device)
    tok = (segments.table[:, 1].to(torch.int64)[:, None] + t).clamp(max=key.shape[0] - 1)  # [S, T]
    seg_keys = key[tok.view(-1)].view(tok.shape[0], seg_tok, *key.shape[1:])
    page_keys = (span_page_keys(seg_keys, division, page_size) if params.index == "span"
                 else page_top_keys(seg_keys, votes, n_tok, page_size))
    phys = block_table[segments.page_row, segments.page_lp].to(torch.int64)
    span_keys[phys] = page_keys[segments.page_seg, segments.page_idx]
    return division


# --------------------------------------------------------------------------------------------
# 3. Page scores, persistent pages, selection
# --------------------------------------------------------------------------------------------

@triton.jit
def _span_scores_kernel(q_ptr, sk_ptr, flag_ptr, bt_ptr, seq_lens_ptr, score_ptr,
                        s_qb, s_qh, s_qd, s_sp, s_sh, s_sd, s_fp, s_fh, s_bt, s_ob, s_oh,
                        max_pages, width, sink_pages, recent_pages,
                        GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                        PERSIST: tl.constexpr):
    """Scores of BLOCK_P logical pages for one (sequence, KV head): ``q_group . span_key``, with
    the group's queries summed. Decode: +inf for sink, recent and flagged pages. PERSIST (choosing
    the flags): -inf for sink and recent pages, flags ignored. -inf past the sequence."""
    pb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    head = kvh * GROUP + offs_h
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=(offs_h < GROUP)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q_sum = tl.sum(q, 0)
    seq_len = tl.load(seq_lens_ptr + b)
    n_pages = (seq_len + PAGE - 1) // PAGE
    j = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    in_seq = (j < n_pages) & (j < max_pages)
    phys = tl.load(bt_ptr + b * s_bt + j, mask=in_seq, other=0).to(tl.int64)
    sk = tl.load(sk_ptr + phys[:, None] * s_sp + kvh * s_sh + offs_d[None, :] * s_sd,
                 mask=in_seq[:, None] & d_ok[None, :], other=0.0)
    score = tl.sum(sk * q_sum[None, :], 1)
    edge = (j < sink_pages) | (j >= n_pages - recent_pages)
    if PERSIST:
        score = tl.where(edge, float("-inf"), score)
    else:
        flag = tl.load(flag_ptr + phys * s_fp + kvh * s_fh, mask=in_seq, other=0)
        score = tl.where(edge | (flag != 0), float("inf"), score)
    score = tl.where(in_seq, score, float("-inf"))
    tl.store(score_ptr + b * s_ob + kvh * s_oh + j, score, mask=j < width)


def _span_scores(q, span_keys, flags, block_table, seq_lens, page_size, sink_pages, recent_pages, width,
                 max_pages, persist):
    batch, h, d = q.shape
    hkv = span_keys.shape[1]
    score_width = max(max_pages, width)
    scores = torch.empty(batch, hkv, score_width, dtype=torch.float32, device=q.device)
    block_p = 32
    _span_scores_kernel[(triton.cdiv(score_width, block_p), batch, hkv)](
        q, span_keys, flags, block_table, seq_lens, scores,
        *q.stride(), *span_keys.stride(), *flags.stride(), block_table.stride(0), scores.stride(0), scores.stride(1),
        max_pages, score_width, sink_pages, recent_pages,
        GROUP=h // hkv, PAGE=page_size, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_H=triton.next_power_of_2(h // hkv), BLOCK_P=block_p, PERSIST=persist,
    )
    return scores


def select_span_pages(q: torch.Tensor, span_keys: torch.Tensor, flags: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, page_size: int, *, sink_pages: int, recent_pages: int,
                      persist_pages: int, num_pages_budget: int,
                      max_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages each decode query attends to, per KV head: sink, recent and flagged pages, plus the
    ``num_pages_budget`` best others by ``sum over the group of q . span_key``. Same contract as
    ``topk_decode.select_pages`` (logical pages ascending, -1 padded, width ``sink + recent +
    persist + budget``). More flagged pages than ``persist_pages`` (prefix-shared pages flagged by
    another request) crowd out budget pages, never forced ones beyond the width."""
    batch, h, d = q.shape
    hkv = span_keys.shape[1]
    if span_keys.shape[2] != d or h % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not match span keys {tuple(span_keys.shape)}")
    width = sink_pages + recent_pages + persist_pages + num_pages_budget
    if width == 0:
        raise ValueError("nothing to select (sink, recent, persist and budget pages are all 0)")
    max_pages = block_table.shape[1] if max_pages is None else max_pages
    if batch == 0:
        empty = torch.empty(0, hkv, width, dtype=torch.int32, device=q.device)
        return empty, empty[..., 0]
    scores = _span_scores(q, span_keys, flags, block_table, seq_lens, page_size, sink_pages, recent_pages, width,
                          max_pages, persist=False)
    return top_pages(scores, width)


def mark_persistent_pages(query: torch.Tensor, span_keys: torch.Tensor, flags: torch.Tensor,
                          block_table: torch.Tensor, segments: SpanSegments, page_size: int, *, sink_pages: int,
                          recent_pages: int, persist_pages: int) -> None:
    """Flag, per prefill row of the step and KV head, the ``persist_pages`` pages (sink and recent
    pages excluded) that the sum of the chunk's last queries scores highest, after clearing every
    flag of the row (after :func:`build_span_keys` of the same step)."""
    if persist_pages == 0 or segments.persist_row.numel() == 0:
        return
    q_sum = torch.einsum("rt,rthd->rhd", segments.persist_weight, query[segments.persist_tok].float())  # [R, H, D]
    bt = block_table[segments.persist_row]
    max_pages = bt.shape[1]
    scores = _span_scores(q_sum, span_keys, flags, bt, segments.persist_seq_len, page_size, sink_pages,
                          recent_pages, persist_pages, max_pages, persist=True)
    chosen, _ = top_pages(scores, persist_pages)  # [R, Hkv, persist]
    n_pages = (segments.persist_seq_len.to(torch.int64) + page_size - 1) // page_size
    sink_row = flags.shape[0] - 1
    lp = torch.arange(max_pages, device=bt.device)
    row_pages = torch.where(lp[None, :] < n_pages[:, None], bt.to(torch.int64), sink_row)  # [R, max_pages]
    phys = torch.where(chosen >= 0, bt.to(torch.int64).gather(1, chosen.clamp(min=0).view(len(bt), -1).to(
        torch.int64)).view(chosen.shape), sink_row)  # [R, Hkv, persist]
    _reflag_rows(flags, row_pages, phys)


def _reflag_rows(flags: torch.Tensor, row_pages: torch.Tensor, phys: torch.Tensor) -> None:
    """Clear the flags of the physical pages ``row_pages`` (any shape), then flag ``phys``
    ``[..., Hkv, n]`` for its KV head (dim -2). Either may name the sink row (the flags' last,
    a page no sequence owns) for "none"; it stays unflagged."""
    sink_row = flags.shape[0] - 1
    flags[row_pages.reshape(-1)] = 0
    heads = torch.arange(phys.shape[-2], device=phys.device)[:, None].expand_as(phys)
    flags[phys.reshape(-1), heads.reshape(-1)] = 1
    flags[sink_row] = 0


def mark_persistent_pages_by_attention(query: torch.Tensor, key_cache: torch.Tensor, flags: torch.Tensor,
                                       block_table: torch.Tensor, segments: SpanSegments, page_size: int,
                                       scale: float, *, sink_pages: int, recent_pages: int,
                                       persist_pages: int, next_pages: int = 0) -> None:
    """Flag, per prefill row of the step and KV head, the pages (sink and recent pages excluded)
    that get the most attention from the chunk's last queries: each query's softmax over its
    causal context in the paged cache (``estimate.representative_scores``, the vertical sums of
    the last-q estimation), summed over the KV head's query heads and the queries, pooled to
    pages. The ``persist_pages // (1 + next_pages)`` best pages are flagged with the
    ``next_pages`` pages after each (runs that overlap, or reach the recent pages, flag fewer), so
    at most ``persist_pages``. Every flag of the row is cleared first. ``query``: the step's
    ``[tokens, H, D]``; the cache already holds the chunk's keys. One last-q pass per row and
    layer (a host loop over the step's prefill rows, from ``segments.persist_host``)."""
    anchors = persist_pages // (1 + next_pages)
    if anchors == 0 or not segments.persist_host:
        return
    hkv = key_cache.shape[2]
    last_q = segments.persist_tok.shape[1]
    sink_row = flags.shape[0] - 1
    dev = flags.device
    for row, q0, q1, seq_len in segments.persist_host:
        n_pages = (seq_len + page_size - 1) // page_size
        bt = block_table[row, :n_pages].to(torch.int64)
        mass = representative_scores(query[q0:q1], key_cache, block_table[row], seq_len, min(last_q, q1 - q0),
                                     scale, group_sum=True)[0][:, :seq_len]  # [Hkv, seq_len]
        mass = torch.nn.functional.pad(mass, (0, n_pages * page_size - seq_len)).view(hkv, n_pages, page_size).sum(-1)
        lp = torch.arange(n_pages, device=dev)
        excluded = (lp < sink_pages) | (lp >= n_pages - recent_pages)
        mass[:, excluded] = float("-inf")
        top = mass.topk(min(anchors, n_pages), dim=1)  # [Hkv, A]
        run = top.indices[:, :, None] + torch.arange(next_pages + 1, device=dev)  # [Hkv, A, 1 + next]
        inside = run < n_pages
        run = run.clamp(max=n_pages - 1)
        ok = (top.values > float("-inf"))[:, :, None] & inside & ~excluded[run]
        _reflag_rows(flags, bt, torch.where(ok, bt[run], sink_row).flatten(1))  # [Hkv, A * (1 + next)]
