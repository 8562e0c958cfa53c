"""One layer call's outcome (:class:`..prefill.run.LayerOutcome`) into the worker's stats, once,
after the call: the layer's code records nothing while it runs.

Nothing here waits for the GPU on the paged path: where counts are exact (a stats file, or a
forward the stage timer samples) the computed pairs, the density flags and the heads' device-side
labels are counted on the device and read back later (:meth:`.stats.SparseStats.read_later`);
rows the kernel ran in its dense mode are counted under ``dense_reasons`` when those flags are
read (:meth:`.stats.SparseStats.flush_deferred`). On the CPU path every row is measured at once.
"""

from __future__ import annotations

import torch
from vllm_sparse_kernels.index_format import causal_pairs

from ..prefill.index import count_pairs, count_pairs_tensor
from ..prefill.route import DenseReason
from .stats import SparseStats


def record_layer(stats: SparseStats, outcome, stats_file: str | None, sampled: bool) -> None:
    """Record ``outcome``; ``stats_file``: the setting (rewritten, at its rate, after the call);
    ``sampled``: whether the stage timer sampled this forward (its counts are then exact)."""
    for row, reason in outcome.dense:
        stats.record_dense_reason(reason, tokens=row.q_len)
    if outcome.flags is not None:
        stats.defer_dense_rows(DenseReason.ESTIMATED_DENSITY, outcome.flags)
    heads = outcome.num_heads
    if not outcome.paged:
        for row, est in outcome.sparse:
            computed = count_pairs(est.index, row.q_len, row.ctx_len)
            if computed >= causal_pairs(row.q_len, row.ctx_len, heads):  # nothing was skipped
                stats.record_dense_reason(DenseReason.EVERY_KEY, tokens=row.q_len)
            else:
                _record(stats, row, heads, computed, est.head_patterns)
        if stats_file:
            stats.dump(stats_file)
        return
    exact = stats.exporting and (bool(stats_file) or sampled)  # TP rank 0 counts
    if exact:
        stats.flush_deferred(wait=False)
    for i, (row, est) in enumerate(outcome.sparse):
        patterns = dict(est.head_patterns)
        if row.row in outcome.every_key:  # computed every key: counted as dense (max_density=1 lets it here)
            stats.record_dense_reason(DenseReason.EVERY_KEY, tokens=row.q_len)
        elif not exact:
            _record(stats, row, heads, None, patterns)
        else:
            _defer_measured(stats, row, heads, est, None if outcome.flags is None else outcome.flags[i], patterns)
    if stats_file:  # without waiting: the counts still on the device follow (stats.refresh)
        stats.dump(stats_file, wait=False)


def _record(stats: SparseStats, row, num_heads: int, computed: int | None, head_patterns) -> None:
    stats.record_sparse_row(row.q_len, causal_pairs(row.q_len, row.ctx_len, num_heads), computed, head_patterns)


def _defer_measured(stats: SparseStats, row, num_heads: int, est, flag: torch.Tensor | None, patterns: dict) -> None:
    """Record a row now and its measured pairs once the device has counted them (no host sync).
    A row flagged dense (``flag``) computed all its causal pairs; heads whose label the device
    decided (:class:`..prefill.patterns.base.HeadSplit`) are recorded once read."""
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


def run_recorded(stats: SparseStats, run, *args, stats_file: str | None = None, **kwargs) -> list:
    """Call a layer run of :mod:`..prefill.run` (``args``: its own, up to the stage timer, which
    comes from ``stats``) and record its outcome after it, as the impls do; returns the rows left
    to the dense kernel. For callers with no error boundary of their own (the claim, tests)."""
    timing = stats.time_stages(args[0].device)
    outcome = run(*args, timing, **kwargs)
    record_layer(stats, outcome, stats_file, timing.sampled)
    return outcome.dense_rows
