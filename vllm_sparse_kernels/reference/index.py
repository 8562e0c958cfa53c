"""The dense (query, key) mask of a :class:`SparseIndex`: the oracle of what an index allows, for
tests and small inputs. Torch only.
"""

from __future__ import annotations

import torch

from ..index_format import SparseIndex, num_blocks, range_stops


def index_to_dense_mask(index: SparseIndex, q_len: int, ctx_len: int) -> torch.Tensor:
    """bool [H, q_len, kv_len] of the (query, key) pairs the index allows, causality applied.

    Materialises the full mask: for tests and small inputs only.
    """
    b = index.block_size
    kv_len = ctx_len + q_len
    h, nqb = index.block_count.shape
    device = index.block_count.device
    # one block of slack: a range may reach past the last key block (its keys there are masked)
    mask = torch.zeros(h, nqb, num_blocks(kv_len, b) * b + b, dtype=torch.bool, device=device)
    for j in range(index.block_index.shape[-1]):
        kb = index.block_index[..., j].to(torch.int64)
        valid = kb >= 0
        pos = kb.clamp(min=0)[..., None] * b + torch.arange(b, device=device)
        mask.scatter_(2, pos, valid[..., None].expand(-1, -1, b) | torch.gather(mask, 2, pos))
    stops = range_stops(index.range_start, b)
    for j in range(index.range_start.shape[-1]):
        s0 = index.range_start[..., j].to(torch.int64)
        pos = s0.clamp(min=0)[..., None] + torch.arange(b, device=device)
        valid = (s0 >= 0)[..., None] & (pos < stops[..., j, None])
        mask.scatter_(2, pos, valid | torch.gather(mask, 2, pos))
    for j in range(index.column_index.shape[-1]):
        c = index.column_index[..., j].to(torch.int64)
        valid = c >= 0
        pos = c.clamp(min=0)[..., None]
        mask.scatter_(2, pos, valid[..., None] | torch.gather(mask, 2, pos))
    mask = mask[..., :kv_len].repeat_interleave(b, dim=1)[:, :q_len]
    qpos = torch.arange(q_len, device=device) + ctx_len
    return mask & (torch.arange(kv_len, device=device)[None, :] <= qpos[:, None])[None]
