"""Triton forward kernel for sparse prefill attention over vLLM's paged KV cache.

Consumes the block + range + column format of :mod:`..index_format` (MInference
Alg. 5 plus its point-range merge): for each query block of 64 queries and each query head,
first the listed whole key blocks (unmasked, except the at most two that reach the query
block's own positions), then the listed key ranges (64 consecutive keys from any position, cut
where the next range starts: the slash lines), then the listed single key columns, gathered
``BLOCK_N`` at a time through the block table. Online
softmax in fp32 (exp2), bf16/fp16 (or fp32) inputs, optional tanh soft-capping and LSE output.
K/V caches hold the query's dtype or fp8 (vLLM's fp8 KV cache: tiles widened to the query's
dtype on load, the per-layer k / v scales applied to the scores' scale and to the output).
Queries that select nothing get a zero output (LSE -inf), never NaN.

A varlen batch of rows is described by :class:`BatchedSparseIndex` (:mod:`.packing`:
:func:`pack_rows`, with the rows' metadata planned once per step by :func:`plan_rows`). The grid
is flat: one program per (list owner, query block), ordered KV head first, then query blocks
from the last (heaviest) to the first, then the heads of the group, so programs that read the
same KV head run together and share its K/V in L2.

Two kernels, built from the same ``@triton.jit`` helpers (:mod:`.tiles`): this module's
:func:`_sparse_fwd_kernel` runs what serving launches (per-head or group-shared lists, rows
flagged to run every causal key, fp8 caches, soft-capping, TMA or gathered loads);
:mod:`.variants` holds ``_sparse_fwd_variants_kernel``, which adds the modes only tests and
benchmarks use: the dense variant (``pack_rows(rows, None)``: every causal key block, no lists
materialised, for comparing against cuDNN / FlashAttention), merged heads
(:func:`merge_group_heads`), the LSE output, the other program order and no prefetch. The
launcher :func:`sparse_prefill_attention` (here) picks one from its arguments.

GQA: a program may stack ``heads_per_program`` query heads of one KV group along M
(BLOCK_M = heads_per_program * 64), so each K/V tile is loaded once for all of them. This needs
one key list for the stacked heads: the dense mode (no lists; padded stacks for groups like 7),
a group-shared index (one list per KV group or sub-group, ``pack_rows(..., heads_per_list=g)``)
and a merged index (:func:`merge_group_heads`: union of the heads' lists plus a per-entry head
bitmask) qualify. Stacking pays for dense at head dim 128 and for group-shared lists; for
per-head lists that differ between heads the union costs more than it saves, so those run one
head per program (the launch table, :mod:`.launch_config`).

K/V are read through the block table with the cache tensors' own strides
(``[num_pages, page_size, Hkv, D]`` views, NHD or HND physical layout, any power-of-two page
size; a 64-key block may span several pages). With pages of a multiple of 64 keys on Hopper or
later, listed blocks are loaded with the tensor memory accelerator instead (``tma``: one 4-D
descriptor per cache, one box = 64 keys of one page and KV head; the pointer gathers cost
registers and address math per key); range and column tiles are always gathered.

The launcher's module also offers the packing entry points (:func:`pack_rows`,
:func:`plan_rows`, :func:`merge_group_heads`) and the launch table's (:func:`default_config`,
:func:`shared_stack`), so that one import serves a caller. Imports nothing from vLLM or
vllm_sparse_backend: torch, triton and this package only.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from ..constants import BLOCK, MAX_START
from ..index_format import SparseIndex
from ..kv_quant import check_kv_dtypes, is_fp8, scale_operand
from . import variants
from .launch_config import default_config, shared_stack
from .packing import (META_WIDTH, BatchedSparseIndex, RowTable, merge_group_heads, pack_rows, plan_rows,
                      row_fields)
from .tiles import (block_list, block_tiles, column_tiles, list_row, program_ids, program_rows, range_tiles,
                    store_rows)

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the TMA path is unavailable
    TensorDescriptor = None

__all__ = ["HEAD_DIMS", "BatchedSparseIndex", "RowTable", "default_config", "merge_group_heads", "pack_rows",
           "plan_rows", "shared_stack", "sparse_prefill_attention", "tma_unusable"]


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

# Lengths and list widths change from step to step: compile once for all of them (Triton would
# otherwise specialise each int argument on divisibility by 16 and on == 1, and a new prompt
# length could trigger a compile of several seconds in the middle of serving).
@triton.jit(do_not_specialize=["s_lh", "num_qb", "maxb", "maxc", "maxr"])
def _sparse_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, meta_ptr,
    bcnt_ptr, bidx_ptr, ccnt_ptr, cidx_ptr, whole_ptr, rcnt_ptr, ridx_ptr, k_scale_ptr, v_scale_ptr,
    k_desc, v_desc,
    q_strides, o_strides, k_strides, v_strides,  # [T, H, D] and [pages, page, Hkv, D] strides
    s_bt, s_lh,  # block-table row stride, list owner stride of the lists (TQB)
    num_qb, maxb, maxc, maxr,
    qk_scale, softcap, skip_log2,
    GROUP: tl.constexpr,  # query heads per KV head
    GH: tl.constexpr,  # query heads stacked in one program (one key list for all of them)
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FALLBACK: tl.constexpr,  # rows flagged in whole_ptr run every causal key block instead of their lists
    KV_SCALED: tl.constexpr,  # dequantised K/V = stored * k_scale / v_scale (fp32 scalars on the device)
    TMA: tl.constexpr,  # listed blocks loaded through k_desc / v_desc (needs BLOCK_N == BLOCK, PAGE % BLOCK == 0)
    SKIP: tl.constexpr,  # the skip-softmax filter on listed blocks below the diagonal (tiles.py)
):
    """The serving kernel: one program per (list owner, query block), KV-head-major order, the
    next tile's list entries and page lookups prefetched. Per program: the listed key blocks, the
    key ranges, the single columns, then the normalised output."""
    BLOCK_M: tl.constexpr = GH * BLOCK
    pid_h, qb = program_ids(num_qb, None, (GROUP + GH - 1) // GH, True)
    rows, keys, lanes, out_rows, nq, qpos0 = program_rows(q_ptr, q_strides, meta_ptr, bt_ptr, s_bt, pid_h, qb,
                                                           GROUP, GH, BLOCK_N, HEAD_DIM)
    m_i = tl.full([BLOCK_M], MAX_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if KV_SCALED:  # k_scale folds into the scores' scale, v_scale into the output
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    cache = (k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc)

    lrow, blist, n_full, n_all, whole = block_list(bcnt_ptr, bidx_ptr, whole_ptr, maxb, s_lh, pid_h, qb, qpos0, nq,
                                                    False, FALLBACK)
    m_i, l_i, acc = block_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, skip_log2, blist, None,
                                 n_full, n_all, whole, PAGE, BLOCK_N, HEAD_DIM, False, False, True, FALLBACK, SOFTCAP,
                                 TMA, SKIP)
    rlist, n_rng = list_row(rcnt_ptr, ridx_ptr, maxr, lrow, whole, FALLBACK)
    m_i, l_i, acc = range_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, rlist, n_rng,
                                 PAGE, BLOCK_N, HEAD_DIM, SOFTCAP)
    clist, n_col = list_row(ccnt_ptr, cidx_ptr, maxc, lrow, whole, FALLBACK)
    m_i, l_i, acc = column_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, clist, n_col, None,
                                  PAGE, BLOCK_N, HEAD_DIM, False, SOFTCAP)

    tok, head, row_ok = out_rows
    store_rows(o_ptr, o_strides, acc, l_i, tok, head, row_ok, v_scale_ptr, HEAD_DIM, KV_SCALED)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

def tma_unusable(key_cache: torch.Tensor, value_cache: torch.Tensor, block_n: int) -> str:
    """Why the TMA path cannot read these caches ('' when it can): each 64-key tile must be one
    box of one page (pages of a multiple of 64 keys, 64-key tiles) and the descriptors need
    16-byte aligned bases and strides with a contiguous head dimension; the hardware is Hopper
    or later (or Triton's interpreter)."""
    if TensorDescriptor is None:
        return "this Triton has no host tensor descriptors"
    if block_n != BLOCK.value:
        return f"key tiles of {block_n} (TMA tiles are one {BLOCK.value}-key block)"
    if key_cache.shape[1] % BLOCK.value:
        return f"pages of {key_cache.shape[1]} keys (need a multiple of {BLOCK.value})"
    for name, c in (("key", key_cache), ("value", value_cache)):
        if c.stride(-1) != 1 or c.data_ptr() % 16 or any(st * c.element_size() % 16 for st in c.stride()[:-1]):
            return f"the {name} cache's strides {tuple(c.stride())} are not 16-byte aligned with a contiguous head dim"
    if key_cache.is_cuda and torch.cuda.get_device_capability(key_cache.device)[0] < 9:
        return "TMA needs compute capability 9.0 or later"
    return ""


def _cache_descriptor(cache: torch.Tensor):
    """4-D descriptor over a [pages, page, Hkv, D] cache view (any order of the first three
    strides, NHD or HND), one box = 64 keys of one page and one KV head."""
    return TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [1, BLOCK.value, 1, cache.shape[-1]])


HEAD_DIMS = (16, 32, 64, 128, 256)  # head sizes the kernels take (tl.arange over the head dim: powers of two)


def _check_operands(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                    out: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Shapes, dtypes, devices and the strides the kernels assume, once per launch (the kernels
    check nothing); returns (T, H, D, page_size, Hkv), T the tokens both q and out hold."""
    check_kv_dtypes(q, key_cache, value_cache)
    if q.dim() != 3:
        raise ValueError(f"q: [tokens, heads, head_dim] expected, got shape {tuple(q.shape)}")
    if out.dim() != 3 or out.shape[1:] != q.shape[1:]:
        raise ValueError(f"out: [tokens, {q.shape[1]}, {q.shape[2]}] expected (the query's heads and head size), "
                         f"got {tuple(out.shape)}")
    if out.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out: fp16, bf16 or fp32 expected, got {out.dtype}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name}: a [num_pages, page_size, kv_heads, head_dim] view expected, got shape "
                             f"{tuple(c.shape)}")
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache: the key cache's shape {tuple(key_cache.shape)} and dtype {key_cache.dtype} "
                         f"expected, got {tuple(value_cache.shape)} {value_cache.dtype}")
    t, h, d = min(q.shape[0], out.shape[0]), q.shape[1], q.shape[2]
    page, hkv, dk = key_cache.shape[1:]
    if dk != d:
        raise ValueError(f"key_cache: head size {dk}, the query's is {d} (they must be equal)")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head size {d} not supported (one of {HEAD_DIMS})")
    if page < 1 or page & (page - 1):
        raise ValueError(f"key_cache: page size {page} must be a power of two")
    if hkv < 1 or h % hkv:
        raise ValueError(f"q: {h} query heads not a multiple of the caches' {hkv} KV heads")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table: int32 [num_reqs, max_pages] expected, got {block_table.dtype} of shape "
                         f"{tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table: a row's pages must be contiguous, got strides {tuple(block_table.stride())}")
    for name, x in (("out", out), ("key_cache", key_cache), ("value_cache", value_cache), ("block_table", block_table)):
        if x.device != q.device:
            raise ValueError(f"{name} on {x.device}, q on {q.device}")
    return t, h, d, page, hkv


def _check_rows(rows: Sequence[Any], t: int, block_table: torch.Tensor, page: int) -> None:
    """Each row's tokens inside q / out, its block-table row inside the table and wide enough for
    its keys (host ints only)."""
    n_reqs, max_pages = block_table.shape
    for r in rows:
        bt_row, tok, q_len, ctx = row_fields(r)
        if tok < 0 or q_len < 0 or tok + q_len > t or ctx < 0:
            raise ValueError(f"rows: tokens {tok}..{tok + q_len - 1} (context {ctx}) outside the {t} of q and out")
        if not 0 <= bt_row < n_reqs or -(-(ctx + q_len) // page) > max_pages:
            raise ValueError(f"rows: block-table row {bt_row} with {ctx + q_len} keys, the table is {n_reqs} x "
                             f"{max_pages} pages of {page}")


def _check_index(bix: BatchedSparseIndex, lists: int, device: torch.device) -> None:
    """The packed index as the kernels read it: int32, contiguous ([lists, TQB] counts and
    [lists, TQB, width] entries: a program finds its row as owner * TQB + query block), on the
    query's device, one list per program's stack of heads."""
    tqb = bix.num_query_blocks
    tensors = [("meta", bix.meta, (tqb, META_WIDTH.value))]
    if not bix.dense:
        tensors += [("block_count", bix.block_count, (lists, tqb)), ("column_count", bix.column_count, (lists, tqb)),
                    ("block_index", bix.block_index, (lists, tqb, None)),
                    ("column_index", bix.column_index, (lists, tqb, None))]
        if bix.range_start is not None:
            tensors += [("range_count", bix.range_count, (lists, tqb)),
                        ("range_start", bix.range_start, (lists, tqb, None))]
        if bix.merged:
            tensors += [("block_bits", bix.block_bits, tuple(bix.block_index.shape)),
                        ("column_bits", bix.column_bits, tuple(bix.column_index.shape))]
    for name, x, shape in tensors:
        if x is None or x.dim() != len(shape) or any(n is not None and n != m for n, m in zip(shape, x.shape)):
            want = " x ".join("width" if n is None else str(n) for n in shape)
            got = None if x is None else tuple(x.shape)
            raise ValueError(f"index.{name}: {want} expected ({lists} lists of {tqb} query blocks), got {got}")
        if x.dtype != torch.int32 or not x.is_contiguous() or x.device != device:
            raise ValueError(f"index.{name}: a contiguous int32 tensor on {device} expected, got {x.dtype} on "
                             f"{x.device}{'' if x.is_contiguous() else ', not contiguous'}")


def _serving_launch(dense: bool, merged: bool, return_lse: bool, kv_major: bool, prefetch: bool, tma: bool) -> bool:
    """Whether a launch runs :func:`_sparse_fwd_kernel` (else :mod:`.variants`' kernel):
    lists per head or per stack of a KV group, KV-head-major programs, the next tiles prefetched
    (which the TMA branch always does), no LSE."""
    return not (dense or merged or return_lse or not kv_major) and (prefetch or tma)


def sparse_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_table: torch.Tensor, rows: Sequence[Any] | None,
                             index: BatchedSparseIndex | Sequence[SparseIndex] | None, scale: float,
                             out: torch.Tensor, softcap: float = 0.0, return_lse: bool = False,
                             *, heads_per_program: int | None = None, num_warps: int | None = None,
                             num_stages: int | None = None, block_n: int | None = None,
                             kv_major: bool | None = None, prefetch: bool | None = None,
                             whole_rows: torch.Tensor | None = None, k_scale=None, v_scale=None,
                             tma: bool | None = None, row_table: RowTable | None = None, skip_below: float = 0.0):
    """Sparse (or dense causal) prefill attention of a varlen batch of rows, in place into ``out``.

    q, out: [T, H, D] (any strides); key_cache, value_cache: [num_pages, page_size, Hkv, D] views
    (any strides); block_table: int32 [num_reqs, max_pages]; rows: SparseRow-like objects (row,
    tok_start, q_len, ctx_len) or 4-tuples, needed unless ``index`` is already packed;
    index: a :class:`BatchedSparseIndex` (from :func:`pack_rows`, possibly merged with
    :func:`merge_group_heads`), a list of per-row :class:`SparseIndex` (one list per query head,
    or one per ``H / lists`` consecutive heads of a KV group: then stacked, see
    :func:`shared_stack`), or None for dense causal.
    Only the rows' tokens of ``out`` are written. Returns ``out``, or ``(out, lse)`` with lse
    fp32 [H, T] (natural log; -inf where a query selected nothing, whose output is zero).
    Shapes, dtypes, devices and the strides the kernels rely on are checked once per launch
    (:func:`_check_operands`, :func:`_check_rows`, :func:`_check_index`): a ``ValueError``
    naming the argument, never a kernel reading out of bounds.
    ``heads_per_program`` (dense only), ``num_warps``, ``num_stages``, ``block_n`` (keys per tile:
    64, or 128 = two listed blocks per tile), ``kv_major`` (program order) and ``prefetch`` (issue
    the next tile's list/page lookups early) override :func:`default_config`.
    ``whole_rows`` (optional, bool/int tensor [num rows] on the device, needs ``rows``): rows
    flagged there ignore their lists and attend to every causal key (the dense mode, decided on
    the GPU: the density fallback without a host sync).
    ``k_scale`` / ``v_scale`` (None, a number, or a one-element fp32 tensor on the device, read
    by the kernel: vLLM's per-layer ``_k_scale`` / ``_v_scale``): the caches hold K / scale and
    V / scale, e.g. fp8 (float8_e4m3fn or e5m2) caches, whose tiles the kernel widens to the
    query's dtype. None or 1.0: the stored values are used as they are.
    ``tma``: load the listed key blocks with the tensor memory accelerator (Hopper and later)
    through descriptors of the caches instead of per-key gathers; needs pages of a multiple of
    64 keys and 64-key tiles (see :func:`tma_unusable`). None: wherever it can read the caches on
    a GPU (faster than the gathered loads there). Range and column tiles are gathered either way.
    ``row_table`` (optional, :func:`plan_rows` of ``rows``, built once per step): the rows'
    metadata and the ``whole_rows`` expansion come from it instead of being built and copied to
    the device at every launch. None: built here, as before.
    ``skip_below`` (0 <= skip_below < 1; 0: off): the skip-softmax filter. A key tile of listed
    blocks below the diagonal whose every weight, relative to its row's largest score so far, is
    below ``skip_below`` (for all of the program's rows) is left out of the sum; each row's output
    then misses at most ``skip_below`` per key of the tiles left out, relative to that row's
    largest weight. Range and column tiles, and the blocks at the diagonal, are always computed.
    """
    if not 0.0 <= skip_below < 1.0:
        raise ValueError(f"skip_below={skip_below}: 0 (off) or a weight ratio below 1")
    t, h, d, page, hkv = _check_operands(q, key_cache, value_cache, block_table, out)
    if rows is not None:
        _check_rows(rows, t, block_table, page)
    ks, vs = scale_operand(k_scale, q.device), scale_operand(v_scale, q.device)
    if (ks is None) != (vs is None):  # the kernel reads both or neither
        one = torch.ones(1, dtype=torch.float32, device=q.device)
        ks, vs = (one, vs) if ks is None else (ks, one)
    group = h // hkv
    if index is None or not isinstance(index, BatchedSparseIndex):
        if rows is None:
            raise ValueError("rows are needed to pack the index")
        per_list = 1
        if index is not None and index and index[0].num_heads != h:
            # lists shared by consecutive heads of a KV group: stack shared_stack() of them per
            # program, repeating each list for the group's remaining stacks
            lists = index[0].num_heads
            if h % lists or group % (h // lists):
                raise ValueError(f"{lists} lists for {h} query heads in groups of {group}")
            per_list = shared_stack(d, h // lists)
            index = [ix.repeat_heads(h // lists // per_list) for ix in index]
        index = pack_rows(rows, index, device=q.device, heads_per_list=per_list, row_table=row_table)
    bix = index
    if bix.block_size != BLOCK.value:
        raise ValueError(f"the kernel is built for {BLOCK.value}-wide blocks")
    tma_why = tma_unusable(key_cache, value_cache, block_n or BLOCK.value)  # once per launch ('' = usable)
    if tma and tma_why:
        raise ValueError(f"tma=True: {tma_why}")
    use_tma = (key_cache.is_cuda and not tma_why) if tma is None else tma
    quantized = is_fp8(key_cache.dtype)  # tiles widened on load: the table stacks more heads on them
    if bix.dense:
        gh = heads_per_program or default_config(d, True, group, tma=use_tma,
                                                 quantized=quantized)["heads_per_program"]
    else:
        gh = bix.heads_per_list
        if heads_per_program not in (None, gh):
            raise ValueError("a sparse index's heads per program is fixed by the index (heads_per_list)")
    if gh & (gh - 1) or (bix.merged and group % gh):
        raise ValueError(f"{gh} stacked heads: must be a power of two (dividing the group of {group} when merged)")
    lists = hkv * ((group + gh - 1) // gh)
    _check_index(bix, lists, q.device)
    cfg = default_config(d, bix.dense, group, gh, shared=not bix.dense and not bix.merged and gh > 1, tma=use_tma,
                         quantized=quantized)
    warps = num_warps or cfg["num_warps"]
    bn = block_n or cfg["block_n"]
    # the default stage count is for the default tile; with wider key tiles and stacked heads,
    # 3 stages of K/V plus the M = 256 query tile exceed Hopper's 228 KB of shared memory
    stages = num_stages or (2 if bn > cfg["block_n"] and gh > 1 else cfg["num_stages"])
    kvm = cfg["kv_major"] if kv_major is None else kv_major
    pf = cfg["prefetch"] if prefetch is None else prefetch
    tqb = bix.num_query_blocks
    lse = torch.empty(h, q.shape[0], dtype=torch.float32, device=q.device) if return_lse else out
    if tqb == 0:
        return (out, lse) if return_lse else out
    if bix.dense:
        bcnt = bidx = ccnt = cidx = bb = cb = rcnt = ridx = bix.meta  # placeholders: no lists are read
        maxb = maxc = maxr = 1
    else:
        bcnt, bidx, ccnt, cidx = bix.block_count, bix.block_index, bix.column_count, bix.column_index
        bb = bix.block_bits if bix.merged else bcnt
        cb = bix.column_bits if bix.merged else bcnt
        maxb, maxc = bidx.shape[-1], cidx.shape[-1]
        if bix.range_start is None:
            rcnt, ridx, maxr = torch.zeros_like(bcnt), bcnt, 1
        else:
            rcnt, ridx, maxr = bix.range_count, bix.range_start, bix.range_start.shape[-1]
    whole = bcnt  # placeholder: not read without FALLBACK
    fallback = whole_rows is not None and not bix.dense
    if fallback:
        if bix.merged or rows is None or len(rows) != whole_rows.numel():
            raise ValueError("whole_rows needs one flag per row (of rows) and an index that is not merged")
        if whole_rows.device != q.device:
            raise ValueError(f"whole_rows on {whole_rows.device}, q on {q.device}")
        # one flag per packed query block (device ops only: no sync)
        if row_table is None:
            per_qb = [whole_rows[i].view(1).expand(-(-row_fields(r)[2] // bix.block_size))
                      for i, r in enumerate(rows)]
            whole = torch.cat(per_qb).to(torch.int32)
        else:
            row_table.check_rows(rows, bix.block_size, q.device)
            whole = row_table.block_flags(whole_rows)
    if use_tma:
        k_desc, v_desc = _cache_descriptor(key_cache), _cache_descriptor(value_cache)
    else:
        k_desc, v_desc = key_cache, value_cache  # placeholders: not read without TMA
    lists_ptrs = (bix.meta, bcnt, bidx, ccnt, cidx)
    other_ptrs = (whole, rcnt, ridx, bcnt if ks is None else ks, bcnt if vs is None else vs,  # (not read unless
                  k_desc, v_desc)                                                               # KV_SCALED / TMA)
    strides = (q.stride(), out.stride(), key_cache.stride(), value_cache.stride())
    scalars = (float(scale), float(softcap) if softcap > 0 else 1.0, -math.log2(skip_below) if skip_below > 0 else 0.0)
    modes = dict(GROUP=group, GH=gh, PAGE=page, BLOCK_N=bn, HEAD_DIM=d, SOFTCAP=softcap > 0, FALLBACK=fallback,
                 KV_SCALED=ks is not None, TMA=use_tma, SKIP=skip_below > 0, num_warps=warps, num_stages=stages)
    grid = (lists * tqb,)
    if _serving_launch(bix.dense, bix.merged, return_lse, kvm, pf, use_tma):
        _sparse_fwd_kernel[grid](q, key_cache, value_cache, out, block_table, *lists_ptrs, *other_ptrs, *strides,
                                 block_table.stride(0), tqb, tqb, maxb, maxc, maxr, *scalars, **modes)
    else:
        variants._sparse_fwd_variants_kernel[grid](q, key_cache, value_cache, out, lse, block_table, *lists_ptrs,
                                                   bb, cb, *other_ptrs, *strides, block_table.stride(0), tqb,
                                                   lse.stride(0) if return_lse else 0, tqb, lists, maxb, maxc, maxr,
                                                   *scalars,
                                                   DENSE=bix.dense, MERGED=bix.merged, WRITE_LSE=return_lse,
                                                   KV_MAJOR=kvm, PREFETCH=pf, **modes)
    return (out, lse) if return_lse else out
