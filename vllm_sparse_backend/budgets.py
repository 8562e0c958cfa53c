"""What the estimators may select, known on the host before anything is estimated: a row's
vertical-slash budgets, the share of its causal pairs the heads' budgets could select, whether
those budgets cover every key, and whether the heads of a KV group share one selection.

Pure Python over the resolved heads and the settings. The estimators (``patterns/``,
``paged_estimate.py``) size their selections with it, and the planner routes rows with it
(:mod:`vllm_sparse_backend.plan` imports it, never the other way), so both see the same budgets.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

from .config import PatternName, SparseSettings
from .head_configs import ResolvedHead


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
