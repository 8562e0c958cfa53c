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
from vllm_sparse_kernels.torch_attention import causal_attention

# Query rows per attention call: bounds the [heads, rows, keys] scores a call materialises.
QUERY_ROWS = 512


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
        out[a:b] = causal_attention(query[a:b], key[:seq_len], value[:seq_len], scale, QUERY_ROWS)
