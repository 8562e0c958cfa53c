"""Prometheus metrics of the sparse path.

Where the numbers show up:

* ``PROMETHEUS_MULTIPROC_DIR`` exported before ``vllm serve`` (every vLLM process inherits it):
  prometheus_client then keeps each process's samples in files of that folder, and vLLM's API
  server merges them at its own ``/metrics``. The worker that runs attention is one of those
  processes, so the plugin's metrics appear there next to vLLM's.
* Otherwise the worker's samples stay in its own default registry, which vLLM never serves. The
  ``metrics_port`` setting then starts prometheus_client's HTTP server inside the worker, bound
  to ``metrics_host`` (this host only unless set otherwise).

Names start with ``sparse_prefill_``, never ``vllm:`` (vLLM unregisters every ``vllm:``
collector of a process when it sets up its own). Everything here degrades to a no-op when
prometheus_client is missing or cannot create its metrics, so serving never depends on it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping

logger = logging.getLogger("vllm.sparse_prefill")

PREFIX = "sparse_prefill_"
DENSITY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)

# name (without _total) -> (kind, label names, help). The README's metrics table lists the same.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "query_tokens": ("counter", ("route",),
                     "Prefill query tokens x attention layers, by route: sparse = computed by the sparse "
                     "path and skipping keys; dense = sent to the dense kernel in steps that had a sparse row, "
                     "including rows that fell back, and rows whose sparse selection covered every key"),
    "rows": ("counter", (), "(request row, attention layer) pairs computed sparse"),
    "causal_pairs": ("counter", (),
                     "(query, key) pairs x heads that dense causal attention would compute for the measured "
                     "sparse rows"),
    "computed_pairs": ("counter", (), "Of causal_pairs, the pairs the sparse selection computed"),
    "density": ("histogram", (),
                "Computed share of the causal (query, key) pairs per sparse row and layer (measured rows)"),
    "stage_seconds": ("histogram", ("stage",),
                      "Time of the sparse path's stages per layer forward (stage = estimate or kernel), "
                      "sampled 1 of timing_sample_every forwards"),
    "head_patterns": ("counter", ("pattern",), "Heads x sparse rows per chosen pattern"),
    "dense_fallbacks": ("counter", ("reason",),
                        "Long rows that ran dense instead of sparse, by reason (sparse_selection_covers_every_key: "
                        "the sparse path selected every causal key, i.e. computed dense attention)"),
}

_SLUG = re.compile(r"[^a-z0-9_/]+")


def label_value(text: str) -> str:
    """Stable snake_case label value of a free-text reason ("a b" -> "a_b")."""
    return _SLUG.sub("_", str(text).strip().lower()).strip("_") or "unknown"


class PrometheusMetrics:
    """The plugin's prometheus_client objects, registered in ``registry`` (default: the process's
    default registry, which multiprocess mode mirrors into PROMETHEUS_MULTIPROC_DIR)."""

    def __init__(self, prometheus_client, registry=None):
        pc = prometheus_client
        kw = {} if registry is None else {"registry": registry}
        self._m: dict[str, Any] = {}
        for name, (kind, labels, doc) in METRICS.items():
            if kind == "counter":
                self._m[name] = pc.Counter(PREFIX + name, doc, labels, **kw)
            else:
                buckets = DENSITY_BUCKETS if name == "density" else SECONDS_BUCKETS
                self._m[name] = pc.Histogram(PREFIX + name, doc, labels, buckets=buckets, **kw)
        # Route labels exist from the start, so a dashboard sees 0 rather than no series.
        for route in ("sparse", "dense"):
            self._m["query_tokens"].labels(route=route)

    def sparse_row(self, q_len: int, causal: int | None, computed: int | None,
                   head_patterns: Mapping[str, int]) -> None:
        m = self._m
        m["rows"].inc()
        m["query_tokens"].labels(route="sparse").inc(q_len)
        if computed is not None:
            self.sparse_row_measured(causal, computed, {})
        for pattern, n in head_patterns.items():
            if n:
                m["head_patterns"].labels(pattern=pattern).inc(n)

    def sparse_row_measured(self, causal: int | None, computed: int, head_patterns: Mapping[str, int]) -> None:
        """A row's measured pairs (and patterns known only on the device), read back after the row."""
        m = self._m
        if causal:
            m["causal_pairs"].inc(causal)
            m["computed_pairs"].inc(computed)
            m["density"].observe(computed / causal)
        for pattern, n in head_patterns.items():
            if n:
                m["head_patterns"].labels(pattern=pattern).inc(n)

    def dense_tokens(self, n: int) -> None:
        if n:
            self._m["query_tokens"].labels(route="dense").inc(n)

    def dense_fallback(self, reason: str, rows: int) -> None:
        self._m["dense_fallbacks"].labels(reason=label_value(reason)).inc(rows)

    def stage_seconds(self, stage: str, seconds: float) -> None:
        self._m["stage_seconds"].labels(stage=stage).observe(seconds)


class _NoMetrics:
    """Stands in when prometheus_client is unavailable or failed: every call does nothing."""

    def __getattr__(self, name):
        return lambda *a, **k: None


NO_METRICS = _NoMetrics()


def _warn(msg: str, *args) -> None:
    logger.warning("sparse-prefill metrics: " + msg, *args)


def create_metrics() -> PrometheusMetrics | _NoMetrics:
    """The process's metrics, made once by its worker runtime (:attr:`..runtime.WorkerRuntime.metrics`),
    which holds them: prometheus_client registers each name once per process."""
    try:
        import prometheus_client
    except ImportError:
        _warn("prometheus_client is not installed; no Prometheus metrics")
        return NO_METRICS
    try:
        return PrometheusMetrics(prometheus_client)
    except Exception as e:  # noqa: BLE001 - e.g. PROMETHEUS_MULTIPROC_DIR names a missing folder
        _warn("cannot create the metrics (%s: %s); serving goes on without them", type(e).__name__, e)
        return NO_METRICS


def exposition_registry():
    """The registry to serve: all processes' samples in multiprocess mode, else this process's."""
    import prometheus_client
    from prometheus_client import multiprocess

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return prometheus_client.REGISTRY


def serve_metrics(port: int, addr: str = "127.0.0.1") -> bool:
    """Start prometheus_client's HTTP server in this process (the worker runtime asks once).
    False if it cannot run (no prometheus_client, or the port is taken: with several workers on a
    host only one binds; with PROMETHEUS_MULTIPROC_DIR set that one serves every process's samples)."""
    try:
        import prometheus_client
    except ImportError:
        _warn("metrics_port=%d set but prometheus_client is not installed", port)
        return False
    try:
        prometheus_client.start_http_server(port, addr=addr, registry=exposition_registry())
    except OSError as e:
        _warn("cannot serve on %s:%d (%s); this process's metrics are not exposed on a port of "
              "its own (with several workers per host, set PROMETHEUS_MULTIPROC_DIR)", addr, port, e)
        return False
    logger.info("sparse-prefill: Prometheus metrics on http://%s:%d/metrics (pid %d)", addr, port, os.getpid())
    return True
