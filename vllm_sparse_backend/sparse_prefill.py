"""Run the sparse rows of one attention layer: estimate -> kernel -> write into vLLM's output.

Backend-agnostic glue between a planned step and the math. Two paths:

* :func:`run_sparse_rows`: the backends hand in the query and output tensors, the rows, and how
  to get a row's K/V (fresh tensors on CPU, a paged-cache gather on GPU); indices are estimated
  in PyTorch on those K/V and the PyTorch reference computes the rows.
* :func:`run_sparse_rows_paged`: the GPU path. Estimation reads K through the block table
  (:mod:`vllm_sparse_backend.paged_estimate`) and the Triton kernel reads K/V the same way;
  nothing is gathered, and nothing waits for the GPU except the one read of the rows' density
  flags per layer that sends too-dense rows to FlashAttention (``estimated_dense_rows="flash"``,
  or ``"auto"`` where the layer's previous call had such rows: :class:`DenseRowHistory`).
"""

from __future__ import annotations

from typing import Callable

import torch
from vllm_sparse_kernels.reference.attention import causal_pairs, sparse_attention

from .budgets import budgets_cover_every_key
from .config import SparseSettings
from .head_configs import ResolvedHead
from .index import count_pairs, count_pairs_tensor, index_density
from .paged_estimate import HeadGroups, estimate_index_paged
from .patterns import estimate_index
from .plan import SparseRow
from .stats import STATS

KVForRow = Callable[[SparseRow], tuple[torch.Tensor, torch.Tensor]]


def run_sparse_rows(query: torch.Tensor, output: torch.Tensor, rows: list[SparseRow], kv_for_row: KVForRow,
                    heads: list[ResolvedHead], settings: SparseSettings, scale: float, softcap: float = 0.0,
                    share: int | None = None) -> None:
    """query: [num_tokens, H, D]; output: [num_tokens, H, Dv], written in place for the rows' tokens.

    kv_for_row gives a row's K/V (all ctx_len + q_len positions); the torch estimators and the
    torch reference compute the row from them. ``share``: see :func:`..patterns.estimate_index`
    (the layer's :attr:`..plan.RankHeads.share`).
    """
    num_heads = query.shape[1]
    timing = STATS.time_stages(query.device)  # a no-op unless this forward is sampled
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
            STATS.record_dense_reason(EVERY_KEY_REASON, tokens=row.q_len)  # nothing was skipped
        else:
            _record(row, num_heads, computed, est.head_patterns)
    timing.done()
    if settings.stats_file:
        STATS.dump(settings.stats_file)


# Rows whose selection was every causal key: dense attention computed by the sparse path (e.g.
# the default vertical-slash budgets on prompts of a few thousand tokens). Counted as dense rows,
# so that the sparse counters and the density say what was skipped. On CPU every row is measured;
# on CUDA the rows whose budgets alone cover every key (:func:`budgets_cover_every_key`).
EVERY_KEY_REASON = "sparse selection covers every key"


def _record(row: SparseRow, num_heads: int, computed: int | None, head_patterns) -> None:
    STATS.record_sparse_row(row.q_len, causal_pairs(row.q_len, row.ctx_len, num_heads), computed, head_patterns)


# The Triton kernel's entry point (sparse_prefill_kernels.sparse_attention.sparse_prefill_attention).
PagedKernel = Callable[..., object]


class DenseRowHistory:
    """One layer's memory for ``estimated_dense_rows="auto"``: did the layer's previous sparse
    call have rows whose estimated index came out denser than ``max_density``?

    Reading the flags on the host costs one sync per layer (the GPU queue drains, and the next
    launches are exposed: 0.18 s of a 1.6 s prefill at 130K on Qwen2.5-Coder-1.5B); not reading
    them runs flagged rows in the kernel's dense mode, ~1.2x FlashAttention's time. Which pays
    depends on how many rows get flagged, and that changes slowly from one call of a layer to
    the next (the same prompt's next chunk, with a little more context). So: read on the host
    (and send flagged rows to FlashAttention) while the previous call had flagged rows or
    nothing is known yet; otherwise let the kernel decide, and copy whether anything was
    flagged back to the host without waiting, to be looked at on the next call. A wrong guess
    costs time only: both ways compute the same attention."""

    def __init__(self) -> None:
        self._flagged: bool | None = None  # the last known call's answer; None: read
        self._pending: tuple[torch.Tensor, object] | None = None  # (host copy, its CUDA event)
        self._pinned: torch.Tensor | None = None  # allocated once: a pinned allocation can sync

    def read_on_host(self) -> bool:
        """Whether this call should read its flags on the host. Never waits: a copy the GPU has
        not finished yet leaves the older answer in force."""
        if self._pending is not None:
            host, done = self._pending
            if done is None or done.query():
                self._flagged, self._pending = bool(host.item()), None
        return self._flagged is not False

    def observed(self, flags: list[bool]) -> None:
        """The flags this call read on the host."""
        self._flagged, self._pending = any(flags), None

    def watch(self, whole: torch.Tensor) -> None:
        """Flags left on the device (the kernel ran flagged rows in its dense mode): copy whether
        any row was flagged to pinned host memory, without waiting."""
        flagged = whole.any().view(1)
        if not whole.is_cuda:
            self._pending = (flagged.clone(), None)
            return
        if self._pinned is None:
            self._pinned = torch.empty(1, dtype=torch.bool, pin_memory=True)
        host = self._pinned  # a later copy into it is queued behind this one on the stream
        host.copy_(flagged, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (host, done)


def run_sparse_rows_paged(query: torch.Tensor, output: torch.Tensor, rows: list[SparseRow],
                          key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                          groups: HeadGroups, settings: SparseSettings, scale: float, softcap: float,
                          kernel: PagedKernel, dense_row: Callable[[SparseRow], None] | None = None,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                          history: DenseRowHistory | None = None) -> None:
    """Estimate every row on the paged cache, then one kernel launch for all rows.

    key_cache / value_cache: [pages, page, Hkv, D] views, of the query's dtype or fp8 with the
    layer's ``k_scale`` / ``v_scale`` (one-element fp32 device tensors: dequantised value =
    stored * scale; both the estimation and the kernel apply them on the device); block_table:
    int32 [num_reqs, max_pages] (rows index it by ``row.row``). ``dense_row`` (the dense kernel for one row) enables the
    density fallback (``settings.max_density`` < 1):

    * rows whose budgets alone exceed ``max_density`` (:meth:`HeadGroups.budget_density`, host
      arithmetic) go to ``dense_row`` without being estimated;
    * rows whose estimated index covers more than ``max_density`` of their causal pairs are
      flagged on the GPU. With ``estimated_dense_rows="flash"`` the flags are read
      on the host (one sync per layer) and those rows go to ``dense_row``, counted as dense rows
      like the budget fallback's. ``"auto"`` (the default) does that where ``history`` (the layer's
      :class:`DenseRowHistory`; without one, every call) says the previous call had flagged rows,
      else what ``"kernel"`` does. With ``"kernel"`` (and always under CUDA-graph capture) the
      kernel runs them in its dense mode (every causal key): no host read decides it, so the
      layer never waits for the GPU; they stay counted as sparse rows (they ran on the sparse
      path) and are also counted under ``dense_reasons`` when the flags are next read
      (:meth:`SparseStats.flush_deferred`: forwards with exact stats, or a dump).
    * rows whose budgets alone cover every key (:func:`budgets_cover_every_key`; only reach here
      with ``max_density`` 1) run the sparse path but are counted as dense rows
      (:data:`EVERY_KEY_REASON`).

    Apart from that flag read, nothing here waits for the GPU,
    also with ``settings.stats_file`` set: every row's counts are
    then read back later like a sampled forward's and the file catches up as they arrive
    (:meth:`SparseStats.refresh`). On the forwards the stage timer samples
    (``timing_sample_every``) the computed pairs, the flags and FlexPrefill's per-head decisions are counted on the device and read back
    later (:meth:`SparseStats.read_later`).
    """
    num_heads = query.shape[1]
    timing = STATS.time_stages(query.device)  # CUDA events on 1 of N forwards, read later: no sync
    exact_stats = STATS.exporting and (bool(settings.stats_file) or timing.sampled)  # TP rank 0 counts
    fallback = dense_row is not None and settings.max_density < 1.0
    if fallback:
        # Rows the budgets cannot make sparse enough skip estimation (short rows, mostly).
        sparse_enough = []
        for row in rows:
            if groups.budget_density(row.q_len, row.ctx_len, settings) > settings.max_density:
                dense_row(row)
                STATS.record_dense_reason("budgets denser than max_density", tokens=row.q_len)
            else:
                sparse_enough.append(row)
        rows = sparse_enough
    covered = {r.row for r in rows if budgets_cover_every_key(groups.head_counts, r.q_len, r.ctx_len, settings)}
    estimates = []
    timing.mark()  # the budget fallback's dense rows above are not ours to time
    for row in rows:
        q = query[row.tok_start:row.tok_start + row.q_len]
        estimates.append(estimate_index_paged(q, key_cache, block_table[row.row], row.ctx_len, groups, settings, scale,
                                              k_scale))
    whole = None
    if fallback and rows:
        dens = [index_density(e.index, r.q_len, r.ctx_len) for e, r in zip(estimates, rows)]
        dens = dens[0].view(1) if len(dens) == 1 else torch.stack(dens)
        whole = dens > settings.max_density
        mode, capturing = settings.estimated_dense_rows, _capturing(query)
        if not capturing and (mode == "flash" or (mode == "auto" and (history is None or history.read_on_host()))):
            timing.lap("estimate")
            flags = whole.tolist()  # the one host read of the layer
            if history is not None:
                history.observed(flags)
            for row, flagged in zip(rows, flags):
                if flagged:
                    dense_row(row)
                    STATS.record_dense_reason(DENSE_MODE_REASON, tokens=row.q_len)
            estimates = [e for e, flagged in zip(estimates, flags) if not flagged]
            rows = [r for r, flagged in zip(rows, flags) if not flagged]
            whole = None
            timing.mark()  # the dense rows are not ours to time
        else:
            STATS.defer_dense_rows(DENSE_MODE_REASON, whole)
            if history is not None and mode == "auto" and not capturing:
                history.watch(whole)
    timing.lap("estimate")
    if exact_stats:
        STATS.flush_deferred(wait=False)
    for i, (row, est) in enumerate(zip(rows, estimates)):
        patterns = dict(est.head_patterns)
        if row.row in covered:  # computes every key: counted as dense (max_density=1 lets it here)
            STATS.record_dense_reason(EVERY_KEY_REASON, tokens=row.q_len)
            continue
        if not exact_stats:
            _record(row, num_heads, None, patterns)
            continue
        _defer_measured(row, num_heads, est, None if whole is None else whole[i], patterns)
    if rows:
        timing.mark()
        scales = {} if k_scale is None and v_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
        kernel(query, key_cache, value_cache, block_table, rows, [e.index for e in estimates], scale, output, softcap,
               whole_rows=whole, **scales)
        timing.lap("kernel")
    timing.done()
    if settings.stats_file:  # without waiting: the counts still on the device follow (STATS.refresh)
        STATS.dump(settings.stats_file, wait=False)


def _capturing(query: torch.Tensor) -> bool:
    return query.is_cuda and torch.cuda.is_current_stream_capturing()


def _defer_measured(row: SparseRow, num_heads: int, est, flag: torch.Tensor | None, patterns: dict) -> None:
    """Record a row now and its measured pairs once the device has counted them (no host sync;
    the stats file shows them once they arrive). A row flagged dense (``flag``)
    computed all its causal pairs; FlexPrefill heads are split by their per-head choice."""
    causal = causal_pairs(row.q_len, row.ctx_len, num_heads)
    computed = count_pairs_tensor(est.index, row.q_len, row.ctx_len) * est.heads_per_list
    if flag is not None:
        computed = torch.where(flag, causal, computed)
    values, n_flex = [computed], None
    if est.query_aware_heads is not None:
        n_flex = patterns.pop("flex_prefill")
        values.append(est.query_aware_heads)
    _record(row, num_heads, None, patterns)

    def measured(v: list[int]) -> None:
        split = None if n_flex is None else {"flex_prefill/query_aware": v[1],
                                             "flex_prefill/vertical_slash": n_flex - v[1]}
        STATS.record_measured_pairs(causal, v[0], split)

    STATS.read_later(values, measured)


# Rows the kernel ran in its dense mode because their estimated index was too dense (flagged on
# the GPU, counted when the flags are read).
DENSE_MODE_REASON = "estimated density above max_density"


# Most sparse rows one claimed step holds (a step holds at most chunk // min_sparse_query_len).
MAX_CLAIMED_ROWS = 8


def worst_case_steps(q_len: int, kv_len: int, min_query_len: int,
                     max_rows: int = MAX_CLAIMED_ROWS) -> list[list[SparseRow]]:
    """The steps the profiling-run claim runs. A step's sparse rows share its chunk of ``q_len``
    queries, each at least ``min_query_len`` long, and every row's index lists live until the
    layer's one kernel launch, so several rows can need more scratch than one row of the whole
    chunk (``benchmarks/scratch_memory.py``: 1.8x with budgets that cover the context). Each row
    sits at the longest context (``kv_len`` tokens, its queries included), in its own block-table
    row. The chunk as one row; then for k = 2 .. min(max_rows, q_len // min_query_len) rows, the
    corners and the middle of the ways to split it: k nearly equal rows, and one long row with
    k - 1 rows of ``min_query_len``, the long one estimated first (its lists live while the
    others are estimated) or last (its estimation's temporaries meet the others' lists)."""
    q_len = min(q_len, kv_len)
    most = max(1, min(max_rows, q_len // max(min_query_len, 1)))
    splits = [[q_len]]
    for k in range(2, most + 1):
        small, long = min_query_len, q_len - (k - 1) * min_query_len
        for lengths in ([q_len * (i + 1) // k - q_len * i // k for i in range(k)],
                        [long] + [small] * (k - 1), [small] * (k - 1) + [long]):
            if lengths not in splits:
                splits.append(lengths)
    steps = []
    for lengths in splits:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        steps.append([SparseRow(row=i, tok_start=a, q_len=n, ctx_len=kv_len - n)
                      for i, (a, n) in enumerate(zip(starts, lengths))])
    return steps


def compile_row(q_len: int, kv_len: int, min_query_len: int) -> SparseRow:
    """One short row the profiling run adds after the claim's steps. The last-q pass picks how it
    sums diagonals by the row's context (``vs_index.last_q_scores``: skewed slabs while they fit,
    a gather above about 768K tokens), so with a long max_model_len the claim's rows compile only
    the long-context variant, and the first request of ordinary length compiled the other one
    (vLLM 0.26's JIT monitor flagged ``_lastq_skew_pass`` and ``_skew_colsum``: on an H200 serving
    1M tokens the first 32K request took 3.1 s, FLASH_ATTN's 1.2 s). Its scratch is far below the
    claim's."""
    q = max(1, min(q_len, kv_len // 2, max(min_query_len, 64)))
    return SparseRow(row=0, tok_start=0, q_len=q, ctx_len=min(q, kv_len - q))


def run_worst_case_steps(query: torch.Tensor, output: torch.Tensor, num_kv_heads: int, kv_len: int,
                         groups: HeadGroups, settings: SparseSettings, scale: float, softcap: float,
                         kernel: PagedKernel, page_size: int = 16,
                         kv_dtype: torch.dtype | None = None) -> list[list[SparseRow]]:
    """Run the GPU path on the largest steps a chunk can hold (:func:`worst_case_steps`), the way
    :func:`run_sparse_rows_paged` runs a step (every row estimated, then one kernel launch), so
    that its transient scratch (score buffers, index lists, the kernel's packed metadata) is seen
    by whoever measures peak memory: vLLM sizes the KV cache from the peak of its profiling run.

    Every scratch size of the path is a host-side function of the rows' lengths and the budgets
    (nothing waits for the GPU), so the K/V values do not matter: all logical pages map to one
    page of a tiny stand-in cache. The steps split all of ``query``'s tokens (at most ``kv_len``);
    ``output`` is overwritten for them; nothing is recorded in the stats. ``kv_dtype``: the
    stand-in cache's dtype (the layer's, e.g. fp8: the kernels' scaled variants are then compiled
    here too, with scales of 1); default the query's. Returns the claim's steps; after them it runs
    :func:`compile_row`, so that the variants of short contexts compile here too.
    """
    steps = worst_case_steps(query.shape[0], kv_len, settings.min_sparse_query_len)
    runs = steps + [[compile_row(query.shape[0], kv_len, settings.min_sparse_query_len)]]
    head_dim = query.shape[-1]
    kv_dtype = kv_dtype or query.dtype
    key_cache = torch.zeros(1, page_size, num_kv_heads, head_dim, dtype=kv_dtype, device=query.device)
    value_cache = torch.zeros(1, page_size, num_kv_heads, output.shape[-1], dtype=kv_dtype, device=query.device)
    block_table = torch.zeros(max(len(rows) for rows in steps), -(-kv_len // page_size), dtype=torch.int32,
                              device=query.device)
    one, scales = None, {}
    if kv_dtype != query.dtype:  # a quantized layer's variants: scales read on the device
        one = torch.ones(1, dtype=torch.float32, device=query.device)
        scales = {"k_scale": one, "v_scale": one}
    flagged_dense = settings.max_density < 1.0 and settings.estimated_dense_rows != "flash"
    for rows in runs:
        indices = [estimate_index_paged(query[r.tok_start:r.tok_start + r.q_len], key_cache, block_table[r.row],
                                        r.ctx_len, groups, settings, scale, one).index for r in rows]
        # the density fallback's temporaries, and a stats / sampled forward's
        dens = torch.stack([index_density(ix, r.q_len, r.ctx_len) for ix, r in zip(indices, rows)])
        for ix, r in zip(indices, rows):
            count_pairs_tensor(ix, r.q_len, r.ctx_len)
        kernel(query, key_cache, value_cache, block_table, rows, indices, scale, output, softcap, **scales)
        if flagged_dense:
            # rows flagged on the device run in the kernel's dense mode, another variant of it:
            # compiled here too, not in the first request that has such a row
            kernel(query, key_cache, value_cache, block_table, rows, indices, scale, output, softcap,
                   whole_rows=dens > settings.max_density, **scales)
        del indices, dens
    return steps
