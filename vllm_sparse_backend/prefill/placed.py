"""Prefill rows over pages a KV placement keeps (issue 54, ``kv_placement=host``): gather, then
causal attention.

With the K/V in host memory vLLM's page holds only the key summaries, so FlashAttention has no
paged cache to read. A step with prefill rows then attends every row (its decode rows too, as
FlashAttention does for the ``topk`` mode on vLLM's cache) over K/V gathered from the placement
after this step's write: by default the row's whole K/V (:func:`dense_prefill_placed`), or, with
a page budget (:func:`selected_prefill_placed`, issue 54 item 3), its sink pages, the pages of its
chunk and the window before it, and the earlier pages whose summaries promise the most attention
to the chunk's last queries: only those cross from host memory.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from vllm_sparse_kernels.torch_attention import causal_attention

# Query rows per attention call: bounds the [heads, rows, keys] scores a call materialises.
QUERY_ROWS = 512
# The chunk's last queries that score earlier pages (MInference's last-q estimate: the end of a
# prompt is what its answer attends from).
SCORING_ROWS = 64


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


def page_attention_bound(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """The largest ``q . k`` any key of a page can give, from its per-dimension min and max
    (Quest's bound: each term ``q_d k_d`` is largest at ``k_d`` = max where ``q_d`` >= 0, else at
    min): query ``[r, H, D]``, key_min / key_max ``[P, Hkv, D]`` -> ``[H, r, P]`` in float32."""
    group = query.shape[1] // key_min.shape[1]
    q = query.float().transpose(0, 1)  # [H, r, D]
    mx = key_max.float().repeat_interleave(group, dim=1).permute(1, 2, 0)  # [H, D, P]
    mn = key_min.float().repeat_interleave(group, dim=1).permute(1, 2, 0)
    return q.clamp(min=0) @ mx - (-q).clamp(min=0) @ mn


def selected_prefill_placed(query: torch.Tensor, query_start_loc: Sequence[int], seq_lens: Sequence[int],
                            block_table: torch.Tensor, page_size: int, scale: float, out: torch.Tensor,
                            gather: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]],
                            summaries: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                            budget_pages: int, sink_pages: int, recent_pages: int) -> None:
    """:func:`dense_prefill_placed` reading part of each row's context: its first ``sink_pages``,
    every page from ``recent_pages`` before its chunk to its end, and of the pages between, the
    ``budget_pages`` with the most estimated attention from the chunk's last queries (softmax of
    :func:`page_attention_bound` over those pages, summed over the scoring rows and heads).
    ``summaries(block_ids)``: their key min and max ``[n, Hkv, D]``. A row whose pages between
    number at most ``budget_pages`` is attended whole, as :func:`dense_prefill_placed` does."""
    table = block_table.cpu()
    for row, seq_len in enumerate(seq_lens):
        a, b = query_start_loc[row], query_start_loc[row + 1]
        if b == a:
            continue
        blocks = table[row, :-(-seq_len // page_size)]
        # pages from `tail` on hold the chunk and the window before it: gathered in order, whole
        tail = max((seq_len - (b - a)) // page_size - recent_pages, 0)
        sinks = min(sink_pages, tail)
        between = blocks[sinks:tail]
        if between.numel() > budget_pages:
            key_min, key_max = summaries(between.to(query.device))
            bound = page_attention_bound(query[max(a, b - SCORING_ROWS):b], key_min, key_max)
            mass = torch.softmax(bound * scale, dim=-1).sum(dim=(0, 1))
            between = between[mass.topk(budget_pages).indices.sort().values.cpu()]
        chosen = sinks + between.numel()
        key, value = gather(blocks[:sinks].tolist() + between.tolist() + blocks[tail:].tolist())
        # the chosen pages precede the tail, whose last positions are the queries': causal_attention's layout
        keep = chosen * page_size + seq_len - tail * page_size
        out[a:b] = causal_attention(query[a:b], key[:keep], value[:keep], scale, QUERY_ROWS)
