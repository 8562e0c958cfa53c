"""Run the sparse rows of one attention layer: estimate -> kernel -> write into vLLM's output.

Backend-agnostic glue between a planned step and the math: the backends hand in the query and
output tensors, the rows, and how to get a row's K/V (fresh tensors on CPU, a paged-cache gather
or the Triton kernel's own paged reads on GPU).
"""

from __future__ import annotations

from typing import Callable

import torch

from .config import SparseSettings
from .head_configs import ResolvedHead
from .index import SparseIndex, count_pairs
from .patterns import estimate_index
from .plan import SparseRow
from .reference import causal_pairs, sparse_attention
from .stats import STATS

KVForRow = Callable[[SparseRow], tuple[torch.Tensor, torch.Tensor]]
# Computes every row at once from the rows and their indices (the Triton kernel over the paged
# cache), writing into the output the caller bound it to.
BatchedKernel = Callable[[list[SparseRow], list[SparseIndex]], object]


def run_sparse_rows(query: torch.Tensor, output: torch.Tensor, rows: list[SparseRow], kv_for_row: KVForRow,
                    heads: list[ResolvedHead], settings: SparseSettings, scale: float,
                    softcap: float = 0.0, batched_kernel: BatchedKernel | None = None) -> None:
    """query: [num_tokens, H, D]; output: [num_tokens, H, Dv], written in place for the rows' tokens.

    kv_for_row gives a row's K/V (all ctx_len + q_len positions) for estimation and, without a
    batched kernel, for the torch reference, which then computes the row.
    """
    num_heads = query.shape[1]
    indices = []
    for row in rows:
        s = slice(row.tok_start, row.tok_start + row.q_len)
        k, v = kv_for_row(row)
        est = estimate_index(query[s], k, row.ctx_len, heads, settings, scale)
        if batched_kernel is None:
            sparse_attention(query[s], k, v, est.index, row.ctx_len, scale, softcap, out=output[s])
        else:
            indices.append(est.index)
        computed = count_pairs(est.index, row.q_len, row.ctx_len)
        with STATS._lock:
            STATS.sparse_rows += 1
            STATS.sparse_query_tokens += row.q_len
            STATS.causal_pairs += causal_pairs(row.q_len, row.ctx_len, num_heads)
            STATS.computed_pairs += computed
            STATS.head_patterns.update(est.head_patterns)
    if batched_kernel is not None and rows:
        batched_kernel(rows, indices)
    if settings.stats_file:
        STATS.dump(settings.stats_file)
