"""The sampled timer of the sparse path's two stages (estimate, kernel).

:class:`SampledTimer` measures them on one of every N sparse layer forwards. On CUDA it records
event pairs on the current stream and reads their elapsed time on a later call, once
``Event.query()`` reports them done, so it never waits for the GPU; elsewhere it reads
``time.perf_counter``. What it measures goes to the ``stage_seconds`` histogram (metrics.py)
through the callback its owner (stats.py) gives it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Callable


class _NoSample:
    """A forward that is not timed: every call does nothing."""

    sampled = False

    def mark(self) -> None:
        pass

    def lap(self, stage: str) -> None:
        pass

    def done(self) -> None:
        pass


NO_SAMPLE = _NoSample()


class _HostSample:
    """Stage times from the host clock (CPU: the work is done when the call returns)."""

    sampled = True

    def __init__(self, timer: "SampledTimer"):
        self._timer = timer
        self._totals: dict[str, float] = defaultdict(float)
        self._t = time.perf_counter()

    def mark(self) -> None:
        """Start a new segment here; time since the last mark or lap is not counted."""
        self._t = time.perf_counter()

    def lap(self, stage: str) -> None:
        """Add the time since the last mark or lap to ``stage``."""
        now = time.perf_counter()
        self._totals[stage] += now - self._t
        self._t = now

    def done(self) -> None:
        for stage, seconds in self._totals.items():
            self._timer.observe(stage, seconds)


class _EventSample:
    """Stage times from CUDA event pairs on the current stream; read later, never waited for."""

    sampled = True

    def __init__(self, timer: "SampledTimer", event_factory: Callable[[], Any]):
        self._timer = timer
        self._new = event_factory
        self._segments: list[tuple[str, Any, Any]] = []
        self._open = self._record()

    def _record(self):
        e = self._new()
        e.record()
        return e

    def mark(self) -> None:
        self._open = self._record()

    def lap(self, stage: str) -> None:
        end = self._record()
        self._segments.append((stage, self._open, end))
        self._open = end

    def done(self) -> None:
        if self._segments:
            self._timer.enqueue(self)

    def finished(self) -> bool:
        return all(end.query() for _, _, end in self._segments)

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for stage, start, end in self._segments:
            out[stage] += start.elapsed_time(end) / 1000.0  # ms -> s
        return out


def _cuda_event():
    import torch

    return torch.cuda.Event(enable_timing=True)


class SampledTimer:
    """Times one of every ``every`` calls to :meth:`sample` (the first call included); 0 = never.

    Usage per sparse layer forward::

        t = timer.sample(query.device)   # starts the first segment
        ...estimate...;  t.lap("estimate")
        t.mark()                         # skip what is not ours (e.g. a dense fallback)
        ...kernel...;    t.lap("kernel")
        t.done()

    ``observe(stage, seconds)`` receives each stage's total for the forward. Device samples are
    kept until their events are done (checked with ``query()`` on later calls, at most
    ``max_pending`` kept: the oldest are dropped beyond that).
    """

    def __init__(self, observe: Callable[[str, float], None], every: int = 0, max_pending: int = 64,
                 event_factory: Callable[[], Any] = _cuda_event):
        self.observe = observe
        self.every = every
        self.max_pending = max_pending
        self._event_factory = event_factory
        self._calls = 0
        self._pending: list[_EventSample] = []
        self._lock = threading.Lock()
        self.dropped = 0

    def sample(self, device=None):
        if self._pending:
            self.poll()
        if self.every <= 0:
            return NO_SAMPLE
        with self._lock:
            n = self._calls
            self._calls += 1
        if n % self.every:
            return NO_SAMPLE
        if getattr(device, "type", device) == "cuda":
            return _EventSample(self, self._event_factory)
        return _HostSample(self)

    def enqueue(self, sample: _EventSample) -> None:
        with self._lock:
            self._pending.append(sample)
            if len(self._pending) > self.max_pending:
                self._pending.pop(0)
                self.dropped += 1

    def poll(self) -> int:
        """Observe the device samples whose events are done; return how many."""
        with self._lock:
            ready = [s for s in self._pending if s.finished()]
            self._pending = [s for s in self._pending if s not in ready]
        for s in ready:
            for stage, seconds in s.totals().items():
                self.observe(stage, seconds)
        return len(ready)

    @property
    def pending(self) -> int:
        return len(self._pending)
