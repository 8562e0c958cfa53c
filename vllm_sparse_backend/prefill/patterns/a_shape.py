"""A-shape heads: attention sinks plus a local window (static; no estimation).

MInference's ``stream_llm`` heads. Selection is at key-block granularity: the blocks holding the
first ``sink_tokens`` keys and the blocks reaching back ``local_window`` keys from each query block.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ...config import PatternGroup
from ...kernels import estimate
from ..index import num_blocks, query_block_bounds
from .base import HeadGroup, PagedSelection, Pattern, PatternSelection, SearchKnob, per_head_params


def a_shape_selection(sink_tokens: torch.Tensor, local_window: torch.Tensor, q_len: int, ctx_len: int,
                      block_size: int) -> PatternSelection:
    """sink_tokens, local_window: int64 [h] per head."""
    device = sink_tokens.device
    q_first, q_last = query_block_bounds(q_len, ctx_len, block_size, device)
    kb = torch.arange(num_blocks(ctx_len + q_len, block_size), device=device)
    k_first, k_last = kb * block_size, kb * block_size + block_size - 1
    sink = k_first[None, None, :] < sink_tokens[:, None, None]
    local = k_last[None, None, :] >= (q_first[None, :, None] - local_window[:, None, None])
    return PatternSelection.blocks_only(sink | local)


class AShapeSettings(PatternGroup):
    """A-shape settings, ``settings.patterns.a_shape``: StreamingLLM-style sink + local window."""

    sink_tokens: int = Field(128, ge=0, description="A-shape: leading tokens every query sees.")
    local_window: int = Field(2048, ge=1, description="A-shape: trailing window every query sees.")


class AShape(Pattern):
    name = "a_shape"
    head_params = per_head_params(AShapeSettings, "sink_tokens", "local_window")
    settings_model = AShapeSettings
    # the window grows; one block of sinks (no estimation to serve)
    search = SearchKnob("ashape", "local_window", serving_cost=0, fixed=(("sink_tokens", 64),))

    def keys_per_query(self, head, kv_len, visible, settings):
        return head.param("sink_tokens") + head.param("local_window")

    def covers_every_key(self, head, kv_len, settings):
        return head.param("sink_tokens") + head.param("local_window") >= kv_len

    def select(self, q, k, kvh, ctx_len, params, settings, scale, share):
        sel = a_shape_selection(params["sink_tokens"], params["local_window"], q.shape[0], ctx_len,
                                settings.block_size)
        return sel, {self.name: q.shape[1]}

    def estimate_paged(self, q_row, key_cache, block_table_row, ctx_len, group: HeadGroup, num_lists, settings,
                       scale, share, k_scale=None):
        b = settings.block_size
        width = num_blocks(int(group.max_params["sink_tokens"]), b) + num_blocks(int(group.max_params["local_window"]),
                                                                                 b) + 2
        return PagedSelection(estimate.a_shape_index(group.params["sink_tokens"], group.params["local_window"],
                                                     q_row.shape[0], ctx_len, b, max_blocks=width))
