"""Block-sparse heads (MInference Alg. 3): mean-pooled Q and K, top-k key blocks per query block.

Scores are pooled Q . pooled K (softmax does not change a row's top-k). The diagonal blocks
are always kept (they count toward k, except that both are kept when an unaligned chunk has two) so that every query sees at least its own position.
"""

from __future__ import annotations

import torch

from ..index import causal_block_mask, diagonal_block_mask
from .common import PatternSelection, block_means, keep_top, sum_head_groups


def block_sparse_selection(q: torch.Tensor, k: torch.Tensor, kvh: torch.Tensor, ctx_len: int,
                           topk_blocks: torch.Tensor, *, block_size: int, share: int = 1) -> PatternSelection:
    """``share`` > 1: every ``share`` consecutive heads (one KV group) get one selection, from
    their scores added up (= the group's summed pooled query against the pooled keys)."""
    q_len = q.shape[0]
    qp = sum_head_groups(block_means(q, block_size), share)  # [h / share, NQB, D]
    kp = block_means(k, block_size)[kvh[::share]]  # [h / share, NKB, D]
    topk_blocks = topk_blocks[::share]
    scores = torch.matmul(qp, kp.transpose(-1, -2))
    causal = causal_block_mask(q_len, ctx_len, block_size, q.device)
    diag = diagonal_block_mask(q_len, ctx_len, block_size, q.device)
    scores = scores.masked_fill(~causal, float("-inf")).masked_fill(diag, float("inf"))
    h, nqb, nkb = scores.shape
    keep = keep_top(scores.reshape(h * nqb, nkb), topk_blocks.repeat_interleave(nqb))
    # A chunk that starts mid-block has two diagonal blocks; both stay even when k = 1.
    return PatternSelection.blocks_only((keep.view(h, nqb, nkb) | diag) & causal).repeat_heads(share)
