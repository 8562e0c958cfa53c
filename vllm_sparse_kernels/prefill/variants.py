"""The variants kernel: :func:`_sparse_fwd_variants_kernel`, the serving kernel's modes that only
tests and benchmarks launch (the dense variant, merged heads, the LSE output, the other program
order, no prefetch).

It lives apart from the serving kernel (:mod:`.attention`, whose launcher
:func:`~.attention.sparse_prefill_attention` picks one of the two from its arguments) so that the
module serving loads holds only what serving runs; both kernels are built from the same
``@triton.jit`` helpers (:mod:`.tiles`). Imports nothing from vLLM or vllm_sparse_backend.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import BLOCK, MAX_START
from .tiles import (block_list, block_tiles, column_tiles, list_row, program_ids, program_rows, range_tiles,
                    store_lse, store_rows)


# Lengths and list widths change from launch to launch: as for the serving kernel, the int
# arguments are not specialised (attention.py says why).
@triton.jit(do_not_specialize=["s_lh", "s_lse_h", "num_qb", "num_lists", "maxb", "maxc", "maxr"])
def _sparse_fwd_variants_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr, meta_ptr,
    bcnt_ptr, bidx_ptr, ccnt_ptr, cidx_ptr, bbits_ptr, cbits_ptr, whole_ptr, rcnt_ptr, ridx_ptr, k_scale_ptr,
    v_scale_ptr, k_desc, v_desc,
    q_strides, o_strides, k_strides, v_strides,
    s_bt, s_lh, s_lse_h,  # ... and the lse head stride
    num_qb, num_lists, maxb, maxc, maxr,
    qk_scale, softcap, skip_log2,
    GROUP: tl.constexpr, GH: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SOFTCAP: tl.constexpr, FALLBACK: tl.constexpr, KV_SCALED: tl.constexpr, TMA: tl.constexpr, SKIP: tl.constexpr,
    DENSE: tl.constexpr,  # no lists: every causal key block (benchmarks' dense baseline)
    MERGED: tl.constexpr,  # merged lists of GH heads with a head bitmask per entry (bbits_ptr / cbits_ptr)
    WRITE_LSE: tl.constexpr,  # also the natural-log LSE into lse_ptr [H, T]
    KV_MAJOR: tl.constexpr,  # program order (False: list owners innermost over all KV heads)
    PREFETCH: tl.constexpr,  # gathered tiles: the next tile's list entries and page lookups issued early
):
    """The serving kernel's modes for tests and benchmarks, from the same helpers: the dense
    variant, merged heads, the LSE output, the other program order and no prefetch. With
    DENSE = MERGED = WRITE_LSE = False and KV_MAJOR = PREFETCH = True it computes what
    :func:`_sparse_fwd_kernel` computes."""
    BLOCK_M: tl.constexpr = GH * BLOCK
    pid_h, qb = program_ids(num_qb, num_lists, (GROUP + GH - 1) // GH, KV_MAJOR)
    rows, keys, lanes, out_rows, nq, qpos0 = program_rows(q_ptr, q_strides, meta_ptr, bt_ptr, s_bt, pid_h, qb,
                                                           GROUP, GH, BLOCK_N, HEAD_DIM)
    m_i = tl.full([BLOCK_M], MAX_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    cache = (k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc)

    lrow, blist, n_full, n_all, whole = block_list(bcnt_ptr, bidx_ptr, whole_ptr, maxb, s_lh, pid_h, qb, qpos0, nq,
                                                    DENSE, FALLBACK)
    m_i, l_i, acc = block_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, skip_log2, blist,
                                 bbits_ptr + lrow * maxb, n_full, n_all, whole,
                                 PAGE, BLOCK_N, HEAD_DIM, DENSE, MERGED, PREFETCH, FALLBACK, SOFTCAP, TMA, SKIP)
    if not DENSE:
        rlist, n_rng = list_row(rcnt_ptr, ridx_ptr, maxr, lrow, whole, FALLBACK)
        m_i, l_i, acc = range_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, rlist, n_rng,
                                     PAGE, BLOCK_N, HEAD_DIM, SOFTCAP)
        clist, n_col = list_row(ccnt_ptr, cidx_ptr, maxc, lrow, whole, FALLBACK)
        m_i, l_i, acc = column_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, clist, n_col,
                                      cbits_ptr + lrow * maxc, PAGE, BLOCK_N, HEAD_DIM, MERGED, SOFTCAP)

    tok, head, row_ok = out_rows
    store_rows(o_ptr, o_strides, acc, l_i, tok, head, row_ok, v_scale_ptr, HEAD_DIM, KV_SCALED)
    if WRITE_LSE:
        store_lse(lse_ptr, s_lse_h, m_i, l_i, tok, head, row_ok)
