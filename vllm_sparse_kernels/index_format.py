"""The one sparse format every pattern produces and every kernel consumes: :class:`SparseIndex`,
with the block geometry the kernels and the estimators share. Torch only (no triton).

Per query block of a row (``block_size`` consecutive queries of the chunk) and per query
head: a list of whole key blocks (aligned to ``block_size`` absolute key positions), a list
of key ranges (runs of up to ``block_size`` consecutive keys starting anywhere) and a list of
single key columns outside both. Blocks and columns are MInference's hybrid block+column
format (Alg. 4/5), with key blocks aligned to absolute positions so that a key block never
straddles two KV-cache pages of a multiple size. Ranges carry slash lines: a diagonal crosses
a query block in ``block_size`` consecutive keys, which as aligned blocks costs two blocks
unless it happens to be aligned, and as a range costs one key tile (MInference's point-range
merge). Causality is applied on top by whoever computes attention: a listed key is used by a
query only if its position is <= the query's.

A range starting at key ``s`` covers keys ``s .. min(s + block_size, next start) - 1``: the
starts are strictly ascending, and a range stops where the next one begins, so ranges never
overlap (each key is counted once by the softmax).

Geometry of a row: ``q_len`` queries at absolute positions ``ctx_len .. ctx_len+q_len-1``
attend to keys ``0 .. ctx_len+q_len-1`` (context already in the cache plus the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SparseIndex:
    """Sparse selection for one row, all query heads.

    block_index / range_start / column_index are ascending within each (head, query block)
    and padded with -1 past their counts. Ranges never overlap a listed block; columns never
    fall inside a listed block or range. Patterns without ranges may leave them out (no ranges:
    width 0).
    """

    block_size: int
    block_count: torch.Tensor  # int32 [H, NQB]
    block_index: torch.Tensor  # int32 [H, NQB, MAXB] key-block ids (key position // block_size)
    column_count: torch.Tensor  # int32 [H, NQB]
    column_index: torch.Tensor  # int32 [H, NQB, MAXC] absolute key positions
    range_count: torch.Tensor | None = None  # int32 [H, NQB]
    range_start: torch.Tensor | None = None  # int32 [H, NQB, MAXR] first key of each range

    def __post_init__(self):
        if (self.range_count is None) != (self.range_start is None):
            raise ValueError("range_count and range_start come together")
        if self.range_count is None:
            self.range_count = torch.zeros_like(self.block_count)
            self.range_start = torch.zeros(*self.block_count.shape, 0, dtype=torch.int32,
                                           device=self.block_count.device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The six list tensors in constructor order (after ``block_size``)."""
        return (self.block_count, self.block_index, self.column_count, self.column_index, self.range_count,
                self.range_start)

    def map_lists(self, fn) -> "SparseIndex":
        """The same index with ``fn`` applied to each list tensor (head / device selections)."""
        return SparseIndex(self.block_size, *(fn(t) for t in self.tensors()))

    @property
    def num_heads(self) -> int:
        return self.block_count.shape[0]

    @property
    def num_query_blocks(self) -> int:
        return self.block_count.shape[1]

    def repeat_heads(self, n: int) -> "SparseIndex":
        """Each list used by ``n`` consecutive heads (a KV group's shared lists, per head)."""
        if n == 1:
            return self
        return self.map_lists(lambda t: t.repeat_interleave(n, dim=0))

    def to(self, device: torch.device | str) -> "SparseIndex":
        return self.map_lists(lambda t: t.to(device))


def range_stops(range_start: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [..., MAXR]: one past the last key of each range (``min(start + block_size, next
    start)``); padding entries get their own (meaningless) value and must be masked by count."""
    start = range_start.to(torch.int64)
    nxt = torch.nn.functional.pad(start[..., 1:], (0, 1), value=-1)
    return torch.where(nxt >= 0, torch.minimum(start + block_size, nxt), start + block_size)


def num_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


def causal_pairs(q_len: int, ctx_len: int, num_heads: int) -> int:
    """(query, key) pairs of dense causal attention for one row, over all heads."""
    return num_heads * (q_len * ctx_len + q_len * (q_len + 1) // 2)


def query_block_bounds(q_len: int, ctx_len: int, block_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute first and last (inclusive) query position of every query block: int64 [NQB]."""
    starts = torch.arange(0, q_len, block_size, device=device, dtype=torch.int64)
    last = torch.clamp(starts + block_size, max=q_len) - 1
    return starts + ctx_len, last + ctx_len


def causal_block_mask(q_len: int, ctx_len: int, block_size: int, device=None) -> torch.Tensor:
    """bool [NQB, NKB]: key block kb can hold a key visible to some query of query block qb."""
    _, q_last = query_block_bounds(q_len, ctx_len, block_size, device)
    nkb = num_blocks(ctx_len + q_len, block_size)
    kb = torch.arange(nkb, device=device, dtype=torch.int64)
    return kb[None, :] * block_size <= q_last[:, None]


def diagonal_block_mask(q_len: int, ctx_len: int, block_size: int, device=None) -> torch.Tensor:
    """bool [NQB, NKB]: key blocks that hold the query block's own positions (always needed:
    every query must at least see itself, otherwise its softmax row is empty)."""
    q_first, q_last = query_block_bounds(q_len, ctx_len, block_size, device)
    nkb = num_blocks(ctx_len + q_len, block_size)
    kb = torch.arange(nkb, device=device, dtype=torch.int64)
    return (kb[None, :] >= (q_first // block_size)[:, None]) & (kb[None, :] <= (q_last // block_size)[:, None])
