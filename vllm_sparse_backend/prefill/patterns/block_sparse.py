"""Block-sparse heads (MInference Alg. 3): top-k key blocks per query block.

Three ways to score a block (``block_scoring``): MInference's mean-pooled Q . mean-pooled K
(softmax does not change a row's top-k); the estimated softmax mass of each block from the
anti-diagonals of strided cells (``antidiagonal``, XAttention's scoring,
:func:`vllm_sparse_kernels.prefill.estimate_math.antidiagonal_block_mass`); or the real attention
mass of a few sampled queries of each query block (``sampled``,
:func:`vllm_sparse_kernels.prefill.estimate_math.sampled_block_mass`). The last two can also keep
only the fewest blocks reaching ``block_mass`` of a row's mass (at most top-k). The diagonal
blocks are always kept (they count toward k, except that both are kept when an unaligned chunk
has two) so that every query sees at least its own position."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from vllm_sparse_kernels.prefill.estimate_math import mass_block_counts, scored_block_mass
from vllm_sparse_kernels.kv_quant import scale_operand
from vllm_sparse_kernels.kv_layout import gather_pages

from ...config import PatternGroup
from ...kernels import estimate
from ..index import causal_block_mask, diagonal_block_mask
from .base import (HeadGroup, PagedSelection, Pattern, PatternSelection, SearchKnob, block_means, keep_top,
                   per_head_params, sum_head_groups)


def block_sparse_selection(q: torch.Tensor, k: torch.Tensor, kvh: torch.Tensor, ctx_len: int,
                           topk_blocks: torch.Tensor, *, block_size: int, share: int = 1,
                           scoring: str = "pooled", stride: int = 16, block_mass: float | None = None,
                           scale: float | None = None, samples: int = 2) -> PatternSelection:
    """``share`` > 1: every ``share`` consecutive heads (one KV group) get one selection, from
    their scores added up (pooled: the group's summed pooled query against the pooled keys;
    antidiagonal, sampled: the group's summed block mass). ``scoring="antidiagonal"`` and
    ``"sampled"`` (``samples`` queries per query block) need ``scale``."""
    q_len = q.shape[0]
    topk_blocks = topk_blocks[::share]
    if scoring != "pooled":
        # K per query head (any head subset); the GPU path maps KV heads without copying
        scores = scored_block_mass(scoring, q, k[:, kvh], ctx_len, block_size, scale, share, stride=stride,
                                   samples=samples)
        counts = mass_block_counts(scores, topk_blocks, block_mass)
    else:
        qp = sum_head_groups(block_means(q, block_size), share)  # [h / share, NQB, D]
        kp = block_means(k, block_size)[kvh[::share]]  # [h / share, NKB, D]
        scores = torch.matmul(qp, kp.transpose(-1, -2))
        counts = topk_blocks.repeat_interleave(scores.shape[1])
    causal = causal_block_mask(q_len, ctx_len, block_size, q.device)
    diag = diagonal_block_mask(q_len, ctx_len, block_size, q.device)
    scores = scores.masked_fill(~causal, float("-inf")).masked_fill(diag, float("inf"))
    h, nqb, nkb = scores.shape
    keep = keep_top(scores.reshape(h * nqb, nkb), counts)
    # A chunk that starts mid-block has two diagonal blocks; both stay even when k = 1.
    return PatternSelection.blocks_only((keep.view(h, nqb, nkb) | diag) & causal).repeat_heads(share)


def row_keys(key_cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int, dtype: torch.dtype,
             k_scale=None) -> torch.Tensor:
    """The row's keys, contiguous [kv_len, Hkv, D] of ``dtype``, dequantised with ``k_scale``
    from an fp8 cache: one gather of every key (2 bytes x Hkv x D per token, 64 MiB at 128K for
    2 KV heads of 128), for the block scorings' torch matmuls (``block_scoring`` other than pooled)."""
    k = gather_pages(key_cache, block_table_row, kv_len).to(dtype)
    ks = scale_operand(k_scale, key_cache.device)
    return k if ks is None else k * ks.to(dtype)


class BlockSparseSettings(PatternGroup):
    """Block-sparse settings, ``settings.patterns.block_sparse``: MInference's scoring and the
    two experimental ones."""

    topk_blocks: int = Field(100, ge=1, description="Key blocks per query block for block-sparse heads.")
    scoring: Literal["pooled", "antidiagonal", "sampled"] = Field(
        "pooled", json_schema_extra={"flat": "block_scoring"}, description=(
            "How block-sparse heads score key blocks: pooled = mean-pooled Q . K (MInference); antidiagonal = "
            "estimated softmax mass from anti-diagonals of stride x stride cells (XAttention); sampled = exact "
            "attention of block_samples queries of each query block. The last two are experiments."))
    samples: int = Field(2, ge=1, le=256, json_schema_extra={"flat": "block_samples"}, description=(
        "Sampled block scores: queries per query block (block_size of them = the exact block mass)."))
    antidiagonal_stride: int = Field(16, description="Anti-diagonal scoring: cell size (a power of two dividing "
                                                     "block_size; 1 / stride of the QK work).")
    block_mass: float | None = Field(None, gt=0.0, le=1.0, description=(
        "Anti-diagonal or sampled scoring: keep the fewest key blocks reaching this share of a query block's "
        "estimated mass (at most topk_blocks); none = always topk_blocks."))

    @model_validator(mode="after")
    def _check(self) -> "BlockSparseSettings":
        if self.block_mass is not None and self.scoring == "pooled":
            raise ValueError("block_mass applies to block_scoring=antidiagonal or sampled only")
        return self

    def check_with(self, settings) -> None:
        s = self.antidiagonal_stride
        if s < 1 or s & (s - 1) or settings.block_size % s:
            raise ValueError(f"antidiagonal_stride={s}: must be a power of two dividing "
                             f"block_size={settings.block_size}")


class BlockSparse(Pattern):
    name = "block_sparse"
    head_params = per_head_params(BlockSparseSettings, "topk_blocks")
    settings_model = BlockSparseSettings
    # the top-k grows; served after pooled scores for every query block
    search = SearchKnob("block", "topk_blocks", serving_cost=2)

    def keys_per_query(self, head, kv_len, visible, settings):
        return head.param("topk_blocks") * settings.block_size

    def covers_every_key(self, head, kv_len, settings):
        return head.param("topk_blocks") >= -(-kv_len // settings.block_size)

    def select(self, q, k, kvh, ctx_len, params, settings, scale, share):
        bs = settings.patterns.block_sparse
        sel = block_sparse_selection(q, k, kvh, ctx_len, params["topk_blocks"], block_size=settings.block_size,
                                     share=share, scoring=bs.scoring, stride=bs.antidiagonal_stride,
                                     block_mass=bs.block_mass, scale=scale, samples=bs.samples)
        return sel, {self.name: q.shape[1]}

    def estimate_paged(self, q_row, key_cache, block_table_row, ctx_len, group: HeadGroup, num_lists, settings,
                       scale, share, k_scale=None):
        # scored for every list of the layer (one pass), the group's lists picked after
        q_len, b = q_row.shape[0], settings.block_size
        topk = torch.full((num_lists,), 1, dtype=torch.int64, device=q_row.device)
        topk[group.ids] = group.params["topk_blocks"].to(torch.int64)
        max_topk = int(group.max_params["topk_blocks"])
        bs = settings.patterns.block_sparse
        if bs.scoring != "pooled":
            k_row = row_keys(key_cache, block_table_row, ctx_len + q_len, q_row.dtype, k_scale)
            mass = scored_block_mass(bs.scoring, q_row, k_row, ctx_len, b, scale, share,
                                     stride=bs.antidiagonal_stride, samples=bs.samples)
            ix = estimate.mass_block_index(mass, topk, q_len, ctx_len, b, max_topk, bs.block_mass)
        else:
            pooled = estimate.pooled_keys(key_cache, block_table_row, ctx_len + q_len, b, k_scale)
            ix = estimate.block_sparse_index(q_row, pooled, ctx_len, topk, b, max_topk=max_topk, share=share)
        return PagedSelection(ix if group.all_heads else ix.map_lists(lambda t: t[group.ids]))
