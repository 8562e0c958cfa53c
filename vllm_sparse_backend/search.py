"""Kernel-aware offline pattern search (MInference Alg. 1), on captured Q/K/V of one layer.

For each head, every candidate pattern is tuned to the same *kernel cost* — the key tiles the
block+column kernel actually processes for this input (a listed key block is one tile per query
block; single columns are gathered 64 per tile), measured on the index the estimator builds, not
a nominal FLOP count — and the candidate whose output is closest to dense attention's output
(relative L2 error, the paper's objective) wins. Offline tool: heads are searched one by one.

The model-running part (:func:`search_model`, the ``vllm-sparse search-patterns`` command) captures
each layer's Q/K/V with transformers and runs :func:`layer_candidates` on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import PatternName, SparseSettings
from .head_configs import HeadPattern, resolve_head
from .index import SparseIndex, build_index, causal_block_mask
from .patterns import estimate_index
from .reference import sparse_attention

COLUMNS_PER_TILE = 64


def kernel_tiles(index: SparseIndex) -> int:
    """Key tiles the sparse kernel processes for this index (all heads, all query blocks)."""
    cols = (index.column_count.to(torch.int64) + COLUMNS_PER_TILE - 1) // COLUMNS_PER_TILE
    return int(index.block_count.to(torch.int64).sum() + cols.sum())


def causal_tiles(q_len: int, ctx_len: int, block_size: int, num_heads: int = 1) -> int:
    return num_heads * int(causal_block_mask(q_len, ctx_len, block_size).sum())


@dataclass
class CandidateResult:
    family: tuple  # its FAMILIES entry: (PatternName, vertical-slash ratio or None)
    pattern: HeadPattern
    tiles: int
    error: float  # ||y - y_dense|| / ||y_dense||


# Candidate families: one scalar knob each, scaled to reach a tile budget. Vertical-slash comes in
# three diagonal:column ratios (MInference's shipped budgets range from 8:1 to 1:35), A-shape keeps
# one block of sink tokens, block-sparse scales its top-k.
VS_RATIOS = (8.0, 1.0, 0.125)
FAMILIES = ((PatternName.A_SHAPE, None),) + tuple((PatternName.VERTICAL_SLASH, r) for r in VS_RATIOS) + \
    ((PatternName.BLOCK_SPARSE, None),)


def _candidate(pattern: PatternName, knob: int, ratio: float | None = None) -> HeadPattern:
    if pattern is PatternName.VERTICAL_SLASH:
        return HeadPattern(pattern=pattern, vertical_size=max(1, knob), slash_size=max(1, round(ratio * knob)))
    if pattern is PatternName.A_SHAPE:
        return HeadPattern(pattern=pattern, sink_tokens=64, local_window=max(1, knob))
    if pattern is PatternName.BLOCK_SPARSE:
        return HeadPattern(pattern=pattern, topk_blocks=max(1, knob))
    raise ValueError(f"no search knob for {pattern}")


def _index(q, k, ctx_len, hp: HeadPattern, settings: SparseSettings, scale: float) -> SparseIndex:
    return estimate_index(q, k, ctx_len, [resolve_head(hp, settings)], settings, scale).index


def _tune(pattern: PatternName, ratio: float | None, q, k, ctx_len, target_tiles: int, settings: SparseSettings,
          scale: float, max_knob: int) -> tuple[HeadPattern, SparseIndex, int]:
    """Largest knob whose index stays within the tile budget (binary search: cost grows with the
    knob); the smallest knob if even that is over budget."""
    lo, hi, best = 1, max_knob, None
    while lo <= hi:
        mid = (lo + hi) // 2
        hp = _candidate(pattern, mid, ratio)
        index = _index(q, k, ctx_len, hp, settings, scale)
        tiles = kernel_tiles(index)
        if tiles <= target_tiles:
            best, lo = (hp, index, tiles), mid + 1
        else:
            hi = mid - 1
    if best is None:
        hp = _candidate(pattern, 1, ratio)
        index = _index(q, k, ctx_len, hp, settings, scale)
        best = (hp, index, kernel_tiles(index))
    return best


# When errors tie (within TIE_TOLERANCE, relative), prefer the pattern that is cheaper to serve:
# A-shape needs no estimation, vertical-slash a last-64-query pass, block-sparse pooled scores
# for every query block.
SERVING_PREFERENCE = (PatternName.A_SHAPE, PatternName.VERTICAL_SLASH, PatternName.BLOCK_SPARSE)
TIE_TOLERANCE = 0.05


def pick_family(errors: dict[tuple, float]) -> tuple:
    """The family with the lowest error; ties (TIE_TOLERANCE, relative) go by SERVING_PREFERENCE."""
    best = min(errors.values())
    tied = [f for f, e in errors.items() if e <= best * (1 + TIE_TOLERANCE) + 1e-9]
    return min(tied, key=lambda f: SERVING_PREFERENCE.index(f[0]))


def search_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, density: float,
                settings: SparseSettings, scale: float, families=FAMILIES) -> list[CandidateResult]:
    """Candidates for one head (q [q_len, 1, D], k/v [kv_len, 1, D]) at ``density`` of the causal
    tiles, best first: lowest error, ties (see TIE_TOLERANCE) broken by SERVING_PREFERENCE."""
    q_len, b = q.shape[0], settings.block_size
    kv_len = k.shape[0]
    full = build_index(causal_block_mask(q_len, ctx_len, b)[None].clone(), b, q_len, ctx_len)
    dense, _ = sparse_attention(q, k, v, full, ctx_len, scale)
    norm = dense.double().norm().clamp_min(1e-30)
    target = max(1, int(density * causal_tiles(q_len, ctx_len, b)))
    results = []
    for pattern, ratio in families:
        max_knob = kv_len if pattern is not PatternName.BLOCK_SPARSE else -(-kv_len // b)
        hp, index, tiles = _tune(pattern, ratio, q, k, ctx_len, target, settings, scale, max_knob)
        out, _ = sparse_attention(q, k, v, index, ctx_len, scale)
        err = float((out.double() - dense.double()).norm() / norm)
        results.append(CandidateResult((pattern, ratio), hp, tiles, err))
    first = pick_family({r.family: r.error for r in results})
    return sorted(results, key=lambda r: (r.family != first, r.error))


def layer_candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, density: float,
                     settings: SparseSettings, scale: float, ctx_len: int = 0) -> list[list[CandidateResult]]:
    """:func:`search_head` for every query head of one layer (q [q_len, H, D], k/v [kv_len, Hkv, D])."""
    group = q.shape[1] // k.shape[1]
    return [search_head(q[:, h:h + 1], k[:, h // group: h // group + 1], v[:, h // group: h // group + 1],
                        ctx_len, density, settings, scale) for h in range(q.shape[1])]


def search_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, density: float, settings: SparseSettings,
                 scale: float, ctx_len: int = 0) -> list[HeadPattern]:
    """Best pattern per query head of one layer, with its relative output error as the ``score``."""
    return [res[0].pattern.model_copy(update={"score": res[0].error})
            for res in layer_candidates(q, k, v, density, settings, scale, ctx_len)]


# ---------------------------------------------------------------------------------------------
# Whole model: capture each layer's Q/K/V with transformers on calibration prompts, search.
# ---------------------------------------------------------------------------------------------

def capture_qkv(model_dir: str, token_ids: list[int]) -> tuple[dict[int, tuple], dict]:
    """Run the model (transformers, CPU or CUDA, fp32) once on ``token_ids``; return per layer
    (q [L, H, D], k [L, Hkv, D], v [L, Hkv, D], scale) after rotary embedding, and the config."""
    from .evaluation.attention_check import capture_attention

    captured: dict[int, tuple] = {}

    def keep(layer, q, k, v, scale, out):
        captured[layer] = (q, k, v, scale)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = capture_attention(model_dir, token_ids, keep, device=device)
    return captured, config


def search_model(model_dir: str, samples: list[list[int]], density: float, settings: SparseSettings,
                 model_name: str, source: str, log=print):
    """Head-config file for a model: per layer and head, the candidate family with the lowest mean
    error over the calibration samples; its budgets from the first sample's tuning."""
    from .head_configs import FORMAT_NAME, HeadConfigFile, LayerHeads

    per_sample = []  # [sample][layer][head] -> {family: CandidateResult}
    for n, ids in enumerate(samples):
        captured, _ = capture_qkv(model_dir, ids)
        layers = []
        for li in sorted(captured):
            q, k, v, scale = captured[li]
            heads = layer_candidates(q, k, v, density, settings, scale)
            layers.append([{r.family: r for r in res} for res in heads])
            log(f"sample {n}: layer {li}: " + ", ".join(res[0].pattern.pattern.value for res in heads))
        per_sample.append(layers)
    out_layers = []
    for li, layer in enumerate(per_sample[0]):
        heads = []
        for h, first in enumerate(layer):
            mean = {f: sum(s[li][h][f].error for s in per_sample) / len(per_sample) for f in first}
            family = pick_family(mean)
            heads.append(first[family].pattern.model_copy(update={"score": round(mean[family], 6)}))
        out_layers.append(LayerHeads(heads=heads))
    import transformers
    return HeadConfigFile(
        format=FORMAT_NAME, version=1, model=model_name, num_layers=len(out_layers),
        num_heads=len(out_layers[0].heads),
        produced_by=(f"vllm-sparse search-patterns: {len(samples)} calibration prompt(s) of "
                     f"{len(samples[0])} tokens from {source}; candidates tuned to {density:.0%} of the "
                     f"causal key tiles; score = relative output error vs dense (transformers "
                     f"{transformers.__version__}, torch {torch.__version__})"),
        settings={"density": density, "block_size": settings.block_size, "last_q": settings.last_q,
                  "families": [[p.value, r] for p, r in FAMILIES]},
        layers=out_layers)

