"""Attention-level check on a real model, no generation: how much of the true attention does the
sparse selection keep?

transformers runs the model once on a real prompt with a custom attention function that hands
each layer's post-RoPE Q, K, V (and the layer's own SDPA output) to a callback. For every layer
and every variant, the project's estimators (:func:`vllm_sparse_backend.patterns.estimate_index`)
build the sparse index from that Q/K exactly as the backend would, and against exact dense
attention we measure

* **recall**: the share of each query's true softmax mass that falls on the selected keys,
  averaged over heads and queries (1.0 = nothing that matters was skipped);
* **output error**: ``||o_sparse - o_dense|| / ||o_dense||`` over the sampled queries, where
  ``o_sparse`` is softmax over the selected keys only (what the sparse kernel computes);
* **density**: the selected share of the causal (query, key) pairs, exact, from the index.

The metric rows are computed for a stratified sample of query positions (``rows``; all of them
for short prompts), a tile of queries at a time against all keys (float32 scores, float64 sums),
so no n x n matrix is ever formed. Unlike task accuracy this stays meaningful beyond the length
a model was trained for.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

from ..head_configs import layer_heads, load_head_config
from ..index import SparseIndex, count_pairs, num_blocks
from ..patterns import estimate_index
from ..reference import causal_pairs, kv_head_map
from .variants import Variant


def sample_rows(n: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` query positions out of ``n``: one at random in each of ``count`` equal strata
    (all positions when ``count >= n``). Sorted, int64."""
    if count >= n:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed)
    edges = torch.linspace(0, n, count + 1)
    lo, hi = edges[:-1].floor().long(), edges[1:].floor().long()
    offs = (torch.rand(count, generator=g) * (hi - lo).clamp(min=1)).long()
    return torch.minimum(lo + offs, torch.full_like(lo, n - 1))


def allowed_keys(index: SparseIndex, rows: torch.Tensor, kv_len: int, ctx_len: int = 0,
                 causal: bool = True) -> torch.Tensor:
    """bool [H, len(rows), kv_len]: the keys the index lets each given query row use (rows are
    positions within the chunk), causality applied unless ``causal`` is False (for callers whose
    probabilities are already 0 past the query)."""
    b = index.block_size
    h = index.num_heads
    qb = rows // b
    nkb = num_blocks(kv_len, b)
    blocks = index.block_index[:, qb].to(torch.int64)  # [H, T, MAXB], -1 padded
    t = rows.shape[0]
    mask_b = torch.zeros(h, t, nkb + 1, dtype=torch.bool)
    mask_b.scatter_(2, torch.where(blocks >= 0, blocks, nkb), True)
    mask = mask_b[..., :nkb].repeat_interleave(b, dim=-1)[..., :kv_len]
    cols = index.column_index[:, qb].to(torch.int64)  # [H, T, MAXC]
    if cols.shape[-1]:
        mask_c = torch.zeros(h, t, kv_len + 1, dtype=torch.bool)
        mask_c.scatter_(2, torch.where(cols >= 0, cols, kv_len), True)
        mask = mask | mask_c[..., :kv_len]
    if not causal:
        return mask
    return mask & (torch.arange(kv_len)[None, :] <= (rows + ctx_len)[:, None])[None]


@dataclass
class SelectionStats:
    """Per head: summed recall over rows, squared error and squared dense norm (float64)."""

    recall_sum: torch.Tensor  # [H]
    err_sq: torch.Tensor  # [H]
    ref_sq: torch.Tensor  # [H]
    rows: int

    @property
    def recall_per_head(self) -> torch.Tensor:
        return self.recall_sum / max(1, self.rows)

    @property
    def error_per_head(self) -> torch.Tensor:
        return (self.err_sq / self.ref_sq.clamp_min(1e-300)).sqrt()

    @property
    def error(self) -> float:
        return float((self.err_sq.sum() / self.ref_sq.sum().clamp_min(1e-300)).sqrt())


def selection_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    indices: Sequence[SparseIndex], rows: torch.Tensor, tile: int = 64,
                    reference_out: torch.Tensor | None = None) -> tuple[list[SelectionStats], float]:
    """Recall and output error of several indices of one layer (q [n, H, D], k/v [n, Hkv, D],
    a pure prefill: query i sits at position i).

    Returns one :class:`SelectionStats` per index and, when ``reference_out`` ([n, H, Dv], e.g.
    the model's own attention output) is given, the largest relative difference between it and
    the dense output computed here on the sampled rows (a check of the capture itself).
    """
    n, h, _ = q.shape
    kvh = kv_head_map(h, k.shape[1])
    kh = k.transpose(0, 1).float()[kvh]  # [H, n, D]: one gather per layer, reused by every tile
    vh = v.transpose(0, 1).float()[kvh]  # [H, n, Dv]
    stats = [SelectionStats(torch.zeros(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64),
                            torch.zeros(h, dtype=torch.float64), int(rows.numel())) for _ in indices]
    ref_diff = 0.0
    for t0 in range(0, rows.numel(), tile):
        rr = rows[t0:t0 + tile]
        qt = q[rr].transpose(0, 1).float()  # [H, T, D]
        s = torch.matmul(qt, kh.transpose(-1, -2)) * scale  # [H, T, n]
        s.masked_fill_(torch.arange(n)[None, None, :] > rr[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        del s
        dense = torch.matmul(p, vh).double()  # [H, T, Dv]
        if reference_out is not None:
            ref = reference_out[rr].transpose(0, 1).double()
            ref_diff = max(ref_diff, float((ref - dense).norm() / dense.norm().clamp_min(1e-30)))
        for st, index in zip(stats, indices):
            pm = p * allowed_keys(index, rr, n, causal=False)  # p is 0 past each query already
            kept = pm.sum(-1, dtype=torch.float64)  # [H, T]
            sparse = torch.matmul(pm, vh).double() / kept.clamp_min(1e-300)[..., None]
            st.recall_sum += kept.sum(-1)
            st.err_sq += ((sparse - dense) ** 2).sum((-1, -2))
            st.ref_sq += (dense ** 2).sum((-1, -2))
    return stats, ref_diff


# ---------------------------------------------------------------------------------------------
# Per layer and variant
# ---------------------------------------------------------------------------------------------

@dataclass
class LayerResult:
    layer: int
    variant: str
    density: float  # selected share of the causal (query, key) pairs, exact
    recall: float  # mean over heads and sampled rows of the kept softmax mass
    recall_min_head: float  # the worst head's mean recall
    error: float  # relative L2 output error over all heads and sampled rows
    error_max_head: float
    head_patterns: dict[str, int]


class LayerChecker:
    """Callable per captured layer: estimates each variant's index and measures it."""

    def __init__(self, variants: Sequence[Variant], rows: int = 1024, seed: int = 0,
                 base_settings: dict[str, Any] | None = None, tile: int = 64):
        self.variants = [v for v in variants if not v.dense]
        self.settings = {v.label: v.settings(**(base_settings or {})) for v in self.variants}
        self.head_files = {label: load_head_config(s.head_config)
                           for label, s in self.settings.items() if s.head_config}
        self.rows, self.seed, self.tile = rows, seed, tile
        self.results: list[LayerResult] = []
        self.capture_diff = 0.0  # largest relative difference, our dense vs the model's output

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 model_out: torch.Tensor | None = None) -> list[LayerResult]:
        n, h, _ = q.shape
        indices, patterns = [], []
        for var in self.variants:
            s = self.settings[var.label]
            heads = layer_heads(self.head_files.get(var.label), s, layer, h)
            est = estimate_index(q, k, 0, heads, s, scale)
            indices.append(est.index)
            patterns.append(dict(est.head_patterns))
        rows = sample_rows(n, self.rows, self.seed + layer)
        stats, diff = selection_stats(q, k, v, scale, indices, rows, self.tile, model_out)
        self.capture_diff = max(self.capture_diff, diff)
        causal = causal_pairs(n, 0, h)
        out = []
        for var, index, st, pat in zip(self.variants, indices, stats, patterns):
            out.append(LayerResult(layer, var.label, count_pairs(index, n, 0) / causal,
                                   float(st.recall_per_head.mean()), float(st.recall_per_head.min()),
                                   st.error, float(st.error_per_head.max()), pat))
        self.results.extend(out)
        return out


def summarize(results: Sequence[LayerResult]) -> dict[str, dict[str, float]]:
    """Per variant over layers: mean density, mean and minimum recall, mean and maximum error."""
    out: dict[str, dict[str, float]] = {}
    for label in dict.fromkeys(r.variant for r in results):
        rs = [r for r in results if r.variant == label]
        out[label] = {"layers": len(rs),
                      "density": statistics.fmean(r.density for r in rs),
                      "recall": statistics.fmean(r.recall for r in rs),
                      "recall_min_layer": min(r.recall for r in rs),
                      "recall_min_head": min(r.recall_min_head for r in rs),
                      "error": statistics.fmean(r.error for r in rs),
                      "error_max_layer": max(r.error for r in rs)}
    return out


def results_json(results: Sequence[LayerResult]) -> list[dict]:
    return [asdict(r) for r in results]


# ---------------------------------------------------------------------------------------------
# Capture from a transformers model
# ---------------------------------------------------------------------------------------------

_ATTENTION_NAME = "vllm_sparse_eval_capture"


def capture_attention(model_dir: str, token_ids: Sequence[int],
                      on_layer: Callable[..., Any], device: str = "cpu") -> dict:
    """Run the model's decoder (fp32, no LM head) once on ``token_ids``; for each attention layer
    call ``on_layer(layer, q [n, H, D], k [n, Hkv, D], v [n, Hkv, Dv], scale, out [n, H, Dv])``
    with post-RoPE tensors and the layer's own (SDPA) output. Returns the model config dict."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask,
                                              scaling=scaling, **kwargs)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        on_layer(module.layer_idx, query[0].transpose(0, 1).detach().cpu(),
                 key[0].transpose(0, 1).detach().cpu(), value[0].transpose(0, 1).detach().cpu(),
                 float(scaling), out[0].detach().cpu())
        return out, weights

    AttentionInterface.register(_ATTENTION_NAME, attention)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=_ATTENTION_NAME,
                                                 dtype=torch.float32)
    model.to(device).eval()
    with torch.no_grad():
        # The decoder only: the LM head over every position would need n x vocab floats
        # (20 GB for Qwen2.5 at 32K), and no logits are needed here.
        model.model(torch.tensor([list(token_ids)], device=device), use_cache=False)
    return model.config.to_dict()
