"""What the sparse path did, per worker process: the one place that records it.

The worker's runtime holds one :class:`SparseStats` (:attr:`..runtime.WorkerRuntime.stats`); the
backends call its ``record_*`` methods (a layer call's through :func:`.record.record_layer`, once,
after the call), each of which updates the JSON counters below and the Prometheus metrics
(:mod:`.metrics`, held by the runtime) together. When the
``stats_file`` setting is set, the worker rewrites that JSON file (atomically) so that a client
such as the demo or a test can read what happened inside the server. It is rewritten at most
once per ``stats_write_interval_s``: a forward inside the interval leaves the write to a timer
that fires at the interval's end, and the process writes what is left when it exits, so the file
is never more than one interval behind what was recorded (0: every forward rewrites it, what a
client that reads the file right after each request needs).

Tensor parallelism: every rank runs every row of a step on its slice of the heads, so each
rank's counters would repeat the same rows (summed by vLLM's multiprocess metrics, and every
rank would rewrite the one stats file). Only TP rank 0 records and exports (:meth:`configure`,
``export``), so rows, query tokens and stage times count each (row, layer) once, as at TP=1.
Pairs, density, head patterns and the density fallbacks (decided per rank, over its heads, on
CUDA) are those of rank 0's heads: its 1/tp of the query heads, with a head-config file the
slice that file gives rank 0. Other ranks record nothing, create no metrics, serve no port and
write no file.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

from . import metrics, timing
from ..config import ObservabilitySettings

logger = logging.getLogger("vllm.sparse_prefill")
_DEFAULT_SAMPLE_EVERY = ObservabilitySettings.model_fields["timing_sample_every"].default
_MAX_READOUTS = 256


def _timer(delay: float, callback: Callable[[], None]) -> None:
    """Call ``callback`` on a daemon thread after ``delay`` seconds (the stats file's trailing write)."""
    timer = threading.Timer(delay, callback)
    timer.daemon = True
    timer.start()


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
    _readouts: list = field(default_factory=list, repr=False)  # device values on their way to the host
    _prom: object = field(default=None, repr=False)  # the runtime's Prometheus metrics (None: none)
    timer: timing.SampledTimer = field(default=None, repr=False)
    exporting: bool = True  # False on tensor-parallel ranks other than 0: nothing is recorded (configure)
    _write_failed: bool = field(default=False, repr=False)  # the last stats-file write failed (logged once)
    _export_failed: bool = field(default=False, repr=False)  # the last metrics update failed (logged once)
    _readout_failed: bool = field(default=False, repr=False)  # a readout's recording failed (logged once)
    # The stats file's rate: at most one write per interval (configure), timed by ``clock``; a
    # write left for later is done by a callback that ``schedule(delay, callback)`` runs.
    write_interval_s: float = 0.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    schedule: Callable[[float, Callable[[], None]], None] = field(default=_timer, repr=False)
    _file_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one write at a time
    _last_write: float | None = field(default=None, repr=False)  # clock() of the last write
    _unwritten: str | None = field(default=None, repr=False)  # path whose newer counts wait for a write
    _scheduled: bool = field(default=False, repr=False)  # a trailing write is scheduled

    def __post_init__(self):
        if self.timer is None:
            self.timer = timing.SampledTimer(self._observe_stage, every=_DEFAULT_SAMPLE_EVERY)

    @classmethod
    def measuring_only(cls) -> "SparseStats":
        """Stats that make every forward a sampled one (pairs counted on the device, stages timed)
        and export nothing: what the profiling-run claim runs the sparse path with, so that it
        allocates what a sampled forward allocates without counting the claim's rows."""
        stats = cls(_prom=metrics.NO_METRICS)
        stats.timer.every = 1
        return stats

    # -- set-up ------------------------------------------------------------------------------

    @property
    def prom(self):
        return metrics.NO_METRICS if self._prom is None else self._prom

    def configure(self, settings: ObservabilitySettings, export: bool = True) -> None:
        """Apply the settings of this process (called when the backend reads them, in the
        worker): timing sample rate and the stats file's rate. ``export``: False on a
        tensor-parallel rank other than 0, which then records nothing (no counters, no timing, no
        stats file; its runtime makes no metrics and serves no port; see the module doc)."""
        self.exporting = export
        if not export:
            self.timer.every = 0
            return
        self.timer.every = settings.timing_sample_every
        self.write_interval_s = settings.stats_write_interval_s
        if settings.stats_file and self.write_interval_s > 0:
            atexit.register(self.write_unwritten)  # the counts of the last interval

    # -- recording ---------------------------------------------------------------------------

    def record_sparse_row(self, q_len: int, causal: int | None, computed: int | None,
                          head_patterns: Mapping[str, int]) -> None:
        """One (row, layer) computed sparse. ``computed`` (pairs the selection computed) is None
        when it was not measured (GPU path without a stats file, on forwards not sampled); the
        pair counters and the density then skip this row."""
        if not self.exporting:
            return
        with self._lock:
            self.sparse_rows += 1
            self.sparse_query_tokens += q_len
            if computed is not None:
                self.causal_pairs += causal
                self.computed_pairs += computed
            self.head_patterns.update(head_patterns)
        self._export(self.prom.sparse_row, q_len, causal, computed, head_patterns)

    def record_measured_pairs(self, causal: int, computed: int, head_patterns: Mapping[str, int] | None = None) -> None:
        """The measured part of a row recorded earlier with ``computed=None`` (read back later):
        its pairs and, where they were only known on the device, its head patterns."""
        if not self.exporting:
            return
        with self._lock:
            self.causal_pairs += causal
            self.computed_pairs += computed
            if head_patterns:
                self.head_patterns.update(head_patterns)
        self._export(self.prom.sparse_row_measured, causal, computed, head_patterns or {})

    def record_dense_tokens(self, n: int) -> None:
        """Query tokens x layers that ran on the dense kernel in a step with sparse rows."""
        if not self.exporting:
            return
        with self._lock:
            self.dense_query_tokens += n
        self._export(self.prom.dense_tokens, n)

    def record_dense_reason(self, reason: str, rows: int = 1, tokens: int = 0) -> None:
        """Long rows kept dense (``reason`` a snake_case key); ``tokens`` of them are counted as
        dense query tokens here (0 when the dense runs count them already)."""
        if not self.exporting:
            return
        with self._lock:
            self.dense_reasons[reason] += rows
            self.dense_query_tokens += tokens
        self._export(self.prom.dense_fallback, reason, rows)
        if tokens:
            self._export(self.prom.dense_tokens, tokens)

    def defer_dense_rows(self, reason: str, flags) -> None:
        """Rows decided on the GPU (``flags``: bool tensor, one per row) that ran dense for
        ``reason``: summed on the device, recorded by :meth:`flush_deferred` (no host sync here)."""
        if not self.exporting:
            return
        with self._lock:
            n = flags.sum()
            if reason in self._deferred:
                self._deferred[reason] += n
            else:
                self._deferred[reason] = n

    def flush_deferred(self, wait: bool = True) -> None:
        """Move the deferred device counts into ``dense_reasons``: now (``wait``, a host sync),
        or once the device has computed them (:meth:`read_later`)."""
        with self._lock:
            pending, self._deferred = self._deferred, {}
        if pending:
            reasons = list(pending)

            def record(counts: list[int]) -> None:
                for reason, rows in zip(reasons, counts):
                    if rows:
                        self.record_dense_reason(reason, rows=rows)

            self.read_later(list(pending.values()), record)
        if wait:
            self.poll_readouts(wait=True)

    def read_later(self, values: list, then: Callable[[list[int]], None]) -> None:
        """Call ``then`` with ``values`` (integer scalar tensors) as host ints once the device has
        computed them, without waiting here: on CUDA they are copied to pinned memory behind an
        event that later calls poll (:meth:`poll_readouts`: every sparse forward, and a waiting
        one in :meth:`dump`). A forward that read them back at once would stall the GPU until
        the host had queued the rest of the layer."""
        if not self.exporting:
            return
        import torch

        flat = torch.stack([v.reshape(()).to(torch.int64) for v in values])
        if flat.device.type != "cuda":
            self._apply_readout(then, flat.tolist())
            return
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        with self._lock:
            self._readouts.append((done, host, then))
            backlog = len(self._readouts) > _MAX_READOUTS
        if backlog:  # nothing polled for a long time: wait for the oldest rather than grow
            self.poll_readouts(wait=True, limit=1)

    def poll_readouts(self, wait: bool = False, limit: int | None = None) -> int:
        """Apply the readouts whose copies are done (all, in order, with ``wait``); returns how many."""
        with self._lock:
            ready = []
            for r in self._readouts:
                if (limit is not None and len(ready) >= limit) or not (wait or r[0].query()):
                    break  # in order: a later copy is not done before an earlier one
                ready.append(r)
            del self._readouts[:len(ready)]
        for done, host, then in ready:
            if wait:
                done.synchronize()
            self._apply_readout(then, host.tolist())
        return len(ready)

    def _apply_readout(self, then: Callable[[list[int]], None], values: list[int]) -> None:
        # Readouts are applied at the start of a later layer's forward (time_stages), outside
        # the sparse path's error boundary: a recording that raises there is logged once and
        # its counts are lost, never the forward.
        try:
            then(values)
        except Exception as e:  # noqa: BLE001 - the counters' own boundary
            if not self._readout_failed:
                self._readout_failed = True
                logger.warning("sparse-prefill: recording counts read back from the device raised %s: %s; serving "
                               "goes on, and the counts miss them", type(e).__name__, e)

    def time_stages(self, device=None):
        """The stage timer of one sparse layer forward: a no-op unless this forward is sampled
        (see :class:`timing.SampledTimer`; ``.sampled`` says which). Applies the readouts that
        have arrived since the last forward."""
        if self._readouts:
            self.poll_readouts()
        return self.timer.sample(device)

    def _observe_stage(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.stage_seconds[stage] += seconds
            self.stage_samples[stage] += 1
        self._export(self.prom.stage_seconds, stage, seconds)

    def _export(self, update: Callable, *args) -> None:
        """One update of the Prometheus metrics, which must not stop serving: an update that raises
        (prometheus-client's multiprocess files on a full disk) is logged once and the metrics miss
        it; the counters above have it. The stage timer reports from inside the sparse path (on
        CPU) or before it (on CUDA), where an error would otherwise send the rows dense or reach
        vLLM."""
        try:
            update(*args)
        except Exception as e:  # noqa: BLE001 - the metrics' own boundary
            if not self._export_failed:
                self._export_failed = True
                logger.warning("sparse-prefill: updating the Prometheus metrics raised %s: %s; serving goes on, "
                               "and later updates try again", type(e).__name__, e)
            return
        self._export_failed = False

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

    def dump(self, path: str, wait: bool = True) -> None:
        """Bring the counts up to date and rewrite the JSON file at ``path`` (at the bounded rate,
        see the module doc). ``wait``: first wait for every readout (a host sync on CUDA), so the
        counts are exact now. Without ``wait`` (what CUDA forwards do, so that a stats file does
        not stall the GPU once per layer) the file holds what the device has finished counting,
        ``pending_readouts`` says how many counts are still on their way, and :meth:`refresh`
        rewrites it when they arrive."""
        if not self.exporting:
            return
        self.flush_deferred(wait=wait)
        if not wait:
            self.poll_readouts()
        self._write_when_due(path)

    def refresh(self, path: str) -> None:
        """Apply the readouts the device has finished and rewrite ``path`` (at the bounded rate)
        if any were: called by the CUDA builder once per step while the stats file is set, so the
        file catches up at the next step (the first decode step of a prompt, at the latest)
        without waiting for the GPU. Nothing while a CUDA graph is captured (its events cannot
        be queried then)."""
        if not self._readouts:
            return
        import torch

        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if not capturing and self.poll_readouts():
            self._write_when_due(path)

    def write_unwritten(self) -> None:
        """Write the counts that a rate-limited write left for later, if any: what the trailing
        timer and the process's exit call. Reads no device value (it may run on another thread)."""
        with self._file_lock:
            self._scheduled = False
            path, self._unwritten = self._unwritten, None
            if path is not None:
                self._write(path)

    def _write_when_due(self, path: str) -> None:
        """Write now if the last write is ``write_interval_s`` old, else leave it to a trailing write."""
        with self._file_lock:
            now = self.clock()
            if self.write_interval_s <= 0 or self._last_write is None \
                    or now - self._last_write >= self.write_interval_s:
                self._unwritten = None
                self._write(path)
                return
            self._unwritten = path
            if self._scheduled:
                return
            self._scheduled = True
            delay = self._last_write + self.write_interval_s - now
        self.schedule(delay, self.write_unwritten)

    def _write(self, path: str) -> None:
        """Replace the file atomically (a private temporary file beside it, then a rename); the
        caller holds ``_file_lock``. A write that fails (a full disk, a folder made read-only) is
        logged once and serving goes on: the next write tries again."""
        self._last_write = self.clock()
        with self._lock:
            data = self.as_dict()
            data["pending_readouts"] = len(self._readouts)
        folder, name = os.path.split(os.path.abspath(path))
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            if not self._write_failed:
                self._write_failed = True
                logger.warning("sparse-prefill: cannot write the stats file %s (%s); serving goes on, and later "
                               "writes try again", path, e)
            return
        self._write_failed = False

