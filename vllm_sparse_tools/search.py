"""Kernel-aware offline pattern search (MInference Alg. 1), batched over heads.

For each head (or, by default, each KV group: the heads that share one key selection in the
backend, ``kv_group_shared``), every candidate family is tuned to the same *kernel cost* — the key
tiles the block+column kernel actually processes for this input (a listed key block is one tile
per query block; single columns are gathered 64 per tile), a share ``density`` of the causal key
tiles — and the candidate whose output is closest to dense attention's output (relative L2 error,
the paper's objective) wins.

Batched: one layer's statistics (the last queries' column and diagonal sums) are computed once
for all heads; the vertical-slash knob is found by a bisection run for all heads and ratios at
once on tile counts computed from ranks (no re-estimation per step, no host sync per step);
A-shape and block-sparse costs do not depend on the data and come from tables built once per
prompt length. The candidates are the registered patterns that declare a search knob
(``Pattern.search``); one without an exact count here is tuned by a bisection on its estimator's
own index (:func:`tune_by_estimator`), so a new pattern needs no edit here. Each family's tuned
selection is then built by the backend's own estimator
(:func:`vllm_sparse_backend.prefill.patterns.estimate_index`, group-shared exactly as the backend decides
it) and scored against dense attention on sampled query rows (the prompt's last rows included), a
tile of queries at a time against all keys (:func:`.evaluation.attention_check.selection_stats`):
no n x n matrix is ever formed, everything stays on the device of the captured tensors.

The model-running part (:func:`search_model`, the ``vllm-sparse search-patterns`` command) runs
the model with transformers on calibration prompts at the serving length, searches each layer in
the capture callback (no layer's Q/K/V is kept), and writes the head-config file; a partial state
file after every layer lets a killed run resume.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_backend.head_configs import FORMAT_NAME, HeadConfigFile, HeadPattern, LayerHeads, resolve_head, save_head_config
from vllm_sparse_backend.prefill.index import causal_block_mask, num_blocks, range_cover
from vllm_sparse_backend.prefill.estimate import estimate_index
from vllm_sparse_backend.prefill.patterns import PATTERNS
from vllm_sparse_backend.prefill.patterns.a_shape import a_shape_selection
from vllm_sparse_backend.prefill.patterns.base import (Pattern, SearchKnob, last_queries_probs, sum_head_groups,
                                                       vertical_and_slash_sums)
from vllm_sparse_backend.prefill.patterns.vertical_slash import slash_block_mask, slash_ranges
from vllm_sparse_backend.prefill.budgets import budget_density, kv_group_share
from vllm_sparse_backend.prefill.patterns.vertical_slash import vs_budgets
from vllm_sparse_kernels.kv_layout import kv_head_map
from .evaluation.attention_check import (COLUMNS_PER_TILE, CaptureModel, LayerChecker, capture_attention,
                                         kernel_tiles_per_head, resolve_device, rope_description, score_rows,
                                         selection_stats)
from .evaluation.variants import Variant


@dataclass
class CandidateResult:
    family: tuple  # its FAMILIES entry: (pattern name, vertical-slash ratio or None)
    pattern: HeadPattern
    tiles: int
    error: float  # ||y - y_dense|| / ||y_dense||


def search_families(patterns: Mapping[str, Pattern] = PATTERNS) -> tuple[tuple[str, float | None], ...]:
    """Candidate families, in the registry's order: one per registered pattern that declares a
    search knob (``Pattern.search``), one per ratio where it has ratios (vertical-slash: its
    diagonal:column ratios)."""
    return tuple(f for name, p in patterns.items() if p.search is not None for f in p.search.families(name))


def _knob(pattern: str) -> SearchKnob:
    p = PATTERNS.get(pattern)
    if p is None or p.search is None:
        raise ValueError(f"no search knob for {pattern}")
    return p.search


FAMILIES = search_families()
# The built-in patterns' knobs, for the exact tile counts below (TileTables, tune_vertical_slash).
VS_RATIOS = _knob("vertical_slash").ratios
SINK_TOKENS = dict(_knob("a_shape").fixed)["sink_tokens"]


def family_name(family: tuple) -> str:
    pattern, ratio = family
    knob = getattr(PATTERNS.get(pattern), "search", None)
    short = knob.label if knob is not None else pattern
    return short if ratio is None else f"{short}{ratio:g}"


def candidate_pattern(pattern: str, knob: int, ratio: float | None = None) -> HeadPattern:
    """The head pattern of a family at a knob value (``Pattern.search``): vertical-slash ``knob``
    columns and ``round(ratio * knob)`` diagonals; A-shape a ``knob``-token window after 64 sink
    tokens; block-sparse ``knob`` key blocks per query block."""
    return HeadPattern(pattern=pattern, **_knob(pattern).head_params(knob, ratio))


_candidate = candidate_pattern  # earlier name


def serving_preference(patterns: Mapping[str, Pattern] = PATTERNS) -> tuple[str, ...]:
    """The searchable patterns, cheapest to serve first (``SearchKnob.serving_cost``; A-shape
    needs no estimation, vertical-slash a last-64-query pass, block-sparse pooled scores for
    every query block)."""
    names = [name for name, p in patterns.items() if p.search is not None]
    return tuple(sorted(names, key=lambda name: patterns[name].search.serving_cost))


# When errors tie (within TIE_TOLERANCE, relative), prefer the pattern that is cheaper to serve.
SERVING_PREFERENCE = serving_preference()
TIE_TOLERANCE = 0.05


def pick_family(errors: dict[tuple, float]) -> tuple:
    """The family with the lowest error; ties (TIE_TOLERANCE, relative) go by SERVING_PREFERENCE."""
    best = min(errors.values())
    tied = [f for f, e in errors.items() if e <= best * (1 + TIE_TOLERANCE) + 1e-9]
    return min(tied, key=lambda f: SERVING_PREFERENCE.index(f[0]))


# ---------------------------------------------------------------------------------------------
# Kernel cost of the candidates
# ---------------------------------------------------------------------------------------------

class TileTables:
    """Per prompt length (a pure prefill of ``n`` queries): the causal tile mask and the kernel
    tiles per head of the data-independent candidates at every knob value — A-shape at windows
    of 1..NKB blocks (a window between two multiples of the block size selects what the next
    multiple does), block-sparse at top-1..NKB (the diagonal block counts toward k)."""

    def __init__(self, n: int, block_size: int, device=None, sink_tokens: int = SINK_TOKENS):
        b = block_size
        self.n, self.block_size = n, b
        self.causal = causal_block_mask(n, 0, b, device)  # [NQB, NKB]
        self.causal_per_head = int(self.causal.sum())
        nkb = num_blocks(n, b)
        ks = torch.arange(1, nkb + 1, device=device)
        self.block_knobs = ks
        self.block_tiles = torch.minimum(ks[:, None], self.causal.sum(1)[None, :]).sum(1)
        self.ashape_knobs = ks * b
        step = max(1, (1 << 24) // max(1, self.causal.numel()))
        parts = []
        for w in self.ashape_knobs.split(step):
            sel = a_shape_selection(torch.full_like(w, sink_tokens), w, n, 0, b)
            parts.append((sel.block_mask & self.causal).sum((1, 2)))
        self.ashape_tiles = torch.cat(parts)

    @staticmethod
    def largest_within(knobs: torch.Tensor, tiles: torch.Tensor, target: int) -> int:
        """The largest knob whose tiles stay within ``target`` (tiles grow with the knob); the
        smallest knob if none does."""
        fits = int((tiles <= target).sum())
        return int(knobs[max(fits, 1) - 1])


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each entry of each row, highest first, ties by position (what ``keep_top``
    keeps: ``ranks < count``)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return ranks


def vs_tiles(v_rank: torch.Tensor, s_rank: torch.Tensor, v_count: torch.Tensor, s_count: torch.Tensor,
             causal: torch.Tensor, block_size: int, slash_tiles: str = "blocks") -> torch.Tensor:
    """Kernel tiles per row of a vertical-slash selection (int64 [X]) of a pure prefill: the top
    ``v_count`` columns and ``s_count`` diagonals by rank ([X, n] each). Slash lines: the key
    ranges of the kept diagonals (``slash_tiles="ranges"``, :func:`slash_ranges`) or the key blocks
    they cross (causal); columns: per query block, the kept causal columns that no range or
    listed block covers, 64 to a tile — what :func:`..index.build_index` lists."""
    x, n = v_rank.shape
    b = block_size
    v_keep = v_rank < v_count[:, None]
    s_keep = s_rank < s_count[:, None]
    if slash_tiles == "ranges":
        r_count, r_start = slash_ranges(s_keep, n, 0, b)  # [X, NQB], [X, NQB, R]
        nqb = r_count.shape[1]
        covered = range_cover(r_start, b, n)  # [X, NQB, n]
        q_last = torch.clamp(torch.arange(nqb, device=v_rank.device) * b + b, max=n) - 1
        reach = torch.arange(n, device=v_rank.device)[None, :] <= q_last[:, None]  # [NQB, n]
        cols = (v_keep[:, None, :] & ~covered & reach[None]).sum(-1)  # [X, NQB]
        col_tiles = (cols + COLUMNS_PER_TILE - 1) // COLUMNS_PER_TILE
        return r_count.to(torch.int64).sum(-1) + col_tiles.sum(-1)
    mask = slash_block_mask(s_keep, n, 0, b) & causal[None]  # [X, NQB, NKB]
    nkb = mask.shape[-1]
    per_block = torch.nn.functional.pad(v_keep.to(torch.int32), (0, nkb * b - n)).view(x, nkb, b).sum(-1)  # [X, NKB]
    cols = torch.bmm((causal[None] & ~mask).float(), per_block.float()[..., None])[..., 0]  # [X, NQB]
    col_tiles = (cols.round().long() + COLUMNS_PER_TILE - 1) // COLUMNS_PER_TILE
    return mask.sum((1, 2)) + col_tiles.sum(-1)


def _vs_floors(n: int, settings: SparseSettings) -> tuple[int, int]:
    """The smallest budgets the estimator runs a row of ``n`` keys with (budgets that grow with
    the row, ``vertical_share`` / ``slash_share``, where the settings have them)."""
    return vs_budgets(1, 1, n, settings)


def vs_max_knob(n: int, ratio: float, max_keys: float | None, settings: SparseSettings) -> int:
    """The largest column budget ``v`` whose budgets (``v`` columns + ``round(ratio * v)``
    diagonals, as the estimator runs them on ``n`` keys) stay within ``max_keys`` keys per query
    (at least 1; ``n`` when ``max_keys`` is None)."""
    if max_keys is None:
        return n
    v_floor, s_floor = _vs_floors(n, settings)
    v = torch.arange(1, n + 1, dtype=torch.float64)
    keys = v.clamp(min=v_floor, max=n) + torch.round(ratio * v).clamp(min=max(1, s_floor), max=n)
    return max(1, int((keys <= max_keys).sum()))


def tune_vertical_slash(vertical: torch.Tensor, slash: torch.Tensor, ratios: Sequence[float], target: int,
                        causal: torch.Tensor, settings: SparseSettings,
                        max_knobs: Sequence[int] | None = None) -> torch.Tensor:
    """Largest column budget ``v`` (diagonals ``round(ratio * v)``) whose selection stays within
    ``target`` tiles, for every selection unit (rows of ``vertical`` / ``slash`` [U, n], the
    scores the estimator ranks, sinks and nearest diagonals already forced) and every ratio at
    once: a bisection of fixed length over [1, max_knobs[ratio] or n], batched, no host sync.
    int64 [R, U]."""
    u, n = vertical.shape
    r = len(ratios)
    device = vertical.device
    v_rank = _ranks(vertical).repeat(r, 1)  # [R*U, n], ratio-major
    s_rank = _ranks(slash).repeat(r, 1)
    ratio = torch.tensor(list(ratios), dtype=torch.float64, device=device).repeat_interleave(u)
    v_floor, s_floor = _vs_floors(n, settings)
    slash_tiles = settings.patterns.vertical_slash.slash_tiles
    lo = torch.ones(r * u, dtype=torch.int64, device=device)
    hi = (torch.full_like(lo, n) if max_knobs is None else
          torch.tensor([min(n, int(m)) for m in max_knobs], dtype=torch.int64, device=device).repeat_interleave(u))
    best = torch.zeros_like(lo)
    for _ in range(n.bit_length() + 1):
        active = lo <= hi
        mid = (lo + hi) // 2
        v_count = mid.clamp(min=v_floor, max=n)
        s_count = torch.round(ratio * mid).long().clamp(min=max(1, s_floor), max=n)
        ok = (vs_tiles(v_rank, s_rank, v_count, s_count, causal, settings.block_size, slash_tiles)
              <= target) & active
        best = torch.where(ok, mid, best)
        lo = torch.where(ok, mid + 1, lo)
        hi = torch.where(active & ~ok, mid - 1, hi)
    return best.clamp(min=1).view(r, u)


def tune_by_estimator(q: torch.Tensor, k: torch.Tensor, family: tuple, target: int, share: int,
                      settings: SparseSettings, scale: float, max_keys: float | None = None) -> torch.Tensor:
    """Largest knob per selection unit whose selection, built by the backend's estimator, stays
    within ``target`` kernel tiles per head (and whose budgets within ``max_keys`` keys per query):
    a bisection over [1, n] for all units at once, on the estimator's own index, for a searchable
    pattern without an exact count above (the tiles must grow with the knob). int64 [U], on the
    CPU; ``settings``: with ``kv_group_shared`` as ``share`` says."""
    pattern, ratio = family
    _knob(pattern)  # a pattern the search cannot scale fails here, naming it
    n, h, _ = q.shape
    units = h // share
    lo = torch.ones(units, dtype=torch.int64)
    hi = torch.full_like(lo, n)
    best = torch.ones_like(lo)
    while bool((lo <= hi).any()):
        active = lo <= hi
        mid = torch.where(active, (lo + hi) // 2, best)
        heads = [resolve_head(candidate_pattern(pattern, int(mid[hh // share]), ratio), settings) for hh in range(h)]
        tiles = kernel_tiles_per_head(estimate_index(q, k, 0, heads, settings, scale).index).cpu()
        ok = active & (tiles.view(units, share).amax(1) <= target)
        if max_keys is not None:
            keys = [PATTERNS[pattern].keys_per_query(heads[u * share], n, (n + 1) / 2, settings) for u in range(units)]
            ok &= torch.tensor(keys) <= max_keys
        best = torch.where(ok, mid, best)
        lo = torch.where(ok, mid + 1, lo)
        hi = torch.where(active & ~ok, mid - 1, hi)
    return best


# ---------------------------------------------------------------------------------------------
# One layer
# ---------------------------------------------------------------------------------------------

@dataclass
class LayerSearch:
    """One layer on one calibration prompt: per family, the tuned knob of every selection unit
    (a KV group when ``share`` > 1, else a query head), the kernel tiles per query head of the
    selection the backend's estimator builds with it, and per query head the squared output
    error and squared dense norm over the sampled rows (float64)."""

    share: int
    families: list  # [[pattern name, ratio or None], ...]
    knobs: list  # [F][U] int
    tiles: list  # [F][H] int
    err_sq: list  # [F][H] float
    ref_sq: list  # [H] float
    target: int  # tiles per head every candidate was tuned to
    causal: int  # causal tiles per head
    seconds: float = 0.0

    def family_keys(self) -> list[tuple]:
        return [(p, r) for p, r in self.families]

    def head_errors(self) -> list[list[float]]:
        return [[(e / max(r, 1e-300)) ** 0.5 for e, r in zip(row, self.ref_sq)] for row in self.err_sq]

    def unit_errors(self) -> list[list[float]]:
        """Relative error of each unit's heads together (the group's selection serves them all)."""
        g = self.share
        out = []
        for row in self.err_sq:
            out.append([(sum(row[u * g:(u + 1) * g]) / max(sum(self.ref_sq[u * g:(u + 1) * g]), 1e-300)) ** 0.5
                        for u in range(len(row) // g)])
        return out

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "LayerSearch":
        return LayerSearch(**d)


def search_layer_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, density: float,
                         settings: SparseSettings, rows: torch.Tensor, *, share: int = 1,
                         families: Sequence[tuple] = FAMILIES, tile: int = 64,
                         tables: TileTables | None = None,
                         max_budget_density: float | None = None) -> LayerSearch:
    """Search one layer of a pure prefill (q [n, H, D], k/v [n, Hkv, D], any device): every family
    tuned to ``density`` of the causal key tiles per head, scored on ``rows``. ``share``: 1 (one
    selection per query head) or the GQA group size (one per KV head, from the group's summed
    scores, as the backend runs ``kv_group_shared``). ``max_budget_density``: also keep every
    candidate's budgets within this share of the keys a query sees on average
    (:func:`vllm_sparse_backend.prefill.budgets.budget_density`, the CUDA backend's check against
    ``max_density``: a layer whose budgets are denser runs dense there)."""
    t0 = time.monotonic()
    n, h, _ = q.shape
    hkv = k.shape[1]
    device = q.device
    if share != 1 and (h % hkv or share != h // hkv):
        raise ValueError(f"share={share}: must be 1 or the GQA group size {h // hkv}")
    units = h // share
    tables = tables if tables is not None else TileTables(n, settings.block_size, device)
    target = max(1, int(density * tables.causal_per_head))
    est_settings = settings.model_copy(update={"kv_group_shared": share > 1})
    max_keys = None
    if max_budget_density is not None and max_budget_density < 1.0:
        max_keys = max_budget_density * (n + 1) / 2  # keys a query of the row sees on average
    knobs: dict[tuple, torch.Tensor] = {}
    vs_families = [f for f in families if f[0] == "vertical_slash"]
    if vs_families:
        kvh = kv_head_map(h, hkv, device)
        vs = settings.patterns.vertical_slash
        probs, qpos = last_queries_probs(q, k, kvh, 0, vs.last_q, scale)
        vertical, slash = vertical_and_slash_sums(probs, qpos)
        del probs
        vertical, slash = sum_head_groups(vertical, share), sum_head_groups(slash, share)
        vertical[:, :vs.keep_first_columns] = float("inf")
        slash[:, :max(1, vs.keep_last_diagonals)] = float("inf")
        tuned = tune_vertical_slash(vertical, slash, [f[1] for f in vs_families], target, tables.causal,
                                    settings, [vs_max_knob(n, f[1], max_keys, settings) for f in vs_families])
        for i, f in enumerate(vs_families):
            knobs[f] = tuned[i]
    big = torch.iinfo(torch.int64).max
    for f in families:
        if f[0] == "a_shape":
            tiles = tables.ashape_tiles
            if max_keys is not None:
                tiles = torch.where(tables.ashape_knobs + SINK_TOKENS <= max_keys, tiles, big)
            knobs[f] = torch.full((units,), tables.largest_within(tables.ashape_knobs, tiles, target))
        elif f[0] == "block_sparse":
            tiles = tables.block_tiles
            if max_keys is not None:
                tiles = torch.where(tables.block_knobs * settings.block_size <= max_keys, tiles, big)
            knobs[f] = torch.full((units,), tables.largest_within(tables.block_knobs, tiles, target))
        elif f[0] != "vertical_slash":  # a pattern with no exact count here: its estimator counts
            knobs[f] = tune_by_estimator(q, k, f, target, share, est_settings, scale, max_keys)
    knob_lists = {f: [int(x) for x in knobs[f].tolist()] for f in families}
    indices = []
    for f in families:
        heads = [resolve_head(candidate_pattern(f[0], knob_lists[f][hh // share], f[1]), est_settings)
                 for hh in range(h)]
        got = kv_group_share(heads, hkv, est_settings)
        if got != share and not (share == 1 and h == hkv):
            raise RuntimeError(f"{family_name(f)}: the estimator would share selections over {got} heads, "
                               f"the search tuned them over {share}")
        indices.append(estimate_index(q, k, 0, heads, est_settings, scale).index)
    stats, _ = selection_stats(q, k, v, scale, indices, rows, tile)
    tiles = torch.stack([kernel_tiles_per_head(ix) for ix in indices]).cpu()
    err = torch.stack([st.err_sq for st in stats]).cpu()
    ref = stats[0].ref_sq.cpu()
    return LayerSearch(share=share, families=[[f[0], f[1]] for f in families],
                       knobs=[knob_lists[f] for f in families], tiles=tiles.tolist(), err_sq=err.tolist(),
                       ref_sq=ref.tolist(), target=target, causal=tables.causal_per_head,
                       seconds=round(time.monotonic() - t0, 3))


def search_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, density: float,
                settings: SparseSettings, scale: float, families=FAMILIES) -> list[CandidateResult]:
    """Candidates for one head (q [q_len, 1, D], k/v [kv_len, 1, D], a pure prefill) at ``density``
    of the causal tiles, scored on every row, best first: lowest error, ties (see TIE_TOLERANCE)
    broken by SERVING_PREFERENCE."""
    return layer_candidates(q, k, v, density, settings, scale, ctx_len, families=families)[0]


def layer_candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, density: float,
                     settings: SparseSettings, scale: float, ctx_len: int = 0, *, share: int = 1,
                     families=FAMILIES, rows: torch.Tensor | None = None) -> list[list[CandidateResult]]:
    """Per query head of one layer (q [q_len, H, D], k/v [kv_len, Hkv, D]), its candidates best
    first (all rows scored unless ``rows``)."""
    if ctx_len:
        raise ValueError("the search runs on pure prefills (ctx_len = 0)")
    n, h, _ = q.shape
    res = search_layer_batched(q, k, v, scale, density, settings,
                               torch.arange(n) if rows is None else rows, share=share, families=families)
    fams = res.family_keys()
    errors = res.head_errors()
    unit_err = res.unit_errors()
    out = []
    for hh in range(h):
        u = hh // share
        cands = [CandidateResult(f, candidate_pattern(f[0], res.knobs[i][u], f[1]), res.tiles[i][hh], errors[i][hh])
                 for i, f in enumerate(fams)]
        first = pick_family({f: unit_err[i][u] for i, f in enumerate(fams)})
        out.append(sorted(cands, key=lambda c: (c.family != first, c.error)))
    return out


def search_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, density: float, settings: SparseSettings,
                 scale: float, ctx_len: int = 0, *, share: int = 1) -> list[HeadPattern]:
    """Best pattern per query head of one layer, with its relative output error as the ``score``."""
    return [res[0].pattern.model_copy(update={"score": res[0].error})
            for res in layer_candidates(q, k, v, density, settings, scale, ctx_len, share=share)]


# ---------------------------------------------------------------------------------------------
# Calibration prompts
# ---------------------------------------------------------------------------------------------

def calibration_prompts(encode: Callable[[str], list[int]], text: str, length: int, samples: int,
                        seed: int = 0) -> list[list[int]]:
    """``samples`` needle-retrieval prompts of exactly ``length`` tokens (MInference searched on
    a retrieval sample): a window of ``text`` (sample i starts at i / samples of the text), a
    passcode sentence at depth (i + 1) / (samples + 1), the question at the end. ``encode``:
    the model's tokenizer without special tokens."""
    rng = random.Random(seed)
    question = encode("\n\nWhat is the secret passcode for the blue door? It is")
    prompts = []
    span = 8 * length  # characters: English prose is ~4 per token, so this leaves room
    for s in range(samples):
        needle = encode(f" The secret passcode for the blue door is {rng.randint(10000, 99999)}. ")
        room = length - len(question) - len(needle)
        if room < 1:
            raise ValueError(f"a {length}-token prompt has no room for text")
        start = max(0, min((len(text) // max(1, samples)) * s, len(text) - span))
        hay = encode(text[start:start + span])[:room]
        if len(hay) < room:
            raise ValueError(f"too little text for a {length}-token prompt ({len(hay)} of {room} tokens "
                             "of text)")
        cut = int(len(hay) * (s + 1) / (samples + 1))
        prompts.append(hay[:cut] + needle + hay[cut:] + question)
    return prompts


# ---------------------------------------------------------------------------------------------
# Whole model
# ---------------------------------------------------------------------------------------------

def _fingerprint(samples: Sequence[Sequence[int]], **kw) -> dict:
    digest = hashlib.sha256(json.dumps([list(s) for s in samples]).encode()).hexdigest()[:16]
    return {"samples_sha256": digest, **kw}


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def aggregate(per_sample: Sequence[Sequence[LayerSearch]], num_heads: int) -> list[list[HeadPattern]]:
    """Per layer and unit, the family with the lowest mean error over the samples (ties by
    serving preference), at the mean of the samples' tuned knobs; every head of a unit gets the
    same pattern and budgets, with its own mean relative error as ``score``."""
    layers = []
    for li in range(len(per_sample[0])):
        results = [s[li] for s in per_sample]
        first = results[0]
        fams = first.family_keys()
        share = first.share
        unit_err = [r.unit_errors() for r in results]
        head_err = [r.head_errors() for r in results]
        heads: list[HeadPattern] = []
        for u in range(num_heads // share):
            mean = {f: sum(e[i][u] for e in unit_err) / len(results) for i, f in enumerate(fams)}
            f = pick_family(mean)
            i = fams.index(f)
            knob = round(sum(r.knobs[i][u] for r in results) / len(results))
            hp = candidate_pattern(f[0], knob, f[1])
            for hh in range(u * share, (u + 1) * share):
                score = sum(e[i][hh] for e in head_err) / len(results)
                heads.append(hp.model_copy(update={"score": round(score, 6)}))
        layers.append(heads)
    return layers


def search_model(model_dir: str, samples: list[list[int]], density: float, settings: SparseSettings,
                 model_name: str, source: str, log: Callable[[str], None] = print, *, device: str = "auto",
                 dtype: str | None = None, yarn: float | None = None, rows: int = 512, tail_rows: int = 64,
                 selection: str = "group", tile: int = 64, seed: int = 0, out_path: str | None = None,
                 resume: bool = False, verify: bool = True, families: Sequence[tuple] = FAMILIES,
                 capture=None, max_budget_density: float | None = None) -> HeadConfigFile:
    """Head-config file for a model from calibration prompts ``samples`` (token ids, one length).

    transformers runs the model once per prompt (``device``, ``dtype``, YaRN ``yarn``); each
    layer is searched in the capture callback (:func:`search_layer_batched`; ``selection`` =
    ``group``: one pattern and budgets per KV group, the backend's ``kv_group_shared`` runs one
    selection for the group; ``head``: per query head, for ``kv_group_shared=false``), ``rows``
    query rows scored per layer (the last ``tail_rows`` among them); ``max_budget_density``
    (e.g. the settings' ``max_density``) keeps every layer's budgets where the CUDA backend's
    density gate runs it sparse at this length. With ``out_path`` a state
    file ``<out>.partial.json`` is rewritten after every layer (``resume``: layers it holds for
    the same inputs are not searched again), the file is written as soon as every layer is
    searched, and again with the verification's results: with ``verify`` the file is run as the
    backend would run it on the same prompts (:class:`.evaluation.attention_check.LayerChecker`)
    and its achieved density, tile density, recall and output error go into ``settings``."""
    if selection not in ("group", "head"):
        raise ValueError(f"selection {selection!r}: group or head")
    lengths = {len(s) for s in samples}
    if len(lengths) != 1:
        raise ValueError(f"calibration prompts of different lengths {sorted(lengths)}")
    n = lengths.pop()
    t_start = time.monotonic()
    cap = capture if capture is not None else CaptureModel(model_dir, device, dtype, yarn)
    log(f"model {model_name}: {cap.num_layers} layers, {cap.num_heads} query / {cap.num_kv_heads} KV heads, "
        f"{cap.dtype} on {cap.device} (loaded in {time.monotonic() - t_start:.1f} s); {len(samples)} prompt(s) "
        f"of {n} tokens; density {density}, selection per {'KV group' if selection == 'group' else 'head'}")
    share = cap.num_heads // cap.num_kv_heads if selection == "group" and cap.num_heads % cap.num_kv_heads == 0 else 1
    fams = [[f[0], f[1]] for f in families]
    vs = settings.patterns.vertical_slash
    fp = _fingerprint(samples, model=model_name, density=density, selection=selection, share=share,
                      rows=rows, tail_rows=tail_rows, seed=seed, block_size=settings.block_size,
                      last_q=vs.last_q, keep_first_columns=vs.keep_first_columns,
                      keep_last_diagonals=vs.keep_last_diagonals, families=fams, yarn=yarn,
                      dtype=str(cap.dtype), max_budget_density=max_budget_density)
    partial = Path(str(out_path) + ".partial.json") if out_path else None
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    if partial is not None and resume and partial.is_file():
        state = json.loads(partial.read_text())
        if state.get("fingerprint") == fp:
            done = state["layers"]
            log(f"resuming from {partial}: {len(done)} layer searches done")
        else:
            log(f"{partial}: made for other inputs; starting over")
    tables: dict[int, TileTables] = {}
    rows_t = score_rows(n, rows, seed, tail_rows)

    for si, ids in enumerate(samples):
        if all(f"{si}:{li}" in done for li in range(cap.num_layers)):
            continue
        t_sample = time.monotonic()

        def on_layer(layer, q, k, v, scale, out, si=si):
            key = f"{si}:{layer}"
            if key in done:
                return
            t = tables.get(n)
            if t is None:
                t = tables[n] = TileTables(n, settings.block_size, q.device)
            res = search_layer_batched(q, k, v, scale, density, settings, rows_t, share=share,
                                       families=families, tile=tile, tables=t,
                                       max_budget_density=max_budget_density)
            done[key] = res.to_json()
            if partial is not None:
                _write_json(partial, {"fingerprint": fp, "layers": done})
            fk = res.family_keys()
            ue = res.unit_errors()
            picks = [fk.index(pick_family({f: ue[i][u] for i, f in enumerate(fk)})) for u in range(len(ue[0]))]
            best = sum(ue[p][u] for u, p in enumerate(picks)) / len(picks)
            counts = {family_name(fk[i]): picks.count(i) for i in sorted(set(picks))}
            tiles = sum(res.tiles[p][hh] for hh in range(len(res.ref_sq)) for p in [picks[hh // share]])
            log(f"sample {si + 1}/{len(samples)} layer {layer:>2}: best {counts} err {best:.4f} "
                f"tiles {tiles / (len(res.ref_sq) * res.causal):.3f} | err per family "
                + " ".join(f"{family_name(f)}={sum(ue[i]) / len(ue[i]):.3f}" for i, f in enumerate(fk))
                + f" ({res.seconds:.2f} s; {time.monotonic() - t_start:.0f} s in all)")

        cap(ids, on_layer)
        log(f"sample {si + 1}/{len(samples)}: searched in {time.monotonic() - t_sample:.1f} s")

    per_sample = [[LayerSearch.from_json(done[f"{si}:{li}"]) for li in range(cap.num_layers)]
                  for si in range(len(samples))]
    layer_patterns = aggregate(per_sample, cap.num_heads)
    import transformers
    meta = {"density": density, "density_target": density, "length": n, "samples": len(samples),
            "model": model_name, "date": datetime.date.today().isoformat(),
            "selection": "per_kv_group" if share > 1 else "per_head", "kv_group_shared": share > 1,
            "block_size": settings.block_size, "last_q": vs.last_q, "keep_first_columns": vs.keep_first_columns,
            "keep_last_diagonals": vs.keep_last_diagonals, "families": fams,
            "max_budget_density": max_budget_density,
            "rows": int(rows_t.numel()), "tail_rows": tail_rows, "device": str(cap.device),
            "dtype": str(cap.dtype).replace("torch.", ""), "yarn": yarn, "rope": rope_description(cap.config),
            "search_seconds": round(time.monotonic() - t_start, 1)}
    how = ("one pattern and budgets per KV group (served with kv_group_shared=true: one selection "
           "per group)" if share > 1 else "per query head (serve with kv_group_shared=false)")
    cfg = HeadConfigFile(
        format=FORMAT_NAME, version=1, model=model_name, num_layers=len(layer_patterns),
        num_heads=cap.num_heads, num_kv_heads=cap.num_kv_heads,
        produced_by=(f"vllm-sparse search-patterns: {len(samples)} calibration prompt(s) of {n} tokens from "
                     f"{source}; candidates tuned to {density:.0%} of the causal key tiles, {how}; score = "
                     f"relative output error vs dense on {int(rows_t.numel())} sampled query rows "
                     f"(transformers {transformers.__version__}, torch {torch.__version__}, "
                     f"{meta['dtype']} on {meta['device']}, {meta['date']})"),
        settings=meta, layers=[LayerHeads(heads=heads) for heads in layer_patterns])
    if out_path:
        save_head_config(cfg, out_path)
        log(f"wrote {out_path} (before verification)")
    serve = settings.model_copy(update={"kv_group_shared": share > 1, "head_config": None})
    per_layer_budget = [budget_density([resolve_head(hp, serve) for hp in heads], n, 0, serve)
                        for heads in layer_patterns]
    meta["budget_density_mean"] = round(sum(per_layer_budget) / len(per_layer_budget), 4)
    meta["budget_density_max"] = round(max(per_layer_budget), 4)
    meta["layers_over_max_density"] = sum(d > serve.gating.max_density for d in per_layer_budget)
    if verify:
        t_verify = time.monotonic()
        base = {k: v for k, v in serve.model_dump().items() if k != "head_config"}
        checker = LayerChecker([Variant("searched", {})], rows=rows, seed=seed, base_settings=base, tile=tile,
                               tail=tail_rows, head_files={"searched": cfg})
        for si, ids in enumerate(samples):
            def check(layer, q, k, v, scale, out, si=si):
                (r,) = checker(layer, q, k, v, scale)
                log(f"verify {si + 1}/{len(samples)} layer {layer:>2}: density {r.density:.3f} tiles "
                    f"{r.tile_density:.3f} recall {r.recall:.4f} err {r.error:.4f} share {r.kv_share}")
            cap(ids, check)
        res = checker.results
        meta["achieved"] = {
            "density": round(sum(r.density for r in res) / len(res), 4),
            "tile_density": round(sum(r.tile_density for r in res) / len(res), 4),
            "recall": round(sum(r.recall for r in res) / len(res), 5),
            "error": round(sum(r.error for r in res) / len(res), 5),
            "error_max_layer": round(max(r.error for r in res), 5),
            "shared_layers": sum(r.kv_share > 1 for r in res) // len(samples),
            "per_layer_density": [round(sum(r.density for r in res if r.layer == li) / len(samples), 4)
                                  for li in range(cap.num_layers)]}
        meta["verify_seconds"] = round(time.monotonic() - t_verify, 1)
        a = meta["achieved"]
        log(f"achieved on the calibration prompts: density {a['density']:.3f} (pairs), tiles "
            f"{a['tile_density']:.3f} (target {density}), recall {a['recall']:.4f}, output error "
            f"{a['error']:.4f} (worst layer {a['error_max_layer']:.4f}); {a['shared_layers']} of "
            f"{cap.num_layers} layers share selections per KV group ({meta['verify_seconds']:.0f} s)")
    meta["total_seconds"] = round(time.monotonic() - t_start, 1)
    cfg = cfg.model_copy(update={"settings": meta})
    if out_path:
        save_head_config(cfg, out_path)
        if partial is not None and partial.exists():
            partial.unlink()
    return cfg


def capture_qkv(model_dir: str, token_ids: list[int], device: str = "auto") -> tuple[dict[int, tuple], dict]:
    """Run the model once on ``token_ids``; return per layer (q [L, H, D], k [L, Hkv, D],
    v [L, Hkv, D], scale) after rotary embedding (on the CPU), and the config. Keeps every
    layer: for short prompts and tests only (the search itself works in the capture callback)."""
    captured: dict[int, tuple] = {}

    def keep(layer, q, k, v, scale, out):
        captured[layer] = (q.cpu(), k.cpu(), v.cpu(), scale)

    config = capture_attention(model_dir, token_ids, keep, device=resolve_device(device))
    return captured, config
