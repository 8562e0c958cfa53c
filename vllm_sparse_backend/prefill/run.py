"""Run the sparse rows of one attention layer: estimate -> kernel -> write into vLLM's output.

Backend-agnostic glue between a planned step and the math. Two paths:

* :func:`run_sparse_rows`: the backends hand in the query and output tensors, the rows, and how
  to get a row's K/V (fresh tensors on CPU, a paged-cache gather on GPU); indices are estimated
  in PyTorch on those K/V and the PyTorch reference computes the rows.
* :func:`run_sparse_rows_paged`: the GPU path. Estimation reads K through the block table
  (:func:`.estimate.estimate_index_paged`) and the Triton kernel reads K/V the same way;
  nothing is gathered, and nothing waits for the GPU except the one read of the rows' density
  flags per layer that sends too-dense rows back to the backend's dense kernel
  (``estimated_dense_rows="flash"``, or ``"auto"`` where the layer's previous call had such
  rows: :class:`.cost.LayerDensityHistory`). Before that, the cost model (:mod:`.cost`) sends rows
  dense that the sparse path is not predicted to win. Which rows go dense, and why, is decided
  in :mod:`.route`.

What the rows did is recorded in the worker's :class:`..observability.stats.SparseStats`, handed in.
"""

from __future__ import annotations

from typing import Callable

import torch
from vllm_sparse_kernels.reference.attention import causal_pairs, sparse_attention

from ..config import SparseSettings
from ..head_configs import ResolvedHead
from ..observability.stats import SparseStats
from .cost import ROW_COST, LayerDensityHistory, RowCost
from .estimate import HeadGroups, estimate_index, estimate_index_paged
from .index import count_pairs, count_pairs_tensor, index_density
from .plan import SparseRow
from .route import DenseReason, flags_on_host, route_layer

KVForRow = Callable[[SparseRow], tuple[torch.Tensor, torch.Tensor]]


def run_sparse_rows(query: torch.Tensor, output: torch.Tensor, rows: list[SparseRow], kv_for_row: KVForRow,
                    heads: list[ResolvedHead], settings: SparseSettings, scale: float, softcap: float,
                    share: int | None, stats: SparseStats) -> None:
    """query: [num_tokens, H, D]; output: [num_tokens, H, Dv], written in place for the rows' tokens.

    kv_for_row gives a row's K/V (all ctx_len + q_len positions); the torch estimators and the
    torch reference compute the row from them. ``share``: see :func:`.estimate.estimate_index`
    (the layer's :attr:`.plan.RankHeads.share`).
    """
    num_heads = query.shape[1]
    timing = stats.time_stages(query.device)  # a no-op unless this forward is sampled
    for row in rows:
        s = slice(row.tok_start, row.tok_start + row.q_len)
        k, v = kv_for_row(row)
        timing.mark()
        est = estimate_index(query[s], k, row.ctx_len, heads, settings, scale, share)
        timing.lap("estimate")
        sparse_attention(query[s], k, v, est.index, row.ctx_len, scale, softcap, out=output[s])
        timing.lap("kernel")
        computed = count_pairs(est.index, row.q_len, row.ctx_len)
        if computed >= causal_pairs(row.q_len, row.ctx_len, num_heads):
            stats.record_dense_reason(DenseReason.EVERY_KEY, tokens=row.q_len)  # nothing was skipped
        else:
            _record(stats, row, num_heads, computed, est.head_patterns)
    timing.done()
    if settings.stats_file:
        stats.dump(settings.stats_file)


def _record(stats: SparseStats, row: SparseRow, num_heads: int, computed: int | None, head_patterns) -> None:
    stats.record_sparse_row(row.q_len, causal_pairs(row.q_len, row.ctx_len, num_heads), computed, head_patterns)


# The Triton kernel's entry point (vllm_sparse_kernels.prefill.attention.sparse_prefill_attention).
PagedKernel = Callable[..., object]


def run_sparse_rows_paged(query: torch.Tensor, output: torch.Tensor, rows: list[SparseRow],
                          key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                          groups: HeadGroups, settings: SparseSettings, scale: float, softcap: float,
                          kernel: PagedKernel, stats: SparseStats, *, density_fallback: bool = False,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                          history: LayerDensityHistory | None = None, row_table=None,
                          row_cost: RowCost = ROW_COST) -> list[SparseRow]:
    """Estimate every row on the paged cache, then one kernel launch for all rows. Returns the
    rows the caller computes on its dense kernel instead (the density fallback); their output is
    left untouched here.

    key_cache / value_cache: [pages, page, Hkv, D] views, of the query's dtype or fp8 with the
    layer's ``k_scale`` / ``v_scale`` (one-element fp32 device tensors: dequantised value =
    stored * scale; both the estimation and the kernel apply them on the device); block_table:
    int32 [num_reqs, max_pages] (rows index it by ``row.row``). ``row_table``: the kernel's
    table of ``rows`` built once for the step (:attr:`..backends.common.SparseStepMetadata.row_table`);
    used when every row runs here, rebuilt by the kernel otherwise.

    ``density_fallback`` (the caller has a dense kernel for single rows; with
    ``settings.max_density`` < 1): the rows :func:`.route.route_layer` sends dense are returned
    without being estimated; after estimation, rows whose index covers more than
    ``max_density`` of their causal pairs are flagged on the GPU. Where :func:`.route.flags_on_host`
    says so the flags are read on the host (one sync per layer) and those rows are returned too;
    otherwise the kernel runs them in its dense mode (every causal key) and they stay counted as
    sparse rows, also counted under ``dense_reasons`` when the flags are next read
    (:meth:`SparseStats.flush_deferred`: forwards with exact stats, or a dump). Every reason
    counted is a :class:`.route.DenseReason`.

    Apart from that flag read, nothing here waits for the GPU, also with ``settings.stats_file``
    set: every row's counts are then read back later like a sampled forward's and the file
    catches up as they arrive (:meth:`SparseStats.refresh`). On the forwards the stage timer
    samples (``timing_sample_every``) the computed pairs, the flags and the heads' device-side
    labels are counted on the device and read back later (:meth:`SparseStats.read_later`).
    """
    num_heads = query.shape[1]
    all_rows = rows
    timing = stats.time_stages(query.device)  # CUDA events on 1 of N forwards, read later: no sync
    exact_stats = stats.exporting and (bool(settings.stats_file) or timing.sampled)  # TP rank 0 counts
    fallback = density_fallback and settings.max_density < 1.0
    capturing = _capturing(query)
    route = route_layer(rows, groups.head_counts, settings, num_heads, query.shape[2], density_fallback=fallback,
                        history=history, capturing=capturing, row_cost=row_cost)
    to_dense = [row for row, _ in route.dense]
    for row, reason in route.dense:
        stats.record_dense_reason(reason, tokens=row.q_len)
    rows, budgets, covered = route.estimate, route.budgets, route.every_key
    estimates = []
    timing.mark()
    for row in rows:
        q = query[row.tok_start:row.tok_start + row.q_len]
        estimates.append(estimate_index_paged(q, key_cache, block_table[row.row], row.ctx_len, groups, settings, scale,
                                              k_scale))
    whole = None
    if fallback and rows:
        dens = [index_density(e.index, r.q_len, r.ctx_len) for e, r in zip(estimates, rows)]
        dens = dens[0].view(1) if len(dens) == 1 else torch.stack(dens)
        whole = dens > settings.max_density
        learned = ([budgets[r.row] for r in rows], [causal_pairs(r.q_len, r.ctx_len, num_heads) for r in rows],
                   settings.max_density)
        if flags_on_host(settings, history, capturing):
            timing.lap("estimate")
            densities = dens.tolist()  # the one host read of the layer
            flags = [d > settings.max_density for d in densities]
            if history is not None:
                history.observed(densities, *learned)
            for row, flagged in zip(rows, flags):
                if flagged:
                    to_dense.append(row)
                    stats.record_dense_reason(DenseReason.ESTIMATED_DENSITY, tokens=row.q_len)
            estimates = [e for e, flagged in zip(estimates, flags) if not flagged]
            rows = [r for r, flagged in zip(rows, flags) if not flagged]
            whole = None
            timing.mark()  # the wait for the flags is not estimation
        else:
            stats.defer_dense_rows(DenseReason.ESTIMATED_DENSITY, whole)
            if history is not None and not capturing:
                history.watch(dens, *learned)
    timing.lap("estimate")
    if exact_stats:
        stats.flush_deferred(wait=False)
    for i, (row, est) in enumerate(zip(rows, estimates)):
        patterns = dict(est.head_patterns)
        if row.row in covered:  # computes every key: counted as dense (max_density=1 lets it here)
            stats.record_dense_reason(DenseReason.EVERY_KEY, tokens=row.q_len)
            continue
        if not exact_stats:
            _record(stats, row, num_heads, None, patterns)
            continue
        _defer_measured(stats, row, num_heads, est, None if whole is None else whole[i], patterns)
    if rows:
        timing.mark()
        extra = {} if k_scale is None and v_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        if row_table is not None and len(rows) == len(all_rows):
            extra["row_table"] = row_table  # the step's table holds exactly these rows
        kernel(query, key_cache, value_cache, block_table, rows, [e.index for e in estimates], scale, output, softcap,
               whole_rows=whole, **extra)
        timing.lap("kernel")
    timing.done()
    if settings.stats_file:  # without waiting: the counts still on the device follow (stats.refresh)
        stats.dump(settings.stats_file, wait=False)
    return to_dense


def _capturing(query: torch.Tensor) -> bool:
    return query.is_cuda and torch.cuda.is_current_stream_capturing()


def _defer_measured(stats: SparseStats, row: SparseRow, num_heads: int, est, flag: torch.Tensor | None,
                    patterns: dict) -> None:
    """Record a row now and its measured pairs once the device has counted them (no host sync;
    the stats file shows them once they arrive). A row flagged dense (``flag``)
    computed all its causal pairs; heads whose label the device decided (:class:`.patterns.base.HeadSplit`)
    are recorded once read."""
    causal = causal_pairs(row.q_len, row.ctx_len, num_heads)
    computed = count_pairs_tensor(est.index, row.q_len, row.ctx_len) * est.heads_per_list
    if flag is not None:
        computed = torch.where(flag, causal, computed)
    totals = [patterns.pop(s.pattern) for s in est.splits]  # recorded once their split is known
    values = [computed] + [s.count for s in est.splits]
    _record(stats, row, num_heads, None, patterns)

    def measured(v: list[int]) -> None:
        labels = {}
        for split, total, n in zip(est.splits, totals, v[1:]):
            labels[split.label], labels[split.rest] = n, total - n
        stats.record_measured_pairs(causal, v[0], labels or None)

    stats.read_later(values, measured)
