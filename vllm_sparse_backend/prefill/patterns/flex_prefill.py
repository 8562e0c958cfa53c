"""FlexPrefill heads (Lai et al., 2025; Algorithms 1-4).

Per head and per input: the last ``fb`` queries of the chunk are the representative queries.
Their true block distribution (softmax, then sum over each key block, averaged over the queries)
is compared with the pooled estimate (softmax of mean(Q_hat) . mean-pooled K) by the square root
of the Jensen-Shannon divergence (natural log). Below ``tau`` the head is query-aware: pooled
block scores for every query block, and the smallest set of blocks of the flattened, normalised
map reaching ``gamma``. Otherwise the head is vertical-slash: the representative queries' column
and diagonal sums, each cut at the smallest count reaching ``gamma``. Both keep at least
``min_budget`` tokens (at most ``max_budget``) per query block, and always the first and the
diagonal key blocks, as the paper's implementation does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field, model_validator
from vllm_sparse_kernels.prefill.estimate_math import rescale_block_mask, sqrt_js_divergence

from ...config import PatternGroup
from ...kernels import estimate
from ..index import causal_block_mask, diagonal_block_mask, num_blocks
from .base import (HeadGroup, HeadSplit, PagedSelection, Pattern, PatternSelection, block_means, cumulative_budget,
                   keep_top, last_queries_probs, per_head_params, vertical_and_slash_sums)
from .vertical_slash import vertical_slash_to_selection


@dataclass
class FlexDecision:
    query_aware: torch.Tensor  # bool [h]
    jsd: torch.Tensor  # float [h], sqrt of the Jensen-Shannon divergence


def flex_prefill_selection(q: torch.Tensor, k: torch.Tensor, kvh: torch.Tensor, ctx_len: int,
                           gamma: torch.Tensor, *, tau: float, flex_block_size: int, min_budget: int,
                           max_budget: int | None, block_size: int,
                           scale: float) -> tuple[PatternSelection, FlexDecision]:
    q_len, kv_len = q.shape[0], k.shape[0]
    fb = flex_block_size
    device = q.device
    h = q.shape[1]
    nkb_f = num_blocks(kv_len, fb)

    # Representative queries: the last block of the chunk.
    probs, qpos = last_queries_probs(q, k, kvh, ctx_len, fb, scale)  # [h, n, kv_len]
    pad = nkb_f * fb - kv_len
    true_blocks = torch.nn.functional.pad(probs, (0, pad)).view(h, probs.shape[1], nkb_f, fb).sum(-1).mean(1)
    kp = block_means(k, fb)[kvh]  # [h, NKBf, D]
    q_hat = q[q_len - probs.shape[1]:].float().mean(0)  # [h, D]
    est = torch.einsum("hd,hkd->hk", q_hat, kp) * scale
    est = est.masked_fill(torch.arange(nkb_f, device=device)[None, :] * fb > qpos[-1], float("-inf"))
    est = torch.softmax(est, dim=-1)
    jsd = sqrt_js_divergence(est, true_blocks)
    query_aware = jsd < tau

    nqb = num_blocks(q_len, block_size)
    nkb = num_blocks(kv_len, block_size)
    min_blocks = -(-min_budget // fb)
    max_blocks = None if max_budget is None else max(1, -(-max_budget // fb))

    # Query-aware candidate: pooled block attention for every query block (Alg. 4, flattened).
    qa_mask = torch.zeros(h, nqb, nkb, dtype=torch.bool, device=device)
    if bool(query_aware.any()):
        qp = block_means(q, fb)  # [h, NQBf, D]
        causal_f = causal_block_mask(q_len, ctx_len, fb, device)
        s = torch.matmul(qp, kp.transpose(-1, -2)) * scale
        a = torch.softmax(s.masked_fill(~causal_f, float("-inf")), dim=-1)  # [h, NQBf, NKBf]
        flat = a.reshape(h, -1)
        keep = keep_top(flat, cumulative_budget(flat, gamma)).view_as(a)
        rows = a.reshape(-1, nkb_f)
        n_rows = rows.shape[0]
        keep |= keep_top(rows, torch.full((n_rows,), min_blocks, device=device)).view_as(a)
        if max_blocks is not None:
            keep &= keep_top(rows, torch.full((n_rows,), max_blocks, device=device)).view_as(a)
        keep |= diagonal_block_mask(q_len, ctx_len, fb, device)[None]
        keep[:, :, 0] = True
        qa_mask = rescale_block_mask(keep & causal_f, fb, block_size, nqb, nkb)

    # Vertical-slash candidate from the representative queries (Alg. 3).
    vertical, slash = vertical_and_slash_sums(probs, qpos)
    lo = min(min_budget, kv_len)
    hi = kv_len if max_budget is None else min(max_budget, kv_len)
    kv_cnt = cumulative_budget(vertical, gamma).clamp(min=lo, max=hi)
    ks_cnt = cumulative_budget(slash, gamma).clamp(min=lo, max=hi)
    v_keep = keep_top(vertical, kv_cnt)
    s_keep = keep_top(slash, ks_cnt)
    s_keep[:, 0] = True  # the main diagonal: every query sees itself
    # aligned blocks (not ranges): the first key block is always listed on top, and the
    # query-aware branch is a block mask that this one is switched against per head
    vs = vertical_slash_to_selection(v_keep, s_keep, q_len, ctx_len, block_size, slash_tiles="blocks")
    vs.block_mask[:, :, 0] = True  # the first key block (attention sinks)

    qa = query_aware[:, None, None]
    block_mask = torch.where(qa, qa_mask, vs.block_mask)
    column_keep = vs.column_keep & ~query_aware[:, None]
    return PatternSelection(block_mask, vs.columns, column_keep), FlexDecision(query_aware, jsd)


class FlexPrefillSettings(PatternGroup):
    """FlexPrefill settings, ``settings.patterns.flex_prefill``."""

    gamma: float = Field(0.95, gt=0.0, le=1.0, description="FlexPrefill cumulative attention to cover.")
    tau: float = Field(0.1, ge=0.0, le=1.0, description="FlexPrefill sqrt-JSD threshold for query-aware heads.")
    block_size: int = Field(128, json_schema_extra={"flat": "flex_block_size"},
                            description="FlexPrefill block size (64 or 128).")
    min_budget: int = Field(1024, ge=0, description="FlexPrefill minimum tokens per head (vertical and slash).")
    max_budget: int | None = Field(None, ge=1, description="FlexPrefill maximum tokens per head, none = unbounded.")

    @model_validator(mode="after")
    def _check(self) -> "FlexPrefillSettings":
        v = self.block_size
        if v < 16 or v > 256 or v & (v - 1):
            raise ValueError(f"flex_block_size={v}: must be a power of two between 16 and 256")
        if self.max_budget is not None and self.max_budget < self.min_budget:
            raise ValueError(f"max_budget={self.max_budget} is below min_budget={self.min_budget}")
        return self

    def check_with(self, settings) -> None:
        if self.block_size % settings.block_size and settings.block_size % self.block_size:
            raise ValueError("flex_block_size and block_size must divide one another")


class FlexPrefill(Pattern):
    """Per input, each head is query-aware or vertical-slash (the stats count both labels)."""

    name = "flex_prefill"
    head_params = per_head_params(FlexPrefillSettings, "gamma")
    settings_model = FlexPrefillSettings
    group_shareable = False  # the per-head query-aware decision has no group form

    def keys_per_query(self, head, kv_len, visible, settings):
        return settings.patterns.flex_prefill.min_budget

    def covers_every_key(self, head, kv_len, settings):
        # both its vertical-slash lines and its query-aware blocks then keep everything
        return settings.patterns.flex_prefill.min_budget >= kv_len

    def select(self, q, k, kvh, ctx_len, params, settings, scale, share):
        flex = settings.patterns.flex_prefill
        sel, decision = flex_prefill_selection(
            q, k, kvh, ctx_len, params["gamma"].float(), tau=flex.tau, flex_block_size=flex.block_size,
            min_budget=flex.min_budget, max_budget=flex.max_budget, block_size=settings.block_size, scale=scale)
        n_qa = int(decision.query_aware.sum())
        return sel, {f"{self.name}/query_aware": n_qa, f"{self.name}/vertical_slash": q.shape[1] - n_qa}

    def estimate_paged(self, q_row, key_cache, block_table_row, ctx_len, group: HeadGroup, num_lists, settings,
                       scale, share, k_scale=None):
        if share > 1:
            raise ValueError("FlexPrefill heads cannot share one selection per KV group")
        flex = settings.patterns.flex_prefill
        gamma = torch.full((num_lists,), flex.gamma, dtype=torch.float32, device=q_row.device)
        gamma[group.ids] = group.params["gamma"].float()
        ix, qa = estimate.flex_prefill_index(
            q_row, key_cache, block_table_row, ctx_len, gamma, tau=flex.tau, flex_block_size=flex.block_size,
            min_budget=flex.min_budget, max_budget=flex.max_budget, block_size=settings.block_size, scale=scale,
            k_scale=k_scale)
        if not group.all_heads:
            ix, qa = ix.map_lists(lambda t: t[group.ids]), qa[group.ids]
        return PagedSelection(ix, HeadSplit(self.name, f"{self.name}/query_aware", f"{self.name}/vertical_slash",
                                            qa.sum()))
