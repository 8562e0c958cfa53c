"""Block-sparse heads (MInference Alg. 3): top-k key blocks per query block.

Three ways to score a block (``block_scoring``): MInference's mean-pooled Q . mean-pooled K
(softmax does not change a row's top-k); the estimated softmax mass of each block from the
anti-diagonals of strided cells (``antidiagonal``, XAttention's scoring,
:func:`sparse_prefill_kernels.estimate_math.antidiagonal_block_mass`); or the real attention
mass of a few sampled queries of each query block (``sampled``,
:func:`sparse_prefill_kernels.estimate_math.sampled_block_mass`). The last two can also keep
only the fewest blocks reaching ``block_mass`` of a row's mass (at most top-k). The diagonal
blocks are always kept (they count toward k, except that both are kept when an unaligned chunk
has two) so that every query sees at least its own position."""

from __future__ import annotations

import torch
from vllm_sparse_kernels.prefill.estimate_math import mass_block_counts, scored_block_mass

from ..index import causal_block_mask, diagonal_block_mask
from .common import PatternSelection, block_means, keep_top, sum_head_groups


def block_sparse_selection(q: torch.Tensor, k: torch.Tensor, kvh: torch.Tensor, ctx_len: int,
                           topk_blocks: torch.Tensor, *, block_size: int, share: int = 1,
                           scoring: str = "pooled", stride: int = 16, block_mass: float | None = None,
                           scale: float | None = None, samples: int = 2) -> PatternSelection:
    """``share`` > 1: every ``share`` consecutive heads (one KV group) get one selection, from
    their scores added up (pooled: the group's summed pooled query against the pooled keys;
    antidiagonal, sampled: the group's summed block mass). ``scoring="antidiagonal"`` and
    ``"sampled"`` (``samples`` queries per query block) need ``scale``."""
    q_len = q.shape[0]
    topk_blocks = topk_blocks[::share]
    if scoring != "pooled":
        # K per query head (any head subset); the GPU path maps KV heads without copying
        scores = scored_block_mass(scoring, q, k[:, kvh], ctx_len, block_size, scale, share, stride=stride,
                                   samples=samples)
        counts = mass_block_counts(scores, topk_blocks, block_mass)
    else:
        qp = sum_head_groups(block_means(q, block_size), share)  # [h / share, NQB, D]
        kp = block_means(k, block_size)[kvh[::share]]  # [h / share, NKB, D]
        scores = torch.matmul(qp, kp.transpose(-1, -2))
        counts = topk_blocks.repeat_interleave(scores.shape[1])
    causal = causal_block_mask(q_len, ctx_len, block_size, q.device)
    diag = diagonal_block_mask(q_len, ctx_len, block_size, q.device)
    scores = scores.masked_fill(~causal, float("-inf")).masked_fill(diag, float("inf"))
    h, nqb, nkb = scores.shape
    keep = keep_top(scores.reshape(h * nqb, nkb), counts)
    # A chunk that starts mid-block has two diagonal blocks; both stay even when k = 1.
    return PatternSelection.blocks_only((keep.view(h, nqb, nkb) | diag) & causal).repeat_heads(share)
