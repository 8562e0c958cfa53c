"""A-shape heads: attention sinks plus a local window (static; no estimation).

MInference's ``stream_llm`` heads. Selection is at key-block granularity: the blocks holding the
first ``sink_tokens`` keys and the blocks reaching back ``local_window`` keys from each query block.
"""

from __future__ import annotations

import torch

from ..index import num_blocks, query_block_bounds
from .common import PatternSelection


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
