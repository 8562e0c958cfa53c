"""Prefill rows over pages a KV placement keeps (issue 54, ``kv_placement=host``): gather, then
dense causal attention.

With the K/V in host memory vLLM's page holds only the key summaries, so FlashAttention has no
paged cache to read. A step with prefill rows then attends every row (its decode rows too, as
FlashAttention does for the ``topk`` mode on vLLM's cache) over the row's whole K/V, gathered from
the placement after this step's write: the context prefilled normally, dense, as long as one
row's K/V fits on the GPU beside the model. A context larger than that (issue 54 item 3: fetch
only what a sparse selection reads) is not built.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

# Query rows per attention call: bounds the [heads, rows, keys] scores a call materialises.
QUERY_ROWS = 512


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T x scale, causal) v for the last ``q`` positions of a sequence of ``s`` keys:
    query ``[q, H, D]``, key / value ``[s, Hkv, D]`` (H a multiple of Hkv, GQA); query row ``i``
    sits at position ``s - q + i`` and sees keys ``0 .. s - q + i``. ``[q, H, D]`` in the query's dtype."""
    q_len, s = query.shape[0], key.shape[0]
    group = query.shape[1] // key.shape[1]
    k = key.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, s, D]
    v = value.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    out = torch.empty_like(query)
    positions = torch.arange(s, device=query.device)
    for a in range(0, q_len, QUERY_ROWS):
        b = min(a + QUERY_ROWS, q_len)
        rows = torch.arange(s - q_len + a, s - q_len + b, device=query.device)
        bias = torch.where(positions[None, :] <= rows[:, None], 0.0, float("-inf")).to(query.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(query[a:b].transpose(0, 1), k, v, attn_mask=bias,
                                                             scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


def dense_prefill_placed(query: torch.Tensor, query_start_loc: Sequence[int], seq_lens: Sequence[int],
                         block_table: torch.Tensor, page_size: int, scale: float, out: torch.Tensor,
                         gather: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every row of a step into ``out``: row ``r``'s queries ``query[qsl[r]:qsl[r+1]]`` (its last
    tokens) over its ``seq_lens[r]`` keys. ``gather(block_ids)``: the K and V of those blocks in
    order, ``[blocks x page, Hkv, D]`` on the query's device. Host lists in, one gather per row."""
    table = block_table.cpu()
    for row, seq_len in enumerate(seq_lens):
        a, b = query_start_loc[row], query_start_loc[row + 1]
        if b == a:
            continue
        key, value = gather(table[row, :-(-seq_len // page_size)].tolist())
        out[a:b] = causal_attention(query[a:b], key[:seq_len], value[:seq_len], scale)
