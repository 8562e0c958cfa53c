"""What the sparse path did, per worker process: the one place that records it.

The backends call the ``record_*`` methods of :data:`STATS`; each updates the JSON counters
below and the Prometheus metrics (:mod:`vllm_sparse_backend.metrics`) together. When the
``stats_file`` setting is set, the worker rewrites that JSON file (atomically) so that a client
such as the demo or a test can read what happened inside the server.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from . import metrics
from .config import SparseSettings

_DEFAULT_SAMPLE_EVERY = SparseSettings.model_fields["timing_sample_every"].default


@dataclass
class SparseStats:
    sparse_rows: int = 0  # (row, layer) pairs computed sparse
    sparse_query_tokens: int = 0  # query tokens x layers computed sparse
    dense_query_tokens: int = 0  # query tokens x layers sent to the dense kernel while sparse was on
    causal_pairs: int = 0  # (query, key) pairs x heads dense causal attention would compute for sparse rows
    computed_pairs: int = 0  # of those, the pairs the sparse selection computed
    head_patterns: Counter = field(default_factory=Counter)  # heads x rows per pattern
    dense_reasons: Counter = field(default_factory=Counter)  # long rows kept dense, by reason
    stage_seconds: Counter = field(default_factory=Counter)  # sampled seconds per stage (estimate, kernel)
    stage_samples: Counter = field(default_factory=Counter)  # sampled forwards per stage
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _deferred: dict = field(default_factory=dict, repr=False)  # reason -> device count of rows, read later
    _prom: object = field(default=None, repr=False)  # Prometheus metrics, created on first record
    timer: metrics.SampledTimer = field(default=None, repr=False)

    def __post_init__(self):
        if self.timer is None:
            self.timer = metrics.SampledTimer(self._observe_stage, every=_DEFAULT_SAMPLE_EVERY)

    # -- set-up ------------------------------------------------------------------------------

    @property
    def prom(self):
        if self._prom is None:
            self._prom = metrics.process_metrics()
        return self._prom

    def configure(self, settings: SparseSettings) -> None:
        """Apply the settings of this process (called when the backend reads them, in the
        worker): timing sample rate, metrics creation, and the optional metrics port."""
        self.timer.every = settings.timing_sample_every
        _ = self.prom  # metrics exist (at 0) from start-up, not from the first long request
        if settings.metrics_port is not None:
            metrics.serve_metrics(settings.metrics_port)

    # -- recording ---------------------------------------------------------------------------

    def record_sparse_row(self, q_len: int, causal: int | None, computed: int | None,
                          head_patterns: Mapping[str, int]) -> None:
        """One (row, layer) computed sparse. ``computed`` (pairs the selection computed) is None
        when it was not measured (GPU path without a stats file, on forwards not sampled); the
        pair counters and the density then skip this row."""
        with self._lock:
            self.sparse_rows += 1
            self.sparse_query_tokens += q_len
            if computed is not None:
                self.causal_pairs += causal
                self.computed_pairs += computed
            self.head_patterns.update(head_patterns)
        self.prom.sparse_row(q_len, causal, computed, head_patterns)

    def record_dense_tokens(self, n: int) -> None:
        """Query tokens x layers that ran on the dense kernel in a step with sparse rows."""
        with self._lock:
            self.dense_query_tokens += n
        self.prom.dense_tokens(n)

    def record_dense_reason(self, reason: str, rows: int = 1, tokens: int = 0) -> None:
        """Long rows kept dense (``reason`` a snake_case key); ``tokens`` of them are counted as
        dense query tokens here (0 when the dense runs count them already)."""
        with self._lock:
            self.dense_reasons[reason] += rows
            self.dense_query_tokens += tokens
        self.prom.dense_fallback(reason, rows)
        if tokens:
            self.prom.dense_tokens(tokens)

    def defer_dense_rows(self, reason: str, flags) -> None:
        """Rows decided on the GPU (``flags``: bool tensor, one per row) that ran dense for
        ``reason``: summed on the device, recorded by :meth:`flush_deferred` (no host sync here)."""
        with self._lock:
            n = flags.sum()
            if reason in self._deferred:
                self._deferred[reason] += n
            else:
                self._deferred[reason] = n

    def flush_deferred(self) -> None:
        """Read the deferred device counts (a host sync) into ``dense_reasons``."""
        with self._lock:
            pending, self._deferred = self._deferred, {}
        for reason, n in pending.items():
            rows = int(n)
            if rows:
                self.record_dense_reason(reason, rows=rows)

    def time_stages(self, device=None):
        """The stage timer of one sparse layer forward: a no-op unless this forward is sampled
        (see :class:`metrics.SampledTimer`; ``.sampled`` says which)."""
        return self.timer.sample(device)

    def _observe_stage(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.stage_seconds[stage] += seconds
            self.stage_samples[stage] += 1
        self.prom.stage_seconds(stage, seconds)

    # -- the JSON file -----------------------------------------------------------------------

    def as_dict(self) -> dict:
        return {
            "pid": os.getpid(),
            "sparse_rows": self.sparse_rows,
            "sparse_query_tokens": self.sparse_query_tokens,
            "dense_query_tokens": self.dense_query_tokens,
            "causal_pairs": self.causal_pairs,
            "computed_pairs": self.computed_pairs,
            "density": self.computed_pairs / self.causal_pairs if self.causal_pairs else None,
            "head_patterns": dict(self.head_patterns),
            "dense_reasons": dict(self.dense_reasons),
            "stage_seconds": dict(self.stage_seconds),
            "stage_samples": dict(self.stage_samples),
        }

    def dump(self, path: str) -> None:
        self.flush_deferred()
        tmp = f"{path}.{os.getpid()}.tmp"
        with self._lock:
            data = self.as_dict()
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)


STATS = SparseStats()
