"""Dense causal attention expressed in the sparse format (every causal key block)."""

from __future__ import annotations

from ..index import causal_block_mask
from .common import PatternSelection


def dense_selection(num_heads: int, q_len: int, ctx_len: int, block_size: int, device=None) -> PatternSelection:
    mask = causal_block_mask(q_len, ctx_len, block_size, device)
    return PatternSelection.blocks_only(mask[None].expand(num_heads, -1, -1).clone())
