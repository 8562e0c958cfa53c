"""Vertical-slash heads (MInference Alg. 2 and 4).

Estimation: softmax of the last ``last_q`` queries against all keys; column sums give the
vertical scores, diagonal sums the slash scores; the first ``keep_first_columns`` columns and the
``keep_last_diagonals`` diagonals nearest the main one are always kept; top-k per head.
Conversion: a slash line crosses each query block in a ``block_size``-long key range. By
default (``slash_tiles="blocks"``) each diagonal is covered by the (at most two) aligned key
blocks it crosses. With ``slash_tiles="ranges"`` the ranges of the kept diagonals are merged
where they touch into segments, and each segment is cut into key ranges of ``block_size`` from
its first key (:func:`slash_ranges`): a scattered diagonal costs one key tile per query block.
Verticals become single columns unless such a range or block already covers them.
Everything is batched over heads.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from ...config import PatternGroup
from ...kernels import estimate, vs_index
from ..index import SparseIndex, compact, num_blocks, query_block_bounds
from .base import (HeadGroup, PagedSelection, Pattern, PatternSelection, SearchKnob, keep_top, last_queries_probs,
                   per_head_params, sum_head_groups, vertical_and_slash_sums)


def vs_budget(size: int, share: float | None, kv_len: int) -> int:
    """A vertical-slash budget for a row of ``kv_len`` keys: ``size``, or ``share`` of the keys
    where that is more (``vertical_share`` / ``slash_share``), never more than the keys."""
    budget = size if share is None else max(size, math.ceil(share * kv_len))
    return min(budget, kv_len)


def vs_budgets(vertical_size: int, slash_size: int, kv_len: int, settings) -> tuple[int, int]:
    """(vertical, slash) budgets of one head for a row of ``kv_len`` keys (see :func:`vs_budget`)."""
    vs = settings.patterns.vertical_slash
    return vs_budget(vertical_size, vs.vertical_share, kv_len), vs_budget(slash_size, vs.slash_share, kv_len)


def slash_block_mask(slash_keep: torch.Tensor, q_len: int, ctx_len: int, block_size: int) -> torch.Tensor:
    """bool [h, NQB, NKB]: key blocks crossed by a kept diagonal inside each query block.

    Diagonal d (= query pos - key pos) meets key block kb inside a query block spanning
    positions [P0, P1] iff d lies in [P0 - kb*B - B + 1, P1 - kb*B]; a prefix sum over the kept
    diagonals answers "is any kept d in that range" for all (query block, key block) at once.
    """
    h, kv_len = slash_keep.shape
    device = slash_keep.device
    q_first, q_last = query_block_bounds(q_len, ctx_len, block_size, device)
    kb0 = torch.arange(num_blocks(kv_len, block_size), device=device) * block_size
    lo = (q_first[:, None] - kb0[None, :] - block_size + 1).clamp(min=0, max=kv_len)
    hi = (q_last[:, None] - kb0[None, :]).clamp(max=kv_len - 1)
    csum = torch.nn.functional.pad(slash_keep.to(torch.int32).cumsum(-1), (1, 0))  # [h, kv_len + 1]
    nqb, nkb = lo.shape
    hits = csum[:, (hi + 1).clamp(min=0).reshape(-1)] - csum[:, lo.reshape(-1)]
    return ((hits > 0) & (hi >= lo).reshape(1, -1)).view(h, nqb, nkb)


def slash_ranges(slash_keep: torch.Tensor, q_len: int, ctx_len: int, block_size: int,
                 query_blocks_per_step: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Key ranges of the kept diagonals (bool [h, kv_len]) in each query block:
    (range_count int32 [h, NQB], range_start int32 [h, NQB, R]) in :class:`SparseIndex`'s format.

    In a query block spanning positions [P0, P1], diagonal d crosses keys [max(P0 - d, 0),
    P1 - d]. Taken by ascending key (descending d), ranges that overlap or touch the previous
    one continue its segment; a segment is cut into ranges of ``block_size`` keys from its first
    key, so each diagonal adds at most two ranges and a segment of L keys costs ceil(L / B). The
    last range of a segment may reach past the segment (real keys, computed for free) but stops
    where the next segment starts. Same arithmetic as ``vllm_sparse_kernels.prefill.vs_index``'s conversion.
    """
    h, kv_len = slash_keep.shape
    device = slash_keep.device
    b = block_size
    n_kept = slash_keep.sum(-1)
    width = max(1, int(n_kept.max())) if h else 1
    d_all = torch.arange(kv_len, device=device).expand(h, kv_len)
    # kept diagonals, descending (largest d = leftmost keys first), -1 padding at the end
    d = torch.where(slash_keep, d_all, -1).sort(-1, descending=True).values[:, :width]  # [h, S]
    q_first, q_last = query_block_bounds(q_len, ctx_len, b, device)
    counts, starts = [], []
    for qb0 in range(0, q_first.numel(), query_blocks_per_step):
        p0 = q_first[qb0:qb0 + query_blocks_per_step].view(1, -1, 1)
        p1 = q_last[qb0:qb0 + query_blocks_per_step].view(1, -1, 1)
        dd = d[:, None, :]
        hit = (dd >= 0) & (dd <= p1)
        s = (p0 - dd).clamp(min=0)
        e = torch.where(hit, p1 - dd, -2)
        e_prev = torch.nn.functional.pad(e[..., :-1], (1, 0), value=-2)
        new = hit & (s > e_prev + 1)
        anchor = torch.where(new, s, -1).cummax(-1).values
        t_lo = torch.div(s - anchor, b, rounding_mode="floor")
        t_hi = torch.div(e - anchor, b, rounding_mode="floor")
        prev_hi = torch.where(new, -1, torch.div(e_prev - anchor, b, rounding_mode="floor"))
        first = torch.maximum(t_lo, prev_hi + 1)
        c = torch.where(hit, (t_hi - first + 1).clamp(min=0), 0)  # 0, 1 or 2 new ranges
        cand = torch.stack([anchor + first * b, anchor + (first + 1) * b], -1)  # [h, G, S, 2]
        keep = torch.stack([c >= 1, c >= 2], -1)
        cnt, st = compact(cand.flatten(-2), keep.flatten(-2))
        counts.append(cnt)
        starts.append(st)
    r = max(1, max(st.shape[-1] for st in starts))
    starts = [torch.nn.functional.pad(st, (0, r - st.shape[-1]), value=-1) for st in starts]
    return torch.cat(counts, 1), torch.cat(starts, 1)


def vertical_slash_to_selection(vertical_keep: torch.Tensor, slash_keep: torch.Tensor, q_len: int, ctx_len: int,
                                block_size: int, slash_tiles: str = "blocks") -> PatternSelection:
    """Kept columns and diagonals (bool [h, kv_len] each) -> ranges (or blocks) + column candidates."""
    kv_len = vertical_keep.shape[-1]
    positions = torch.arange(kv_len, device=vertical_keep.device).expand_as(vertical_keep)
    count, cols = compact(positions, vertical_keep)
    cols = cols.to(torch.int64)
    if slash_tiles == "blocks":
        return PatternSelection(slash_block_mask(slash_keep, q_len, ctx_len, block_size), cols, cols >= 0)
    h = slash_keep.shape[0]
    no_blocks = torch.zeros(h, num_blocks(q_len, block_size), num_blocks(kv_len, block_size), dtype=torch.bool,
                            device=slash_keep.device)
    return PatternSelection(no_blocks, cols, cols >= 0, *slash_ranges(slash_keep, q_len, ctx_len, block_size))


def band_shift(ctx_len: int, band: int) -> int:
    """Diagonals before the first whole band: bands start at diagonals congruent to ``ctx_len``
    (mod ``band``), where a band of ``block_size`` diagonals meets exactly two key blocks in
    every query block (any other start would meet three)."""
    return (-ctx_len) % band


def slash_band_scores(slash: torch.Tensor, ctx_len: int, band: int) -> torch.Tensor:
    """[h, kv_len] diagonal scores -> [h, bands] sums over bands of ``band`` diagonals (band 0
    is partial unless ``ctx_len`` is a multiple of ``band``; +inf stays +inf)."""
    h, kv_len = slash.shape
    shift = band_shift(ctx_len, band)
    padded = torch.nn.functional.pad(slash, (shift, -(-(kv_len + shift) // band) * band - kv_len - shift))
    return padded.view(h, -1, band).sum(-1)


def slash_bands_to_diagonals(band_keep: torch.Tensor, kv_len: int, ctx_len: int, band: int) -> torch.Tensor:
    """bool [h, bands] -> bool [h, kv_len]: every diagonal of a kept band."""
    shift = band_shift(ctx_len, band)
    return band_keep.repeat_interleave(band, dim=-1)[:, shift:shift + kv_len]


def band_count(slash_size: torch.Tensor | int, band: int) -> torch.Tensor | int:
    """Bands standing for a budget of ``slash_size`` diagonals (rounded up; per head or one int)."""
    return (slash_size + band - 1) // band


def keep_columns(vertical: torch.Tensor, vertical_size: torch.Tensor, keep_first_columns: int) -> torch.Tensor:
    """Column sums [h, kv_len] (overwritten: the first ``keep_first_columns`` become +inf, the
    sinks) -> bool [h, kv_len], the ``vertical_size[h]`` best columns of each head."""
    vertical[:, :keep_first_columns] = float("inf")
    return keep_top(vertical, vertical_size.clamp(max=vertical.shape[-1]))


def keep_diagonals(slash: torch.Tensor, slash_size: torch.Tensor, keep_last_diagonals: int, ctx_len: int,
                   slash_band: int = 1) -> torch.Tensor:
    """Diagonal sums [h, kv_len] (overwritten: the ``keep_last_diagonals`` nearest the main one,
    and the main one at least, become +inf: no empty rows) -> bool [h, kv_len], the
    ``slash_size[h]`` best diagonals of each head, or with ``slash_band`` > 1 every diagonal of
    the best bands (:func:`slash_band_scores`)."""
    kv_len = slash.shape[-1]
    slash[:, :max(1, keep_last_diagonals)] = float("inf")
    if slash_band > 1:
        bands = slash_band_scores(slash, ctx_len, slash_band)
        return slash_bands_to_diagonals(keep_top(bands, band_count(slash_size.clamp(max=kv_len), slash_band)),
                                        kv_len, ctx_len, slash_band)
    return keep_top(slash, slash_size.clamp(max=kv_len))


def vertical_slash_selection(q: torch.Tensor, k: torch.Tensor, kvh: torch.Tensor, ctx_len: int,
                             vertical_size: torch.Tensor, slash_size: torch.Tensor, *, last_q: int,
                             keep_first_columns: int, keep_last_diagonals: int, block_size: int,
                             scale: float, share: int = 1, slash_band: int = 1,
                             slash_tiles: str = "blocks", normalizer_sample: int = 1) -> PatternSelection:
    """q: [q_len, h, D] (this pattern's heads), k: [kv_len, Hkv, D], kvh: [h] kv head of each head.
    ``share`` > 1: every ``share`` consecutive heads (one KV group) get one selection, from their
    column and diagonal sums added up (budgets: the group's first head's). ``slash_band`` > 1:
    diagonals are kept in bands of that many (:func:`slash_band_scores`), ``slash_size`` / band
    bands per head by their summed scores: with bands of ``block_size`` the budget buys key
    blocks the kernel computes anyway, where scattered single diagonals each cost two blocks."""
    q_len = q.shape[0]
    probs, qpos = last_queries_probs(q, k, kvh, ctx_len, last_q, scale, normalizer_sample)
    vertical, slash = vertical_and_slash_sums(probs, qpos)
    vertical, slash = sum_head_groups(vertical, share), sum_head_groups(slash, share)
    v_keep = keep_columns(vertical, vertical_size[::share], keep_first_columns)
    s_keep = keep_diagonals(slash, slash_size[::share], keep_last_diagonals, ctx_len, slash_band)
    return vertical_slash_to_selection(v_keep, s_keep, q_len, ctx_len, block_size, slash_tiles).repeat_heads(share)


def band_diagonals(b_idx: torch.Tensor, band: int, shift: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending band ids (int32 [h, w], -1 padded) -> their diagonals (int32 [h, w * band],
    ascending, -1 padded) and counts [h]; diagonals outside [0, kv_len) of the first and last
    bands dropped."""
    h, w = b_idx.shape
    d = b_idx.to(torch.int64)[:, :, None] * band - shift + torch.arange(band, device=b_idx.device)
    ok = (b_idx[:, :, None] >= 0) & (d >= 0) & (d < kv_len)
    d = torch.where(ok, d, torch.full_like(d, 1 << 40)).view(h, w * band).sort(-1).values
    d = torch.where(d == 1 << 40, torch.full_like(d, -1), d)
    return d.to(torch.int32).contiguous(), ok.view(h, -1).sum(-1).to(torch.int32)


def paged_vertical_slash_index(q_row, key_cache, bt_row, ctx_len, group: HeadGroup, settings, scale: float,
                               share: int, k_scale=None) -> SparseIndex:
    """The GPU estimator: the last queries' column and diagonal scores read through the block
    table (one pass for every head of the layer), the group's heads picked, top-k on the device."""
    q_len = q_row.shape[0]
    kv_len = ctx_len + q_len
    vs = settings.patterns.vertical_slash
    # shared: a KV group's mass, summed inside the kernel (the group's heads share each K tile)
    vertical, slash = estimate.representative_scores(q_row, key_cache, bt_row, kv_len, min(vs.last_q, q_len),
                                                     scale, group_sum=share > 1, k_scale=k_scale,
                                                     normalizer_sample=vs.normalizer_sample)
    if not group.all_heads:
        vertical, slash = vertical[group.ids], slash[group.ids]
    vertical[:, : vs.keep_first_columns] = float("inf")
    slash[:, : max(1, vs.keep_last_diagonals)] = float("inf")  # at least the main diagonal
    shares = {"vertical_size": vs.vertical_share, "slash_size": vs.slash_share}

    def budget(name):  # a host int when the group has one budget (vs_topk then skips the per-head cut)
        lo, hi = group.min_params[name], group.max_params[name]
        if lo == hi:
            return vs_budget(int(hi), shares[name], kv_len)
        return group.params[name].clamp(min=vs_budget(1, shares[name], kv_len), max=kv_len)

    max_v = vs_budget(int(group.max_params["vertical_size"]), vs.vertical_share, kv_len)
    max_s = vs_budget(int(group.max_params["slash_size"]), vs.slash_share, kv_len)
    band = vs.slash_band
    if band == 1:
        v_idx, v_cnt, s_idx, s_cnt = vs_index.vs_topk(vertical, slash, budget("vertical_size"), budget("slash_size"),
                                                      max_v, max_s)
    else:  # whole bands of diagonals by their summed scores (slash_band_scores)
        bands = slash_band_scores(slash, ctx_len, band)
        # -inf past the last band: one width for both score rows (vs_topk's single-launch select)
        bands = torch.nn.functional.pad(bands, (0, kv_len - bands.shape[1]), value=float("-inf"))
        v_idx, v_cnt, b_idx, _ = vs_index.vs_topk(vertical, bands, budget("vertical_size"),
                                                  band_count(budget("slash_size"), band), max_v,
                                                  band_count(max_s, band))
        s_idx, s_cnt = band_diagonals(b_idx, band, band_shift(ctx_len, band), kv_len)
    return vs_index.vertical_slash_index(v_idx, v_cnt, s_idx, s_cnt, q_len, ctx_len, settings.block_size,
                                         slash_tiles=vs.slash_tiles)


class VerticalSlashSettings(PatternGroup):
    """Vertical-slash settings, ``settings.patterns.vertical_slash``: budgets and last-q
    estimation (``last_q`` is also read by the cost model's estimation term, prefill/route.py,
    and by spans decode's persistent pages, which reuse the same last queries)."""

    vertical_size: int = Field(1000, ge=1, description="Vertical-slash: columns (keys) kept per head.")
    slash_size: int = Field(6096, ge=1, description="Vertical-slash: diagonals kept per head.")
    vertical_share: float | None = Field(None, gt=0.0, le=1.0, description=(
        "Budget growing with the context: a row's column budget is the larger of vertical_size and this share "
        "of its keys (context + chunk), head-config files' vertical-slash heads included; none = fixed."))
    slash_share: float | None = Field(None, gt=0.0, le=1.0, description=(
        "Budget growing with the context: a row's diagonal budget is the larger of slash_size and this share "
        "of its keys; none = fixed."))
    slash_band: int = Field(1, ge=1, le=1024, description=(
        "Diagonals kept together as one slash unit: 1 = single diagonals (MInference), block_size = "
        "bands of whole key blocks chosen by their summed scores (slash_size / band of them)."))
    slash_tiles: Literal["blocks", "ranges"] = Field("blocks", description=(
        "How the kernel computes a kept diagonal: blocks = the (at most two) aligned key blocks it crosses in "
        "each query block; ranges = its 64 keys as one unaligned key range (touching diagonals merged)."))
    last_q: int = Field(64, ge=1, description="Queries at the end of the chunk used to estimate vertical/slash.")
    normalizer_sample: int = Field(1, ge=1, le=16, description=(
        "Estimation's row sums from one key tile in N between the first 1024 keys and the 4096 before the "
        "last queries (those read whole), the sum counted N times: about 1/N of its first pass over the keys; "
        "1 = every key (exact)."))
    keep_first_columns: int = Field(30, ge=0, description="Columns always kept (attention sinks).")
    keep_last_diagonals: int = Field(30, ge=0, description="Diagonals nearest the main one always kept.")


class VerticalSlash(Pattern):
    name = "vertical_slash"
    head_params = per_head_params(VerticalSlashSettings, "vertical_size", "slash_size")
    settings_model = VerticalSlashSettings
    # columns grow, diagonals in three ratios to them (MInference's shipped budgets range from 8:1
    # to 1:35); served after a last-queries pass
    search = SearchKnob("vs", "vertical_size", serving_cost=1, ratio_param="slash_size", ratios=(8.0, 1.0, 0.125))

    def keys_per_query(self, head, kv_len, visible, settings):
        return sum(vs_budgets(head.param("vertical_size"), head.param("slash_size"), kv_len, settings))

    def covers_every_key(self, head, kv_len, settings):
        return max(vs_budgets(head.param("vertical_size"), head.param("slash_size"), kv_len, settings)) >= kv_len

    def select(self, q, k, kvh, ctx_len, params, settings, scale, share):
        # budgets that grow with the row (vertical_share / slash_share) as on the GPU path
        v_floor, s_floor = vs_budgets(1, 1, k.shape[0], settings)
        vs = settings.patterns.vertical_slash
        sel = vertical_slash_selection(
            q, k, kvh, ctx_len, params["vertical_size"].clamp(min=v_floor), params["slash_size"].clamp(min=s_floor),
            last_q=vs.last_q, keep_first_columns=vs.keep_first_columns, keep_last_diagonals=vs.keep_last_diagonals,
            block_size=settings.block_size, scale=scale, share=share, slash_band=vs.slash_band,
            slash_tiles=vs.slash_tiles, normalizer_sample=vs.normalizer_sample)
        return sel, {self.name: q.shape[1]}

    def estimate_paged(self, q_row, key_cache, block_table_row, ctx_len, group: HeadGroup, num_lists, settings,
                       scale, share, k_scale=None):
        return PagedSelection(paged_vertical_slash_index(q_row, key_cache, block_table_row, ctx_len, group, settings,
                                                         scale, share, k_scale))
