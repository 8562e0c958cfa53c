"""Index estimation: a row's Q/K and each head's pattern -> one SparseIndex for all heads.

Heads are grouped by pattern and each group is estimated in one batched call (at most five
groups, never a loop over heads). The estimators return block masks and column candidates; the
assembly into the kernel format happens once, in :func:`vllm_sparse_backend.index.build_index`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from vllm_sparse_kernels.reference.attention import kv_head_map

from ..config import PatternName, SparseSettings
from ..head_configs import ResolvedHead
from ..index import SparseIndex, build_index, num_blocks
from ..budgets import kv_group_share, vs_budgets
from .a_shape import a_shape_selection
from .block_sparse import block_sparse_selection
from .common import PatternSelection
from .dense import dense_selection
from .flex_prefill import flex_prefill_selection
from .vertical_slash import vertical_slash_selection


@dataclass
class Estimate:
    index: SparseIndex
    # heads per pattern; FlexPrefill heads are split into "flex_prefill/query_aware" and
    # "flex_prefill/vertical_slash" by the online decision
    head_patterns: Counter = field(default_factory=Counter)


def estimate_index(q: torch.Tensor, k: torch.Tensor, ctx_len: int, heads: list[ResolvedHead],
                   settings: SparseSettings, scale: float, share: int | None = None) -> Estimate:
    """q: [q_len, H, D] (the row's queries), k: [ctx_len + q_len, Hkv, D] (all keys of the row).
    ``share``: query heads per shared key selection (:attr:`..plan.RankHeads.share`, decided for
    the whole layer under tensor parallelism); None: :func:`..budgets.kv_group_share` of these heads."""
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

    groups: dict[PatternName, list[int]] = {}
    for i, hp in enumerate(heads):
        groups.setdefault(hp.pattern, []).append(i)
    for pattern, ids_list in groups.items():
        ids = torch.tensor(ids_list, device=device)
        group_heads = [heads[i] for i in ids_list]

        def per_head(name: str, group_heads=group_heads) -> torch.Tensor:
            return torch.tensor([getattr(hp, name) for hp in group_heads], device=device)

        if pattern is PatternName.DENSE:
            sel = dense_selection(len(ids_list), q_len, ctx_len, b, device)
        elif pattern is PatternName.A_SHAPE:
            sel = a_shape_selection(per_head("sink_tokens"), per_head("local_window"), q_len, ctx_len, b)
        elif pattern is PatternName.VERTICAL_SLASH:
            # budgets that grow with the row (vertical_share / slash_share) as on the GPU path
            v_floor, s_floor = vs_budgets(1, 1, kv_len, settings)
            sel = vertical_slash_selection(
                q[:, ids], k, kvh[ids], ctx_len, per_head("vertical_size").clamp(min=v_floor),
                per_head("slash_size").clamp(min=s_floor),
                last_q=settings.last_q, keep_first_columns=settings.keep_first_columns,
                keep_last_diagonals=settings.keep_last_diagonals, block_size=b, scale=scale, share=share,
                slash_band=settings.slash_band, slash_tiles=settings.slash_tiles)
        elif pattern is PatternName.BLOCK_SPARSE:
            sel = block_sparse_selection(q[:, ids], k, kvh[ids], ctx_len, per_head("topk_blocks"), block_size=b,
                                         share=share, scoring=settings.block_scoring,
                                         stride=settings.antidiagonal_stride, block_mass=settings.block_mass,
                                         scale=scale, samples=settings.block_samples)
        elif pattern is PatternName.FLEX_PREFILL:
            sel, decision = flex_prefill_selection(
                q[:, ids], k, kvh[ids], ctx_len, per_head("gamma").float(), tau=settings.tau,
                flex_block_size=settings.flex_block_size, min_budget=settings.min_budget,
                max_budget=settings.max_budget, block_size=b, scale=scale)
            n_qa = int(decision.query_aware.sum())
            counts["flex_prefill/query_aware"] += n_qa
            counts["flex_prefill/vertical_slash"] += len(ids_list) - n_qa
        else:  # pragma: no cover - PatternName is closed
            raise ValueError(f"unknown pattern {pattern}")
        if pattern is not PatternName.FLEX_PREFILL:
            counts[pattern.value] += len(ids_list)
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
