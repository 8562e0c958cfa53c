"""Triton forward kernel for sparse prefill attention over vLLM's paged KV cache.

Consumes the block + range + column format of :mod:`.index_format` (MInference
Alg. 5 plus its point-range merge): for each query block of 64 queries and each query head,
first the listed whole key blocks (unmasked, except the at most two that reach the query
block's own positions), then the listed key ranges (64 consecutive keys from any position, cut
where the next range starts: the slash lines), then the listed single key columns, gathered
``BLOCK_N`` at a time through the block table. Online
softmax in fp32 (exp2), bf16/fp16 (or fp32) inputs, optional tanh soft-capping and LSE output.
K/V caches hold the query's dtype or fp8 (vLLM's fp8 KV cache: tiles widened to the query's
dtype on load, the per-layer k / v scales applied to the scores' scale and to the output).
Queries that select nothing get a zero output (LSE -inf), never NaN.

A varlen batch of rows is described by :class:`BatchedSparseIndex` (:func:`pack_rows`): the rows'
indices concatenated along the query-block axis, plus one metadata row per query block
(block-table row, first token in q/out, valid queries, absolute position of the first query,
the row's kv length). The grid is flat: one program per (list owner, query block), ordered KV
head first, then query blocks from the last (heaviest) to the first, then the heads of the group,
so programs that read the same KV head run together and share its K/V in L2.

Two kernels, built from the same ``@triton.jit`` helpers: :func:`_sparse_fwd_kernel` runs what
serving launches (per-head or group-shared lists, rows flagged to run every causal key, fp8
caches, soft-capping, TMA or gathered loads); :func:`_sparse_fwd_variants_kernel` adds the modes
only tests and benchmarks use: the dense variant (``pack_rows(rows, None)``: every causal key
block, no lists materialised, for comparing against cuDNN / FlashAttention), merged heads
(:func:`merge_group_heads`), the LSE output, the other program order and no prefetch. The
launcher :func:`sparse_prefill_attention` picks one from its arguments.

GQA: a program may stack ``heads_per_program`` query heads of one KV group along M
(BLOCK_M = heads_per_program * 64), so each K/V tile is loaded once for all of them. This needs
one key list for the stacked heads: the dense mode (no lists; padded stacks for groups like 7),
a group-shared index (one list per KV group or sub-group, ``pack_rows(..., heads_per_list=g)``)
and a merged index (:func:`merge_group_heads`: union of the heads' lists plus a per-entry head
bitmask) qualify. Measured (docs/kernel-notes.md): stacking wins for dense at head dim
128 and for group-shared lists (4 heads: 1.5x at head dim 128 on H200); for per-head lists that
differ between heads the union costs more than it saves, so those run one head per program.

K/V are read through the block table with the cache tensors' own strides
(``[num_pages, page_size, Hkv, D]`` views, NHD or HND physical layout, any power-of-two page
size; a 64-key block may span several pages). With pages of a multiple of 64 keys on Hopper or
later, listed blocks are loaded with the tensor memory accelerator instead (``tma``: one 4-D
descriptor per cache, one box = 64 keys of one page and KV head; the pointer gathers cost
registers and address math per key, 1.04-1.28x at 128K, docs/kernel-notes.md); range and
column tiles are always gathered.

Imports nothing from vLLM or vllm_sparse_backend: torch, triton and this package only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from .constants import BIG_KEY, BLOCK, LN2, LOG2E, MAX_START, NEG_INF
from .index_format import SparseIndex
from .kv_quant import check_kv_dtypes, scale_operand

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the TMA path is unavailable
    TensorDescriptor = None

# Columns of the per-query-block metadata table (int32 [TQB, META_WIDTH]): block-table row, first
# token in q/out, valid queries, absolute position of the first query, kv length of the row.
META_BT_ROW, META_TOK, META_NQ, META_QPOS, META_KVLEN = (tl.constexpr(i) for i in range(5))
META_WIDTH: tl.constexpr = tl.constexpr(5)


# --------------------------------------------------------------------------------------------
# Host-side packing
# --------------------------------------------------------------------------------------------

def _row_fields(r: Any) -> tuple[int, int, int, int]:
    """(block-table row, tok_start, q_len, ctx_len) from a SparseRow-like object or a 4-tuple."""
    if isinstance(r, (tuple, list)):
        bt_row, tok, q_len, ctx = r
        return int(bt_row), int(tok), int(q_len), int(ctx)
    return int(r.row), int(r.tok_start), int(r.q_len), int(r.ctx_len)


@dataclass
class BatchedSparseIndex:
    """Indices of several rows, concatenated along the query-block axis.

    meta: int32 [TQB, 5]: block-table row, first token in q/out, valid queries, absolute
    position of the first query, kv length of the row. The list tensors follow
    :class:`SparseIndex` with the rows' query blocks concatenated (TQB = sum of NQB) and the
    list widths padded to the widest row. ``list_heads`` is the number of list owners: the
    query heads, or the stacked head groups of a merged index (then ``block_bits`` /
    ``column_bits`` say which of the group's heads each entry belongs to).
    ``dense=True``: no lists at all, every causal key block is used.
    """

    block_size: int
    meta: torch.Tensor
    block_count: torch.Tensor | None = None  # int32 [LH, TQB]
    block_index: torch.Tensor | None = None  # int32 [LH, TQB, MAXB]
    column_count: torch.Tensor | None = None  # int32 [LH, TQB]
    column_index: torch.Tensor | None = None  # int32 [LH, TQB, MAXC]
    heads_per_list: int = 1
    block_bits: torch.Tensor | None = None  # int32 [LH, TQB, MAXB] (merged only)
    column_bits: torch.Tensor | None = None  # int32 [LH, TQB, MAXC] (merged only)
    dense: bool = False
    range_count: torch.Tensor | None = None  # int32 [LH, TQB]
    range_start: torch.Tensor | None = None  # int32 [LH, TQB, MAXR]

    @property
    def num_query_blocks(self) -> int:
        return self.meta.shape[0]

    @property
    def merged(self) -> bool:
        return self.block_bits is not None


def _meta_table(rows: Sequence[Any], block_size: int, device) -> torch.Tensor:
    entries = []
    for r in rows:
        bt_row, tok, q_len, ctx = _row_fields(r)
        for s in range(0, q_len, block_size):
            entries.append((bt_row, tok + s, min(block_size, q_len - s), ctx + s, ctx + q_len))
    meta = torch.tensor(entries, dtype=torch.int32).reshape(-1, META_WIDTH.value)
    if torch.device(device).type == "cuda":
        meta = meta.pin_memory().to(device, non_blocking=True)
    return meta.to(device)


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[-1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=-1)


def pack_rows(rows: Sequence[Any], indices: Sequence[SparseIndex] | None, device=None,
              block_size: int = BLOCK.value, heads_per_list: int = 1) -> BatchedSparseIndex:
    """Build the batched index of ``rows`` (SparseRow-like: row, tok_start, q_len, ctx_len; or
    4-tuples in that order). ``indices=None`` gives the dense (full causal) variant.
    ``heads_per_list`` > 1: each index has one list per ``heads_per_list`` consecutive query heads
    of a KV group (a group-shared pattern), and the kernel stacks those heads in one program.
    No device synchronisation: widths come from tensor shapes, metadata from host ints."""
    if indices is None:
        if device is None:
            raise ValueError("device is needed for a dense batch")
        return BatchedSparseIndex(block_size, _meta_table(rows, block_size, device), dense=True)
    if len(indices) != len(rows):
        raise ValueError(f"{len(indices)} indices for {len(rows)} rows")
    block_size = indices[0].block_size
    device = device if device is not None else indices[0].block_count.device
    for r, ix in zip(rows, indices):
        _, _, q_len, _ = _row_fields(r)
        if ix.block_size != block_size or ix.num_query_blocks != (q_len + block_size - 1) // block_size:
            raise ValueError("index does not match its row (block size or number of query blocks)")
    maxb = max(1, max(ix.block_index.shape[-1] for ix in indices))
    maxc = max(1, max(ix.column_index.shape[-1] for ix in indices))
    maxr = max(1, max(ix.range_start.shape[-1] for ix in indices))

    def cat(ts):  # one row (the usual long prompt): its own lists, no copy
        ts = [t.to(device) for t in ts]
        return ts[0].contiguous() if len(ts) == 1 else torch.cat(ts, dim=1).contiguous()

    def side_by_side(ts, width):
        """The rows' [LH, QB, w] lists as one [LH, TQB, width], -1 past each row's own width.
        One allocation, each row copied into its slice: padding a narrower row first would hold
        a padded copy of it beside the output, so a step of rows of unequal widths needed more
        scratch than the profiling run's equal rows (1.19x, docs/kernel-notes.md)."""
        ts = [t.to(device=device, dtype=torch.int32) for t in ts]
        if len(ts) == 1:
            return _pad_last(ts[0], width).contiguous()
        out = torch.full((ts[0].shape[0], sum(t.shape[1] for t in ts), width), -1, dtype=torch.int32, device=device)
        q0 = 0
        for t in ts:
            out[:, q0:q0 + t.shape[1], : t.shape[-1]] = t
            q0 += t.shape[1]
        return out

    return BatchedSparseIndex(
        block_size,
        _meta_table(rows, block_size, device),
        cat([ix.block_count.to(torch.int32) for ix in indices]),
        side_by_side([ix.block_index for ix in indices], maxb),
        cat([ix.column_count.to(torch.int32) for ix in indices]),
        side_by_side([ix.column_index for ix in indices], maxc),
        heads_per_list,
        range_count=cat([ix.range_count.to(torch.int32) for ix in indices]),
        range_start=side_by_side([ix.range_start for ix in indices], maxr),
    )


def merge_group_heads(bix: BatchedSparseIndex, heads_per_program: int) -> BatchedSparseIndex:
    """Union of the lists of ``heads_per_program`` consecutive query heads (which must share a
    KV head), with a bitmask per entry saying which of them use it. Blocks: sorted union.
    Columns: the heads' lists concatenated (a column used by several heads appears once per
    head; order does not matter to the kernel). Torch, on the index's device, no host sync."""
    g = heads_per_program
    if bix.dense or g == 1:
        return bix
    if bix.range_count is not None and bool((bix.range_count > 0).any()):
        # ranges of different heads overlap in arbitrary ways; merged lists are a benchmark-side
        # layout for block lists (build vertical-slash indices with slash_tiles="blocks")
        raise ValueError("merge_group_heads takes indices without key ranges")
    h, tqb, maxb = bix.block_index.shape
    if h % g:
        raise ValueError(f"{h} heads not divisible by {g}")
    lh = h // g
    dev = bix.block_index.device
    # Blocks: membership as bits over a dense key-block axis, then compact.
    bi = bix.block_index.view(lh, g, tqb, maxb).to(torch.int64)
    nkb = int(bix.meta[:, META_KVLEN.value].max().item() + bix.block_size - 1) // bix.block_size \
        if bix.meta.numel() else 1  # one sync; merging is an offline / benchmark-side helper
    bits = torch.zeros(lh, tqb, nkb + 1, dtype=torch.int64, device=dev)
    for j in range(g):
        tgt = torch.where(bi[:, j] >= 0, bi[:, j], torch.full_like(bi[:, j], nkb))
        bits.scatter_reduce_(2, tgt, torch.full_like(tgt, 1 << j), reduce="sum", include_self=True)
    bits = bits[..., :nkb]
    keep = bits > 0
    count = keep.sum(-1)
    width = max(1, int(count.max().item()))
    big = torch.iinfo(torch.int64).max
    kb = torch.arange(nkb, device=dev).expand(lh, tqb, nkb)
    key = torch.where(keep, kb, torch.full_like(kb, big)).sort(-1).values[..., :width]
    ok = key != big
    block_index = torch.where(ok, key, torch.full_like(key, -1))
    block_bits = torch.where(ok, torch.gather(bits, 2, key.clamp(max=nkb - 1)), torch.zeros_like(key))
    # Columns: concatenate with each head's bit.
    ci = bix.column_index.view(lh, g, tqb, -1)
    column_index = ci.permute(0, 2, 1, 3).reshape(lh, tqb, -1)
    hb = (1 << torch.arange(g, device=dev, dtype=torch.int32)).view(1, 1, g, 1).expand(lh, tqb, g, ci.shape[-1])
    column_bits = torch.where(column_index >= 0, hb.reshape(lh, tqb, -1), torch.zeros_like(column_index))
    # Move valid entries to the front (stable) so that counts describe a prefix.
    order = (column_index < 0).to(torch.int8).argsort(dim=-1, stable=True)
    column_index = torch.gather(column_index, 2, order)
    column_bits = torch.gather(column_bits, 2, order)
    column_count = (column_index >= 0).sum(-1).to(torch.int32)
    return BatchedSparseIndex(bix.block_size, bix.meta, count.to(torch.int32), block_index.to(torch.int32).contiguous(),
                              column_count, column_index.to(torch.int32).contiguous(), g,
                              block_bits.to(torch.int32).contiguous(), column_bits.to(torch.int32).contiguous(),
                              range_count=torch.zeros_like(count, dtype=torch.int32),
                              range_start=torch.full((lh, tqb, 1), -1, dtype=torch.int32, device=dev))


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------

@triton.jit
def _kv_offsets(bt_row_ptr, kpos, kv_ok, kvh, k_strides, v_strides, PAGE: tl.constexpr):
    """Row offsets (int64) of key positions kpos in the key and value caches (strides of their
    [pages, page, Hkv, D] views)."""
    page = tl.load(bt_row_ptr + kpos // PAGE, mask=kv_ok, other=0).to(tl.int64)
    slot = (kpos % PAGE).to(tl.int64)
    k_off = page * k_strides[0] + slot * k_strides[1] + kvh * k_strides[2]
    v_off = page * v_strides[0] + slot * v_strides[1] + kvh * v_strides[2]
    return k_off, v_off


@triton.jit
def _listed_block(blist, e, ok, whole, DENSE: tl.constexpr, FALLBACK: tl.constexpr):
    """Key block of list entry e: e itself in dense mode (or for a row running every causal block,
    ``whole``), else the listed one (0 where ``ok`` is false)."""
    if DENSE:
        return e
    elif FALLBACK:
        listed = (ok.to(tl.int32) * (1 - whole.to(tl.int32))) != 0  # ok and not whole (interpreter-safe)
        return tl.where(whole, e, tl.load(blist + e, mask=listed, other=0))
    else:
        return tl.load(blist + e, mask=ok, other=0)


@triton.jit
def _heads_using(bits, head_bit):
    """Merged lists: [BLOCK_M, BLOCK_N] mask of the stacked rows whose head (its bit, head_bit
    [BLOCK_M]) is set in the entry bits of each key column (bits [BLOCK_N])."""
    return ((bits[None, :] >> head_bit[:, None]) & 1) != 0


@triton.jit
def _online_softmax(m_i, l_i, acc, q, kt, v, allow, qk_scale, softcap, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold one key tile (kt: [HEAD_DIM, BLOCK_N], v: [BLOCK_N, HEAD_DIM]) into the running
    online softmax (log2 domain): row maxima m_i, row sums l_i, output accumulator acc."""
    # an fp8 cache is widened to the query's dtype here (its scales are in qk_scale and the
    # output); for a cache of the query's dtype these are no-ops
    kt = kt.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, kt)
    if SOFTCAP:
        # softcap * tanh(s * scale / softcap), tanh through exp2; then to the log2 domain
        x = s * (qk_scale / softcap)
        e = tl.exp2(x * (2.0 * LOG2E))
        s = softcap * (1.0 - 2.0 / (e + 1.0)) * LOG2E
    else:
        s = s * (qk_scale * LOG2E)
    if MASKED:
        s = tl.where(allow, s, NEG_INF)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, kv_ok, allow,
                 s_kd, s_vd, qk_scale, softcap,
                 MASKED: tl.constexpr, LOAD_MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One BLOCK_N-wide key tile gathered through per-key row offsets k_off/v_off ([BLOCK_N])."""
    if LOAD_MASKED:
        kt = tl.load(k_ptr + k_off[None, :] + offs_d[:, None] * s_kd, mask=kv_ok[None, :], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :] * s_vd, mask=kv_ok[:, None], other=0.0)
    else:
        kt = tl.load(k_ptr + k_off[None, :] + offs_d[:, None] * s_kd)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :] * s_vd)
    return _online_softmax(m_i, l_i, acc, q, kt, v, allow, qk_scale, softcap, MASKED, SOFTCAP)


@triton.jit
def _tile_page_slot(bt_row_ptr, kb, ok, PAGE: tl.constexpr):
    """(page, first slot) of key block kb, whose BLOCK keys lie in one page (PAGE % BLOCK == 0)."""
    page = tl.load(bt_row_ptr + (kb * BLOCK) // PAGE, mask=ok, other=0)
    return page, (kb * BLOCK) % PAGE


@triton.jit
def _attend_tile_tma(m_i, l_i, acc, q, k_desc, v_desc, page, slot, kvh, kv_ok, allow, qk_scale, softcap,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One key tile of BLOCK_N consecutive keys of one page, loaded with the tensor memory
    accelerator (4-D descriptors over the [pages, page, Hkv, D] caches)."""
    k = tl.reshape(k_desc.load([page, slot, kvh, 0]), [BLOCK_N, HEAD_DIM])
    v = tl.reshape(v_desc.load([page, slot, kvh, 0]), [BLOCK_N, HEAD_DIM])
    if MASKED:
        # the page's keys past the row's end hold whatever the cache holds: keep them out of p @ v
        v = tl.where(kv_ok[:, None], v, tl.zeros_like(v))
    return _online_softmax(m_i, l_i, acc, q, tl.trans(k), v, allow, qk_scale, softcap, MASKED, SOFTCAP)


@triton.jit
def _key_lanes(BLOCK_N: tl.constexpr):
    """Per key column of a tile: (offs_n, sub, within, zero_n): its index; which of the tile's
    KPT = BLOCK_N // BLOCK listed blocks or ranges it comes from (a scalar 0 with one per tile, so
    that list entries and their masks stay scalars); its key within that block or range; and
    zeros that widen a scalar to [BLOCK_N]."""
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_N == BLOCK:
        sub = tl.program_id(0) * 0
    else:
        sub = offs_n // BLOCK
    return offs_n, sub, offs_n % BLOCK, offs_n * 0


@triton.jit
def _program_ids(num_qb, num_lists, LPK: tl.constexpr, KV_MAJOR: tl.constexpr):
    """(list owner, query block) of this program. KV_MAJOR: the programs of one KV head run
    together (its K/V stays in L2), query blocks from the last (heaviest) to the first, the KV
    head's LPK list owners innermost; else list owners innermost over all KV heads."""
    pid = tl.program_id(0)
    if KV_MAJOR:
        per_kv = num_qb * LPK
        kvh_i = pid // per_kv
        rem = pid % per_kv
        qb = num_qb - 1 - rem // LPK
        pid_h = kvh_i * LPK + rem % LPK
    else:
        pid_h = pid % num_lists
        qb = num_qb - 1 - pid // num_lists
    return pid_h, qb


@triton.jit
def _program_rows(q_ptr, q_strides, meta_ptr, bt_ptr, s_bt, pid_h, qb,
                  GROUP: tl.constexpr, GH: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """List owner pid_h's rows of query block qb: GH heads of one KV group stacked along M (row r:
    the group's head (pid_h % LPK) * GH + r // BLOCK, query r % BLOCK of the block).

    Returns (rows, keys, lanes, out_rows, nq, qpos0):
    rows = (q, qpos, head_bit): per row its query vector, absolute position and head bit;
    keys = (bt_row_ptr, kvh_i, kvh, kv_len): the row's block-table row, the KV head (int32,
    int64) and the row's kv length; lanes: :func:`_key_lanes`; out_rows = (tok, head, row_ok): per
    row its token and query head in q / out, and whether it is a real query of a real head (not a
    padding head >= GROUP); nq, qpos0: the block's valid queries and first query position."""
    BLOCK_M: tl.constexpr = GH * BLOCK
    LPK: tl.constexpr = (GROUP + GH - 1) // GH  # list owners per KV head
    kvh_i = pid_h // LPK
    kvh = kvh_i.to(tl.int64)

    mrow = meta_ptr + qb * META_WIDTH
    bt_row = tl.load(mrow + META_BT_ROW)
    tok0 = tl.load(mrow + META_TOK)
    nq = tl.load(mrow + META_NQ)
    qpos0 = tl.load(mrow + META_QPOS)
    kv_len = tl.load(mrow + META_KVLEN)
    bt_row_ptr = bt_ptr + bt_row.to(tl.int64) * s_bt

    offs_m = tl.arange(0, BLOCK_M)
    r_in = offs_m % BLOCK  # query within the block
    head_bit = offs_m // BLOCK
    hg = (pid_h % LPK) * GH + head_bit  # head within the KV group (>= GROUP: padding rows, masked)
    head = kvh_i * GROUP + hg
    offs_d = tl.arange(0, HEAD_DIM)
    lanes = _key_lanes(BLOCK_N)
    row_ok = r_in < nq
    if GROUP % GH != 0:
        row_ok = row_ok & (hg < GROUP)
        head = tl.minimum(head, kvh_i * GROUP + GROUP - 1)
    qpos = qpos0 + r_in
    tok = (tok0 + r_in).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * q_strides[0] + head[:, None] * q_strides[1] + offs_d[None, :] * q_strides[2],
                mask=row_ok[:, None], other=0.0)
    return (q, qpos, head_bit), (bt_row_ptr, kvh_i, kvh, kv_len), lanes, (tok, head, row_ok), nq, qpos0


@triton.jit
def _block_list(bcnt_ptr, bidx_ptr, whole_ptr, maxb, s_lh, pid_h, qb, qpos0, nq,
                DENSE: tl.constexpr, FALLBACK: tl.constexpr):
    """(lrow, blist, n_full, n_all, whole): the program's row of the [lists, TQB(, width)] lists
    (list owner pid_h, query block qb; s_lh = TQB), its list of key blocks, how many of the
    entries end at or before the first query (no causal mask needed), how many there are, and
    whether the row runs every causal key block instead of its list (FALLBACK: flagged in
    whole_ptr; in dense mode there is no list and every causal block counts)."""
    kb_full = (qpos0 + 1) // BLOCK  # key blocks kb < kb_full end at or before the first query
    lrow = pid_h.to(tl.int64) * s_lh + qb
    blist = bidx_ptr + lrow * maxb
    n_causal = (qpos0 + nq - 1) // BLOCK + 1
    whole = n_causal < 0  # (false; a placeholder unless FALLBACK)
    if DENSE:
        n_full = kb_full
        n_all = n_causal
    else:
        n_all = tl.load(bcnt_ptr + lrow)
        last1 = tl.load(blist + n_all - 1, mask=n_all >= 1, other=-1)
        last2 = tl.load(blist + n_all - 2, mask=n_all >= 2, other=-1)
        n_full = n_all - (last1 >= kb_full).to(tl.int32) - (last2 >= kb_full).to(tl.int32)
        if FALLBACK:
            whole = tl.load(whole_ptr + qb) != 0
            n_all = tl.where(whole, n_causal, n_all)
            n_full = tl.where(whole, kb_full, n_full)
    return lrow, blist, n_full, n_all, whole


@triton.jit
def _list_row(cnt_ptr, idx_ptr, width, lrow, whole, FALLBACK: tl.constexpr):
    """(entries, count) of row lrow of a [lists, TQB, width] list: none where the row runs every
    causal key block instead (FALLBACK, ``whole``)."""
    n = tl.load(cnt_ptr + lrow)
    if FALLBACK:
        n = tl.where(whole, 0, n)
    return idx_ptr + lrow * width, n


@triton.jit
def _block_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, blist, bits_row, n_full, n_all, whole,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DENSE: tl.constexpr,
                 MERGED: tl.constexpr, PREFETCH: tl.constexpr, FALLBACK: tl.constexpr, SOFTCAP: tl.constexpr,
                 TMA: tl.constexpr):
    """The listed key blocks (:func:`_block_list`), KPT = BLOCK_N // BLOCK per key tile: 1) the
    tiles of blocks strictly below the diagonal, unmasked (but for merged heads' bits); 2) the
    rest, causally masked: the (at most two) blocks reaching the queries' own positions, an odd
    block left. TMA: tiles loaded through the descriptors (one 64-key block per tile), else
    gathered per key. bits_row: the entries' head bits (MERGED only)."""
    KPT: tl.constexpr = BLOCK_N // BLOCK  # listed key blocks per key tile (1 or 2)
    n_full_tiles = n_full // KPT
    n_tiles = (n_all + KPT - 1) // KPT
    q, qpos, head_bit = rows
    bt_row_ptr, kvh_i, kvh, kv_len = keys
    offs_n, sub, within, zero_n = lanes
    k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc = cache
    offs_d = tl.arange(0, HEAD_DIM)

    # 1) tiles of whole key blocks strictly below the diagonal: no masks (unless merged heads).
    n_full_e = n_full_tiles * KPT
    if TMA:
        # one page lookup per tile, a scalar; the next tile's is issued before this tile's math
        kb = _listed_block(blist, sub, sub < n_full_e, whole, DENSE, FALLBACK)
        page, slot = _tile_page_slot(bt_row_ptr, kb, sub < n_full_e, PAGE)
        for t in range(0, n_full_tiles):
            e_n = t + 1
            ok_n = e_n < n_full_e
            kb_n = _listed_block(blist, e_n, ok_n, whole, DENSE, FALLBACK)
            page_n, slot_n = _tile_page_slot(bt_row_ptr, kb_n, ok_n, PAGE)
            if MERGED:
                allow = _heads_using(tl.load(bits_row + t) + zero_n, head_bit)
                m_i, l_i, acc = _attend_tile_tma(m_i, l_i, acc, q, k_desc, v_desc, page, slot, kvh_i, within >= 0,
                                                 allow, qk_scale, softcap, BLOCK_N, HEAD_DIM, True, SOFTCAP)
            else:
                m_i, l_i, acc = _attend_tile_tma(m_i, l_i, acc, q, k_desc, v_desc, page, slot, kvh_i, within >= 0,
                                                 within >= 0, qk_scale, softcap, BLOCK_N, HEAD_DIM, False, SOFTCAP)
            page = page_n
            slot = slot_n
    else:
        # With PREFETCH the next tile's list entries and page lookups are issued before this
        # tile's math, so the K/V loads of a tile depend only on loop-carried offsets.
        if PREFETCH:
            kb = _listed_block(blist, sub, sub < n_full_e, whole, DENSE, FALLBACK)
            kpos = kb * BLOCK + within
            k_off, v_off = _kv_offsets(bt_row_ptr, kpos, (sub + zero_n) < n_full_e, kvh, k_strides, v_strides, PAGE)
        for t in range(0, n_full_tiles):
            e = t * KPT + sub
            if PREFETCH:
                e_n = e + KPT
                ok_n = e_n < n_full_e
                kb_n = _listed_block(blist, e_n, ok_n, whole, DENSE, FALLBACK)
                kpos_n = kb_n * BLOCK + within
                k_off_n, v_off_n = _kv_offsets(bt_row_ptr, kpos_n, (e_n + zero_n) < n_full_e, kvh, k_strides,
                                               v_strides, PAGE)
            else:
                kb = _listed_block(blist, e, e >= 0, whole, DENSE, FALLBACK)
                kpos = kb * BLOCK + within
                k_off, v_off = _kv_offsets(bt_row_ptr, kpos, kpos >= 0, kvh, k_strides, v_strides, PAGE)
            if MERGED:
                allow = _heads_using(tl.load(bits_row + e) + zero_n, head_bit)  # e: a scalar or [BLOCK_N]
                m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, within >= 0, allow,
                                             k_strides[3], v_strides[3], qk_scale, softcap, True, False, SOFTCAP)
            else:
                m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, within >= 0,
                                             within >= 0, k_strides[3], v_strides[3], qk_scale, softcap, False, False,
                                             SOFTCAP)
            if PREFETCH:
                k_off = k_off_n
                v_off = v_off_n

    # 2) the rest: the (at most two) blocks reaching the queries' own positions, an odd block left
    for t in range(n_full_tiles, n_tiles):
        e = t * KPT + sub
        e_ok = e < n_all
        kb = _listed_block(blist, e, e_ok, whole, DENSE, FALLBACK)
        kpos = kb * BLOCK + within
        kv_ok = ((e + zero_n) < n_all) & (kpos < kv_len)  # (vector form: the interpreter mis-types scalar & vector)
        allow = (kpos[None, :] <= qpos[:, None]) & kv_ok[None, :]
        if MERGED:
            allow = allow & _heads_using(tl.load(bits_row + e, mask=e_ok, other=0) + zero_n, head_bit)
        if TMA:
            page, slot = _tile_page_slot(bt_row_ptr, kb, e_ok, PAGE)
            m_i, l_i, acc = _attend_tile_tma(m_i, l_i, acc, q, k_desc, v_desc, page, slot, kvh_i, kv_ok, allow,
                                             qk_scale, softcap, BLOCK_N, HEAD_DIM, True, SOFTCAP)
        else:
            k_off, v_off = _kv_offsets(bt_row_ptr, kpos, kv_ok, kvh, k_strides, v_strides, PAGE)
            m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, kv_ok, allow,
                                         k_strides[3], v_strides[3], qk_scale, softcap, True, True, SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _range_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, rlist, n_rng,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr):
    """The listed key ranges (slash lines), ascending: each covers BLOCK keys from its start, cut
    where the next one starts; KPT of them per key tile. Always masked (causal, the cut, the
    row's end); gathered per key."""
    KPT: tl.constexpr = BLOCK_N // BLOCK
    q, qpos, head_bit = rows
    bt_row_ptr, kvh_i, kvh, kv_len = keys
    offs_n, sub, within, zero_n = lanes
    k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc = cache
    offs_d = tl.arange(0, HEAD_DIM)
    for t in range(0, (n_rng + KPT - 1) // KPT):
        e = t * KPT + sub
        e_ok = (e + zero_n) < n_rng
        start = tl.load(rlist + e, mask=e < n_rng, other=0)
        stop = tl.load(rlist + e + 1, mask=e + 1 < n_rng, other=BIG_KEY)
        kpos = start + within
        kv_ok = e_ok & (kpos < stop) & (kpos < kv_len)
        k_off, v_off = _kv_offsets(bt_row_ptr, kpos, kv_ok, kvh, k_strides, v_strides, PAGE)
        allow = (kpos[None, :] <= qpos[:, None]) & kv_ok[None, :]
        m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, kv_ok, allow,
                                     k_strides[3], v_strides[3], qk_scale, softcap, True, True, SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _column_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, clist, n_col, bits_row,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MERGED: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    """The listed single key columns, BLOCK_N per key tile, gathered and masked (causal, the
    row's end; merged heads: the entries' head bits in bits_row)."""
    q, qpos, head_bit = rows
    bt_row_ptr, kvh_i, kvh, kv_len = keys
    offs_n, sub, within, zero_n = lanes
    k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc = cache
    offs_d = tl.arange(0, HEAD_DIM)
    for j in range(0, n_col, BLOCK_N):
        c_ok = (j + offs_n) < n_col
        kpos = tl.load(clist + j + offs_n, mask=c_ok, other=0)
        c_ok = c_ok & (kpos >= 0) & (kpos < kv_len)
        k_off, v_off = _kv_offsets(bt_row_ptr, kpos, c_ok, kvh, k_strides, v_strides, PAGE)
        allow = (kpos[None, :] <= qpos[:, None]) & c_ok[None, :]
        if MERGED:
            allow = allow & _heads_using(tl.load(bits_row + j + offs_n, mask=c_ok, other=0), head_bit)
        m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, c_ok, allow,
                                     k_strides[3], v_strides[3], qk_scale, softcap, True, True, SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _store_rows(o_ptr, o_strides, acc, l_i, tok, head, row_ok, v_scale_ptr,
                HEAD_DIM: tl.constexpr, KV_SCALED: tl.constexpr):
    """The normalised output of the program's real rows (zero where a query selected nothing)."""
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_SCALED:
        o = o * tl.load(v_scale_ptr)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(o_ptr + tok[:, None] * o_strides[0] + head[:, None] * o_strides[1] + offs_d[None, :] * o_strides[2],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _store_lse(lse_ptr, s_lse_h, m_i, l_i, tok, head, row_ok):
    """Natural-log LSE of the program's real rows into lse [H, T] (-inf where a query selected
    nothing)."""
    has = l_i > 0.0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, NEG_INF)
    tl.store(lse_ptr + head.to(tl.int64) * s_lse_h + tok, lse, mask=row_ok)


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
    qk_scale, softcap,
    GROUP: tl.constexpr,  # query heads per KV head
    GH: tl.constexpr,  # query heads stacked in one program (one key list for all of them)
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FALLBACK: tl.constexpr,  # rows flagged in whole_ptr run every causal key block instead of their lists
    KV_SCALED: tl.constexpr,  # dequantised K/V = stored * k_scale / v_scale (fp32 scalars on the device)
    TMA: tl.constexpr,  # listed blocks loaded through k_desc / v_desc (needs BLOCK_N == BLOCK, PAGE % BLOCK == 0)
):
    """The serving kernel: one program per (list owner, query block), KV-head-major order, the
    next tile's list entries and page lookups prefetched. Per program: the listed key blocks, the
    key ranges, the single columns, then the normalised output."""
    BLOCK_M: tl.constexpr = GH * BLOCK
    pid_h, qb = _program_ids(num_qb, None, (GROUP + GH - 1) // GH, True)
    rows, keys, lanes, out_rows, nq, qpos0 = _program_rows(q_ptr, q_strides, meta_ptr, bt_ptr, s_bt, pid_h, qb,
                                                           GROUP, GH, BLOCK_N, HEAD_DIM)
    m_i = tl.full([BLOCK_M], MAX_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if KV_SCALED:  # k_scale folds into the scores' scale, v_scale into the output
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    cache = (k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc)

    lrow, blist, n_full, n_all, whole = _block_list(bcnt_ptr, bidx_ptr, whole_ptr, maxb, s_lh, pid_h, qb, qpos0, nq,
                                                    False, FALLBACK)
    m_i, l_i, acc = _block_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, blist, None,
                                 n_full, n_all, whole, PAGE, BLOCK_N, HEAD_DIM, False, False, True, FALLBACK, SOFTCAP,
                                 TMA)
    rlist, n_rng = _list_row(rcnt_ptr, ridx_ptr, maxr, lrow, whole, FALLBACK)
    m_i, l_i, acc = _range_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, rlist, n_rng,
                                 PAGE, BLOCK_N, HEAD_DIM, SOFTCAP)
    clist, n_col = _list_row(ccnt_ptr, cidx_ptr, maxc, lrow, whole, FALLBACK)
    m_i, l_i, acc = _column_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, clist, n_col, None,
                                  PAGE, BLOCK_N, HEAD_DIM, False, SOFTCAP)

    tok, head, row_ok = out_rows
    _store_rows(o_ptr, o_strides, acc, l_i, tok, head, row_ok, v_scale_ptr, HEAD_DIM, KV_SCALED)


@triton.jit(do_not_specialize=["s_lh", "s_lse_h", "num_qb", "num_lists", "maxb", "maxc", "maxr"])
def _sparse_fwd_variants_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bt_ptr, meta_ptr,
    bcnt_ptr, bidx_ptr, ccnt_ptr, cidx_ptr, bbits_ptr, cbits_ptr, whole_ptr, rcnt_ptr, ridx_ptr, k_scale_ptr,
    v_scale_ptr, k_desc, v_desc,
    q_strides, o_strides, k_strides, v_strides,
    s_bt, s_lh, s_lse_h,  # ... and the lse head stride
    num_qb, num_lists, maxb, maxc, maxr,
    qk_scale, softcap,
    GROUP: tl.constexpr, GH: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SOFTCAP: tl.constexpr, FALLBACK: tl.constexpr, KV_SCALED: tl.constexpr, TMA: tl.constexpr,
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
    pid_h, qb = _program_ids(num_qb, num_lists, (GROUP + GH - 1) // GH, KV_MAJOR)
    rows, keys, lanes, out_rows, nq, qpos0 = _program_rows(q_ptr, q_strides, meta_ptr, bt_ptr, s_bt, pid_h, qb,
                                                           GROUP, GH, BLOCK_N, HEAD_DIM)
    m_i = tl.full([BLOCK_M], MAX_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    cache = (k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc)

    lrow, blist, n_full, n_all, whole = _block_list(bcnt_ptr, bidx_ptr, whole_ptr, maxb, s_lh, pid_h, qb, qpos0, nq,
                                                    DENSE, FALLBACK)
    m_i, l_i, acc = _block_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, blist,
                                 bbits_ptr + lrow * maxb, n_full, n_all, whole,
                                 PAGE, BLOCK_N, HEAD_DIM, DENSE, MERGED, PREFETCH, FALLBACK, SOFTCAP, TMA)
    if not DENSE:
        rlist, n_rng = _list_row(rcnt_ptr, ridx_ptr, maxr, lrow, whole, FALLBACK)
        m_i, l_i, acc = _range_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, rlist, n_rng,
                                     PAGE, BLOCK_N, HEAD_DIM, SOFTCAP)
        clist, n_col = _list_row(ccnt_ptr, cidx_ptr, maxc, lrow, whole, FALLBACK)
        m_i, l_i, acc = _column_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, clist, n_col,
                                      cbits_ptr + lrow * maxc, PAGE, BLOCK_N, HEAD_DIM, MERGED, SOFTCAP)

    tok, head, row_ok = out_rows
    _store_rows(o_ptr, o_strides, acc, l_i, tok, head, row_ok, v_scale_ptr, HEAD_DIM, KV_SCALED)
    if WRITE_LSE:
        _store_lse(lse_ptr, s_lse_h, m_i, l_i, tok, head, row_ok)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

def shared_stack(head_dim: int, heads_per_list: int) -> int:
    """Heads stacked per program for lists shared by ``heads_per_list`` query heads (H200,
    docs/kernel-notes.md run 15). Head dim 128: the largest power of two dividing it, at
    most 4 (M = 256): 1.5x over one head per program, 2 heads 1.15x. Head dim 64: 4 when it
    divides (1.02-1.07x), else 1 (2 heads were 1.2x slower than one)."""
    if head_dim < 128:
        return 4 if heads_per_list % 4 == 0 else 1
    gh = 1
    while gh < 4 and heads_per_list % (2 * gh) == 0:
        gh *= 2
    return gh


def default_config(head_dim: int, dense: bool, group: int, merged_heads: int = 1, shared: bool = False,
                   tma: bool = False) -> dict:
    """Launch parameters measured at 128K (docs/kernel-notes.md).

    Gathered loads (pages of any size; H100 runs 2, 3 and 5, H200 sessions 6 and 15): dense,
    head dim 128: 4 heads of a KV group stacked per program (M = 256, 16 warps), so each K/V tile
    serves 4 heads, 3 stages with the next tile's offsets prefetched (1.22x cuDNN's time at 128K
    vs 1.34x with 2 stages and no prefetch); head dim 64: one head per program. Sparse, per-head
    lists: M = 64, 4 warps, next tile's offsets prefetched; head dim 64 takes two listed blocks
    per 128-wide key tile, head dim 128 one block and 3 stages. Sparse, lists shared by the
    stacked heads (``shared``): 4 warps per head and 3 stages; merged lists: 2 stages.

    TMA loads (``tma``: pages of 64+ keys, Hopper; H200, session 2026-11-24 part 3): one 64-key
    block per tile always; 3 stages at head dim 128 (2 and 4 were slower or equal), 2 at head dim
    64 with one head per program; dense stacks 4 heads where they divide the group, else none
    (groups of 6: one head 104.7 ms vs two stacked 109.4 ms at 128K).
    """
    if tma:
        if dense:
            gh = 4 if head_dim >= 128 and group % 4 == 0 else 1
        else:
            gh = merged_heads
        stages = 3 if head_dim >= 128 or gh > 1 else 2
        return {"heads_per_program": gh, "num_warps": 4 * gh, "num_stages": stages, "block_n": 64,
                "kv_major": True, "prefetch": True}
    if dense:
        if head_dim >= 128:
            gh = 4 if group % 4 == 0 else (2 if group % 2 == 0 else 1)
            return {"heads_per_program": gh, "num_warps": 4 * gh, "num_stages": 3, "block_n": 64, "kv_major": True,
                    "prefetch": True}
        return {"heads_per_program": 1, "num_warps": 4, "num_stages": 2, "block_n": 64, "kv_major": True,
                "prefetch": False}
    gh = merged_heads
    if head_dim >= 128 or gh > 1:
        return {"heads_per_program": gh, "num_warps": 4 * gh, "num_stages": 3 if gh == 1 or shared else 2,
                "block_n": 64, "kv_major": True, "prefetch": True}
    return {"heads_per_program": gh, "num_warps": 4, "num_stages": 2, "block_n": 128, "kv_major": True,
            "prefetch": True}


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
        bt_row, tok, q_len, ctx = _row_fields(r)
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
    """Whether a launch runs :func:`_sparse_fwd_kernel` (else :func:`_sparse_fwd_variants_kernel`):
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
                             tma: bool | None = None):
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
    a GPU (1.04-1.28x the gathered loads at 128K, docs/kernel-notes.md). Range and column
    tiles are gathered either way.
    """
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
        index = pack_rows(rows, index, device=q.device, heads_per_list=per_list)
    bix = index
    if bix.block_size != BLOCK.value:
        raise ValueError(f"the kernel is built for {BLOCK.value}-wide blocks")
    tma_why = tma_unusable(key_cache, value_cache, block_n or BLOCK.value)  # once per launch ('' = usable)
    if tma and tma_why:
        raise ValueError(f"tma=True: {tma_why}")
    use_tma = (key_cache.is_cuda and not tma_why) if tma is None else tma
    if bix.dense:
        gh = heads_per_program or default_config(d, True, group, tma=use_tma)["heads_per_program"]
    else:
        gh = bix.heads_per_list
        if heads_per_program not in (None, gh):
            raise ValueError("a sparse index's heads per program is fixed by the index (heads_per_list)")
    if gh & (gh - 1) or (bix.merged and group % gh):
        raise ValueError(f"{gh} stacked heads: must be a power of two (dividing the group of {group} when merged)")
    lists = hkv * ((group + gh - 1) // gh)
    _check_index(bix, lists, q.device)
    cfg = default_config(d, bix.dense, group, gh, shared=not bix.dense and not bix.merged and gh > 1, tma=use_tma)
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
        per_qb = [whole_rows[i].view(1).expand(-(-_row_fields(r)[2] // bix.block_size)) for i, r in enumerate(rows)]
        whole = torch.cat(per_qb).to(torch.int32)
    if use_tma:
        k_desc, v_desc = _cache_descriptor(key_cache), _cache_descriptor(value_cache)
    else:
        k_desc, v_desc = key_cache, value_cache  # placeholders: not read without TMA
    lists_ptrs = (bix.meta, bcnt, bidx, ccnt, cidx)
    other_ptrs = (whole, rcnt, ridx, bcnt if ks is None else ks, bcnt if vs is None else vs,  # (not read unless
                  k_desc, v_desc)                                                               # KV_SCALED / TMA)
    strides = (q.stride(), out.stride(), key_cache.stride(), value_cache.stride())
    scalars = (float(scale), float(softcap) if softcap > 0 else 1.0)
    modes = dict(GROUP=group, GH=gh, PAGE=page, BLOCK_N=bn, HEAD_DIM=d, SOFTCAP=softcap > 0, FALLBACK=fallback,
                 KV_SCALED=ks is not None, TMA=use_tma, num_warps=warps, num_stages=stages)
    grid = (lists * tqb,)
    if _serving_launch(bix.dense, bix.merged, return_lse, kvm, pf, use_tma):
        _sparse_fwd_kernel[grid](q, key_cache, value_cache, out, block_table, *lists_ptrs, *other_ptrs, *strides,
                                 block_table.stride(0), tqb, tqb, maxb, maxc, maxr, *scalars, **modes)
    else:
        _sparse_fwd_variants_kernel[grid](q, key_cache, value_cache, out, lse, block_table, *lists_ptrs, bb, cb,
                                          *other_ptrs, *strides, block_table.stride(0), tqb,
                                          lse.stride(0) if return_lse else 0, tqb, lists, maxb, maxc, maxr,
                                          *scalars,
                                          DENSE=bix.dense, MERGED=bix.merged, WRITE_LSE=return_lse, KV_MAJOR=kvm,
                                          PREFETCH=pf, **modes)
    return (out, lse) if return_lse else out
