"""What the sparse path did, observed: the per-worker counters and the stats file (``stats.py``),
the Prometheus metrics and the sampled stage timer (``metrics.py``). The serving path hands
them what happened; a metric change touches nothing under ``prefill/``."""
