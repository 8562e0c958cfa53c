"""Dense causal attention expressed in the sparse format (every causal key block)."""

from __future__ import annotations

import torch

from ...kernels import estimate
from ..index import causal_block_mask, num_blocks
from .base import HeadGroup, PagedSelection, Pattern, PatternSelection


def dense_selection(num_heads: int, q_len: int, ctx_len: int, block_size: int, device=None) -> PatternSelection:
    mask = causal_block_mask(q_len, ctx_len, block_size, device)
    return PatternSelection.blocks_only(mask[None].expand(num_heads, -1, -1).clone())


class Dense(Pattern):
    name = "dense"

    def keys_per_query(self, head, kv_len, visible, settings):
        return visible

    def covers_every_key(self, head, kv_len, settings):
        return True

    def select(self, q, k, kvh, ctx_len, params, settings, scale, share):
        sel = dense_selection(q.shape[1], q.shape[0], ctx_len, settings.block_size, q.device)
        return sel, {self.name: q.shape[1]}

    def estimate_paged(self, q_row, key_cache, block_table_row, ctx_len, group: HeadGroup, num_lists, settings,
                       scale, share, k_scale=None):
        # every causal key block: an A-shape whose sink covers the whole row
        q_len = q_row.shape[0]
        kv_len, b = ctx_len + q_len, settings.block_size
        full = torch.full((len(group.ids),), kv_len, dtype=torch.int64, device=q_row.device)
        return PagedSelection(estimate.a_shape_index(full, full, q_len, ctx_len, b, max_blocks=num_blocks(kv_len, b)))
