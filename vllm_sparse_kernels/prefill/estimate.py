"""GPU index estimation for the block-sparse, FlexPrefill and A-shape heads of one row.

K is read from vLLM's paged cache (``key_cache [num_pages, page_size, Hkv, D]`` view, any strides
with a unit stride over D, plus the row's block-table row), of the queries' dtype or fp8 with the
layer's ``k_scale`` (the kernels widen fp8 tiles on load and apply the scale once). Nothing here synchronises with the
host: no ``.item()`` / ``.tolist()``, no data-dependent shapes. Every output width is a host int
(the number of causal key blocks, or a cap the caller passes), lists are ``-1`` padded and carry
counts, and data-dependent branches (FlexPrefill's per-head decision) compute both sides and
select on the device.

Pieces:

* :func:`pooled_keys` (Triton): mean of each aligned key block, pages read directly.
* :func:`block_sparse_index`: pooled Q . pooled K on the device (torch), top-k per query block
  with the diagonal blocks forced, then :func:`_assemble` (Triton) turns the block mask into the
  ascending lists. Matches ``patterns/block_sparse.py`` + ``build_index``.
* :func:`mass_block_index`: the same lists from a block mass (``estimate_math.scored_block_mass``:
  anti-diagonal cells, or the exact attention of a few sampled queries per query block; torch
  over the row's K gathered by the caller), optionally cut at a cumulative share of each query
  block's mass.
* :func:`flex_prefill_index`: representative-query scores with ``vs_index.last_q_scores``
  (chunks of <= 64 queries, summed), the sqrt-JSD decision, the query-aware branch in torch over
  the pooled [H, NQBf, NKBf] map, the vertical-slash branch with ``vs_index.vs_topk`` +
  ``vertical_slash_index``, and one Triton pass that writes either branch's lists per head.
  Matches ``patterns/flex_prefill.py`` + ``build_index``.
* :func:`a_shape_index`: closed-form lists (torch, broadcast arithmetic).

Ties: where the torch estimators rank with a *stable* sort (lower key block / position wins a
tie), :func:`block_sparse_index` and the vertical-slash top-k use ``torch.topk``, whose order among
equal scores is unspecified. Exact ties of float scores do not occur with real activations; the
tests use random data without them. The query-aware branch uses the same stable sorts as torch.

Peak extra device memory at 128K tokens, Llama-3-8B shape (H=32, Hkv=8, D=128, block 64,
flex block 128 -> NQB = NKB = 2048, NQBf = NKBf = 1024), fp32/int32/int64 as noted:

* block_sparse_index: scores [H, NQB, NKB] fp32 512 MiB with the top-k [H, NQB, max_topk]
  values/indices (max_topk=100: 75 MiB); the scores are freed before the bool mask (128 MiB) and
  the output [H, NQB, max_topk + 1] int32 (26 MiB) exist -> ~0.6 GiB. With max_topk left at NKB
  the top-k alone is 1.5 GiB: pass the real maximum.
* flex_prefill_index: the query-aware map [H, NQBf, NKBf] fp32 128 MiB with its stable sort
  (values 128 MiB + int64 order 256 MiB + cumsum 128 MiB, freed before the next step), the
  block-size mask 128 MiB bool, the vertical-slash lists [H, NQB, NKB] int32 512 MiB, the output
  lists 512 MiB, columns [H, NQB, max_columns] int32 (max_columns=4096: 1 GiB)
  -> ~2.3 GiB at the default column cap, ~1.5 GiB with max_columns=1024.
* a_shape_index: the output [H, NQB, max_blocks] int32 (and as much int64 scratch).

Imports nothing from vLLM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import BLOCK
from ..index_format import SparseIndex, causal_block_mask, diagonal_block_mask, num_blocks, query_block_bounds
from ..kv_quant import scale_operand
from .estimate_math import (block_means, cumulative_budget, mass_block_counts, rescale_block_mask, sqrt_js_divergence,
                            sum_head_groups)
from .vs_index import LAST_Q, last_q_scores, vertical_slash_index, vs_topk

# Default cap on FlexPrefill vertical columns per head (the column lists are [H, NQB, cap]).
DEFAULT_MAX_COLUMNS = 4096


# --------------------------------------------------------------------------------------------
# Pooled keys
# --------------------------------------------------------------------------------------------

# bt_ptr: one block-table row, not always 16-byte aligned (see vs_index._lastq_pass)
@triton.jit(do_not_specialize=["kv_len"], do_not_specialize_on_alignment=["bt_ptr"])
def _pool_kernel(k_ptr, bt_ptr, out_ptr, k_scale_ptr, s_kp, s_kt, s_kh, s_oh, s_ob, kv_len,
                 PAGE: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, HEAD_DIM: tl.constexpr,
                 K_SCALED: tl.constexpr):
    kvh = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for j in tl.static_range(0, BLOCK, SUB):  # SUB rows at a time bounds the register tile
        kpos = kb * BLOCK + j + tl.arange(0, SUB)
        ok = kpos < kv_len
        # masked loads: the block table past the row and unused page slots hold garbage / NaN
        page = tl.load(bt_ptr + kpos // PAGE, mask=ok, other=0).to(tl.int64)
        off = page * s_kp + (kpos % PAGE).to(tl.int64) * s_kt + kvh * s_kh
        x = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    n = tl.minimum(kv_len - kb * BLOCK, BLOCK)  # the last block may be short
    mean = acc / n.to(tl.float32)
    if K_SCALED:  # a quantized cache: dequantised K = stored * k_scale
        mean = mean * tl.load(k_scale_ptr)
    tl.store(out_ptr + kvh * s_oh + kb * s_ob + offs_d, mean)


def pooled_keys(key_cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int,
                block_size: int, k_scale=None) -> torch.Tensor:
    """Mean of each aligned key block of the row: fp32 [Hkv, ceil(kv_len / block_size), D].

    Same values as ``patterns.common.block_means(k, block_size)`` up to summation order.
    ``k_scale`` (None, a number or a one-element fp32 device tensor): the cache holds
    K / k_scale (vLLM's fp8 cache); the means are of the dequantised keys."""
    page, hkv, d = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    if key_cache.stride(3) != 1:
        raise ValueError("pooled_keys needs a unit stride over the head dim")
    nkb = num_blocks(kv_len, block_size)
    out = torch.empty(hkv, nkb, d, dtype=torch.float32, device=key_cache.device)
    ks = scale_operand(k_scale, key_cache.device)
    if nkb:
        _pool_kernel[(hkv, nkb)](key_cache, block_table_row, out, out if ks is None else ks, key_cache.stride(0),
                                 key_cache.stride(1), key_cache.stride(2), out.stride(0), out.stride(1), kv_len,
                                 PAGE=page, BLOCK=block_size, SUB=min(block_size, 32), HEAD_DIM=d,
                                 K_SCALED=ks is not None, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------
# Mask / list assembly
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["s_mh", "s_mq", "q_len", "ctx_len", "nqb", "nkb", "max_vb", "max_b"])
def _assemble_kernel(mask_ptr, pick_ptr, vcnt_ptr, vidx_ptr, bcnt_ptr, bidx_ptr,
                     s_mh, s_mq, q_len, ctx_len, nqb, nkb, max_vb, max_b,
                     BLOCK: tl.constexpr, CH: tl.constexpr, HAS_VS: tl.constexpr):
    """One program per (head, query block). Heads with pick[h] != 0: the causal key blocks of
    the bool mask row, ascending. Other heads (HAS_VS): the vertical-slash list copied with key
    block 0 put in front when it is missing (FlexPrefill always keeps the first block).
    Everything past the count is set to -1 (the output is allocated uninitialised)."""
    h = tl.program_id(0)
    qb = tl.program_id(1)
    row = h.to(tl.int64) * nqb + qb
    out = bidx_ptr + row * max_b
    lanes = tl.arange(0, CH)
    pick = tl.load(pick_ptr + h)
    count = pick * 0  # an int32 scalar tensor, so that both branches and the loops can update it
    if pick != 0:
        q_last = ctx_len + tl.minimum(qb * BLOCK + BLOCK, q_len) - 1
        n_causal = tl.minimum(q_last // BLOCK + 1, nkb)
        m_row = mask_ptr + h.to(tl.int64) * s_mh + qb.to(tl.int64) * s_mq
        for j in range(0, n_causal, CH):
            kb = j + lanes
            keep = tl.load(m_row + kb, mask=kb < n_causal, other=0) != 0
            k = keep.to(tl.int32)
            pos = count + tl.cumsum(k, 0) - k
            tl.store(out + pos, kb, mask=keep & (pos < max_b))
            count += tl.sum(k, 0)
    elif HAS_VS:
        n = tl.load(vcnt_ptr + row)
        vrow = vidx_ptr + row * max_vb
        first = tl.load(vrow, mask=n > 0, other=-1)
        add = (first != 0).to(tl.int32)  # lists are ascending: block 0 is either first or absent
        for j in range(0, n, CH):
            i = j + lanes
            ok = i < n
            tl.store(out + i + add, tl.load(vrow + i, mask=ok, other=-1), mask=ok & (i + add < max_b))
        tl.store(out, 0, mask=add != 0)
        count = n + add
    count = tl.minimum(count, max_b)
    tl.store(bcnt_ptr + row, count)
    for j in range(count, max_b, CH):
        i = j + lanes
        tl.store(out + i, -1, mask=i < max_b)


def _assemble(mask: torch.Tensor, pick: torch.Tensor, q_len: int, ctx_len: int, block_size: int, max_b: int,
              vs_count: torch.Tensor | None = None, vs_index: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """bool mask [H, NQB, NKB] (+ optional vertical-slash lists for heads with pick == 0)
    -> (block_count int32 [H, NQB], block_index int32 [H, NQB, max_b])."""
    h, nqb, nkb = mask.shape
    dev = mask.device
    count = torch.empty(h, nqb, dtype=torch.int32, device=dev)
    index = torch.empty(h, nqb, max_b, dtype=torch.int32, device=dev)
    if h and nqb:
        m = mask.view(torch.uint8)  # same bytes; triton loads uint8 reliably, bool (int1) less so
        has_vs = vs_index is not None
        vcnt = vs_count if has_vs else count
        vidx = vs_index if has_vs else index
        _assemble_kernel[(h, nqb)](m, pick.to(torch.int32).contiguous(), vcnt, vidx, count, index,
                                   m.stride(0), m.stride(1), q_len, ctx_len, nqb, nkb,
                                   vidx.shape[-1], max_b, BLOCK=block_size, CH=128, HAS_VS=has_vs, num_warps=4)
    return count, index


def _no_columns(h: int, nqb: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(h, nqb, dtype=torch.int32, device=dev),
            torch.full((h, nqb, 1), -1, dtype=torch.int32, device=dev))


# --------------------------------------------------------------------------------------------
# Block-sparse heads
# --------------------------------------------------------------------------------------------

def block_sparse_index(q_row: torch.Tensor, pooled_k: torch.Tensor, ctx_len: int, topk: torch.Tensor,
                       block_size: int = BLOCK.value, max_topk: int | None = None, share: int = 1) -> SparseIndex:
    """MInference block-sparse heads (``patterns/block_sparse.py``) on the device.

    q_row: [q_len, H, D] the row's queries; pooled_k: [Hkv, NKB, D] from :func:`pooled_keys` at
    ``block_size``; topk: int [H] key blocks per query block. ``max_topk`` (host int, e.g. the
    largest topk of the config) bounds the top-k width and the list width (max_topk + 1: the
    second diagonal block of an unaligned chunk comes on top); default NKB. Per-head values
    above it are clipped to it. ``share`` > 1: one selection per ``share`` consecutive heads (a KV
    group), from their summed scores; the index then has H / share lists and topk is per list.
    """
    q_len, h, _ = q_row.shape
    hkv, nkb, d = pooled_k.shape
    nqb = num_blocks(q_len, block_size)
    # summed scores of a group's heads = the group's summed pooled query against the keys
    qp = sum_head_groups(block_means(q_row, block_size), share)  # [H / share, NQB, D] fp32
    h = h // share
    # GQA without gathering K: the group's query heads share one [NKB, D] operand.
    scores = torch.matmul(qp.reshape(hkv, (h // hkv) * nqb, d), pooled_k.transpose(1, 2)).view(h, nqb, nkb)
    counts = topk.to(device=q_row.device, dtype=torch.int64).repeat_interleave(nqb)
    return _top_blocks_index(scores, counts, q_len, ctx_len, block_size, max_topk)


def mass_block_index(mass: torch.Tensor, topk: torch.Tensor, q_len: int, ctx_len: int, block_size: int = BLOCK.value,
                     max_topk: int | None = None, block_mass: float | None = None) -> SparseIndex:
    """Block-sparse heads scored by a block mass (``estimate_math.scored_block_mass``: the
    ``antidiagonal`` and ``sampled`` scorings of ``patterns/block_sparse.py``) on the device: per
    query block the ``topk`` [lists] best causal key blocks, or with ``block_mass`` the fewest
    reaching that share of its mass (at most topk); ``max_topk`` as :func:`block_sparse_index`.
    The anti-diagonal mass holds [H, q_len / stride, kv_len / stride] fp32 cell scores while it
    runs (a 16K chunk at 128K, 12 heads, stride 16: 384 MiB, twice during the softmax); the
    sampled one at most 2^26 scores at a time (256 MiB)."""
    counts = mass_block_counts(mass, topk, block_mass)
    return _top_blocks_index(mass, counts, q_len, ctx_len, block_size, max_topk)


def _top_blocks_index(scores: torch.Tensor, counts: torch.Tensor, q_len: int, ctx_len: int, block_size: int,
                      max_topk: int | None) -> SparseIndex:
    """scores [h, NQB, NKB] -> the ``counts[h * NQB + qb]`` best causal key blocks of each query
    block (at most ``max_topk``), the diagonal blocks forced, as ascending lists."""
    h, nqb, nkb = scores.shape
    dev = scores.device
    w = nkb if max_topk is None else max(1, min(max_topk, nkb))
    causal = causal_block_mask(q_len, ctx_len, block_size, dev)
    diag = diagonal_block_mask(q_len, ctx_len, block_size, dev)
    scores.masked_fill_(~causal, float("-inf")).masked_fill_(diag, float("inf"))
    top = scores.topk(w, dim=-1, sorted=True).indices  # the diagonal (+inf) comes first, as in torch
    del scores
    keep = torch.arange(w, device=dev)[None, None, :] < counts.view(h, nqb, 1)
    mask = torch.zeros(h, nqb, nkb, dtype=torch.bool, device=dev).scatter_(2, top, keep.expand_as(top))
    mask |= diag  # both diagonal blocks of an unaligned chunk, even for k = 1
    count, index = _assemble(mask, torch.ones(h, dtype=torch.int32, device=dev), q_len, ctx_len, block_size,
                             min(w + 1, nkb))
    return SparseIndex(block_size, count, index, *_no_columns(h, nqb, dev))


# --------------------------------------------------------------------------------------------
# FlexPrefill heads
# --------------------------------------------------------------------------------------------

def _rank_order(scores: torch.Tensor) -> torch.Tensor:
    """Indices of each row of scores [R, N], best first; ties: lower index first (as keep_top)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices


def _first_of_order(order: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """bool [R, N]: the first ``count`` (per row, or one int) entries of each ranking."""
    n = order.shape[-1]
    limit = count.view(-1, 1) if isinstance(count, torch.Tensor) else count  # a host int stays one (no copy)
    ranks_ok = torch.arange(n, device=order.device)[None, :] < limit
    out = torch.zeros(order.shape, dtype=torch.bool, device=order.device)
    return out.scatter_(-1, order, ranks_ok.expand_as(order))


def _query_aware_mask(q_row, kp, ctx_len, gamma, fb, min_blocks, max_blocks, block_size, scale):
    """FlexPrefill Alg. 4 for all heads: bool [H, NQB, NKB] at ``block_size`` granularity."""
    q_len, h, _ = q_row.shape
    dev = q_row.device
    nkb_f = kp.shape[1]
    qp = block_means(q_row, fb)  # [H, NQBf, D]
    causal_f = causal_block_mask(q_len, ctx_len, fb, dev)
    a = torch.softmax((torch.matmul(qp, kp.transpose(-1, -2)) * scale).masked_fill_(~causal_f, float("-inf")), -1)
    # Flattened map: smallest set of blocks reaching gamma. One stable sort gives both the budget
    # (as cumulative_budget: normalising before or after sorting gives the same sequence) and the
    # ranking (as keep_top).
    flat = a.reshape(h, -1)
    vals, order = flat.sort(dim=-1, descending=True, stable=True)
    total = flat.sum(-1, keepdim=True).clamp_min(torch.finfo(flat.dtype).tiny)
    csum = (vals / total).cumsum(-1)
    del vals
    k = ((csum < gamma.to(csum).view(-1, 1)).sum(-1) + 1).clamp(max=flat.shape[-1])
    del csum
    keep = _first_of_order(order, k).view_as(a)
    del order
    rows = a.reshape(-1, nkb_f)
    row_order = _rank_order(rows)
    keep |= _first_of_order(row_order, min_blocks).view_as(a)
    if max_blocks is not None:
        keep &= _first_of_order(row_order, max_blocks).view_as(a)
    del row_order
    keep |= diagonal_block_mask(q_len, ctx_len, fb, dev)[None]
    keep[:, :, 0] = True
    keep &= causal_f
    return rescale_block_mask(keep, fb, block_size, num_blocks(q_len, block_size), num_blocks(ctx_len + q_len, block_size))


def representative_scores(q_row: torch.Tensor, key_cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int,
                          n: int, scale: float, group_sum: bool = False,
                          k_scale=None, normalizer_sample: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash sums [H, kv_len] fp32 of the last ``n`` queries of the row (any n);
    [Hkv, kv_len] summed over each KV group's heads with ``group_sum``.

    ``last_q_scores`` takes at most LAST_Q (64) queries ending at kv_len; queries are independent
    rows of the softmax, so the last n are split into chunks of LAST_Q ending at kv_len,
    kv_len - LAST_Q, ... and
    each chunk only sees keys below its own end (causality), its sums padded with zeros.
    ``k_scale``, ``normalizer_sample``: as :func:`vs_index.last_q_scores`."""
    q_len = q_row.shape[0]
    vert = slash = None
    for end in range(q_len, q_len - n, -LAST_Q):  # host ints only
        start = max(end - LAST_Q, q_len - n)
        kv_end = kv_len - (q_len - end)
        v, s = last_q_scores(q_row[start:end], key_cache, block_table_row, kv_end, scale, group_sum=group_sum,
                             k_scale=k_scale, normalizer_sample=normalizer_sample)
        if vert is None:
            vert, slash = v, s
        else:
            vert[:, :kv_end] += v
            slash[:, :kv_end] += s
    return vert, slash


def flex_prefill_index(q_row: torch.Tensor, key_cache: torch.Tensor, block_table_row: torch.Tensor, ctx_len: int,
                       gamma: torch.Tensor, *, tau: float, flex_block_size: int, min_budget: int,
                       max_budget: int | None, block_size: int, scale: float,
                       max_columns: int | None = None, k_scale=None) -> tuple[SparseIndex, torch.Tensor]:
    """FlexPrefill heads (``patterns/flex_prefill.py``) on the device -> (index, query_aware bool [H]).

    q_row: [q_len, H, D]; key_cache: [pages, page, Hkv, D] view; block_table_row: int32 row;
    gamma: float [H]. ``max_columns`` (host int) caps the vertical columns per head of the
    vertical-slash branch, keeping the best-scoring ones; default ``min(budget cap, max(
    min_budget, 4096))``. Both branches are computed for every head; the decision picks per head
    on the device. ``k_scale``: the per-layer scale of an fp8 cache (None: K as stored).
    """
    q_len, h, _ = q_row.shape
    hkv = key_cache.shape[2]
    dev = q_row.device
    fb, b = flex_block_size, block_size
    kv_len = ctx_len + q_len
    nkb, nkb_f = num_blocks(kv_len, b), num_blocks(kv_len, fb)
    gamma = gamma.to(device=dev, dtype=torch.float32)
    kvh = torch.arange(h, device=dev) // (h // hkv)

    # Representative queries: the last fb of the chunk.
    n = min(fb, q_len)
    vertical, slash = representative_scores(q_row, key_cache, block_table_row, kv_len, n, scale, k_scale=k_scale)
    true_blocks = torch.nn.functional.pad(vertical, (0, nkb_f * fb - kv_len)).view(h, nkb_f, fb).sum(-1) / n
    kp = pooled_keys(key_cache, block_table_row, kv_len, fb, k_scale)[kvh]  # [H, NKBf, D]: small, gather is fine
    q_hat = q_row[q_len - n:].float().mean(0)
    est = torch.einsum("hd,hkd->hk", q_hat, kp) * scale
    est = est.masked_fill(torch.arange(nkb_f, device=dev)[None, :] * fb > kv_len - 1, float("-inf"))
    query_aware = sqrt_js_divergence(torch.softmax(est, -1), true_blocks) < tau

    # Query-aware branch (all heads; the decision picks later).
    min_blocks = -(-min_budget // fb)
    max_blocks = None if max_budget is None else max(1, -(-max_budget // fb))
    qa_mask = _query_aware_mask(q_row, kp, ctx_len, gamma, fb, min_blocks, max_blocks, b, scale)

    # Vertical-slash branch: cumulative budgets clamped to [lo, hi].
    lo = min(min_budget, kv_len)
    hi = kv_len if max_budget is None else min(max_budget, kv_len)
    v_cnt = cumulative_budget(vertical, gamma).clamp(min=lo, max=hi)
    s_cnt = cumulative_budget(slash, gamma).clamp(min=lo, max=hi)
    # The main diagonal is always kept on top of the s_cnt best: one more when it is not among them.
    s_cnt = s_cnt + ((slash > slash[:, :1]).sum(-1) >= s_cnt).to(s_cnt.dtype)
    slash[:, 0] = float("inf")
    max_v = min(hi, max(lo, DEFAULT_MAX_COLUMNS) if max_columns is None else max(1, max_columns))
    v_idx, v_cnt, s_idx, s_cnt = vs_topk(vertical, slash, v_cnt, s_cnt, max_v, min(hi + 1, kv_len))
    # Key block 0 is always listed for these heads, so a column inside it is never listed.
    v_idx = torch.where(v_idx < b, -1, v_idx)
    # aligned blocks, as in patterns/flex_prefill.py: block 0 is added on top, and the
    # query-aware branch's block lists replace these per head
    vs = vertical_slash_index(v_idx, v_cnt, s_idx, s_cnt, q_len, ctx_len, b, max_blocks=nkb, max_columns=max_v,
                              slash_tiles="blocks")

    block_count, block_index = _assemble(qa_mask, query_aware, q_len, ctx_len, b, nkb, vs.block_count, vs.block_index)
    column_count = torch.where(query_aware[:, None], 0, vs.column_count)
    column_index = vs.column_index.masked_fill_(query_aware[:, None, None], -1)
    return SparseIndex(b, block_count, block_index, column_count, column_index), query_aware


# --------------------------------------------------------------------------------------------
# A-shape heads
# --------------------------------------------------------------------------------------------

def a_shape_index(sink_tokens: torch.Tensor, local_window: torch.Tensor, q_len: int, ctx_len: int,
                  block_size: int = BLOCK.value, max_blocks: int | None = None) -> SparseIndex:
    """Sink blocks plus the local window (``patterns/a_shape.py``), in closed form.

    sink_tokens, local_window: int [H] on the target device. The list of a query block is
    0 .. ns-1 (blocks holding the first sink tokens) followed by lo .. hi (the window's blocks up
    to the last causal one), the two ranges merged where they overlap. ``max_blocks`` (host int,
    e.g. ceil(max sink / B) + ceil(max window / B) + 2) sets the list width; default NKB.
    """
    dev = sink_tokens.device
    b = block_size
    nkb = num_blocks(ctx_len + q_len, b)
    w = nkb if max_blocks is None else max(1, min(max_blocks, nkb))
    q_first, q_last = query_block_bounds(q_len, ctx_len, b, dev)
    hi = (q_last // b)[None, :]  # last causal key block [1, NQB]
    ns = torch.minimum((sink_tokens.to(torch.int64)[:, None] + b - 1) // b, hi + 1)  # [H, NQB]
    # first key block whose last key is >= q_first - window: floor((q_first - window) / B)
    lo = torch.maximum((q_first[None, :] - local_window.to(torch.int64)[:, None]) // b, ns)
    count = ns + (hi - lo + 1).clamp(min=0)
    j = torch.arange(w, device=dev)[None, None, :]
    idx = torch.where(j < ns[..., None], j, lo[..., None] + j - ns[..., None])
    idx = torch.where(j < count[..., None], idx, -1)
    h, nqb = count.shape
    return SparseIndex(b, count.clamp(max=w).to(torch.int32), idx.to(torch.int32), *_no_columns(h, nqb, dev))
