"""Building and measuring :class:`SparseIndex` lists on the package side: compaction of masks into
lists, pair counts and density (stats).

The format itself (what every pattern produces and every kernel consumes) is defined in the kernel
package, :mod:`vllm_sparse_kernels.index_format`; its names are re-exported here. The dense mask
of an index (an oracle for tests) is :func:`vllm_sparse_kernels.reference.index.index_to_dense_mask`.
"""

from __future__ import annotations

import torch

from vllm_sparse_kernels.index_format import (SparseIndex, causal_block_mask, diagonal_block_mask, num_blocks,
                                              query_block_bounds, range_stops)

__all__ = ["SparseIndex", "build_index", "causal_block_mask", "compact", "count_pairs", "count_pairs_tensor",
           "diagonal_block_mask", "in_ranges", "index_density", "num_blocks",
           "query_block_bounds", "range_cover", "range_stops"]


def range_cover(range_start: torch.Tensor, block_size: int, kv_len: int) -> torch.Tensor:
    """bool [..., kv_len]: the keys the ranges of each list ([..., MAXR], -1 padded) cover.
    Ranges never overlap: +1 at each start, -1 at each stop, and the running sum is 0 or 1."""
    start = range_start.to(torch.int64)
    ok = start >= 0
    edge = torch.zeros(*start.shape[:-1], kv_len + 1, dtype=torch.int8, device=start.device)
    one = torch.ones_like(start, dtype=torch.int8)
    edge.scatter_add_(-1, torch.where(ok, start.clamp(max=kv_len), kv_len), one)
    edge.scatter_add_(-1, torch.where(ok, range_stops(start, block_size).clamp(max=kv_len), kv_len), -one)
    return edge[..., :kv_len].cumsum(-1, dtype=torch.int8) > 0


def compact(values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the kept entries of each last-dim row to the front, ascending.

    values: int64 [..., N] (non-negative), keep: bool [..., N] -> (count int32 [...], index int32 [..., M])
    with M = max count and -1 padding.
    """
    count = keep.sum(-1)
    width = int(count.max()) if count.numel() else 0
    big = torch.iinfo(torch.int64).max
    key = torch.where(keep, values.to(torch.int64), torch.full_like(values, big, dtype=torch.int64))
    key = key.sort(-1).values[..., :width]
    index = torch.where(key == big, torch.full_like(key, -1), key)
    return count.to(torch.int32), index.to(torch.int32)


def build_index(
    block_mask: torch.Tensor,
    block_size: int,
    q_len: int,
    ctx_len: int,
    column_candidates: torch.Tensor | None = None,
    column_keep: torch.Tensor | None = None,
    range_count: torch.Tensor | None = None,
    range_start: torch.Tensor | None = None,
) -> SparseIndex:
    """Assemble a SparseIndex from a key-block mask, optional ranges and column candidates.

    block_mask: bool [H, NQB, NKB]; it is intersected with the causal block mask.
    range_count / range_start: int32 [H, NQB] / [H, NQB, R] (format of :class:`SparseIndex`);
    a head with ranges must list no block that overlaps them (the vertical-slash heads list
    none). column_candidates: int64 [H, C] absolute key positions (any order), column_keep:
    bool [H, C] (False marks padding). A column is listed for a query block when it is causally
    reachable from that block and neither a listed key block nor a range covers it.
    """
    device = block_mask.device
    h, nqb, nkb = block_mask.shape
    block_mask = block_mask & causal_block_mask(q_len, ctx_len, block_size, device)[None]
    kb = torch.arange(nkb, device=device, dtype=torch.int64).expand(h, nqb, nkb)
    block_count, block_index = compact(kb, block_mask)

    if column_candidates is None or column_candidates.shape[-1] == 0:
        column_count = torch.zeros(h, nqb, dtype=torch.int32, device=device)
        column_index = torch.zeros(h, nqb, 0, dtype=torch.int32, device=device)
    else:
        # Sort the candidates and drop repeats: a key listed twice would be counted twice.
        big = torch.iinfo(torch.int64).max
        cols = torch.where(column_keep, column_candidates.to(torch.int64), big).sort(-1).values  # [H, C]
        unique = torch.ones_like(cols, dtype=torch.bool)
        unique[:, 1:] = cols[:, 1:] != cols[:, :-1]
        col_ok = (cols != big) & unique
        cols = torch.where(col_ok, cols, 0)
        _, q_last = query_block_bounds(q_len, ctx_len, block_size, device)
        keep = col_ok[:, None, :] & (cols[:, None, :] <= q_last[None, :, None])  # [H, NQB, C]
        covered = torch.gather(block_mask, 2, (cols // block_size).clamp(max=nkb - 1)[:, None, :].expand(h, nqb, -1))
        if range_start is not None and range_start.shape[-1]:
            covered = covered | in_ranges(range_start, cols[:, None, :].expand(h, nqb, -1), block_size)
        keep = keep & ~covered
        column_count, column_index = compact(cols[:, None, :].expand(h, nqb, -1), keep)
    return SparseIndex(block_size, block_count, block_index, column_count, column_index, range_count, range_start)


def in_ranges(range_start: torch.Tensor, keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool [..., C]: whether each key lies inside one of the ranges of its list ([..., R])."""
    start = range_start.to(torch.int64)
    big = torch.iinfo(torch.int64).max
    sorted_starts = torch.where(start >= 0, start, big).contiguous()
    last = torch.searchsorted(sorted_starts, keys.contiguous(), right=True) - 1  # last start <= key
    found = torch.gather(sorted_starts, -1, last.clamp(min=0))
    # the next start is > key by construction, so the range's own width decides
    return (last >= 0) & (keys < found + block_size)


def count_pairs(index: SparseIndex, q_len: int, ctx_len: int) -> int:
    """(query, key) pairs over all heads that the index allows, causality applied, without
    materialising a mask (closed forms per listed block and column). Stats and tests use it."""
    return int(count_pairs_tensor(index, q_len, ctx_len))


def count_pairs_tensor(index: SparseIndex, q_len: int, ctx_len: int) -> torch.Tensor:
    """:func:`count_pairs` as a 0-dim int64 tensor on the index's device (no host sync).
    Heads are taken a few at a time so that each int64 temporary stays around 32 MiB (a few live at once)."""
    b = index.block_size
    kv_len = ctx_len + q_len
    device = index.block_count.device
    q_first, q_last = query_block_bounds(q_len, ctx_len, b, device)
    qf, ql = q_first.view(1, -1, 1), q_last.view(1, -1, 1)
    h, nqb = index.block_count.shape
    per_head = nqb * max(1, index.block_index.shape[-1], index.column_index.shape[-1], index.range_start.shape[-1])
    step = max(1, (1 << 22) // per_head)
    total = torch.zeros((), dtype=torch.int64, device=device)

    def run_pairs(s, e, listed):  # keys s..e (inclusive) of each listed run, for the rows qf..ql
        # rows p in [qf, ql]: p < s -> 0 keys; s <= p <= e -> p - s + 1; p > e -> e - s + 1
        lo, hi = torch.maximum(qf, s), torch.minimum(ql, e)
        n_ramp = (hi - lo + 1).clamp(min=0)
        ramp = n_ramp * (lo - s + 1) + n_ramp * (n_ramp - 1) // 2
        flat = (ql - torch.maximum(qf, e + 1) + 1).clamp(min=0) * (e - s + 1)
        return ((ramp + flat) * listed).sum()

    for h0 in range(0, h, step):
        kb = index.block_index[h0:h0 + step].to(torch.int64)
        s = kb * b  # first key of the block
        total += run_pairs(s, torch.clamp(s + b, max=kv_len) - 1, kb >= 0)
        rs = index.range_start[h0:h0 + step]
        stop = torch.clamp(range_stops(rs, b), max=kv_len)
        total += run_pairs(rs.to(torch.int64), stop - 1, rs >= 0)
        c = index.column_index[h0:h0 + step].to(torch.int64)
        total += ((ql - torch.maximum(qf, c) + 1).clamp(min=0) * (c >= 0)).sum()
    return total


def index_density(index: SparseIndex, q_len: int, ctx_len: int) -> torch.Tensor:
    """Cheap upper bound of the share of causal (query, key) pairs the index computes: every
    listed block and range counted full, every column for a whole query block. A 0-dim fp32 tensor on the
    index's device (no host sync)."""
    b = index.block_size
    causal = index.num_heads * (q_len * ctx_len + q_len * (q_len + 1) // 2)
    # listed / causal = (blocks * b + columns) * b / causal, in as few launches as possible (per layer)
    tiles = index.block_count.sum(dtype=torch.float32) + index.range_count.sum(dtype=torch.float32)
    listed = torch.add(index.column_count.sum(dtype=torch.float32), tiles, alpha=b)
    return listed.mul_(b / max(causal, 1)).clamp_(max=1.0)
