"""Launch configuration of the sparse prefill kernel: a table of (conditions -> configuration)
rows, the first matching row wins.

Plain Python (neither torch nor triton): the launcher reads it once per launch, and the tests
check every input against a frozen copy of the results. The numbers were chosen by measurement
at 128K tokens; the runs behind them are listed in docs/kernel-measurements.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# Head dims from here up count as wide (128, 256): their query tile fills the registers with one
# 64-query block, so stacking and stage counts differ from the narrow ones (16, 32, 64).
WIDE_HEAD_DIM = 128

# The most query heads one program stacks (BLOCK_M = 4 * 64 = 256 rows).
MAX_STACK = 4

# Warps per stacked head of a program.
WARPS_PER_HEAD = 4


def shared_stack(head_dim: int, heads_per_list: int) -> int:
    """Heads stacked per program for lists shared by ``heads_per_list`` query heads. Wide heads:
    the largest power of two dividing it, at most :data:`MAX_STACK`. Narrow heads: MAX_STACK
    when it divides, else one (a stack of two was slower than one head per program)."""
    if head_dim < WIDE_HEAD_DIM:
        return MAX_STACK if heads_per_list % MAX_STACK == 0 else 1
    gh = 1
    while gh < MAX_STACK and heads_per_list % (2 * gh) == 0:
        gh *= 2
    return gh


# How a row of the table chooses the heads stacked per program.
INDEX_HEADS = "index"  # the index fixes it (its heads per list; 1 for per-head lists)
GROUP_DIVISOR = "group divisor"  # the largest of 4, 2, 1 dividing the KV group
GROUP_OF_FOUR = "four if it divides the group"  # 4 where it divides the KV group, else 1
ONE = "one"  # one head per program


@dataclass(frozen=True)
class LaunchRule:
    """One row of :data:`LAUNCH_TABLE`: the conditions (None: any value) and what they give."""

    tma: bool | None
    dense: bool | None
    wide: bool | None  # head_dim >= WIDE_HEAD_DIM
    stacked: bool | None  # the index's heads per list > 1 (sparse rows only)
    shared: bool | None  # lists shared by the stacked heads (not merged)
    heads: str  # one of INDEX_HEADS, GROUP_DIVISOR, GROUP_OF_FOUR, ONE
    num_stages: int
    block_n: int
    prefetch: bool
    quantized: bool | None = None  # the K/V cache narrower than the queries (fp8), widened on load

    def matches(self, **conditions: bool) -> bool:
        return all(getattr(self, name) in (None, value) for name, value in conditions.items())


# Gathered loads take pages of any size; TMA loads (pages of a multiple of 64 keys, Hopper)
# always use one 64-key block per tile. Every row runs its programs KV-head-major with
# WARPS_PER_HEAD warps per stacked head. Dense, wide heads: a KV group's heads stacked so each
# K/V tile serves several, 3 stages, the next tile's offsets prefetched; narrow: one head per
# program. Sparse per-head lists: narrow heads take two listed blocks per 128-wide key tile,
# wide ones one block and 3 stages; lists shared by the stacked heads 3 stages, merged lists 2.
# Dense, wide, TMA, fp8 cache: every K/V tile is widened once per program, so stacking two heads
# where four do not divide the group halves that work (1.5B layout, group 6: 0.70x / 0.69x the
# one-head time at 32K / 128K on an H200; the bf16 cache kept one head, the same speed within 1%).
LAUNCH_TABLE: tuple[LaunchRule, ...] = (
    #          tma    dense  wide   stacked shared heads          stages block_n prefetch
    LaunchRule(True, True, True, None, None, GROUP_DIVISOR, 3, 64, True, quantized=True),
    LaunchRule(True, True, True, None, None, GROUP_OF_FOUR, 3, 64, True),
    LaunchRule(True, True, False, None, None, ONE, 2, 64, True),
    LaunchRule(True, False, True, None, None, INDEX_HEADS, 3, 64, True),
    LaunchRule(True, False, False, True, None, INDEX_HEADS, 3, 64, True),
    LaunchRule(True, False, False, False, None, INDEX_HEADS, 2, 64, True),
    LaunchRule(False, True, True, None, None, GROUP_DIVISOR, 3, 64, True),
    LaunchRule(False, True, False, None, None, ONE, 2, 64, False),
    LaunchRule(False, False, True, False, None, INDEX_HEADS, 3, 64, True),
    LaunchRule(False, False, None, True, True, INDEX_HEADS, 3, 64, True),
    LaunchRule(False, False, None, True, False, INDEX_HEADS, 2, 64, True),
    LaunchRule(False, False, False, False, None, INDEX_HEADS, 2, 128, True),
)


def _stacked_heads(rule: str, group: int, index_heads: int) -> int:
    if rule == INDEX_HEADS:
        return index_heads
    if rule == GROUP_OF_FOUR:
        return MAX_STACK if group % MAX_STACK == 0 else 1
    if rule == GROUP_DIVISOR:
        gh = MAX_STACK
        while group % gh:
            gh //= 2
        return gh
    return 1


def default_config(head_dim: int, dense: bool, group: int, merged_heads: int = 1, shared: bool = False,
                   tma: bool = False, quantized: bool = False) -> dict:
    """Launch parameters (heads_per_program, num_warps, num_stages, block_n, kv_major, prefetch)
    of the first row of :data:`LAUNCH_TABLE` that matches. ``merged_heads``: the heads per list
    of a sparse index (ignored for dense); ``shared``: those heads share one list; ``quantized``:
    an fp8 K/V cache under wider queries."""
    conditions = dict(tma=tma, dense=dense, wide=head_dim >= WIDE_HEAD_DIM, stacked=merged_heads > 1, shared=shared,
                      quantized=quantized)
    rule = next(r for r in LAUNCH_TABLE if r.matches(**conditions))
    gh = _stacked_heads(rule.heads, group, merged_heads)
    return {"heads_per_program": gh, "num_warps": WARPS_PER_HEAD * gh, "num_stages": rule.num_stages,
            "block_n": rule.block_n, "kv_major": True, "prefetch": rule.prefetch}
