"""Index estimation: a row's queries and each head's pattern -> one SparseIndex for all heads.

Two estimators with one contract, each dispatching through the pattern registry
(:data:`.patterns.PATTERNS`), never on a pattern's name:

* :func:`estimate_index`: PyTorch, on the row's K gathered out of the cache (the CPU path, and
  ``kernel=torch`` on CUDA).
* :func:`estimate_index_paged`: the GPU, straight from vLLM's paged KV cache. K is read through
  the block table by the Triton estimators (nothing is gathered) and nothing synchronises with
  the host: every width is a host int derived from the row's lengths and the budgets, so a whole
  step is queued without waiting for the GPU.

Heads are grouped by pattern once per layer (:class:`HeadGroups`) and each group is estimated
in one batched call. With ``kv_group_shared`` (and a layer that allows it,
:func:`.budgets.kv_group_share`) the unit of selection is the KV group instead of the query
head: scores are summed over each group's heads and the index holds one list per KV head
(``PagedEstimate.heads_per_list`` = the group size), which the kernel runs with the group's heads stacked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from vllm_sparse_kernels.kv_layout import kv_head_map

from ..settings import SparseSettings
from ..head_configs import ResolvedHead
from .budgets import kv_group_share
from .index import SparseIndex, build_index, num_blocks
from .patterns import get_pattern
from .patterns.base import HeadGroup, HeadSplit, PatternSelection


@dataclass
class Estimate:
    index: SparseIndex
    # heads per pattern label; FlexPrefill heads are split into "flex_prefill/query_aware" and
    # "flex_prefill/vertical_slash" by the online decision
    head_patterns: Counter = field(default_factory=Counter)


def _groups_by_pattern(heads: list[ResolvedHead]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, hp in enumerate(heads):
        groups.setdefault(hp.pattern, []).append(i)
    return groups


def estimate_index(q: torch.Tensor, k: torch.Tensor, ctx_len: int, heads: list[ResolvedHead],
                   settings: SparseSettings, scale: float, share: int | None = None) -> Estimate:
    """q: [q_len, H, D] (the row's queries), k: [ctx_len + q_len, Hkv, D] (all keys of the row).
    ``share``: query heads per shared key selection (:attr:`.plan.RankHeads.share`, decided for
    the whole layer under tensor parallelism); None: :func:`.budgets.kv_group_share` of these heads."""
    q_len, num_heads, _ = q.shape
    if len(heads) != num_heads:
        raise ValueError(f"{len(heads)} head patterns for {num_heads} query heads")
    device = q.device
    b = settings.block_size
    kv_len = k.shape[0]
    kvh = kv_head_map(num_heads, k.shape[1], device)
    if share is None:
        share = kv_group_share(heads, k.shape[1], settings)  # 1, or the GQA group (one selection per KV head)
    elif share != 1 and num_heads % share:
        raise ValueError(f"share={share} does not divide {num_heads} query heads")
    block_mask = torch.zeros(num_heads, num_blocks(q_len, b), num_blocks(kv_len, b), dtype=torch.bool, device=device)
    column_parts: list[tuple[torch.Tensor, PatternSelection]] = []
    range_parts: list[tuple[torch.Tensor, PatternSelection]] = []
    counts: Counter = Counter()

    for name, ids_list in _groups_by_pattern(heads).items():
        pattern = get_pattern(name)
        ids = torch.tensor(ids_list, device=device)
        params = {f: torch.tensor([heads[i].param(f) for i in ids_list], device=device)
                  for f in pattern.head_fields}
        sel, labels = pattern.select(q[:, ids], k, kvh[ids], ctx_len, params, settings, scale, share)
        counts.update(labels)
        block_mask[ids] = sel.block_mask
        if sel.columns.shape[-1]:
            column_parts.append((ids, sel))
        if sel.range_start is not None:
            range_parts.append((ids, sel))

    columns = column_keep = None
    if column_parts:
        width = max(sel.columns.shape[-1] for _, sel in column_parts)
        columns = torch.zeros(num_heads, width, dtype=torch.int64, device=device)
        column_keep = torch.zeros(num_heads, width, dtype=torch.bool, device=device)
        for ids, sel in column_parts:
            c = sel.columns.shape[-1]
            columns[ids, :c] = sel.columns
            column_keep[ids, :c] = sel.column_keep
    range_count = range_start = None
    if range_parts:
        width = max(sel.range_start.shape[-1] for _, sel in range_parts)
        range_count = torch.zeros(num_heads, num_blocks(q_len, b), dtype=torch.int32, device=device)
        range_start = torch.full((num_heads, num_blocks(q_len, b), width), -1, dtype=torch.int32, device=device)
        for ids, sel in range_parts:
            range_count[ids] = sel.range_count
            range_start[ids, :, : sel.range_start.shape[-1]] = sel.range_start
    index = build_index(block_mask, b, q_len, ctx_len, columns, column_keep, range_count, range_start)
    return Estimate(index, counts)


@dataclass
class HeadGroups:
    groups: list[HeadGroup]
    num_heads: int
    head_counts: Counter  # distinct ResolvedHead -> number of heads (host-side budget checks)
    share: int = 1  # query heads per list: 1, or the GQA group size (kv_group_shared)

    @property
    def num_lists(self) -> int:
        return self.num_heads // self.share

    @classmethod
    def from_heads(cls, heads: list[ResolvedHead], device, share: int = 1) -> "HeadGroups":
        """``share``: from :func:`.budgets.kv_group_share` (the heads of each group of ``share``
        are then identical, so one list per group stands for all of them)."""
        lists = heads[::share]
        groups = []
        for name, ids in _groups_by_pattern(lists).items():
            pattern = get_pattern(name)
            params, max_params, min_params = {}, {}, {}
            for f in pattern.head_fields:
                vals = [lists[i].param(f) for i in ids]
                params[f] = torch.tensor(vals, device=device)
                max_params[f], min_params[f] = max(vals), min(vals)
            groups.append(HeadGroup(pattern, torch.tensor(ids, device=device), params, max_params, min_params,
                                    len(ids) == len(lists)))
        return cls(groups, len(heads), Counter(heads), share)


@dataclass
class PagedEstimate:
    index: SparseIndex
    head_patterns: dict[str, int]  # heads per pattern (host ints known without a sync)
    # patterns whose heads' labels were decided on the device (FlexPrefill's per-head choice)
    splits: list[HeadSplit] = field(default_factory=list)
    heads_per_list: int = 1  # the index has one list per this many consecutive query heads


def _merge(parts: list[tuple[torch.Tensor, SparseIndex]], num_heads: int) -> SparseIndex:
    """Scatter the groups' indices into one of the widest widths (heads in layer order)."""
    first = parts[0][1]
    dev, b, nqb = first.block_count.device, first.block_size, first.num_query_blocks
    merged = []
    for count, lists in ((0, 1), (2, 3), (4, 5)):  # (count, list) pairs of SparseIndex.tensors()
        width = max(ix.tensors()[lists].shape[-1] for _, ix in parts)
        c = torch.zeros(num_heads, nqb, dtype=torch.int32, device=dev)
        li = torch.full((num_heads, nqb, width), -1, dtype=torch.int32, device=dev)
        for ids, ix in parts:
            t = ix.tensors()
            c[ids] = t[count]
            li[ids, :, : t[lists].shape[-1]] = t[lists]
        merged += [c, li]
    return SparseIndex(b, *merged)


def estimate_index_paged(q_row: torch.Tensor, key_cache: torch.Tensor, block_table_row: torch.Tensor, ctx_len: int,
                         groups: HeadGroups, settings: SparseSettings, scale: float, k_scale=None) -> PagedEstimate:
    """q_row: [q_len, H, D] the row's queries (any token stride); key_cache: [pages, page, Hkv, D]
    view of the layer's cache (the chunk's keys already written); block_table_row: int32 [pages].
    ``k_scale``: an fp8 cache's per-layer scale (a one-element fp32 device tensor or a number;
    dequantised K = stored * k_scale), None for a cache of the queries' dtype."""
    num_heads = q_row.shape[1]
    if num_heads != groups.num_heads:
        raise ValueError(f"{groups.num_heads} head patterns for {num_heads} query heads")
    share, num_lists = groups.share, groups.num_lists
    if share not in (1, num_heads // key_cache.shape[2]):
        raise ValueError(f"one selection per {share} heads: must be 1 or the KV group size")
    parts: list[tuple[torch.Tensor, SparseIndex]] = []
    counts: dict[str, int] = {}
    splits: list[HeadSplit] = []
    for g in groups.groups:
        sel = g.pattern.estimate_paged(q_row, key_cache, block_table_row, ctx_len, g, num_lists, settings, scale,
                                       share, k_scale)
        if sel.split is not None:
            splits.append(sel.split)
        counts[g.pattern.name] = len(g.ids) * share
        parts.append((g.ids, sel.index))
    index = parts[0][1] if len(parts) == 1 else _merge(parts, num_lists)
    return PagedEstimate(index, counts, splits, share)
