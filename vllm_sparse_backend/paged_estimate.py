"""Index estimation on the GPU, straight from vLLM's paged KV cache (the estimate arrow of the
CUDA backend's Triton path).

Same contract as :func:`vllm_sparse_backend.patterns.estimate_index` (a row's queries and the
layer's per-head patterns in, one :class:`SparseIndex` for all heads out), but K is read through
the block table by the kernels of ``sparse_prefill_kernels/vs_index.py`` and
``sparse_prefill_kernels/estimate.py`` (nothing is gathered out of the cache) and nothing synchronises with the host: every width is a
host int derived from the row's lengths and the configured budgets, so a whole step is queued
without waiting for the GPU.

Heads are grouped by pattern once per layer (:class:`HeadGroups`); each group is estimated in one
batched call. The score passes run over all heads of the layer (their GQA mapping is fixed by
head order) and the group's heads are picked afterwards: with the usual one-pattern layers that
is exactly the work needed.

With ``kv_group_shared`` (and a layer that allows it, :func:`vllm_sparse_backend.budgets.kv_group_share`)
the unit of selection is the KV group instead of the query head: scores are summed over each
group's heads and the index holds one list per KV head (``PagedEstimate.heads_per_list`` = the
group size), which the kernel runs with the group's heads stacked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from vllm_sparse_kernels.kv_quant import scale_operand
from vllm_sparse_kernels.prefill.estimate_math import scored_block_mass
from vllm_sparse_kernels.reference.attention import gather_pages

from .budgets import budget_density, vs_budget
from .config import PatternName, SparseSettings
from .head_configs import ResolvedHead
from .index import SparseIndex, num_blocks
from .kernels import estimate, vs_index
from .patterns.vertical_slash import band_count, band_shift, slash_band_scores


@dataclass
class HeadGroup:
    pattern: PatternName
    ids: torch.Tensor  # int64 [n] lists of the layer with this pattern (query heads, or KV heads when shared)
    params: dict[str, torch.Tensor]  # per-list budgets [n] (ResolvedHead fields)
    max_params: dict[str, float]  # the largest of each, as host numbers (output widths)
    min_params: dict[str, float]  # the smallest (equal to the largest: one budget for the group)
    all_heads: bool  # the group is the whole layer (no head selection or scatter needed)


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
        """``share``: from :func:`vllm_sparse_backend.budgets.kv_group_share` (the heads of each
        group of ``share`` are then identical, so one list per group stands for all of them)."""
        lists = heads[::share]
        by_pattern: dict[PatternName, list[int]] = {}
        for i, hp in enumerate(lists):
            by_pattern.setdefault(hp.pattern, []).append(i)
        groups = []
        for pattern, ids in by_pattern.items():
            params, max_params, min_params = {}, {}, {}
            for name in ("vertical_size", "slash_size", "topk_blocks", "sink_tokens", "local_window", "gamma"):
                vals = [getattr(lists[i], name) for i in ids]
                params[name] = torch.tensor(vals, device=device)
                max_params[name], min_params[name] = max(vals), min(vals)
            groups.append(HeadGroup(pattern, torch.tensor(ids, device=device), params, max_params, min_params,
                                    len(ids) == len(lists)))
        return cls(groups, len(heads), Counter(heads), share)

    def budget_density(self, q_len: int, ctx_len: int, settings: SparseSettings) -> float:
        """:func:`vllm_sparse_backend.budgets.budget_density` of this layer's heads."""
        return budget_density(self.head_counts, q_len, ctx_len, settings)


@dataclass
class PagedEstimate:
    index: SparseIndex
    # heads per pattern (host ints known without a sync); FlexPrefill's per-head decision stays
    # on the device: query_aware_heads is an int64 scalar tensor (or None without such heads).
    head_patterns: dict[str, int]
    query_aware_heads: torch.Tensor | None = None
    heads_per_list: int = 1  # the index has one list per this many consecutive query heads


def _select(ix: SparseIndex, ids: torch.Tensor) -> SparseIndex:
    return ix.map_lists(lambda t: t[ids])


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


def _vertical_slash(q_row, key_cache, bt_row, ctx_len, group: HeadGroup, settings: SparseSettings,
                    scale: float, share: int, k_scale=None) -> SparseIndex:
    q_len = q_row.shape[0]
    kv_len = ctx_len + q_len
    # shared: a KV group's mass, summed inside the kernel (the group's heads share each K tile)
    vertical, slash = estimate.representative_scores(q_row, key_cache, bt_row, kv_len, min(settings.last_q, q_len),
                                                     scale, group_sum=share > 1, k_scale=k_scale)
    if not group.all_heads:
        vertical, slash = vertical[group.ids], slash[group.ids]
    vertical[:, : settings.keep_first_columns] = float("inf")
    slash[:, : max(1, settings.keep_last_diagonals)] = float("inf")  # at least the main diagonal
    shares = {"vertical_size": settings.vertical_share, "slash_size": settings.slash_share}

    def budget(name):  # a host int when the group has one budget (vs_topk then skips the per-head cut)
        lo, hi = group.min_params[name], group.max_params[name]
        if lo == hi:
            return vs_budget(int(hi), shares[name], kv_len)
        return group.params[name].clamp(min=vs_budget(1, shares[name], kv_len), max=kv_len)

    max_v = vs_budget(int(group.max_params["vertical_size"]), settings.vertical_share, kv_len)
    max_s = vs_budget(int(group.max_params["slash_size"]), settings.slash_share, kv_len)
    band = settings.slash_band
    if band == 1:
        v_idx, v_cnt, s_idx, s_cnt = vs_index.vs_topk(vertical, slash, budget("vertical_size"), budget("slash_size"),
                                                      max_v, max_s)
    else:  # whole bands of diagonals by their summed scores (patterns.vertical_slash.slash_band_scores)
        bands = slash_band_scores(slash, ctx_len, band)
        # -inf past the last band: one width for both score rows (vs_topk's single-launch select)
        bands = torch.nn.functional.pad(bands, (0, kv_len - bands.shape[1]), value=float("-inf"))
        v_idx, v_cnt, b_idx, _ = vs_index.vs_topk(vertical, bands, budget("vertical_size"),
                                                  band_count(budget("slash_size"), band), max_v,
                                                  band_count(max_s, band))
        s_idx, s_cnt = _band_diagonals(b_idx, band, band_shift(ctx_len, band), kv_len)
    return vs_index.vertical_slash_index(v_idx, v_cnt, s_idx, s_cnt, q_len, ctx_len, settings.block_size,
                                         slash_tiles=settings.slash_tiles)


def _band_diagonals(b_idx: torch.Tensor, band: int, shift: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending band ids (int32 [h, w], -1 padded) -> their diagonals (int32 [h, w * band],
    ascending, -1 padded) and counts [h]; diagonals outside [0, kv_len) of the first and last
    bands dropped."""
    h, w = b_idx.shape
    d = b_idx.to(torch.int64)[:, :, None] * band - shift + torch.arange(band, device=b_idx.device)
    ok = (b_idx[:, :, None] >= 0) & (d >= 0) & (d < kv_len)
    d = torch.where(ok, d, torch.full_like(d, 1 << 40)).view(h, w * band).sort(-1).values
    d = torch.where(d == 1 << 40, torch.full_like(d, -1), d)
    return d.to(torch.int32).contiguous(), ok.view(h, -1).sum(-1).to(torch.int32)


def row_keys(key_cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int, dtype: torch.dtype,
              k_scale=None) -> torch.Tensor:
    """The row's keys, contiguous [kv_len, Hkv, D] of ``dtype``, dequantised with ``k_scale``
    from an fp8 cache: one gather of every key (2 bytes x Hkv x D per token, 64 MiB at 128K for
    2 KV heads of 128), for the block scorings' torch matmuls (``block_scoring`` other than pooled)."""
    k = gather_pages(key_cache, block_table_row, kv_len).to(dtype)
    ks = scale_operand(k_scale, key_cache.device)
    return k if ks is None else k * ks.to(dtype)


def estimate_index_paged(q_row: torch.Tensor, key_cache: torch.Tensor, block_table_row: torch.Tensor, ctx_len: int,
                         groups: HeadGroups, settings: SparseSettings, scale: float, k_scale=None) -> PagedEstimate:
    """q_row: [q_len, H, D] the row's queries (any token stride); key_cache: [pages, page, Hkv, D]
    view of the layer's cache (the chunk's keys already written); block_table_row: int32 [pages].
    ``k_scale``: an fp8 cache's per-layer scale (a one-element fp32 device tensor or a number;
    dequantised K = stored * k_scale), None for a cache of the queries' dtype."""
    q_len, num_heads, _ = q_row.shape
    if num_heads != groups.num_heads:
        raise ValueError(f"{groups.num_heads} head patterns for {num_heads} query heads")
    b = settings.block_size
    kv_len = ctx_len + q_len
    dev = q_row.device
    share, num_lists = groups.share, groups.num_lists
    if share not in (1, num_heads // key_cache.shape[2]):
        raise ValueError(f"one selection per {share} heads: must be 1 or the KV group size")
    parts: list[tuple[torch.Tensor, SparseIndex]] = []
    counts: dict[str, int] = {}
    query_aware = None
    for g in groups.groups:
        n = len(g.ids)
        if g.pattern is PatternName.DENSE:
            # every causal key block: A-shape whose sink covers the whole row
            full = torch.full((n,), kv_len, dtype=torch.int64, device=dev)
            ix = estimate.a_shape_index(full, full, q_len, ctx_len, b, max_blocks=num_blocks(kv_len, b))
        elif g.pattern is PatternName.A_SHAPE:
            width = (num_blocks(int(g.max_params["sink_tokens"]), b) + num_blocks(int(g.max_params["local_window"]), b)
                     + 2)
            ix = estimate.a_shape_index(g.params["sink_tokens"], g.params["local_window"], q_len, ctx_len, b,
                                   max_blocks=width)
        elif g.pattern is PatternName.VERTICAL_SLASH:
            ix = _vertical_slash(q_row, key_cache, block_table_row, ctx_len, g, settings, scale, share, k_scale)
        elif g.pattern is PatternName.BLOCK_SPARSE:
            topk = torch.full((num_lists,), 1, dtype=torch.int64, device=dev)
            topk[g.ids] = g.params["topk_blocks"].to(torch.int64)
            max_topk = int(g.max_params["topk_blocks"])
            if settings.block_scoring != "pooled":
                k_row = row_keys(key_cache, block_table_row, kv_len, q_row.dtype, k_scale)
                mass = scored_block_mass(settings.block_scoring, q_row, k_row, ctx_len, b, scale, share,
                                         stride=settings.antidiagonal_stride, samples=settings.block_samples)
                ix = estimate.mass_block_index(mass, topk, q_len, ctx_len, b, max_topk, settings.block_mass)
            else:
                pooled = estimate.pooled_keys(key_cache, block_table_row, kv_len, b, k_scale)
                ix = estimate.block_sparse_index(q_row, pooled, ctx_len, topk, b, max_topk=max_topk, share=share)
            if not g.all_heads:
                ix = _select(ix, g.ids)
        elif g.pattern is PatternName.FLEX_PREFILL:
            if share > 1:  # kv_group_share never shares FlexPrefill heads
                raise ValueError("FlexPrefill heads cannot share one selection per KV group")
            gamma = torch.full((num_heads,), settings.gamma, dtype=torch.float32, device=dev)
            gamma[g.ids] = g.params["gamma"].float()
            ix, qa = estimate.flex_prefill_index(
                q_row, key_cache, block_table_row, ctx_len, gamma, tau=settings.tau,
                flex_block_size=settings.flex_block_size, min_budget=settings.min_budget,
                max_budget=settings.max_budget, block_size=b, scale=scale, k_scale=k_scale)
            if not g.all_heads:
                ix, qa = _select(ix, g.ids), qa[g.ids]
            query_aware = qa.sum()
        else:  # pragma: no cover - PatternName is closed
            raise ValueError(f"unknown pattern {g.pattern}")
        counts[g.pattern.value] = n * share
        parts.append((g.ids, ix))
    index = parts[0][1] if len(parts) == 1 else _merge(parts, num_lists)
    return PagedEstimate(index, counts, query_aware, share)
