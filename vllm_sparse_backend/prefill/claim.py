"""The profiling-run claim of the sparse path's scratch memory.

vLLM sizes the KV cache from the peak memory of its profiling run. The sparse path's scratch
(score buffers, index lists, the kernel's packed metadata) is allocated per layer and freed after
it, so the profiling run must run the path on the largest steps a chunk can hold for that peak
to include it (:func:`run_worst_case_steps`). Every scratch size is a host-side function of the
rows' lengths and the budgets, so the K/V values do not matter and a tiny stand-in cache serves.
The vLLM side (when to claim, once per layer shape) is :mod:`vllm_sparse_backend.backends.claim`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..settings import SparseSettings
from ..observability.record import run_recorded
from ..observability.stats import SparseStats
from .estimate import HeadGroups, estimate_index_paged
from .index import index_density
from .plan import SparseRow
from .run import run_sparse_rows_paged

PagedKernel = Callable[..., object]  # vllm_sparse_kernels.prefill.attention.sparse_prefill_attention


# Most sparse rows one claimed step holds (a step holds at most chunk // min_sparse_query_len).
MAX_CLAIMED_ROWS = 8


def worst_case_steps(q_len: int, kv_len: int, min_query_len: int,
                     max_rows: int = MAX_CLAIMED_ROWS) -> list[list[SparseRow]]:
    """The steps the profiling-run claim runs. A step's sparse rows share its chunk of ``q_len``
    queries, each at least ``min_query_len`` long, and every row's index lists live until the
    layer's one kernel launch, so several rows can need more scratch than one row of the whole
    chunk (measured by ``benchmarks/studies/scratch_memory.py``, now in git history). Each row
    sits at the longest context (``kv_len`` tokens, its queries included), in its own block-table
    row. The chunk as one row; then for k = 2 .. min(max_rows, q_len // min_query_len) rows, the
    corners and the middle of the ways to split it: k nearly equal rows, and one long row with
    k - 1 rows of ``min_query_len``, the long one estimated first (its lists live while the
    others are estimated) or last (its estimation's temporaries meet the others' lists)."""
    q_len = min(q_len, kv_len)
    most = max(1, min(max_rows, q_len // max(min_query_len, 1)))
    splits = [[q_len]]
    for k in range(2, most + 1):
        small, long = min_query_len, q_len - (k - 1) * min_query_len
        for lengths in ([q_len * (i + 1) // k - q_len * i // k for i in range(k)],
                        [long] + [small] * (k - 1), [small] * (k - 1) + [long]):
            if lengths not in splits:
                splits.append(lengths)
    steps = []
    for lengths in splits:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        steps.append([SparseRow(row=i, tok_start=a, q_len=n, ctx_len=kv_len - n)
                      for i, (a, n) in enumerate(zip(starts, lengths))])
    return steps


def compile_row(q_len: int, kv_len: int, min_query_len: int) -> SparseRow:
    """One short row the profiling run adds after the claim's steps. The last-q pass picks how it
    sums diagonals by the row's context (``vs_index.last_q_scores``: skewed slabs while they fit,
    a gather above about 768K tokens), so with a long max_model_len the claim's rows compile only
    the long-context variant, and the first request of ordinary length would compile the other
    one (vLLM's JIT monitor flags ``_lastq_skew_pass`` and ``_skew_colsum`` then). Its scratch is
    far below the claim's."""
    q = max(1, min(q_len, kv_len // 2, max(min_query_len, 64)))
    return SparseRow(row=0, tok_start=0, q_len=q, ctx_len=min(q, kv_len - q))


def run_worst_case_steps(query: torch.Tensor, output: torch.Tensor, num_kv_heads: int, kv_len: int,
                         groups: HeadGroups, settings: SparseSettings, scale: float, softcap: float,
                         kernel: PagedKernel, page_size: int = 16,
                         kv_dtype: torch.dtype | None = None) -> list[list[SparseRow]]:
    """Run the GPU path on the largest steps a chunk can hold (:func:`worst_case_steps`), through
    :func:`run_sparse_rows_paged` itself as a sampled forward runs it (every row estimated and its
    pairs counted on the device, then one kernel launch), so
    that its transient scratch (score buffers, index lists, the kernel's packed metadata) is seen
    by whoever measures peak memory: vLLM sizes the KV cache from the peak of its profiling run.

    Every scratch size of the path is a host-side function of the rows' lengths and the budgets
    (nothing waits for the GPU), so the K/V values do not matter: all logical pages map to one
    page of a tiny stand-in cache. The steps split all of ``query``'s tokens (at most ``kv_len``);
    ``output`` is overwritten for them; nothing is recorded in the worker's stats. Where rows can
    be flagged dense on the device, each step is estimated a second time for the kernel's dense
    mode (the flags' temporaries and that kernel variant). ``kv_dtype``: the
    stand-in cache's dtype (the layer's, e.g. fp8: the kernels' scaled variants are then compiled
    here too, with scales of 1); default the query's. Returns the claim's steps; after them it runs
    :func:`compile_row`, so that the variants of short contexts compile here too.
    """
    steps = worst_case_steps(query.shape[0], kv_len, settings.gating.min_sparse_query_len)
    runs = steps + [[compile_row(query.shape[0], kv_len, settings.gating.min_sparse_query_len)]]
    head_dim = query.shape[-1]
    kv_dtype = kv_dtype or query.dtype
    key_cache = torch.zeros(1, page_size, num_kv_heads, head_dim, dtype=kv_dtype, device=query.device)
    value_cache = torch.zeros(1, page_size, num_kv_heads, output.shape[-1], dtype=kv_dtype, device=query.device)
    block_table = torch.zeros(max(len(rows) for rows in steps), -(-kv_len // page_size), dtype=torch.int32,
                              device=query.device)
    one, scales = None, {}
    if kv_dtype != query.dtype:  # a quantized layer's variants: scales read on the device
        one = torch.ones(1, dtype=torch.float32, device=query.device)
        scales = {"k_scale": one, "v_scale": one}
    # every row estimated and counted as a sampled forward counts it (pair counts and head labels
    # measured on the device): the path itself, with max_density 1 so that no row is skipped
    every_row = settings.replace(max_density=1.0)
    flagged_dense = settings.gating.max_density < 1.0 and settings.gating.estimated_dense_rows != "flash"
    for rows in runs:
        run_recorded(SparseStats.measuring_only(), run_sparse_rows_paged, query, output, rows, key_cache, value_cache,
                     block_table, groups, every_row, scale, softcap, kernel, **scales)
        if flagged_dense:
            # the density fallback's temporaries, and rows flagged on the device running in the
            # kernel's dense mode, another variant of it: compiled here, not in the first request
            # that has such a row
            indices = [estimate_index_paged(query[r.tok_start:r.tok_start + r.q_len], key_cache, block_table[r.row],
                                            r.ctx_len, groups, settings, scale, one).index for r in rows]
            dens = torch.stack([index_density(ix, r.q_len, r.ctx_len) for ix, r in zip(indices, rows)])
            kernel(query, key_cache, value_cache, block_table, rows, indices, scale, output, softcap,
                   whole_rows=dens > settings.gating.max_density, **scales)
            del indices, dens
    return steps
