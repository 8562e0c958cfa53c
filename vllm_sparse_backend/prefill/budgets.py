"""What the estimators may select, known on the host before anything is estimated: a row's
vertical-slash budgets, the share of its causal pairs the heads' budgets could select, whether
those budgets cover every key, and whether the heads of a KV group share one selection.

Host arithmetic over the resolved heads and the settings; each pattern answers for its own
budgets (:meth:`.patterns.base.Pattern.keys_per_query`, ``covers_every_key``). The planner routes
rows with it and the density gate skips estimation with it, so both see the same budgets.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from ..settings import SparseSettings
from ..head_configs import ResolvedHead
from .patterns import get_pattern


def kv_group_share(heads: list[ResolvedHead], num_kv_heads: int, settings: SparseSettings) -> int:
    """Query heads per shared key selection in a layer: the GQA group size when
    ``settings.kv_group_shared`` is on and the layer allows it (every KV group's heads have the
    same pattern and budgets, and its pattern is ``group_shareable``), else 1. Heads are in
    vLLM's order: group g holds heads g*G .. g*G + G - 1."""
    h = len(heads)
    if not settings.kv_group_shared or num_kv_heads <= 0 or h % num_kv_heads or h == num_kv_heads:
        return 1
    g = h // num_kv_heads
    for start in range(0, h, g):
        first = heads[start]
        if not get_pattern(first.pattern).group_shareable or any(x != first for x in heads[start:start + g]):
            return 1
    return g


def budget_density(heads: Counter[ResolvedHead] | Iterable[ResolvedHead], q_len: int, ctx_len: int,
                   settings: SparseSettings) -> float:
    """The share of a row's causal (query, key) pairs the heads' budgets alone would select,
    were their keys as few as the budgets say (host arithmetic, nothing estimated).

    The real index is never much sparser (block rounding only adds keys), so a row whose
    budget density is above ``max_density`` would fall back to dense after estimation anyway;
    it is sent dense without estimating. Keys per query, per head: the pattern's
    ``keys_per_query``, over the mean number of keys a query of the row can see,
    ``ctx_len + (q_len + 1) / 2``. ``heads``: the layer's heads, or a Counter of distinct heads.
    """
    counts = heads if isinstance(heads, Counter) else Counter(heads)
    visible = ctx_len + (q_len + 1) / 2
    kv_len = ctx_len + q_len
    total = 0.0
    for h, n in counts.items():
        keys = get_pattern(h.pattern).keys_per_query(h, kv_len, visible, settings)
        total += n * min(1.0, keys / visible)
    return total / sum(counts.values())


def budgets_cover_every_key(heads: Counter[ResolvedHead] | Iterable[ResolvedHead], q_len: int, ctx_len: int,
                            settings: SparseSettings) -> bool:
    """True when every head's budgets alone select every key of the row, whatever the scores:
    the sparse path then computes dense attention (and is counted as dense); each pattern
    answers for its heads (``covers_every_key``). Sufficient, not
    necessary: an estimate can still select every key of a row whose budgets are smaller
    (scattered diagonals cost whole key blocks), which only measuring the index tells."""
    kv_len = ctx_len + q_len
    return all(get_pattern(h.pattern).covers_every_key(h, kv_len, settings)
               for h in (heads if isinstance(heads, Counter) else Counter(heads)))
