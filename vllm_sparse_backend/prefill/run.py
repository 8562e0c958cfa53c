"""One attention layer's sparse rows: route (:mod:`.route`) -> estimate -> one launch into vLLM's output (PyTorch on
each row's K/V, or Triton through the block table); the caller records the :class:`.plan.LayerOutcome` once."""

from __future__ import annotations

from typing import Callable

import torch
from vllm_sparse_kernels.index_format import causal_pairs
from vllm_sparse_kernels.torch_attention import causal_attention, sparse_attention

from .cost import ROW_COST
from .estimate import estimate_index, estimate_index_paged
from .index import index_density
from .plan import LayerOutcome, SparseRow
from .route import DenseReason, flags_on_host, route_layer


def run_sparse_rows(query, output, rows: list[SparseRow], kv_for_row: Callable, heads, settings, scale: float,
                    softcap: float, share: int | None, timing) -> LayerOutcome:
    """query [num_tokens, H, D], output [num_tokens, H, Dv]; ``share``: :func:`.estimate.estimate_index`'s."""
    outcome = LayerOutcome(query.shape[1], paged=False)
    for row in rows:
        s = slice(row.tok_start, row.tok_start + row.q_len)
        k, v = kv_for_row(row)
        timing.mark()
        est = estimate_index(query[s], k, row.ctx_len, heads, settings, scale, share)
        timing.lap("estimate")
        sparse_attention(query[s], k, v, est.index, row.ctx_len, scale, softcap, out=output[s])
        if (n := row.exact_rows) and not softcap:  # the answer's rows (the router's choice): every key
            output[s][-n:] = causal_attention(query[s][-n:], k, v, scale)
        timing.lap("kernel")
        outcome.sparse.append((row, est))
    timing.done()
    return outcome


def run_sparse_rows_paged(query, output, rows: list[SparseRow], key_cache, value_cache, block_table, groups,
                          settings, scale: float, softcap: float, kernel: Callable, timing, *,
                          density_fallback: bool = False, k_scale=None, v_scale=None, history=None,
                          row_table=None, row_cost=ROW_COST) -> LayerOutcome:
    """``density_fallback``: rows estimated too dense may go to the caller's dense kernel (see ``flags_on_host``)."""
    capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
    fallback = density_fallback and settings.gating.max_density < 1.0
    route = route_layer(rows, groups.head_counts, settings, query.shape[1], query.shape[2], density_fallback=fallback,
                        history=history, capturing=capturing, row_cost=row_cost)
    outcome = LayerOutcome(query.shape[1], True, route.dense, every_key=route.every_key)
    timing.mark()
    todo = [(r, estimate_index_paged(query[r.tok_start:r.tok_start + r.q_len], key_cache, block_table[r.row],
                                     r.ctx_len, groups, settings, scale, k_scale)) for r in route.estimate]
    if fallback and todo:
        dens = torch.stack([index_density(e.index, r.q_len, r.ctx_len).view(()) for r, e in todo])
        outcome.flags = dens > settings.gating.max_density
        learned = ([route.budgets[r.row] for r, _ in todo],
                   [causal_pairs(r.q_len, r.ctx_len, outcome.num_heads) for r, _ in todo], settings.gating.max_density)
        if flags_on_host(settings, history, capturing):
            timing.lap("estimate")
            densities = dens.tolist()  # the one host read of the layer
            if history is not None:
                history.observed(densities, *learned)
            outcome.dense += [(r, DenseReason.ESTIMATED_DENSITY) for (r, _), d in zip(todo, densities)
                              if d > settings.gating.max_density]
            todo = [t for t, d in zip(todo, densities) if d <= settings.gating.max_density]
            outcome.flags = None
            timing.mark()  # the wait for the flags is not estimation
        elif history is not None and not capturing:
            history.watch(dens, *learned)
    timing.lap("estimate")
    outcome.sparse = todo
    if todo:
        timing.mark()
        extra = {} if k_scale is None and v_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        if row_table is not None and len(todo) == len(rows):
            extra["row_table"] = row_table  # the step's table holds exactly these rows
        kernel(query, key_cache, value_cache, block_table, [r for r, _ in todo], [e.index for _, e in todo], scale,
               output, softcap, whole_rows=outcome.flags, skip_below=settings.skip_tile_below, **extra)
        timing.lap("kernel")
    timing.done()
    return outcome
