"""Host-side packing of the sparse prefill kernel's input: the rows of a step and their indices
as one :class:`BatchedSparseIndex`.

A varlen batch of rows is described by the rows' indices concatenated along the query-block axis,
plus one metadata row per query block (block-table row, first token in q/out, valid queries,
absolute position of the first query, the row's kv length). The metadata depends on the rows
only, not on the layer: :func:`plan_rows` builds it once per step as a :class:`RowTable`, which
:func:`pack_rows` and the launcher reuse for every layer instead of copying it to the device
again. :func:`merge_group_heads` merges per-head lists into one list per stack of heads.

Torch on the host and the index's device; triton only for the column numbers the kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import triton.language as tl

from ..constants import BLOCK
from ..index_format import SparseIndex

# Columns of the per-query-block metadata table (int32 [TQB, META_WIDTH]): block-table row, first
# token in q/out, valid queries, absolute position of the first query, kv length of the row.
META_BT_ROW, META_TOK, META_NQ, META_QPOS, META_KVLEN = (tl.constexpr(i) for i in range(5))
META_WIDTH: tl.constexpr = tl.constexpr(5)


def row_fields(r: Any) -> tuple[int, int, int, int]:
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


def _meta_entries(rows: Sequence[Any], block_size: int) -> list[tuple[int, int, int, int, int]]:
    """The metadata rows (host ints) of every query block of ``rows``, in packing order."""
    entries = []
    for r in rows:
        bt_row, tok, q_len, ctx = row_fields(r)
        for s in range(0, q_len, block_size):
            entries.append((bt_row, tok + s, min(block_size, q_len - s), ctx + s, ctx + q_len))
    return entries


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, so the copy does not wait
    for the host."""
    if torch.device(device).type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _meta_table(rows: Sequence[Any], block_size: int, device) -> torch.Tensor:
    meta = torch.tensor(_meta_entries(rows, block_size), dtype=torch.int32).reshape(-1, META_WIDTH.value)
    return _to_device(meta, device)


@dataclass(frozen=True, eq=False)
class RowTable:
    """What the kernel needs to know of a step's rows, built once per step by :func:`plan_rows`
    and shared by every layer's launch.

    ``meta``: int32 [TQB, META_WIDTH] on the device (see :class:`BatchedSparseIndex`);
    ``block_rows``: int32 [TQB] on the device, the row of each packed query block (the
    ``whole_rows`` flags per row become flags per query block with one gather);
    ``query_blocks``: each row's number of query blocks (host ints); ``rows``: each row's
    (block-table row, tok_start, q_len, ctx_len), which a launch checks its own rows against.
    """

    block_size: int
    meta: torch.Tensor
    block_rows: torch.Tensor
    query_blocks: tuple[int, ...]
    rows: tuple[tuple[int, int, int, int], ...]

    @property
    def num_query_blocks(self) -> int:
        return self.meta.shape[0]

    def check_rows(self, rows: Sequence[Any], block_size: int, device) -> None:
        """ValueError unless the table was planned for these rows, this block size and device."""
        if block_size != self.block_size:
            raise ValueError(f"row_table: planned for {self.block_size}-query blocks, the index has {block_size}")
        want = torch.device(device)
        if want.type != self.meta.device.type or want.index not in (None, self.meta.device.index):
            raise ValueError(f"row_table on {self.meta.device}, the launch on {device}")
        if tuple(row_fields(r) for r in rows) != self.rows:
            raise ValueError("row_table: planned for other rows than these")

    def block_flags(self, row_flags: torch.Tensor) -> torch.Tensor:
        """int32 [TQB]: each packed query block's flag, from one flag per row (device ops only)."""
        return row_flags.index_select(0, self.block_rows).to(torch.int32)


def plan_rows(rows: Sequence[Any], block_size: int, device) -> RowTable:
    """The :class:`RowTable` of ``rows`` (SparseRow-like objects or 4-tuples, see
    :func:`pack_rows`) for ``block_size``-query blocks (the kernel's: ``BLOCK``) on ``device``:
    its device tensors copied in one transfer (through pinned memory to a GPU), once per step."""
    fields = tuple(row_fields(r) for r in rows)
    query_blocks = tuple(-(-q_len // block_size) for _, _, q_len, _ in fields)
    entries = _meta_entries(fields, block_size)
    block_rows = [i for i, n in enumerate(query_blocks) for _ in range(n)]
    # one host buffer, one copy: the meta table first, then the row of each query block
    host = torch.tensor([v for e in entries for v in e] + block_rows, dtype=torch.int32)
    on_device = _to_device(host, device)
    tqb = len(entries)
    meta = on_device[: tqb * META_WIDTH.value].view(tqb, META_WIDTH.value)
    return RowTable(block_size, meta, on_device[tqb * META_WIDTH.value:], query_blocks, fields)


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[-1] == width:
        return t
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=-1)


def _row_meta(rows: Sequence[Any], block_size: int, device, row_table: RowTable | None) -> torch.Tensor:
    """The metadata of ``rows``: the planned table's, or built and copied now."""
    if row_table is None:
        return _meta_table(rows, block_size, device)
    row_table.check_rows(rows, block_size, device)
    return row_table.meta


def pack_rows(rows: Sequence[Any], indices: Sequence[SparseIndex] | None, device=None,
              block_size: int = BLOCK.value, heads_per_list: int = 1,
              row_table: RowTable | None = None) -> BatchedSparseIndex:
    """Build the batched index of ``rows`` (SparseRow-like: row, tok_start, q_len, ctx_len; or
    4-tuples in that order). ``indices=None`` gives the dense (full causal) variant.
    ``heads_per_list`` > 1: each index has one list per ``heads_per_list`` consecutive query heads
    of a KV group (a group-shared pattern), and the kernel stacks those heads in one program.
    No device synchronisation: widths come from tensor shapes, metadata from host ints.
    ``row_table`` (:func:`plan_rows` of the same rows): its metadata is used as it is, not
    built and copied again."""
    if indices is None:
        if device is None:
            raise ValueError("device is needed for a dense batch")
        return BatchedSparseIndex(block_size, _row_meta(rows, block_size, device, row_table), dense=True)
    if len(indices) != len(rows):
        raise ValueError(f"{len(indices)} indices for {len(rows)} rows")
    block_size = indices[0].block_size
    device = device if device is not None else indices[0].block_count.device
    for r, ix in zip(rows, indices):
        _, _, q_len, _ = row_fields(r)
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
        a padded copy of it beside the output, so a step of rows of unequal widths would need
        more scratch than the profiling run's equal rows."""
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
        _row_meta(rows, block_size, device, row_table),
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
