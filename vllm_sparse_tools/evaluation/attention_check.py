"""Attention-level check on a real model, no generation: how much of the true attention does the
sparse selection keep?

transformers runs the model once on a real prompt with a custom attention function that hands
each layer's post-RoPE Q, K, V (and the layer's own SDPA output) to a callback, on the device the
model runs on. For every layer and every variant, the project's estimators
(:func:`vllm_sparse_backend.prefill.patterns.estimate_index`, with the backend's own decision whether the
heads of a KV group share one selection, :func:`vllm_sparse_backend.prefill.budgets.kv_group_share`) build
the sparse index from that Q/K exactly as the backend would, and against exact dense attention we
measure

* **recall**: the share of each query's true softmax mass that falls on the selected keys,
  averaged over heads and queries (1.0 = nothing that matters was skipped);
* **output error**: ``||o_sparse - o_dense|| / ||o_dense||`` over the sampled queries, where
  ``o_sparse`` is softmax over the selected keys only (what the sparse kernel computes);
* **density**: the selected share of the causal (query, key) pairs, exact, from the index; and
  the kernel's cost, the key tiles it processes over the causal tiles (``tile_density``).

The metric rows are computed for a stratified sample of query positions (``rows``; all of them
for short prompts; optionally the last ``tail`` rows too), a tile of queries at a time against all
keys (float32 scores, float64 sums), so no n x n matrix is ever formed: on CUDA at 128K a tile of
64 rows x 12 heads is 400 MB of scores. Everything stays on the device of the captured tensors.

With ``chunk`` the prompt is estimated the way vLLM's chunked prefill runs it (16K-token chunks
on CUDA): each chunk's queries against the keys up to its end, the chunk's own last queries doing
the estimation; with ``gating`` the library's routing applies per chunk and layer as in the CUDA
backend (chunks under ``min_sparse_query_len`` queries, budgets or estimated indices denser than
``max_density`` run dense). Unlike task accuracy this stays meaningful beyond the length a model
was trained for (with YaRN, :func:`model_config`).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from vllm_sparse_backend.head_configs import HeadConfigFile, layer_heads, load_head_config
from vllm_sparse_backend.prefill.index import (SparseIndex, build_index, causal_block_mask, count_pairs, index_density, num_blocks,
                     range_cover)
from vllm_sparse_backend.prefill.estimate import estimate_index
from vllm_sparse_backend.prefill.budgets import budget_density, kv_group_share
from vllm_sparse_kernels.index_format import causal_pairs
from vllm_sparse_kernels.kv_layout import kv_head_map
from .rope import scaled_max_positions, yarn_parameters
from .variants import Variant


def sample_rows(n: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` query positions out of ``n``: one at random in each of ``count`` equal strata
    (all positions when ``count >= n``). Sorted, int64, on the CPU (a CPU generator: move the
    result to the device)."""
    if count >= n:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed)
    edges = torch.linspace(0, n, count + 1)
    lo, hi = edges[:-1].floor().long(), edges[1:].floor().long()
    offs = (torch.rand(count, generator=g) * (hi - lo).clamp(min=1)).long()
    return torch.minimum(lo + offs, torch.full_like(lo, n - 1))


def score_rows(n: int, count: int, seed: int = 0, tail: int = 0) -> torch.Tensor:
    """``count`` query positions out of ``n``: the last ``tail`` positions (the queries that see
    the most keys, where a selection loses most), the rest stratified over the positions before
    them (:func:`sample_rows`). All positions when ``count >= n``. Sorted, unique, int64, CPU."""
    if count >= n:
        return torch.arange(n)
    tail = max(0, min(tail, count, n))
    head = sample_rows(n - tail, count - tail, seed) if count > tail and n > tail else torch.zeros(0, dtype=torch.long)
    return torch.cat([head, torch.arange(n - tail, n)]).unique()


def sample_runs(n: int, count: int, run: int, seed: int = 0) -> torch.Tensor:
    """About ``count`` query positions out of ``n`` in whole runs of ``run`` consecutive positions,
    each run starting at a multiple of ``run`` (the aligned runs stratified as in
    :func:`sample_rows`), so that every group of a grouped oracle is measured whole. Sorted,
    int64, CPU; all positions of the whole runs when they are fewer than asked."""
    runs = n // run
    starts = sample_rows(runs, max(1, count // run), seed) * run
    return (starts[:, None] + torch.arange(run)[None, :]).flatten()


def allowed_keys(index: SparseIndex, rows: torch.Tensor, kv_len: int, ctx_len: int = 0,
                 causal: bool = True) -> torch.Tensor:
    """bool [H, len(rows), kv_len]: the keys the index lets each given query row use (rows are
    positions within the chunk, on the index's device), causality applied unless ``causal`` is
    False (for callers whose probabilities are already 0 past the query)."""
    b = index.block_size
    h = index.num_heads
    device = index.block_count.device
    rows = rows.to(device)
    qb = rows // b
    nkb = num_blocks(kv_len, b)
    blocks = index.block_index[:, qb].to(torch.int64)  # [H, T, MAXB], -1 padded
    t = rows.shape[0]
    mask_b = torch.zeros(h, t, nkb + 1, dtype=torch.bool, device=device)
    mask_b.scatter_(2, torch.where(blocks >= 0, blocks, nkb), True)
    mask = mask_b[..., :nkb].repeat_interleave(b, dim=-1)[..., :kv_len]
    if index.range_start.shape[-1]:
        mask = mask | range_cover(index.range_start[:, qb], b, kv_len)
    cols = index.column_index[:, qb].to(torch.int64)  # [H, T, MAXC]
    if cols.shape[-1]:
        mask_c = torch.zeros(h, t, kv_len + 1, dtype=torch.bool, device=device)
        mask_c.scatter_(2, torch.where(cols >= 0, cols, kv_len), True)
        mask = mask | mask_c[..., :kv_len]
    if not causal:
        return mask
    return mask & (torch.arange(kv_len, device=device)[None, :] <= (rows + ctx_len)[:, None])[None]


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

    def add(self, other: "SelectionStats") -> None:
        self.recall_sum += other.recall_sum
        self.err_sq += other.err_sq
        self.ref_sq += other.ref_sq
        self.rows += other.rows


def _block_mass(p: torch.Tensor, block_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., n] softmax mass summed per key block of ``block_size``: [..., NKB] (``dtype``: the sum's)."""
    n = p.shape[-1]
    nkb = num_blocks(n, block_size)
    return torch.nn.functional.pad(p, (0, nkb * block_size - n)).unflatten(-1, (nkb, block_size)).sum(-1, dtype=dtype)


def _blocks_to_keep(density: float, last_rows: torch.Tensor, ctx: int, block_size: int) -> torch.Tensor:
    """``ceil(density x causal key blocks)`` of each row or group ending at ``last_rows``, at least 1."""
    causal_blocks = (last_rows + ctx) // block_size + 1
    # (a hair under: 0.3 x 10 is 3.0000000000000004 in floating point, which must keep 3)
    return torch.ceil(density * causal_blocks.double() - 1e-9).long().clamp(min=1)


def _top_blocks(mass: torch.Tensor, keep_n: torch.Tensor) -> torch.Tensor:
    """bool like ``mass`` [A, B, NKB]: each (a, b)'s ``keep_n[b]`` blocks of most mass (ties: the
    earlier block)."""
    nkb = mass.shape[-1]
    order = mass.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(nkb, device=mass.device).expand_as(order))
    return ranks < keep_n[None, :, None]


def oracle_block_mask(p: torch.Tensor, rows: torch.Tensor, ctx: int, density: float, block_size: int) -> torch.Tensor:
    """The best any key-block selection could keep at ``density``: bool [H, T, n], for each
    sampled row (positions ``rows`` within the chunk, keys before ``ctx`` are context) and head
    its own ``ceil(density x its causal key blocks)`` blocks of most true softmax mass ``p``
    [H, T, n]. A per-row choice: an upper bound for the kernel's selections, which give each
    query block (64 rows) one list."""
    keep = _top_blocks(_block_mass(p, block_size), _blocks_to_keep(density, rows, ctx, block_size))
    return keep.repeat_interleave(block_size, dim=-1)[..., :p.shape[-1]]


def group_oracle_block_mask(p: torch.Tensor, rows: torch.Tensor, ctx: int, density: float, block_size: int,
                            group_rows: int, kv_heads: torch.Tensor) -> torch.Tensor:
    """:func:`oracle_block_mask` with one key-block list per group: the query heads of one KV
    head (``kv_heads`` [H], each head's KV head) at the positions ``rows // group_rows`` has in
    common. The group keeps the ``ceil(density x causal blocks of its last row)`` blocks of most
    true mass summed over its rows and heads, the best a kernel whose tiles share one list over
    such a group could select (64-position tiles of a KV group: what the backend runs)."""
    h, t, n = p.shape
    mass = _block_mass(p, block_size, torch.float64)  # [H, T, NKB]
    kv_heads = kv_heads.to(p.device)
    group_of_row = torch.unique_consecutive(rows // group_rows, return_inverse=True)[1]  # [T]
    groups = int(group_of_row.max()) + 1
    group_mass = mass.new_zeros(int(kv_heads.max()) + 1, groups, mass.shape[-1])
    group_mass.index_put_((kv_heads[:, None].expand(h, t), group_of_row[None, :].expand(h, t)), mass,
                          accumulate=True)
    last_row = torch.zeros(groups, dtype=torch.long, device=p.device).scatter_reduce_(
        0, group_of_row, rows.to(p.device), reduce="amax")
    keep = _top_blocks(group_mass, _blocks_to_keep(density, last_row, ctx, block_size))  # [Hkv, groups, NKB]
    return keep[kv_heads][:, group_of_row].repeat_interleave(block_size, dim=-1)[..., :n]


def selection_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    indices: Sequence[SparseIndex], rows: torch.Tensor, tile: int = 64,
                    reference_out: torch.Tensor | None = None, oracle_densities: Sequence[float] = (),
                    block_size: int = 64, group_oracles: Sequence[tuple[float, int]] = ()
                    ) -> tuple[list[SelectionStats], float]:
    """Recall and output error of several indices of one row of one layer: q [q_len, H, D] (the
    row's queries, at positions ``kv_len - q_len ..``), k/v [kv_len, Hkv, D] (a pure prefill
    when kv_len == q_len). ``rows``: positions within the row's queries.

    Scores are float32, a tile of ``tile`` rows against all keys at a time, sums float64; the
    results (per-head tensors) are on q's device. Returns one :class:`SelectionStats` per index,
    then one per ``oracle_densities`` entry (:func:`oracle_block_mask` at ``block_size``), then
    one per ``group_oracles`` (density, rows per group) pair (:func:`group_oracle_block_mask`;
    a group's rows must fall in one tile of ``tile`` rows), and,
    when ``reference_out`` ([q_len, H, Dv], e.g. the model's own attention output) is given,
    the largest relative difference between it and the dense output computed here on the sampled
    rows (a check of the capture itself).
    """
    q_len, h, _ = q.shape
    n = k.shape[0]
    ctx = n - q_len
    device = q.device
    rows = rows.to(device)
    kvh = kv_head_map(h, k.shape[1], device)
    kh = k.transpose(0, 1).float()[kvh]  # [H, n, D]: one gather per layer, reused by every tile
    vh = v.transpose(0, 1).float()[kvh]  # [H, n, Dv]
    keys = torch.arange(n, device=device)

    def zeros():
        return torch.zeros(h, dtype=torch.float64, device=device)

    stats = [SelectionStats(zeros(), zeros(), zeros(), int(rows.numel()))
             for _ in range(len(indices) + len(oracle_densities) + len(group_oracles))]
    ref_diff = torch.zeros((), dtype=torch.float64, device=device)
    for t0 in range(0, rows.numel(), tile):
        rr = rows[t0:t0 + tile]
        qt = q[rr].transpose(0, 1).float()  # [H, T, D]
        s = torch.matmul(qt, kh.transpose(-1, -2)) * scale  # [H, T, n]
        s.masked_fill_(keys[None, None, :] > (rr + ctx)[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        del s
        dense = torch.matmul(p, vh).double()  # [H, T, Dv]
        if reference_out is not None:
            ref = reference_out[rr].transpose(0, 1).double()
            ref_diff = torch.maximum(ref_diff, (ref - dense).norm() / dense.norm().clamp_min(1e-30))
        masks = [lambda index=index: allowed_keys(index, rr, n, ctx, causal=False) for index in indices]
        masks += [lambda d=d: oracle_block_mask(p, rr, ctx, d, block_size) for d in oracle_densities]
        masks += [lambda d=d, g=g: group_oracle_block_mask(p, rr, ctx, d, block_size, g, kvh)
                  for d, g in group_oracles]
        for st, mask in zip(stats, masks):
            pm = p * mask()  # p is 0 past each query already
            kept = pm.sum(-1, dtype=torch.float64)  # [H, T]
            sparse = torch.matmul(pm, vh).double() / kept.clamp_min(1e-300)[..., None]
            st.recall_sum += kept.sum(-1)
            st.err_sq += ((sparse - dense) ** 2).sum((-1, -2))
            st.ref_sq += (dense ** 2).sum((-1, -2))
    return stats, float(ref_diff)


# ---------------------------------------------------------------------------------------------
# Kernel cost
# ---------------------------------------------------------------------------------------------

COLUMNS_PER_TILE = 64  # single key columns the sparse kernel gathers into one key tile


def kernel_tiles_per_head(index: SparseIndex) -> torch.Tensor:
    """Key tiles the sparse kernel processes per query head (int64 [H], on the index's device):
    one per listed key block or key range and query block, plus the query block's columns 64 to
    a tile."""
    cols = (index.column_count.to(torch.int64) + COLUMNS_PER_TILE - 1) // COLUMNS_PER_TILE
    return index.block_count.to(torch.int64).sum(1) + index.range_count.to(torch.int64).sum(1) + cols.sum(1)


def kernel_tiles(index: SparseIndex) -> int:
    """Key tiles the sparse kernel processes for this index (all heads, all query blocks)."""
    return int(kernel_tiles_per_head(index).sum())


def causal_tiles(q_len: int, ctx_len: int, block_size: int, num_heads: int = 1) -> int:
    """Key tiles of dense causal attention for one row (per head, times ``num_heads``)."""
    return num_heads * int(causal_block_mask(q_len, ctx_len, block_size).sum())


def dense_index(num_heads: int, q_len: int, ctx_len: int, block_size: int, device=None) -> SparseIndex:
    """Every causal key block: what a row that runs dense computes."""
    mask = causal_block_mask(q_len, ctx_len, block_size, device)[None].expand(num_heads, -1, -1).clone()
    return build_index(mask, block_size, q_len, ctx_len)


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
    head_patterns: dict[str, int]  # heads per pattern (x estimated chunks when chunked)
    tile_density: float = float("nan")  # kernel key tiles / causal key tiles
    kv_share: int = 1  # query heads per selection (the GQA group when shared, as the backend runs it)
    chunks: int = 1  # chunks the prompt was estimated in
    dense_chunks: dict[str, int] = field(default_factory=dict)  # chunks run dense, per reason (gating)
    # the prompt's last ``tail`` rows alone (a task's question: what it can still read of the
    # needles), NaN without a tail
    tail_recall: float = float("nan")
    tail_recall_min_head: float = float("nan")


def group_oracle_label(density: float, group_rows: int) -> str:
    """Result label of the grouped block oracle (:func:`group_oracle_block_mask`)."""
    return f"group-oracle@{density:g}/{group_rows}q"


def oracle_label(density: float) -> str:
    """Result label of the per-row block oracle at ``density`` (:func:`oracle_block_mask`)."""
    return f"row-oracle@{density:g}"


GATING_SHORT = "query chunk shorter than min_sparse_query_len"
GATING_BUDGETS = "budgets denser than max_density"
GATING_ESTIMATED = "estimated density above max_density"


class LayerChecker:
    """Callable per captured layer: estimates each variant's index and measures it.

    ``chunk``: estimate the prompt in chunks of this many queries, each against the keys up to
    its end (vLLM's chunked prefill; 0 = the whole prompt as one row). ``gating``: route chunks
    dense where the CUDA backend would (see the module docstring). ``tail``: the last rows of the
    prompt always among the sampled rows. ``head_files``: head-config files by variant label, in
    place of the variants' ``head_config`` paths.
    """

    def __init__(self, variants: Sequence[Variant], rows: int = 1024, seed: int = 0,
                 base_settings: dict[str, Any] | None = None, tile: int = 64, *, chunk: int = 0,
                 gating: bool = False, tail: int = 0,
                 head_files: dict[str, HeadConfigFile] | None = None, oracle_densities: Sequence[float] = (),
                 oracle_block_size: int = 64, oracle_groups: Sequence[int] = ()):
        self.variants = [v for v in variants if not v.dense]
        self.settings = {v.label: v.settings(**(base_settings or {})) for v in self.variants}
        self.head_files = {label: load_head_config(s.head_config)
                           for label, s in self.settings.items() if s.head_config}
        self.head_files.update(head_files or {})
        self.rows, self.seed, self.tile, self.tail = rows, seed, tile, tail
        self.chunk, self.gating = chunk, gating
        self.oracle_densities, self.oracle_block_size = tuple(oracle_densities), oracle_block_size
        # grouped oracles: rows sampled in runs of the largest group, each run one tile
        self.group_oracles = tuple((d, g) for g in oracle_groups for d in oracle_densities)
        self.run = max(oracle_groups, default=1)
        if self.run > 1 and (tile % self.run or any(self.run % g for g in oracle_groups)):
            raise ValueError(f"oracle groups {list(oracle_groups)} must divide the largest, which must divide "
                             f"the tile ({tile} rows)")
        self.results: list[LayerResult] = []
        self.capture_diff = 0.0  # largest relative difference, our dense vs the model's output

    def _index(self, s, heads, q, k, ctx, scale, reasons) -> tuple[SparseIndex, dict]:
        q_len, h = q.shape[0], q.shape[1]
        if self.gating:
            if q_len < s.gating.min_sparse_query_len or ctx + q_len < s.gating.min_sparse_seq_len:
                reasons[GATING_SHORT] = reasons.get(GATING_SHORT, 0) + 1
                return dense_index(h, q_len, ctx, s.block_size, q.device), {}
            if s.gating.max_density < 1.0 and budget_density(heads, q_len, ctx, s) > s.gating.max_density:
                reasons[GATING_BUDGETS] = reasons.get(GATING_BUDGETS, 0) + 1
                return dense_index(h, q_len, ctx, s.block_size, q.device), {}
        est = estimate_index(q, k, ctx, heads, s, scale)
        if self.gating and s.gating.max_density < 1.0 and float(index_density(est.index, q_len, ctx)) > s.gating.max_density:
            reasons[GATING_ESTIMATED] = reasons.get(GATING_ESTIMATED, 0) + 1
            return dense_index(h, q_len, ctx, s.block_size, q.device), dict(est.head_patterns)
        return est.index, dict(est.head_patterns)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 model_out: torch.Tensor | None = None) -> list[LayerResult]:
        n, h, _ = q.shape
        step = self.chunk if self.chunk and self.chunk < n else n
        bounds = [(c0, min(n, c0 + step)) for c0 in range(0, n, step)]
        if self.run > 1:  # whole runs, aligned with the chunks when the chunk is a multiple of the run
            rows = sample_runs(n, self.rows, self.run, self.seed + layer).to(q.device)
        else:
            rows = score_rows(n, self.rows, self.seed + layer, self.tail).to(q.device)
        heads = {var.label: layer_heads(self.head_files.get(var.label), self.settings[var.label], layer, h)
                 for var in self.variants}
        total: list[SelectionStats | None] = [None] * (len(self.variants) + len(self.oracle_densities)
                                                       + len(self.group_oracles))
        pairs = [0] * len(self.variants)
        tiles = [0] * len(self.variants)
        causal_t = [0] * len(self.variants)
        patterns: list[dict[str, int]] = [{} for _ in self.variants]
        reasons: list[dict[str, int]] = [{} for _ in self.variants]
        tail_stats: list[SelectionStats] = []
        for c0, c1 in bounds:
            qc, kc, vc = q[c0:c1], k[:c1], v[:c1]
            indices = []
            for i, var in enumerate(self.variants):
                s = self.settings[var.label]
                index, pat = self._index(s, heads[var.label], qc, kc, c0, scale, reasons[i])
                indices.append(index)
                for name, cnt in pat.items():
                    patterns[i][name] = patterns[i].get(name, 0) + cnt
                pairs[i] += count_pairs(index, c1 - c0, c0)
                tiles[i] += kernel_tiles(index)
                causal_t[i] += causal_tiles(c1 - c0, c0, index.block_size, h)
            rr = rows[(rows >= c0) & (rows < c1)] - c0
            out_c = None if model_out is None else model_out[c0:c1]
            stats, diff = selection_stats(qc, kc, vc, scale, indices, rr, self.tile, out_c, self.oracle_densities,
                                          self.oracle_block_size, self.group_oracles)
            self.capture_diff = max(self.capture_diff, diff)
            if self.tail and c1 == n:  # the question's rows, scored apart from the rest
                tail_rows = torch.arange(max(c0, n - self.tail), n, device=q.device) - c0
                tail_stats = selection_stats(qc, kc, vc, scale, indices, tail_rows, self.tile)[0]
            for i, st in enumerate(stats):  # the variants' indices, then the oracles
                if total[i] is None:
                    total[i] = st
                else:
                    total[i].add(st)
        causal = causal_pairs(n, 0, h)
        out = []
        for i, var in enumerate(self.variants):
            st = total[i]
            s = self.settings[var.label]
            out.append(LayerResult(layer, var.label, pairs[i] / causal,
                                   float(st.recall_per_head.mean()), float(st.recall_per_head.min()),
                                   st.error, float(st.error_per_head.max()), patterns[i],
                                   tiles[i] / max(1, causal_t[i]), kv_group_share(heads[var.label], k.shape[1], s),
                                   len(bounds), reasons[i],
                                   *((float(tail_stats[i].recall_per_head.mean()),
                                      float(tail_stats[i].recall_per_head.min())) if tail_stats else ())))
        oracles = [(oracle_label(d), d) for d in self.oracle_densities]
        oracles += [(group_oracle_label(d, g), d) for d, g in self.group_oracles]
        for (label, d), st in zip(oracles, total[len(self.variants):]):
            # density: the nominal share (each row or group keeps ceil(d x its causal blocks) blocks)
            out.append(LayerResult(layer, label, d, float(st.recall_per_head.mean()),
                                   float(st.recall_per_head.min()), st.error, float(st.error_per_head.max()),
                                   {}, d, 1, len(bounds)))
        self.results.extend(out)
        return out


def summarize(results: Sequence[LayerResult]) -> dict[str, dict[str, float]]:
    """Per variant over layers: mean density, mean and minimum recall, mean and maximum error."""
    out: dict[str, dict[str, float]] = {}
    for label in dict.fromkeys(r.variant for r in results):
        rs = [r for r in results if r.variant == label]
        out[label] = {"layers": len(rs),
                      "density": statistics.fmean(r.density for r in rs),
                      "tile_density": statistics.fmean(r.tile_density for r in rs),
                      "recall": statistics.fmean(r.recall for r in rs),
                      "recall_min_layer": min(r.recall for r in rs),
                      "recall_min_head": min(r.recall_min_head for r in rs),
                      "error": statistics.fmean(r.error for r in rs),
                      "error_max_layer": max(r.error for r in rs),
                      "shared_layers": sum(r.kv_share > 1 for r in rs),
                      "dense_chunks": sum(sum(r.dense_chunks.values()) for r in rs),
                      "tail_recall": statistics.fmean(r.tail_recall for r in rs),
                      "tail_recall_min_layer": min(r.tail_recall for r in rs)}
    return out


def results_json(results: Sequence[LayerResult]) -> list[dict]:
    return [asdict(r) for r in results]


# ---------------------------------------------------------------------------------------------
# Capture from a transformers model
# ---------------------------------------------------------------------------------------------

_ATTENTION_NAME = "vllm_sparse_eval_capture"


def resolve_device(device: str = "auto") -> str:
    """``auto``: cuda when available, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device {device!r}: cpu, cuda, cuda:N or auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available here")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """``auto``/None: bfloat16 on CUDA (the served dtype; SDPA runs flash attention), float32 on
    the CPU (bf16 matmuls are slow there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r}: one of auto, {', '.join(names)}")
    return names[dtype]


def model_config(model_dir: str, yarn: float | None = None, yarn_original: int | None = None):
    """The model's transformers config, with YaRN rope scaling applied when ``yarn`` is given:
    ``rope_parameters`` = {rope_type: yarn, factor, original_max_position_embeddings, rope_theta}
    (transformers 5, where ``rope_scaling`` is an alias of it; 4.x: ``rope_scaling`` with
    ``type``/``rope_type``) and ``max_position_embeddings`` = factor x original, so that
    transformers' consistency check sees the same factor."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if not yarn:
        return config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = yarn_parameters(rope, getattr(config, "rope_theta", None), config.max_position_embeddings, yarn,
                             yarn_original)
    if "rope_parameters" in type(config).__dict__ or hasattr(config, "rope_parameters"):
        config.rope_parameters = params  # transformers 5 (rope_scaling is an alias)
    else:  # transformers 4.x
        config.rope_scaling = {**params, "type": "yarn"}
    config.max_position_embeddings = scaled_max_positions(params, config.max_position_embeddings)
    return config


def rope_description(config) -> dict[str, Any] | None:
    """The rope parameters the model runs with (for result metadata)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return dict(rope) if rope else None


def _no_attention_mask(*args, **kwargs):
    """Mask function registered for the capture's attention name: a single unpadded prompt
    needs none (the attention is causal by construction)."""
    return None


def _cuda_causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prefill on CUDA, [b, H, n, D] in, [b, n, H, D] out (transformers'
    layout), by a fused SDPA kernel only (flash, memory-efficient or cuDNN): the math fallback,
    which forms the n x n score matrix (400 GB at 128K for 12 heads), is excluded, so an
    unsupported case fails at once instead of running out of memory. K/V are repeated to the
    query heads (0.4 GB each at 128K) rather than relying on ``enable_gqa`` support."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1,
                                                               scale=scale)
    return out.transpose(1, 2).contiguous()


class CaptureModel:
    """A transformers model loaded once, run on prompts with each layer's attention handed to a
    callback (see :func:`capture_attention`). ``device``: cuda/cpu/auto; ``dtype``: see
    :func:`resolve_dtype`; ``yarn``: rope scaling factor (:func:`model_config`).

    Attention inside the model: on CUDA :func:`_cuda_causal_sdpa` (fused kernels only, never an
    n x n matrix), on the CPU transformers' SDPA function; ``fused_sdpa`` True / False forces one
    or the other (tests run the CUDA path's code on the CPU)."""

    fused_sdpa: bool | None = None

    def __init__(self, model_dir: str, device: str = "auto", dtype: str | torch.dtype | None = None,
                 yarn: float | None = None, yarn_original: int | None = None):
        from transformers import AutoModelForCausalLM

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.config = model_config(model_dir, yarn, yarn_original)
        self._on_layer: Callable[..., Any] | None = None
        self._register()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, config=self.config,
                                                          attn_implementation=_ATTENTION_NAME,
                                                          dtype=self.dtype)
        self.model.to(self.device).eval()
        self.num_layers = int(self.config.num_hidden_layers)
        self.num_heads = int(self.config.num_attention_heads)
        self.num_kv_heads = int(getattr(self.config, "num_key_value_heads", None) or self.num_heads)

    def _register(self) -> None:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
            # attention_mask is None for a registered custom name: SDPA runs causal (is_causal).
            if scaling is None:
                scaling = query.shape[-1] ** -0.5
            fused = query.is_cuda if self.fused_sdpa is None else self.fused_sdpa
            if fused and attention_mask is None and kwargs.get("sliding_window") is None:
                out, weights = _cuda_causal_sdpa(query, key, value, scaling), None
            else:
                out, weights = sdpa_attention_forward(module, query, key, value, attention_mask,
                                                      scaling=scaling, **kwargs)
            if self._on_layer is not None:
                self._on_layer(module.layer_idx, query[0].transpose(0, 1).detach(),
                               key[0].transpose(0, 1).detach(), value[0].transpose(0, 1).detach(),
                               float(scaling), out[0].detach())
            return out, weights

        AttentionInterface.register(_ATTENTION_NAME, attention)
        try:  # no mask at all for this name (never an n x n one): attention runs is_causal
            from transformers.masking_utils import AttentionMaskInterface

            AttentionMaskInterface.register(_ATTENTION_NAME, _no_attention_mask)
        except ImportError:  # pragma: no cover - transformers without mask interfaces
            pass

    def __call__(self, token_ids: Sequence[int], on_layer: Callable[..., Any]) -> None:
        """Run the decoder once on ``token_ids``; ``on_layer(layer, q [n, H, D], k [n, Hkv, D],
        v [n, Hkv, Dv], scale, out [n, H, Dv])`` gets post-RoPE tensors on the model's device
        (views valid during the call only) and the layer's own SDPA output."""
        self._register()
        self._on_layer = on_layer
        try:
            with torch.no_grad():
                # The decoder only: the LM head over every position would need n x vocab floats
                # (20 GB for Qwen2.5 at 32K), and no logits are needed here.
                self.model.model(torch.tensor([list(token_ids)], device=self.device), use_cache=False)
        finally:
            self._on_layer = None


def capture_attention(model_dir: str, token_ids: Sequence[int], on_layer: Callable[..., Any],
                      device: str = "cpu", dtype: str | torch.dtype | None = None,
                      yarn: float | None = None) -> dict:
    """Load the model (float32 on the CPU, bf16 on CUDA unless ``dtype``), run its decoder once
    on ``token_ids`` and call ``on_layer(layer, q [n, H, D], k [n, Hkv, D], v [n, Hkv, Dv],
    scale, out [n, H, Dv])`` for each attention layer with post-RoPE tensors on ``device`` and
    the layer's own (SDPA) output. Returns the model config dict."""
    cap = CaptureModel(model_dir, device, dtype, yarn)
    cap(token_ids, on_layer)
    return cap.config.to_dict()
