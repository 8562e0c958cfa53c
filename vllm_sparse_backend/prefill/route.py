"""Where a prefill row goes to the wrapped dense kernel instead of the sparse path: the one module
that decides it, in three stages, each cheaper to ask than the next is to run.

* per layer group, once at start-up (:func:`group_dense_reason`): the CUDA builder for its group,
  and the profiling-run claim for one layer, so that the claim reserves memory only for layers
  that can run sparse;
* per step, in the builder (:func:`step_may_be_sparse`, :func:`plan_step`): the rows' lengths,
  the budgets of the group's layers, and the step cost gate (rows on which even an empty
  selection would lose);
* per layer, before estimation (:func:`route_layer`): the layer's budgets, the cost model with
  the layer's density history; after estimation, the estimated density (:func:`flags_on_host`
  says whether it is read on the host, or left to the kernel's dense mode).

Each reason is a :class:`DenseReason`; the error boundary of the backends and the CPU twin use it
too. Its values are the strings the stats file and the metrics' ``reason`` label show.

Pure Python over host-side lengths: nothing here reads a device value or needs vLLM.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from ..settings import SparseSettings
from .budgets import budget_density, budgets_cover_every_key
from .cost import ROW_COST, LayerDensityHistory, RowCost
from .plan import SparseRow, StepPlan


class DenseReason(StrEnum):
    """Why rows ran dense. The start-up ones are logged once (every row of the group is the wrapped
    kernel's, nothing is counted); the others are counted per row under ``dense_reasons`` and
    ``dense_fallbacks_total{reason}`` (the label: :func:`..observability.metrics.label_value` of the value)."""

    # per layer group, at start-up
    DISABLED = "disabled by VLLM_SPARSE_ENABLED"
    LAYER_UNSUPPORTED = "a layer the sparse path does not support"
    DECODE_CONTEXT_PARALLEL = "decode context parallelism is not supported"
    CLAIM_FAILED = "the sparse path could not run in the memory-profiling run"
    TRITON_UNUSABLE = "the Triton sparse path cannot run here"
    # per step
    CACHED_CONTEXT_ON_CPU = "cached_context_on_cpu"  # the CPU twin cannot read vLLM's packed CPU cache
    BUDGETS = "budgets denser than max_density"
    # even an empty selection would cost more than dense (estimation and the fixed per-row cost)
    CANNOT_PAY = "cost model: sparse cannot pay at this length"
    LONGER_THAN_MAX = "sequence longer than max_sparse_seq_len"
    PROMPT_END = "chunk ending its prompt, within exact_prompt_end"  # the whole chunk is its exact tail
    # per layer
    COST_MODEL = "cost model: dense predicted faster"  # before estimation (:mod:`.cost`)
    # flagged on the GPU after estimation: read on the host, or run in the kernel's dense mode
    ESTIMATED_DENSITY = "estimated density above max_density"
    # the selection was every causal key: run by the sparse path but counted dense, so that the
    # sparse counters and the density say what was skipped (measured on CPU; on CUDA the rows
    # whose budgets alone cover every key)
    EVERY_KEY = "sparse selection covers every key"
    FUSED_OUTPUT_QUANT = "fused output quantization"  # logged only: the layer quantizes FlashAttention's output
    SPARSE_PATH_ERROR = "sparse path error"  # the error boundary: the sparse path raised


def group_dense_reason(settings: SparseSettings, *, unsupported: str | None, dcp_size: int = 1,
                       claim_failed: str | None = None,
                       triton_why: str | None = None) -> tuple[DenseReason, str] | None:
    """Why every row of a layer group runs dense for the life of the process, with the detail
    to log, or None. Asked by the CUDA builder for its group and by the profiling-run claim for
    its layer. ``unsupported``: a layer's :func:`..backends.common.unsupported_reason` (the first
    such layer's, for a group); ``triton_why``: why the Triton path cannot run the layers
    (only where ``kernel`` is not torch); ``claim_failed``: how the profiling-run claim failed."""
    if not settings.gating.enabled:
        return DenseReason.DISABLED, ""
    if unsupported is not None:
        return DenseReason.LAYER_UNSUPPORTED, unsupported
    if dcp_size > 1:
        return DenseReason.DECODE_CONTEXT_PARALLEL, f"decode_context_parallel_size {dcp_size}"
    if claim_failed is not None:
        return DenseReason.CLAIM_FAILED, claim_failed
    if triton_why is not None and settings.kernel != "torch":
        return DenseReason.TRITON_UNUSABLE, triton_why
    return None


def step_may_be_sparse(settings: SparseSettings, max_query_len: int, causal: bool, multimodal: bool) -> bool:
    """Whether any row of a step could run sparse: the builder's first question, asked before
    the step's lengths are read row by row."""
    return max_query_len >= settings.gating.min_sparse_query_len and causal and not multimodal


def plan_step(query_start_loc: list[int], seq_lens: list[int], settings: SparseSettings,
              allow_context: bool = True, head_sets: list[Counter] | None = None,
              row_heads: tuple[int, int] | None = None, row_cost: RowCost = ROW_COST, *,
              step_token_budget: int | None = None) -> StepPlan:
    """Route each row. ``query_start_loc`` has num_reqs + 1 entries; ``seq_lens`` = context + chunk.

    A row goes sparse when its chunk has at least ``min_sparse_query_len`` queries and its
    sequence at least ``min_sparse_seq_len`` tokens and at most ``max_sparse_seq_len``. ``allow_context=False`` (the CPU twin, which
    cannot read vLLM's ISA-packed CPU cache) keeps rows that have cached context dense.
    ``head_sets`` (optional: the distinct head-pattern multisets of the layers the step serves)
    keeps long rows dense whose budgets no layer could make sparser than ``max_density``
    (:func:`.budgets.budget_density`; with ``max_density`` 1 none is). ``row_heads`` (optional:
    the layers' most query heads on this rank and their head size), with ``cost_model`` and
    ``max_density`` < 1: rows the cost model says sparse could not beat FlashAttention on even
    with an empty selection (:meth:`.cost.RowCost.sparse_pays` at density 0: what estimation and
    the fixed per-row cost alone take, in every layer) stay in the dense runs, so that the layers
    neither estimate nor probe them and FlashAttention runs them with the step's other dense rows
    (short prompts, mostly). Rows with no queries (cudagraph padding) belong to no run.

    Each sparse row gets its exact tail (:attr:`.plan.SparseRow.exact_rows`): ``exact_last_rows``,
    and for a chunk that ends its prompt at least ``exact_prompt_end`` (such a chunk of at most that
    many queries runs dense, :attr:`DenseReason.PROMPT_END`). ``step_token_budget`` (vLLM's
    scheduler budget, :func:`.._compat.step_token_budget`; None: unknown) tells which chunks end
    their prompt (:func:`cut_row`).
    """
    n = len(seq_lens)
    sparse, dense_runs, reasons = [], [], Counter()
    cut = cut_row(query_start_loc, seq_lens, step_token_budget) if settings.gating.exact_prompt_end else None
    run_start = None
    for i in range(n + 1):
        dense = False
        if i < n:
            q_len = query_start_loc[i + 1] - query_start_loc[i]
            prompt_end = settings.gating.exact_prompt_end if cut is not None and i != cut else 0
            reason = _row_dense_reason(q_len, seq_lens[i], settings, allow_context, head_sets, row_heads, row_cost)
            if reason is None and q_len <= prompt_end:
                reason = DenseReason.PROMPT_END
            if reason is None:
                exact = min(q_len, max(settings.gating.exact_last_rows, prompt_end))
                sparse.append(SparseRow(i, query_start_loc[i], q_len, seq_lens[i] - q_len, exact))
            else:
                dense = q_len > 0
                if reason is not _SHORT:
                    reasons[reason] += 1
        if dense and run_start is None:
            run_start = i
        elif not dense and run_start is not None:
            dense_runs.append((run_start, i))
            run_start = None
    return StepPlan(sparse, dense_runs, reasons)


def cut_row(query_start_loc: list[int], seq_lens: list[int], step_token_budget: int | None) -> int | None:
    """The row whose chunk vLLM's scheduler may have cut short, -1 if none was, None if unknown
    (no budget): every other row's chunk ends its prompt.

    The scheduler gives each request it schedules all its remaining tokens, or what is left of
    the step's budget; it stops once the budget is spent. So only the request it scheduled last
    can have been cut, and only in a step that spends the whole budget; in a step under budget
    no row was. In a full step that last request is the newest one: running requests go before
    waiting ones, in the order they arrived. A prompt's last chunk therefore shares its step with
    the next prompt's first chunk whenever one is waiting, and the newest row is taken to be the
    one with the least cached context (ties: the later row; a row of one query is a decode).
    Where that guess is wrong (a newer request with a long prefix-cache hit) a cut chunk gets a
    prompt end's exact rows (slower, not less accurate) and the prompt's own end is taken as cut.
    Other caps (``long_prefill_token_threshold``, speculative decoding's draft slots,
    ``max_model_len``) can leave a step under budget with a chunk cut: also slower, not less
    accurate. A step whose one prefill chunk fills the budget exactly is taken as cut."""
    if step_token_budget is None:
        return None
    if query_start_loc[-1] < step_token_budget:
        return -1
    prefill = [i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] > 1]
    if not prefill:
        return -1
    return min(reversed(prefill), key=lambda i: seq_lens[i] - (query_start_loc[i + 1] - query_start_loc[i]))


_SHORT = object()  # a row below the length thresholds: dense, and not counted (the common case)


def _row_dense_reason(q_len: int, seq_len: int, settings: SparseSettings, allow_context: bool, head_sets,
                      row_heads, row_cost: RowCost):
    if not (settings.gating.enabled and q_len >= settings.gating.min_sparse_query_len and seq_len >= settings.gating.min_sparse_seq_len):
        return _SHORT
    if settings.gating.max_sparse_seq_len is not None and seq_len > settings.gating.max_sparse_seq_len:
        return DenseReason.LONGER_THAN_MAX
    ctx = seq_len - q_len
    if ctx > 0 and not allow_context:
        return DenseReason.CACHED_CONTEXT_ON_CPU
    if head_sets and settings.gating.max_density < 1.0 and all(
            budget_density(h, q_len, ctx, settings) > settings.gating.max_density for h in head_sets):
        return DenseReason.BUDGETS
    if row_heads is not None and settings.gating.cost_model and settings.gating.max_density < 1.0 \
            and not row_cost.sparse_pays(q_len, ctx, row_heads[0], row_heads[1], 0.0,
                                             settings.patterns.vertical_slash.last_q):
        return DenseReason.CANNOT_PAY
    return None


@dataclass
class LayerRoute:
    """One layer's rows before estimation (:func:`route_layer`)."""

    estimate: list[SparseRow]  # rows the layer estimates
    dense: list[tuple[SparseRow, DenseReason]] = field(default_factory=list)  # rows left to the dense kernel
    budgets: dict[int, float] = field(default_factory=dict)  # row -> budget density, for the history
    every_key: set[int] = field(default_factory=set)  # rows run sparse but counted dense (EVERY_KEY)


def route_layer(rows: list[SparseRow], head_counts: Counter, settings: SparseSettings, num_heads: int,
                head_size: int, *, density_fallback: bool, history: LayerDensityHistory | None,
                capturing: bool, row_cost: RowCost = ROW_COST) -> LayerRoute:
    """Route a layer's sparse rows before estimation (``head_counts``: the layer's distinct heads
    and how many of each, :attr:`.estimate.HeadGroups.head_counts`). With ``density_fallback``
    (the caller has a dense kernel for single rows) and ``max_density`` < 1:

    * rows whose budgets alone exceed ``max_density`` go dense without being estimated;
    * with ``cost_model`` and a ``history`` (not while a CUDA graph is captured: the history's
      event query is illegal then), so do rows the cost model predicts dense to be faster on
      (:meth:`.cost.RowCost.sparse_pays`, at the density ``history`` predicts), except one in
      :attr:`~.cost.LayerDensityHistory.PROBE_EVERY`, estimated to keep the prediction measured.

    Rows whose budgets alone cover every key (they only get here with ``max_density`` 1) run
    the sparse path but are counted dense (:attr:`DenseReason.EVERY_KEY`)."""
    route = LayerRoute(rows)
    if density_fallback and settings.gating.max_density < 1.0:
        route.estimate = []
        for row in rows:
            budget = budget_density(head_counts, row.q_len, row.ctx_len, settings)
            if budget > settings.gating.max_density:  # short rows, mostly: no estimate can be sparse enough
                route.dense.append((row, DenseReason.BUDGETS))
                continue
            if settings.gating.cost_model and history is not None and not capturing:
                predicted = history.predicted_density(budget)
                if (predicted > settings.gating.max_density or not row_cost.sparse_pays(
                        row.q_len, row.ctx_len, num_heads, head_size, predicted,
                        settings.patterns.vertical_slash.last_q)) \
                        and not history.probe_due():
                    route.dense.append((row, DenseReason.COST_MODEL))
                    continue
            route.budgets[row.row] = budget
            route.estimate.append(row)
    route.every_key = {r.row for r in route.estimate
                       if budgets_cover_every_key(head_counts, r.q_len, r.ctx_len, settings)}
    return route


def flags_on_host(settings: SparseSettings, history: LayerDensityHistory | None, capturing: bool) -> bool:
    """Whether a layer reads its rows' estimated-density flags on the host (one sync) and sends
    the flagged rows dense, rather than letting the kernel run them in its dense mode:
    ``estimated_dense_rows`` "flash", or "auto" where the layer's previous call had flagged rows
    (or there is no ``history``); never while a CUDA graph is captured."""
    mode = settings.gating.estimated_dense_rows
    return not capturing and (mode == "flash" or (mode == "auto" and (history is None or history.read_on_host())))
