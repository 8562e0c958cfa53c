"""GPU index building for vertical-slash heads, with no host synchronisation.

Two steps, both batched over heads:

1. :func:`vs_topk`: top-k of the vertical (column) and slash (diagonal) scores -> sorted index
   lists of fixed width (``max_v`` / ``max_s``, host ints from the config) with per-head counts.
2. :func:`vertical_slash_index` (Triton, MInference Alg. 4 in spirit): one program per (head,
   query block) walks the kept diagonals from far to near, so the key blocks they cross come in
   ascending order; it merges them (each diagonal crosses at most two aligned blocks, a block is
   emitted once) with a prefix sum over 128 diagonals at a time, then keeps every vertical that is
   causally reachable and whose key block no kept diagonal crosses (a vectorised binary search
   over the sorted diagonals). Output is a :class:`SparseIndex` of fixed width, no dense
   [H, NQB, NKB] mask, no ``.item()``.

Semantics match ``vllm_sparse_backend.patterns.vertical_slash.vertical_slash_to_selection``
followed by ``build_index`` (tests/plugin_triton/test_vs_estimate.py checks it): diagonal d (query
pos - key pos) of a query block spanning [P0, P1] covers key blocks (max(P0 - d, 0) // B) ..
((P1 - d) // B) when d <= P1.

Imports nothing from vLLM or vllm_sparse_backend: torch, triton and this package only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import BIG_KEY, BLOCK, MAX_START, NEG_INF
from ..index_format import SparseIndex, num_blocks
from ..kv_quant import check_kv_dtypes, scale_operand
from ..topk_select import aligned_rows, topk_ascending
from .estimate_math import (LAST_QUERIES_PER_CALL, NORMALIZER_FIRST_KEYS, NORMALIZER_TILE, NORMALIZER_WINDOW,
                            SAMPLED_EXP_CAP, sampled_normalizer_region)


def _row_counts(h: int, wv: int, ws: int, dev) -> torch.Tensor:
    """int32 [2h]: wv for the h vertical rows, ws for the h slash rows (built on the device, so
    also inside a CUDA-graph capture)."""
    t = torch.full((2 * h,), ws, dtype=torch.int32, device=dev)
    t[:h] = wv
    return t


def vs_topk(vertical: torch.Tensor, slash: torch.Tensor, v_count: torch.Tensor | int, s_count: torch.Tensor | int,
            max_v: int, max_s: int, select: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top entries of the scores [h, kv_len] -> (v_idx int32 [h, max_v] ascending key positions,
    v_cnt int32 [h], s_idx int32 [h, max_s] ascending diagonals, s_cnt int32 [h]); -1 padded.

    Per-head sizes ``v_count`` / ``s_count`` (int or int tensor [h]) are clipped to
    ``max_v`` / ``max_s`` (host ints) and to kv_len. Entries to keep unconditionally (first columns,
    nearest diagonals) should carry +inf scores, as the torch estimator does.
    ``select``: with one host budget for all heads, ``radix`` takes the columns with
    :func:`topk_select.topk_ascending` (already ascending, no sort), ``torch`` with
    ``torch.topk`` + a sort; ``auto`` = radix on CUDA. Per-head budgets always use torch.
    """
    h, kv_len = vertical.shape
    dev = vertical.device
    radix = select == "radix" or (select == "auto" and vertical.is_cuda)

    def pick(scores, count, width):
        w = min(width, kv_len)
        if isinstance(count, int) and count >= w:
            # every head keeps its top w: no best-first order needed, only ascending positions
            if radix:
                return topk_ascending(scores, w, width)
            idx = scores.topk(w, dim=-1, sorted=False).indices.sort(-1).values.to(torch.int32)
            if w < width:
                idx = torch.nn.functional.pad(idx, (0, width - w), value=-1)
            return idx.contiguous(), torch.full((h,), w, dtype=torch.int32, device=dev)
        top = scores.topk(w, dim=-1, sorted=True).indices  # best first
        cnt = torch.as_tensor(count, device=dev).expand(h).clamp(max=w).to(torch.int32)
        keep = torch.arange(w, device=dev)[None, :] < cnt[:, None]
        idx = torch.where(keep, top, torch.full_like(top, BIG_KEY.value)).sort(-1).values
        idx = torch.where(idx == BIG_KEY.value, torch.full_like(idx, -1), idx).to(torch.int32)
        if w < width:
            idx = torch.nn.functional.pad(idx, (0, width - w), value=-1)
        return idx.contiguous(), cnt.contiguous()

    wv, ws = min(max_v, kv_len), min(max_s, kv_len)
    if radix and isinstance(v_count, int) and isinstance(s_count, int) and v_count >= wv and s_count >= ws:
        # both selections in one radix select with per-row counts: half the launches of two
        both = aligned_rows(2 * h, kv_len, device=dev)  # the concatenation, rows 16-aligned
        both[:h].copy_(vertical)
        both[h:].copy_(slash)
        idx, cnt = topk_ascending(both, max(wv, ws), max(max_v, max_s), row_k=_row_counts(h, wv, ws, dev))
        return idx[:h, :max_v].contiguous(), cnt[:h], idx[h:, :max_s].contiguous(), cnt[h:]
    v_idx, v_cnt = pick(vertical, v_count, max_v)
    s_idx, s_cnt = pick(slash, s_count, max_s)
    return v_idx, v_cnt, s_idx, s_cnt


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["q_len", "ctx_len", "nqb", "max_v", "max_s", "max_b", "max_c", "max_r"])
def _vs_convert_kernel(v_idx_ptr, v_cnt_ptr, s_idx_ptr, s_cnt_ptr,
                       bcnt_ptr, bidx_ptr, ccnt_ptr, cidx_ptr, rcnt_ptr, ridx_ptr,
                       q_len, ctx_len, nqb, max_v, max_s, max_b, max_c, max_r,
                       BLOCK: tl.constexpr, CH: tl.constexpr, LOG_S: tl.constexpr, LOG_R: tl.constexpr,
                       RANGES: tl.constexpr):
    h = tl.program_id(0)
    qb = tl.program_id(1)
    p0 = ctx_len + qb * BLOCK
    p1 = ctx_len + tl.minimum(qb * BLOCK + BLOCK, q_len) - 1
    ns = tl.load(s_cnt_ptr + h)
    nv = tl.load(v_cnt_ptr + h)
    s_row = s_idx_ptr + h.to(tl.int64) * max_s
    v_row = v_idx_ptr + h.to(tl.int64) * max_v
    out_row = h.to(tl.int64) * nqb + qb
    b_out = bidx_ptr + out_row * max_b
    c_out = cidx_ptr + out_row * max_c
    r_out = ridx_ptr + out_row * max_r
    lanes = tl.arange(0, CH)

    count = ns * 0
    if RANGES:
        # Key ranges of the kept diagonals, far diagonals first -> ascending keys. Diagonal d
        # crosses keys [max(p0 - d, 0), p1 - d]; a range that overlaps or touches the previous
        # one continues its segment, and a segment is cut into BLOCK-key ranges from its first
        # key (the anchor; a running max over the chunk, carried across chunks). Each diagonal
        # emits the (at most two) ranges of its segment it reaches first.
        anchor_in = count - 1
        for j in range(0, ns, CH):
            i = j + lanes
            ok = i < ns
            d = tl.load(s_row + (ns - 1 - i), mask=ok, other=BIG_KEY)
            d_prev = tl.load(s_row + (ns - i), mask=ok & (i > 0), other=BIG_KEY)
            hit = d <= p1
            s = tl.maximum(p0 - d, 0)
            e = p1 - d
            e_prev = tl.where(d_prev <= p1, p1 - d_prev, -2)
            new = hit & (s > e_prev + 1)
            anchor = tl.maximum(tl.associative_scan(tl.where(new, s, -1), 0, _max_combine), anchor_in)
            t_lo = (s - anchor) // BLOCK
            t_hi = (e - anchor) // BLOCK
            prev_hi = tl.where(new, -1, (e_prev - anchor) // BLOCK)
            first = tl.maximum(t_lo, prev_hi + 1)
            c = tl.where(hit, tl.maximum(t_hi - first + 1, 0), 0)
            pos = count + tl.cumsum(c, 0) - c
            r0 = anchor + first * BLOCK
            tl.store(r_out + pos, r0, mask=(c >= 1) & (pos < max_r))
            tl.store(r_out + pos + 1, r0 + BLOCK, mask=(c >= 2) & (pos + 1 < max_r))
            count += tl.sum(c, 0)
            anchor_in = tl.max(anchor, 0)
        count = tl.minimum(count, max_r)
        tl.store(rcnt_ptr + out_row, count)
        tl.store(bcnt_ptr + out_row, count * 0)
        tl.debug_barrier()  # the columns below read this program's ranges back
    else:
        # key blocks crossed by the kept diagonals, far diagonals first -> ascending key blocks
        for j in range(0, ns, CH):
            i = j + lanes
            ok = i < ns
            d = tl.load(s_row + (ns - 1 - i), mask=ok, other=BIG_KEY)
            d_prev = tl.load(s_row + (ns - i), mask=ok & (i > 0), other=BIG_KEY)  # the element before in this order
            hit = d <= p1
            lo_b = tl.maximum(p0 - d, 0) // BLOCK
            hi_b = tl.where(hit, (p1 - d) // BLOCK, -1)
            prev_hi = tl.where(d_prev <= p1, (p1 - d_prev) // BLOCK, -1)
            first = tl.maximum(lo_b, prev_hi + 1)
            c = tl.where(hit, tl.maximum(hi_b - first + 1, 0), 0)
            pos = count + tl.cumsum(c, 0) - c
            tl.store(b_out + pos, first, mask=(c >= 1) & (pos < max_b))
            tl.store(b_out + pos + 1, first + 1, mask=(c >= 2) & (pos + 1 < max_b))
            count += tl.sum(c, 0)
        tl.store(bcnt_ptr + out_row, tl.minimum(count, max_b))
        tl.store(rcnt_ptr + out_row, count * 0)

    # verticals: causal and not inside a crossed block / range
    ccount = nv * 0
    for j in range(0, nv, CH):
        i = j + lanes
        ok = i < nv
        col = tl.load(v_row + i, mask=ok, other=0)
        ok = ok & (col >= 0) & (col <= p1)
        lo = tl.zeros([CH], dtype=tl.int32)
        if RANGES:
            hi = tl.zeros([CH], dtype=tl.int32) + count
            for _ in tl.static_range(LOG_R):  # first range starting after col
                active = lo < hi
                mid = (lo + hi) // 2
                v = tl.load(r_out + mid, mask=active & ok, other=BIG_KEY)
                right = v <= col
                lo = tl.where(active & right, mid + 1, lo)
                hi = tl.where(active & (v > col), mid, hi)
            # the range before it starts at or before col; the next one starts after col
            r_prev = tl.load(r_out + lo - 1, mask=ok & (lo >= 1), other=-BIG_KEY)
            keep = ok & (col >= r_prev + BLOCK)
        else:
            kb = col // BLOCK
            lo_d = p0 - kb * BLOCK - BLOCK + 1  # diagonals crossing block kb inside this query block
            hi_d = p1 - kb * BLOCK
            hi = tl.zeros([CH], dtype=tl.int32) + ns
            for _ in tl.static_range(LOG_S):  # first kept diagonal >= lo_d
                active = lo < hi
                mid = (lo + hi) // 2
                v = tl.load(s_row + mid, mask=active & ok, other=BIG_KEY)
                right = v < lo_d
                lo = tl.where(active & right, mid + 1, lo)
                hi = tl.where(active & (v >= lo_d), mid, hi)
            dfirst = tl.load(s_row + lo, mask=ok & (lo < ns), other=BIG_KEY)
            keep = ok & (dfirst > hi_d)
        k = keep.to(tl.int32)
        pos = ccount + tl.cumsum(k, 0) - k
        tl.store(c_out + pos, col, mask=keep & (pos < max_c))
        ccount += tl.sum(k, 0)
    tl.store(ccnt_ptr + out_row, tl.minimum(ccount, max_c))


def max_blocks_bound(q_len: int, ctx_len: int, max_s: int, block_size: int = BLOCK.value) -> int:
    """Widest possible block list: every diagonal crosses at most two key blocks, and a query
    block sees at most all causal key blocks."""
    return max(1, min(num_blocks(ctx_len + q_len, block_size), 2 * max_s))


def max_ranges_bound(q_len: int, ctx_len: int, max_s: int, block_size: int = BLOCK.value) -> int:
    """Widest possible range list: a diagonal adds at most two ranges, and the ranges of a query
    block number at most its segments (one per diagonal) plus one per ``block_size`` keys."""
    return max(1, min(2 * max_s, max_s + num_blocks(ctx_len + q_len, block_size)))


def vertical_slash_index(v_idx: torch.Tensor, v_cnt: torch.Tensor, s_idx: torch.Tensor, s_cnt: torch.Tensor,
                         q_len: int, ctx_len: int, block_size: int = BLOCK.value, max_blocks: int | None = None,
                         max_columns: int | None = None, chunk: int = 512, slash_tiles: str = "blocks") -> SparseIndex:
    """Sorted vertical positions / diagonals (from :func:`vs_topk`) -> SparseIndex of one row.

    ``slash_tiles``: "ranges" (the diagonals as key ranges, ``patterns.vertical_slash.slash_ranges``)
    or "blocks" (the aligned key blocks they cross). Widths are fixed from host ints
    (``max_blocks`` defaults to :func:`max_blocks_bound` / :func:`max_ranges_bound` and bounds
    whichever list the diagonals fill, ``max_columns`` to ``v_idx.shape[1]``); lists longer than
    a width given smaller than that are cut (their counts say so). No host synchronisation.
    ``chunk`` (a power of two): diagonals or verticals a program handles per step (the default
    measured faster than smaller chunks).
    """
    if slash_tiles not in ("ranges", "blocks"):
        raise ValueError(f"slash_tiles must be 'ranges' or 'blocks', not {slash_tiles!r}")
    ranges = slash_tiles == "ranges"
    h, max_v = v_idx.shape
    max_s = s_idx.shape[1]
    nqb = num_blocks(q_len, block_size)
    dev = v_idx.device
    bound = max_ranges_bound if ranges else max_blocks_bound
    width = max_blocks or bound(q_len, ctx_len, max_s, block_size)
    max_b, max_r = (1, width) if ranges else (width, 1)
    max_c = max(1, max_columns if max_columns is not None else max_v)
    block_index = torch.full((h, nqb, max_b), -1, dtype=torch.int32, device=dev)
    range_start = torch.full((h, nqb, max_r), -1, dtype=torch.int32, device=dev)
    column_index = torch.full((h, nqb, max_c), -1, dtype=torch.int32, device=dev)
    block_count = torch.empty(h, nqb, dtype=torch.int32, device=dev)
    range_count = torch.empty(h, nqb, dtype=torch.int32, device=dev)
    column_count = torch.empty(h, nqb, dtype=torch.int32, device=dev)
    if h and nqb:
        _vs_convert_kernel[(h, nqb)](
            v_idx.contiguous(), v_cnt.to(torch.int32).contiguous(), s_idx.contiguous(),
            s_cnt.to(torch.int32).contiguous(), block_count, block_index, column_count, column_index,
            range_count, range_start,
            q_len, ctx_len, nqb, max_v, max_s, max_b, max_c, max_r,
            BLOCK=block_size, CH=chunk, LOG_S=max(1, int(max_s).bit_length()),
            LOG_R=max(1, int(max_r).bit_length()), RANGES=ranges, num_warps=4)
    return SparseIndex(block_size, block_count, block_index, column_count, column_index, range_count, range_start)


# --------------------------------------------------------------------------------------------
# Last-q estimation: softmax of the chunk's last queries against all keys, column and diagonal
# sums, in two passes over the keys (row max / sum, then normalised sums). Reads K through the
# paged cache like the attention kernel.
# --------------------------------------------------------------------------------------------

# How pass 2 turns a tile's probabilities into diagonal (slash) sums (``last_q_scores(diagonals=)``).
DIAG_MODES = {"atomic": 0, "gather": 1, "skew": 2}

# A sampled pass 1 (``normalizer_sample``) caps pass 2's exponent here: fp32 exp overflows past 88.
EXP_CAP: tl.constexpr = tl.constexpr(SAMPLED_EXP_CAP)


@triton.jit
def _key_tile(k_ptr, bt_ptr, kpos, k_ok, kvh, offs_d, s_kp, s_kt, s_kh, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """K^T tile [HEAD_DIM, BLOCK_N] of key positions kpos through the block table."""
    if MASKED:
        page = tl.load(bt_ptr + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
    else:
        page = tl.load(bt_ptr + kpos // PAGE).to(tl.int64)
    k_off = page * s_kp + (kpos % PAGE).to(tl.int64) * s_kt + kvh * s_kh
    if MASKED:
        return tl.load(k_ptr + k_off[None, :] + offs_d[:, None], mask=k_ok[None, :], other=0.0)
    return tl.load(k_ptr + k_off[None, :] + offs_d[:, None])


@triton.jit
def _online_row_stats(m, l, s):
    """Running row maxima and sums of exp(s - max) after one more tile of scores s [rows, keys]."""
    m_new = tl.maximum(m, tl.max(s, 1))
    return m_new, l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)


@triton.jit
def _tiles_row_stats(m, l, q, start, end, step, k_ptr, bt_ptr, offs_n, kvh, offs_d, s_kp, s_kt, s_kh, scale,
                     PAGE: tl.constexpr):
    """Pass 1's running row maxima and sums over the unmasked key tiles at start, start + step, ...
    below end."""
    for j in range(start, end, step):
        kt = _key_tile(k_ptr, bt_ptr, j + offs_n, offs_n >= 0, kvh, offs_d, s_kp, s_kt, s_kh, PAGE, False)
        kt = kt.to(q.dtype)  # an fp8 cache widened to the query's dtype (a no-op otherwise)
        m, l = _online_row_stats(m, l, tl.dot(q, kt).to(tl.float32) * scale)
    return m, l


@triton.jit
def _put_column_sums(ptr, sums, k_ok, ONE_WRITER: tl.constexpr):
    """A tile's column sums into their output row: stored by the row's only writer, else added
    atomically (with group sums, the head stacks of one KV group share the row)."""
    if ONE_WRITER:
        tl.store(ptr, sums, mask=k_ok)
    else:
        tl.atomic_add(ptr, sums, mask=k_ok)


@triton.jit
def _unmasked_end(start, k_end, q0_pos, n_q, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """End of the key tiles from ``start`` that need no mask: inside [start, k_end) and at or
    before the first query's position, with all BLOCK_Q query rows present."""
    n_full = (tl.minimum(k_end, q0_pos + 1) - start) // BLOCK_N
    n_full = tl.where(n_q == BLOCK_Q, tl.maximum(n_full, 0), 0)
    return start + n_full * BLOCK_N


@triton.jit
def _exp_rows(s, m, SAMPLE: tl.constexpr):
    """exp(s - row max) of pass 2. With a sampled pass 1 (SAMPLE > 1) the max is of the keys it
    read: a key it skipped may score above it, so the exponent is capped (no inf in the sums)."""
    if SAMPLE > 1:
        return tl.exp(tl.minimum(s - m[:, None], EXP_CAP))
    return tl.exp(s - m[:, None])


@triton.jit
def _head_probs(q, kt, m, inv_l, allow, scale, MASKED: tl.constexpr, SAMPLE: tl.constexpr):
    """Normalised probabilities of one head's query rows over a key tile (0 where not allowed)."""
    p = _exp_rows(tl.dot(q, kt).to(tl.float32) * scale, m, SAMPLE) * inv_l[:, None]
    if MASKED:
        p = tl.where(allow, p, 0.0)
    return p


@triton.jit
def _head_rows(q_ptr, stats_ptr, s_qt, s_qh, head, rq, q_ok, offs_d, BLOCK_Q: tl.constexpr):
    """One head's last queries [BLOCK_Q, D], their row maxima and 1 / row sums (from pass 1)."""
    q = tl.load(q_ptr + rq[:, None].to(tl.int64) * s_qt + head * s_qh + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    m = tl.load(stats_ptr + head * 2 * BLOCK_Q + rq)
    inv_l = 1.0 / tl.load(stats_ptr + head * 2 * BLOCK_Q + BLOCK_Q + rq)
    return q, m, inv_l


@triton.jit(do_not_specialize=["kv_len", "q0_pos", "n_q", "split", "skew_w"],
            do_not_specialize_on_alignment=["bt_ptr"])  # as _lastq_pass
def _lastq_skew_pass(q_ptr, k_ptr, bt_ptr, stats_ptr, vert_ptr, slab_ptr, k_scale_ptr,
                     s_qt, s_qh, s_kp, s_kt, s_kh, kv_len, q0_pos, n_q, scale, split, skew_w,
                     GROUP: tl.constexpr, STACK: tl.constexpr, GROUP_SUM: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, K_SCALED: tl.constexpr,
                     SAMPLE: tl.constexpr):
    # Pass 2 of the skew mode. One program per (STACK heads of a KV group, key range), the heads
    # as separate BLOCK_Q-row products over each K tile (not one stacked STACK * BLOCK_Q-row
    # product as in pass 1): their probabilities add up in registers of one layout (the diagonal
    # sums only need the group's total), the causal mask is built once for BLOCK_Q rows and the
    # column sums reduce one BLOCK_Q-row tile; tiles wholly below the first query skip the mask.
    # Each tile row i is stored into this program's slab shifted left by i (column kpos - i +
    # BLOCK_Q - 1), so every diagonal lands in one slab column; _skew_colsum sums the columns.
    # No barrier, no atomic here (GROUP_SUM with several stacks per group: vert adds atomically).
    h0 = tl.program_id(0) * STACK
    sp = tl.program_id(1)
    kvh = (h0 // GROUP).to(tl.int64)
    rq = tl.arange(0, BLOCK_Q)
    q_ok = rq < n_q
    qpos = q0_pos + rq
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    out_row = kvh if GROUP_SUM else h0.to(tl.int64)
    if K_SCALED:  # a quantized cache: dequantised K = stored * k_scale
        scale = scale * tl.load(k_scale_ptr)
    qa, ma, la = _head_rows(q_ptr, stats_ptr, s_qt, s_qh, h0, rq, q_ok, offs_d, BLOCK_Q)
    if STACK >= 2:
        qb, mb, lb = _head_rows(q_ptr, stats_ptr, s_qt, s_qh, h0 + 1, rq, q_ok, offs_d, BLOCK_Q)
    if STACK >= 4:
        qc, mc, lc = _head_rows(q_ptr, stats_ptr, s_qt, s_qh, h0 + 2, rq, q_ok, offs_d, BLOCK_Q)
        qd, md, ld = _head_rows(q_ptr, stats_ptr, s_qt, s_qh, h0 + 3, rq, q_ok, offs_d, BLOCK_Q)
    start = sp * split
    k_end = tl.minimum(kv_len, start + split)
    j_mid = _unmasked_end(start, k_end, q0_pos, n_q, BLOCK_Q, BLOCK_N)
    slab = slab_ptr + tl.program_id(0).to(tl.int64) * BLOCK_Q * skew_w + rq[:, None].to(tl.int64) * skew_w
    for phase in tl.static_range(2):  # 0: unmasked tiles, 1: the rest
        if phase == 0:
            lo = start
            hi = j_mid
        else:
            lo = j_mid
            hi = k_end
        for j in range(lo, hi, BLOCK_N):
            kpos = j + offs_n
            k_ok = kpos < k_end
            kt = _key_tile(k_ptr, bt_ptr, kpos, k_ok, kvh, offs_d, s_kp, s_kt, s_kh, PAGE, phase == 1).to(qa.dtype)
            allow = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :] & q_ok[:, None]
            p = _head_probs(qa, kt, ma, la, allow, scale, phase == 1, SAMPLE)
            if STACK >= 2:
                p += _head_probs(qb, kt, mb, lb, allow, scale, phase == 1, SAMPLE)
            if STACK >= 4:
                p += _head_probs(qc, kt, mc, lc, allow, scale, phase == 1, SAMPLE)
                p += _head_probs(qd, kt, md, ld, allow, scale, phase == 1, SAMPLE)
            _put_column_sums(vert_ptr + out_row * kv_len + kpos, tl.sum(p, 0), k_ok, STACK == GROUP or not GROUP_SUM)
            tl.store(slab + (kpos[None, :] - rq[:, None] + (BLOCK_Q - 1)), p, mask=k_ok[None, :])


# One compile for all rows. bt_ptr is one row of vLLM's block table: its address is 16-byte aligned
# only in some rows (a row is max_pages int32), and the profiling run compiles with an aligned one.
@triton.jit(do_not_specialize=["kv_len", "q0_pos", "n_q", "n_split", "split", "far_lo", "far_hi"],
            do_not_specialize_on_alignment=["bt_ptr"])
def _lastq_pass(q_ptr, k_ptr, bt_ptr, part_ptr, stats_ptr, vert_ptr, slash_ptr, k_scale_ptr,
                s_qt, s_qh, s_kp, s_kt, s_kh, kv_len, q0_pos, n_q, scale, n_split, split, far_lo, far_hi,
                GROUP: tl.constexpr, STACK: tl.constexpr, GROUP_SUM: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                SECOND: tl.constexpr, DIAG: tl.constexpr, K_SCALED: tl.constexpr, SAMPLE: tl.constexpr):
    # Pass 1 of every mode (each key range's row max and sum) and pass 2 of the gather and atomic
    # modes. One program per (STACK consecutive query heads of one KV group, key range). The
    # heads' queries are stacked along M (row r: head h0 + r // BLOCK_Q, query r % BLOCK_Q), so
    # each K tile is loaded once for all of them. GROUP_SUM: outputs are per KV head, summed over
    # its group (a program covering the whole group stores, otherwise programs add atomically).
    ROWS: tl.constexpr = STACK * BLOCK_Q
    h0 = tl.program_id(0) * STACK
    sp = tl.program_id(1)
    kvh = (h0 // GROUP).to(tl.int64)
    rr = tl.arange(0, ROWS)
    rq = rr % BLOCK_Q
    head = h0 + rr // BLOCK_Q
    q_ok = rq < n_q
    qpos = q0_pos + rq
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rq[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=q_ok[:, None], other=0.0)
    offs_n = tl.arange(0, BLOCK_N)
    if K_SCALED:  # a quantized cache: dequantised K = stored * k_scale
        scale = scale * tl.load(k_scale_ptr)
    if GROUP_SUM:
        out_row = kvh
    else:
        out_row = h0.to(tl.int64)
    if SECOND:
        m = tl.load(stats_ptr + head * 2 * BLOCK_Q + rq)
        inv_l = 1.0 / tl.load(stats_ptr + head * 2 * BLOCK_Q + BLOCK_Q + rq)
    else:
        m = tl.full([ROWS], MAX_START, dtype=tl.float32)
        l = tl.zeros([ROWS], dtype=tl.float32)
    k_end = tl.minimum(kv_len, (sp + 1) * split)
    j_mid = sp * split
    if not SECOND:
        # pass 1 over the tiles wholly below the first query: no mask
        j_mid = _unmasked_end(j_mid, k_end, q0_pos, n_q, BLOCK_Q, BLOCK_N)
        whole_from = sp * split
        if SAMPLE > 1:
            # [far_lo, far_hi): one tile in SAMPLE (on a grid from far_lo), its sum counted SAMPLE
            # times; the first keys and the window before the queries are read whole
            step = BLOCK_N * SAMPLE
            start = far_lo + tl.cdiv(tl.maximum(whole_from, far_lo) - far_lo, step) * step
            m, l = _tiles_row_stats(m, l, q, start, tl.minimum(j_mid, far_hi), step, k_ptr, bt_ptr, offs_n, kvh,
                                    offs_d, s_kp, s_kt, s_kh, scale, PAGE)
            l = l * SAMPLE
            m, l = _tiles_row_stats(m, l, q, whole_from, tl.minimum(j_mid, far_lo), BLOCK_N, k_ptr, bt_ptr, offs_n,
                                    kvh, offs_d, s_kp, s_kt, s_kh, scale, PAGE)
            whole_from = tl.maximum(whole_from, far_hi)
        m, l = _tiles_row_stats(m, l, q, whole_from, j_mid, BLOCK_N, k_ptr, bt_ptr, offs_n, kvh, offs_d, s_kp, s_kt,
                                s_kh, scale, PAGE)
    for j in range(j_mid, k_end, BLOCK_N):
        kpos = j + offs_n
        k_ok = kpos < k_end
        kt = _key_tile(k_ptr, bt_ptr, kpos, k_ok, kvh, offs_d, s_kp, s_kt, s_kh, PAGE, True).to(q.dtype)
        s = tl.dot(q, kt).to(tl.float32) * scale
        allow = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :] & q_ok[:, None]
        s = tl.where(allow, s, NEG_INF)
        if SECOND:
            p = tl.where(allow, _exp_rows(s, m, SAMPLE) * inv_l[:, None], 0.0)
            _put_column_sums(vert_ptr + out_row * kv_len + kpos, tl.sum(p, 0), k_ok, STACK == GROUP or not GROUP_SUM)
            if STACK > 1:
                # the stacked heads' probabilities at each (query, key): diagonals are shared
                p = tl.sum(tl.reshape(p, [STACK, BLOCK_Q, BLOCK_N]), 0)
            if DIAG == 1:
                # gather: the tile's BLOCK_Q + BLOCK_N - 1 diagonals summed in registers (row i,
                # diagonal t holds p[i, i - t + BLOCK_N - 1]), one atomic per diagonal
                ri = tl.arange(0, BLOCK_Q)
                offs_t = tl.arange(0, BLOCK_Q + BLOCK_N)
                jj = ri[:, None] - offs_t[None, :] + (BLOCK_N - 1)
                in_tile = (jj >= 0) & (jj < BLOCK_N)
                x = tl.gather(p, tl.where(in_tile, jj, 0), 1)
                dsum = tl.sum(tl.where(in_tile, x, 0.0), 0)
                dd = q0_pos - j + offs_t - (BLOCK_N - 1)
                tl.atomic_add(slash_ptr + out_row * kv_len + dd, dsum,
                              mask=(offs_t < BLOCK_Q + BLOCK_N - 1) & (dd >= 0))
            else:
                ri = tl.arange(0, BLOCK_Q)
                d = (q0_pos + ri)[:, None] - kpos[None, :]
                ok = (kpos[None, :] <= (q0_pos + ri)[:, None]) & k_ok[None, :] & (ri < n_q)[:, None]
                tl.atomic_add(slash_ptr + out_row * kv_len + d, p, mask=ok)
        else:
            m, l = _online_row_stats(m, l, s)
    if not SECOND:
        base = part_ptr + (head * n_split + sp) * 2 * BLOCK_Q
        tl.store(base + rq, m)
        tl.store(base + BLOCK_Q + rq, l)


def lastq_stack(group: int) -> int:
    """Query heads stacked per program in :func:`last_q_scores` with ``group_sum``: the largest
    power of two dividing the group, at most 4 (M = 256 rows; 8 heads would be 512 rows of fp32
    scores per tile). Stacking measured faster than per-head scores summed afterwards, and 4
    heads faster than 2."""
    st = 1
    while st < 4 and group % (2 * st) == 0:
        st *= 2
    return st


def lastq_split(kv_len: int, programs_per_range: int) -> int:
    """Keys per program of :func:`last_q_scores`: 4096, halved (down to 1024) while that leaves
    fewer than ~512 programs (4 per SM of an H100/H200), so short rows still fill the GPU."""
    split = 4096
    while split > 1024 and programs_per_range * ((kv_len + split - 1) // split) < 512:
        split //= 2
    return split


@triton.jit(do_not_specialize=["n_split"])
def _merge_row_stats(part_ptr, stats_ptr, n_split, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
    # Pass 1's per-key-range (max, sum) of one head's rows -> the row max and the sum rescaled to
    # it (at least 1e-30), as pass 2 reads them. One program per query head.
    h = tl.program_id(0)
    rq = tl.arange(0, BLOCK_Q)
    base = part_ptr + h.to(tl.int64) * n_split * 2 * BLOCK_Q
    m = tl.full([BLOCK_Q], MAX_START, dtype=tl.float32)
    l = tl.zeros([BLOCK_Q], dtype=tl.float32)
    for s0 in range(0, n_split, BLOCK_S):  # BLOCK_S key ranges at a time
        sp = s0 + tl.arange(0, BLOCK_S)
        ok = (sp < n_split)[:, None]
        m_p = tl.load(base + sp[:, None] * 2 * BLOCK_Q + rq[None, :], mask=ok, other=MAX_START)
        l_p = tl.load(base + sp[:, None] * 2 * BLOCK_Q + BLOCK_Q + rq[None, :], mask=ok, other=0.0)
        m_new = tl.maximum(m, tl.max(m_p, 0))
        l = l * tl.exp(m - m_new) + tl.sum(l_p * tl.exp(m_p - m_new[None, :]), 0)
        m = m_new
    tl.store(stats_ptr + h * 2 * BLOCK_Q + rq, m)
    tl.store(stats_ptr + h * 2 * BLOCK_Q + BLOCK_Q + rq, tl.maximum(l, 1e-30))


@triton.jit(do_not_specialize=["skew_w", "kv_len", "q0_pos", "n_q"])
def _skew_colsum(skew_ptr, slash_ptr, skew_w, kv_len, q0_pos, n_q,
                 SLABS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr):
    # Diagonal sums from pass 2's skewed slabs: slab column c holds diagonal q0_pos + BLOCK_Q - 1 - c
    # of every query row. Row i wrote columns whose key c + i - (BLOCK_Q - 1) is in [0, kv_len); the
    # rest of the slab was never written and is masked. SLABS programs' slabs sum into one output
    # row (the stacks of one KV group with group_sum).
    o = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for sl in range(SLABS):
        slab = skew_ptr + (o * SLABS + sl).to(tl.int64) * BLOCK_Q * skew_w
        for i in range(0, n_q):
            key = c + i - (BLOCK_Q - 1)
            acc += tl.load(slab + i * skew_w + c, mask=(key >= 0) & (key < kv_len), other=0.0)
    d = q0_pos + (BLOCK_Q - 1) - c
    tl.store(slash_ptr + o.to(tl.int64) * kv_len + d, acc, mask=(d >= 0) & (d < kv_len))


# Queries of one last_q_scores call: the rows of its query tile (the chunk's last LAST_Q queries).
LAST_Q = LAST_QUERIES_PER_CALL  # 64

# Keys per tile of last_q_scores' first pass, and of its second pass but in the skew mode.
KEY_TILE = NORMALIZER_TILE  # 64: also the tile a sampled pass 1 reads or skips

# Keys per program of the skew mode's column sums.
SKEW_COLUMNS = 512


def skew_width(kv_len: int) -> int:
    """Columns of a skew slab: a tile row shifted by its query's offset spans kv_len + LAST_Q - 1."""
    return kv_len + LAST_Q - 1


# The skew mode's slabs (LAST_Q x skew_width(kv_len) fp32 per program) are a per-layer transient;
# above this the gather mode (no slab, slower) takes over. KV-group-shared Llama-3-8B shape: 8
# slabs, skew up to ~768K tokens; one list per query head (32 slabs): up to ~192K.
SKEW_SLAB_BYTES = 3 << 29  # 1.5 GiB


def last_q_scores(q_last: torch.Tensor, key_cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int,
                  scale: float, split: int | None = None, diagonals: str = "auto", group_sum: bool = False,
                  stack: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  block_n: int = KEY_TILE, k_scale=None, normalizer_sample: int = 1,
                  first_keys: int = NORMALIZER_FIRST_KEYS, window: int = NORMALIZER_WINDOW
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores (fp32) of the row's last queries: [H, kv_len], or [Hkv, kv_len]
    summed over each KV group's query heads with ``group_sum``.

    q_last: [n, H, D] with n <= LAST_Q (64), the chunk's last n queries (absolute positions kv_len - n ..
    kv_len - 1); key_cache: [pages, page, Hkv, D] view; block_table_row: int32 [max_pages].
    Same sums as ``patterns.common.last_queries_probs`` + ``vertical_and_slash_sums``: pass 1
    takes each key range's row max / sum (grid head stacks x key ranges, ``stack`` heads of a
    group sharing each K tile with ``group_sum``: default :func:`lastq_stack`), a small kernel
    merges them, pass 2 writes normalised column sums and the diagonal sums. ``diagonals`` says
    how pass 2 gets those from each 64 x 64 tile: ``skew`` stores the tile's rows shifted into a
    per-program slab (64 x :func:`skew_width` fp32) that a third kernel sums by column; ``gather``
    sums the tile's diagonals in registers (``tl.gather``) and adds them atomically; ``atomic``
    adds every element atomically; ``auto``: skew while the slabs fit in :data:`SKEW_SLAB_BYTES`,
    else gather. ``num_warps``, ``num_stages`` and ``block_n`` (skew only) set pass 2's launch.
    ``k_scale`` (None, a number or a one-element fp32 device tensor, read on the device): the
    cache holds K / k_scale, e.g. vLLM's fp8 cache (tiles widened to the query's dtype on load).
    ``normalizer_sample`` N > 1: pass 1 reads the ``first_keys`` and the ``window`` keys before
    the first query whole and one 64-key tile in N of the keys between, counting its sum N times
    (:func:`sampled_normalizer_region`): the row sums estimated at about 1/N of pass 1's reads.
    """
    n, h, d = q_last.shape
    page, hkv = key_cache.shape[1], key_cache.shape[2]
    if n > LAST_Q or key_cache.stride(3) != 1 or q_last.stride(2) != 1:
        raise ValueError(f"last_q_scores needs at most {LAST_Q} queries and unit stride over the head dim")
    if diagonals not in DIAG_MODES and diagonals != "auto":
        raise ValueError(f"diagonals={diagonals!r}: auto or one of {sorted(DIAG_MODES)}")
    group = h // hkv
    st = (stack or lastq_stack(group)) if group_sum else 1
    if group % st or st not in (1, 2, 4):
        raise ValueError(f"stack {st}: 1, 2 or 4 heads dividing the KV group of {group}")
    if diagonals == "auto":
        slab_bytes = LAST_Q * skew_width(kv_len) * torch.finfo(torch.float32).bits // 8
        diagonals = "skew" if (h // st) * slab_bytes <= SKEW_SLAB_BYTES else "gather"
    if block_n != KEY_TILE and diagonals != "skew":
        raise ValueError(f"only the skew mode takes key tiles other than {KEY_TILE} wide")
    dev = q_last.device
    check_kv_dtypes(q_last, key_cache)
    ks = scale_operand(k_scale, dev)
    split = split or lastq_split(kv_len, h // st)
    n_split = (kv_len + split - 1) // split
    part = torch.empty(h, n_split, 2, LAST_Q, dtype=torch.float32, device=dev)
    stats = torch.empty(h, 2, LAST_Q, dtype=torch.float32, device=dev)
    n_out = hkv if group_sum else h
    n_prog = h // st
    one_writer = st == group or not group_sum  # else the group's stacks add their column sums
    skew = diagonals == "skew"
    vert = (torch.empty if skew and one_writer else torch.zeros)(n_out, kv_len, dtype=torch.float32, device=dev)
    slash = (torch.empty if skew else torch.zeros)(n_out, kv_len, dtype=torch.float32, device=dev)
    common = dict(GROUP=group, STACK=st, GROUP_SUM=group_sum, PAGE=page, BLOCK_Q=LAST_Q, HEAD_DIM=d,
                  K_SCALED=ks is not None)
    ks = stats if ks is None else ks  # a placeholder, not read unless K_SCALED
    geometry = (q_last.stride(0), q_last.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                kv_len, kv_len - n, n, float(scale))
    far_lo, far_hi = sampled_normalizer_region(kv_len - n, normalizer_sample, first_keys, window)
    common["SAMPLE"] = normalizer_sample
    # pass 1: 8 warps for 4 stacked heads (M = 256), else 4 (measured faster)
    _lastq_pass[(n_prog, n_split)](q_last, key_cache, block_table_row, part, stats, vert, slash, ks, *geometry,
                                   n_split, split, far_lo, far_hi, SECOND=False, DIAG=0, BLOCK_N=KEY_TILE, **common,
                                   num_warps=max(4, 2 * st), num_stages=2)
    _merge_row_stats[(h,)](part, stats, n_split, BLOCK_Q=LAST_Q, BLOCK_S=32, num_warps=4)
    if skew:
        # 4 warps and 2 stages (more warps or stages, or 32-key tiles, measured slower)
        slabs = torch.empty(n_prog * LAST_Q * skew_width(kv_len), dtype=torch.float32, device=dev)
        _lastq_skew_pass[(n_prog, n_split)](q_last, key_cache, block_table_row, stats, vert, slabs, ks, *geometry,
                                            split, skew_width(kv_len), BLOCK_N=block_n, **common, num_warps=num_warps or 4,
                                            num_stages=num_stages or 2)
        width = skew_width(kv_len)
        _skew_colsum[(n_out, triton.cdiv(width, SKEW_COLUMNS))](slabs, slash, width, kv_len, kv_len - n, n,
                                                                 SLABS=n_prog // n_out, BLOCK_Q=LAST_Q,
                                                                 BLOCK_C=SKEW_COLUMNS, num_warps=4)
    else:
        _lastq_pass[(n_prog, n_split)](q_last, key_cache, block_table_row, part, stats, vert, slash, ks,
                                       *geometry, n_split, split, far_lo, far_hi, SECOND=True,
                                       DIAG=DIAG_MODES[diagonals], BLOCK_N=KEY_TILE, **common,
                                       num_warps=num_warps or max(4, 2 * st), num_stages=num_stages or 3)
    return vert, slash
