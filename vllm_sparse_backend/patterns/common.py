"""Pieces shared by the pattern estimators (all batched over heads; no per-head loops). The score
arithmetic they share with the GPU estimators (``block_means``, ``sum_head_groups``,
``cumulative_budget``) lives in :mod:`sparse_prefill_kernels.estimate_math` and is re-exported here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm_sparse_kernels.prefill.estimate_math import block_means, cumulative_budget, sum_head_groups  # noqa: F401

from ..index import SparseIndex, build_index, num_blocks


@dataclass
class PatternSelection:
    """What an estimator selects for a subset of heads, before assembly into a SparseIndex.

    block_mask: bool [h, NQB, NKB]; columns: int64 [h, C] absolute key positions with
    column_keep: bool [h, C] (False = padding). C may be 0. range_count / range_start: key
    ranges per query block (``SparseIndex``'s format), or None.
    """

    block_mask: torch.Tensor
    columns: torch.Tensor
    column_keep: torch.Tensor
    range_count: torch.Tensor | None = None
    range_start: torch.Tensor | None = None

    @staticmethod
    def blocks_only(block_mask: torch.Tensor) -> "PatternSelection":
        h = block_mask.shape[0]
        empty = torch.zeros(h, 0, dtype=torch.int64, device=block_mask.device)
        return PatternSelection(block_mask, empty, empty.bool())

    def to_index(self, block_size: int, q_len: int, ctx_len: int) -> SparseIndex:
        """This selection alone as a SparseIndex (``index.build_index``)."""
        return build_index(self.block_mask, block_size, q_len, ctx_len, self.columns, self.column_keep,
                           self.range_count, self.range_start)

    def repeat_heads(self, n: int) -> "PatternSelection":
        """Each selection used by ``n`` consecutive heads (a KV group's shared selection)."""
        if n == 1:
            return self
        return PatternSelection(*(None if t is None else t.repeat_interleave(n, dim=0) for t in (
            self.block_mask, self.columns, self.column_keep, self.range_count, self.range_start)))


def last_queries_probs(q: torch.Tensor, k: torch.Tensor, kvh: torch.Tensor, ctx_len: int, n: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax of the last ``n`` queries of the chunk against all keys (fp32).

    Returns (probs [h, n', kv_len], absolute positions of those queries [n']).
    """
    q_len = q.shape[0]
    kv_len = k.shape[0]
    n = min(n, q_len)
    qs = q[q_len - n:].transpose(0, 1).float()  # [h, n, D]
    ks = k.transpose(0, 1).float()[kvh]  # [h, kv_len, D]; estimation-sized gather only
    s = torch.matmul(qs, ks.transpose(-1, -2)) * scale
    qpos = torch.arange(q_len - n, q_len, device=q.device) + ctx_len
    s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > qpos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1), qpos


def vertical_and_slash_sums(probs: torch.Tensor, qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column sums [h, kv_len] and diagonal sums [h, kv_len] (index d = query pos - key pos)."""
    h, n, kv_len = probs.shape
    vertical = probs.sum(1)
    d = qpos[:, None] - torch.arange(kv_len, device=probs.device)[None, :]  # [n, kv_len]
    d = d.clamp(min=0)  # masked (future) keys have probability 0, so where they land is irrelevant
    slash = torch.zeros(h, kv_len, dtype=probs.dtype, device=probs.device)
    slash.scatter_add_(1, d.reshape(1, -1).expand(h, -1), probs.reshape(h, -1))
    return vertical, slash


def keep_top(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool mask of the ``counts[h]`` highest entries of each row of scores [h, N]."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return ranks < counts.to(scores.device)[:, None]


