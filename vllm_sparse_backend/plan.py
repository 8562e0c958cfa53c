"""Step planning: which rows of a vLLM step run sparse, which run dense (in contiguous runs).

Pure Python over CPU-side lengths, so the builders can call it without a device sync and tests
can call it without vLLM.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .config import ConfigError, PatternName, SparseSettings
from .head_configs import HeadConfigFile, ResolvedHead, layer_heads


@dataclass(frozen=True)
class SparseRow:
    """One request's chunk: queries at absolute positions ctx_len .. ctx_len + q_len - 1."""

    row: int  # index of the request in the batch
    tok_start: int  # first token of the chunk in the step's flattened query/output tensors
    q_len: int
    ctx_len: int


@dataclass
class StepPlan:
    sparse_rows: list[SparseRow]
    dense_runs: list[tuple[int, int]]  # maximal runs [first_row, end_row) of rows for the dense kernel
    dense_reasons: Counter = field(default_factory=Counter)  # why long rows stayed dense

    @property
    def has_sparse(self) -> bool:
        return bool(self.sparse_rows)


def kv_group_share(heads: list[ResolvedHead], num_kv_heads: int, settings: SparseSettings) -> int:
    """Query heads per shared key selection in a layer: the GQA group size when
    ``settings.kv_group_shared`` is on and the layer allows it (every KV group's heads have the
    same pattern and budgets, and none is FlexPrefill, whose per-head query-aware decision has
    no group form), else 1. Heads are in vLLM's order: group g holds heads g*G .. g*G + G - 1."""
    h = len(heads)
    if not settings.kv_group_shared or num_kv_heads <= 0 or h % num_kv_heads or h == num_kv_heads:
        return 1
    g = h // num_kv_heads
    for start in range(0, h, g):
        first = heads[start]
        if first.pattern is PatternName.FLEX_PREFILL or any(x != first for x in heads[start:start + g]):
            return 1
    return g


def tp_local_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one tensor-parallel rank, by vLLM's column-parallel QKV layout
    (``QKVParallelLinear``): rank r holds query heads r*H/tp .. (r+1)*H/tp - 1 and, when
    Hkv >= tp, KV heads r*Hkv/tp .. (r+1)*Hkv/tp - 1; when Hkv < tp each rank holds one KV head,
    number r // (tp / Hkv) (each replicated on tp / Hkv ranks). Either way a rank's query heads
    and its KV heads keep the model's GQA mapping."""
    if tp_size < 1 or num_heads % tp_size or num_heads % num_kv_heads \
            or (num_kv_heads % tp_size and tp_size % num_kv_heads):
        raise ConfigError(f"tensor parallel size {tp_size} does not fit {num_heads} query / {num_kv_heads} KV heads "
                          "(vLLM needs it to divide the query heads, and to divide or be a multiple of the KV heads)")
    return num_heads // tp_size, max(1, num_kv_heads // tp_size)


@dataclass(frozen=True)
class RankHeads:
    """One attention layer's query heads on one tensor-parallel rank (all of them at TP=1): their
    patterns, in vLLM's head order, and ``share``, the query heads per shared key selection on
    this rank (:func:`kv_group_share`, decided for the whole layer: see :func:`rank_heads`)."""

    heads: list[ResolvedHead]
    share: int = 1


def rank_heads(cfg: HeadConfigFile | None, settings: SparseSettings, layer_index: int, num_heads: int,
               num_kv_heads: int, tp_size: int = 1, tp_rank: int = 0) -> RankHeads:
    """The part of one layer that rank ``tp_rank`` of ``tp_size`` computes. ``num_heads`` /
    ``num_kv_heads``: the model's (all ranks'); the head-config file ``cfg`` names global heads
    and the rank takes its slice (:func:`tp_local_heads`).

    Whether KV groups share one selection is decided on the whole layer, as at TP=1: a layer with
    one mixed group somewhere keeps one selection per query head on every rank, so that a rank
    whose own groups happen to be uniform does not select differently from the single-GPU run.
    Where a rank holds part of a KV group (Hkv < tp), its shared selection is made from the scores
    of the heads it holds: every rank computes its heads on its own, so that part of the group is
    the unit (its selection can differ from TP=1's, which sums the whole group's scores)."""
    local_heads, local_kv = tp_local_heads(num_heads, num_kv_heads, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tensor parallel rank {tp_rank} is not in 0..{tp_size - 1}")
    heads = layer_heads(cfg, settings, layer_index, local_heads, tp_rank)
    whole_layer = layer_heads(cfg, settings, layer_index, num_heads) if tp_size > 1 else heads
    share = kv_group_share(heads, local_kv, settings) if kv_group_share(whole_layer, num_kv_heads, settings) > 1 else 1
    return RankHeads(heads, share)


def vs_budget(size: int, share: float | None, kv_len: int) -> int:
    """A vertical-slash budget for a row of ``kv_len`` keys: ``size``, or ``share`` of the keys
    where that is more (``vertical_share`` / ``slash_share``), never more than the keys."""
    budget = size if share is None else max(size, math.ceil(share * kv_len))
    return min(budget, kv_len)


def vs_budgets(vertical_size: int, slash_size: int, kv_len: int, settings: SparseSettings) -> tuple[int, int]:
    """(vertical, slash) budgets of one head for a row of ``kv_len`` keys (see :func:`vs_budget`)."""
    return (vs_budget(vertical_size, settings.vertical_share, kv_len),
            vs_budget(slash_size, settings.slash_share, kv_len))


def budget_density(heads: Counter[ResolvedHead] | Iterable[ResolvedHead], q_len: int, ctx_len: int,
                   settings: SparseSettings) -> float:
    """The share of a row's causal (query, key) pairs the heads' budgets alone would select,
    were their keys as few as the budgets say (host arithmetic, nothing estimated).

    The real index is never much sparser (block rounding only adds keys), so a row whose
    budget density is above ``max_density`` would fall back to dense after estimation anyway;
    it is sent dense without estimating. Keys per query, per head: vertical + slash sizes
    (vertical-slash), top-k blocks (block-sparse), sink + window (A-shape), the minimum budget
    (FlexPrefill), all (dense), with the row's budgets (:func:`vs_budgets`); over the mean
    number of keys a query of the row can see, ``ctx_len + (q_len + 1) / 2``. ``heads``: the layer's heads, or a Counter of distinct heads.
    """
    counts = heads if isinstance(heads, Counter) else Counter(heads)
    visible = ctx_len + (q_len + 1) / 2
    total = 0.0
    for h, n in counts.items():
        keys = {PatternName.DENSE: visible,
                PatternName.A_SHAPE: h.sink_tokens + h.local_window,
                PatternName.VERTICAL_SLASH: sum(vs_budgets(h.vertical_size, h.slash_size, ctx_len + q_len, settings)),
                PatternName.BLOCK_SPARSE: h.topk_blocks * settings.block_size,
                PatternName.FLEX_PREFILL: settings.min_budget}[h.pattern]
        total += n * min(1.0, keys / visible)
    return total / sum(counts.values())


def budgets_cover_every_key(heads: Counter[ResolvedHead] | Iterable[ResolvedHead], q_len: int, ctx_len: int,
                            settings: SparseSettings) -> bool:
    """True when every head's budgets alone select every key of the row, whatever the scores:
    the sparse path then computes dense attention (and is counted as dense). Per head: dense;
    vertical or slash budget (:func:`vs_budgets`) at least the row's keys (every column, or
    every diagonal); sink + window at least the keys (A-shape); top-k blocks at least the
    row's key blocks (block-sparse); FlexPrefill's minimum budget at least the keys (both its
    vertical-slash lines and its query-aware blocks then keep everything). Sufficient, not
    necessary: an estimate can still select every key of a row whose budgets are smaller
    (scattered diagonals cost whole key blocks), which only measuring the index tells."""
    kv_len = ctx_len + q_len
    key_blocks = -(-kv_len // settings.block_size)
    for h in (heads if isinstance(heads, Counter) else Counter(heads)):
        if h.pattern is PatternName.VERTICAL_SLASH:
            covered = max(vs_budgets(h.vertical_size, h.slash_size, kv_len, settings)) >= kv_len
        else:
            covered = {PatternName.DENSE: True,
                       PatternName.A_SHAPE: h.sink_tokens + h.local_window >= kv_len,
                       PatternName.BLOCK_SPARSE: h.topk_blocks >= key_blocks,
                       PatternName.FLEX_PREFILL: settings.min_budget >= kv_len}[h.pattern]
        if not covered:
            return False
    return True


def plan_step(query_start_loc: list[int], seq_lens: list[int], settings: SparseSettings,
              allow_context: bool = True, worth_estimating: Callable[[int, int], bool] | None = None) -> StepPlan:
    """Route each row. ``query_start_loc`` has num_reqs + 1 entries; ``seq_lens`` = context + chunk.

    A row goes sparse when its chunk has at least ``min_sparse_query_len`` queries and its
    sequence at least ``min_sparse_seq_len`` tokens. ``allow_context=False`` (the CPU twin, which
    cannot read vLLM's ISA-packed CPU cache) keeps rows that have cached context dense.
    ``worth_estimating(q_len, ctx_len)`` (optional) keeps long rows dense that no layer could
    run sparse enough (see :func:`budget_density`). Rows with no queries (cudagraph padding)
    belong to no run.
    """
    n = len(seq_lens)
    sparse, dense_runs, reasons = [], [], Counter()
    run_start = None
    for i in range(n + 1):
        dense = False
        if i < n:
            q_len = query_start_loc[i + 1] - query_start_loc[i]
            ctx = seq_lens[i] - q_len
            long_enough = settings.enabled and q_len >= settings.min_sparse_query_len \
                and seq_lens[i] >= settings.min_sparse_seq_len
            if long_enough and ctx > 0 and not allow_context:
                reasons["cached_context_on_cpu"] += 1
                long_enough = False
            if long_enough and worth_estimating is not None and not worth_estimating(q_len, ctx):
                reasons["budgets denser than max_density"] += 1
                long_enough = False
            if long_enough:
                sparse.append(SparseRow(i, query_start_loc[i], q_len, ctx))
            else:
                dense = q_len > 0
        if dense and run_start is None:
            run_start = i
        elif not dense and run_start is not None:
            dense_runs.append((run_start, i))
            run_start = None
    return StepPlan(sparse, dense_runs, reasons)
