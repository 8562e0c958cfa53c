"""Step planning: which rows of a vLLM step run sparse, which run dense (in contiguous runs).

Pure Python over CPU-side lengths, so the builders can call it without a device sync and tests
can call it without vLLM.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .config import SparseSettings


@dataclass(frozen=True)
class SparseRow:
    """One request's chunk: queries at absolute positions ctx_len .. ctx_len + q_len - 1."""

    row: int  # index of the request in the batch
    tok_start: int  # first token of the chunk in the step's flattened query/output tensors
    q_len: int
    ctx_len: int


@dataclass
class StepPlan:
    sparse_rows: list[SparseRow]
    dense_runs: list[tuple[int, int]]  # maximal runs [first_row, end_row) of rows for the dense kernel
    dense_reasons: Counter = field(default_factory=Counter)  # why long rows stayed dense

    @property
    def has_sparse(self) -> bool:
        return bool(self.sparse_rows)


def plan_step(query_start_loc: list[int], seq_lens: list[int], settings: SparseSettings,
              allow_context: bool = True) -> StepPlan:
    """Route each row. ``query_start_loc`` has num_reqs + 1 entries; ``seq_lens`` = context + chunk.

    A row goes sparse when its chunk has at least ``min_sparse_query_len`` queries and its
    sequence at least ``min_sparse_seq_len`` tokens. ``allow_context=False`` (the CPU twin, which
    cannot read vLLM's ISA-packed CPU cache) keeps rows that have cached context dense.
    Rows with no queries (cudagraph padding) belong to no run.
    """
    n = len(seq_lens)
    sparse, dense_runs, reasons = [], [], Counter()
    run_start = None
    for i in range(n + 1):
        dense = False
        if i < n:
            q_len = query_start_loc[i + 1] - query_start_loc[i]
            ctx = seq_lens[i] - q_len
            long_enough = settings.enabled and q_len >= settings.min_sparse_query_len \
                and seq_lens[i] >= settings.min_sparse_seq_len
            if long_enough and ctx > 0 and not allow_context:
                reasons["cached_context_on_cpu"] += 1
                long_enough = False
            if long_enough:
                sparse.append(SparseRow(i, query_start_loc[i], q_len, ctx))
            else:
                dense = q_len > 0
        if dense and run_start is None:
            run_start = i
        elif not dense and run_start is not None:
            dense_runs.append((run_start, i))
            run_start = None
    return StepPlan(sparse, dense_runs, reasons)
