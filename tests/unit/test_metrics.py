"""Prometheus metrics: SparseStats feeds the JSON file and the metrics together; the sampled
stage timer; the multiprocess hand-over to vLLM's /metrics; the plugin's own port; and, at the
end, a real CPU vLLM server scraped at /metrics after a long request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from vllm_sparse_backend.observability import metrics, timing
from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.settings import load_settings
from vllm_sparse_backend.observability.metrics import PrometheusMetrics
from vllm_sparse_backend.observability.timing import SampledTimer
from vllm_sparse_backend.observability.stats import SparseStats
from vllm_sparse_backend.runtime import WorkerRuntime
from fakes import ManualEvent


def _stats_with_registry():
    registry = CollectorRegistry()
    st = SparseStats()
    st._prom = PrometheusMetrics(prometheus_client, registry=registry)
    return st, registry


def _value(registry, name, **labels):
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_records_update_json_counters_and_metrics_together(tmp_path):
    st, reg = _stats_with_registry()
    st.record_sparse_row(1000, causal=4000, computed=1000, head_patterns={"vertical_slash": 3, "a_shape": 1})
    st.record_sparse_row(500, causal=2000, computed=None, head_patterns={"vertical_slash": 4})  # not measured
    st.record_dense_tokens(70)
    st.record_dense_reason("estimated density above max_density", tokens=300)
    st.record_dense_reason("cached_context_on_cpu", rows=2)

    d = st.as_dict()
    assert (d["sparse_rows"], d["sparse_query_tokens"], d["dense_query_tokens"]) == (2, 1500, 370)
    assert (d["causal_pairs"], d["computed_pairs"], d["density"]) == (4000, 1000, 0.25)
    assert d["head_patterns"] == {"vertical_slash": 7, "a_shape": 1}
    assert d["dense_reasons"] == {"estimated density above max_density": 1, "cached_context_on_cpu": 2}
    st.dump(str(tmp_path / "s.json"))
    assert json.loads((tmp_path / "s.json").read_text())["sparse_query_tokens"] == 1500

    assert _value(reg, "sparse_prefill_rows_total") == 2
    assert _value(reg, "sparse_prefill_query_tokens_total", route="sparse") == 1500
    assert _value(reg, "sparse_prefill_query_tokens_total", route="dense") == 370
    assert _value(reg, "sparse_prefill_causal_pairs_total") == 4000
    assert _value(reg, "sparse_prefill_computed_pairs_total") == 1000
    # only the measured row is in the density histogram: 0.25 falls in the 0.3 bucket, not 0.2
    assert _value(reg, "sparse_prefill_density_count") == 1
    assert _value(reg, "sparse_prefill_density_sum") == 0.25
    assert _value(reg, "sparse_prefill_density_bucket", le="0.2") == 0
    assert _value(reg, "sparse_prefill_density_bucket", le="0.3") == 1
    assert _value(reg, "sparse_prefill_head_patterns_total", pattern="vertical_slash") == 7
    assert _value(reg, "sparse_prefill_head_patterns_total", pattern="a_shape") == 1
    assert _value(reg, "sparse_prefill_dense_fallbacks_total",
                  reason="estimated_density_above_max_density") == 1
    assert _value(reg, "sparse_prefill_dense_fallbacks_total", reason="cached_context_on_cpu") == 2


def test_measured_pairs_read_back_later_count_like_a_measured_row():
    """A row recorded first without its pairs (a sampled GPU forward reads them back later) ends
    with the same counters, density and patterns as one recorded measured at once."""
    import torch

    st, reg = _stats_with_registry()
    st.record_sparse_row(1000, causal=4000, computed=None, head_patterns={"vertical_slash": 3})
    assert st.as_dict()["density"] is None and _value(reg, "sparse_prefill_density_count") == 0
    got = []
    st.read_later([torch.tensor(1000), torch.tensor(2, dtype=torch.int32)], got.append)  # CPU: at once
    assert got == [[1000, 2]]
    st.record_measured_pairs(4000, got[0][0], {"flex_prefill/query_aware": got[0][1]})
    d = st.as_dict()
    assert (d["sparse_rows"], d["causal_pairs"], d["computed_pairs"], d["density"]) == (1, 4000, 1000, 0.25)
    assert d["head_patterns"] == {"vertical_slash": 3, "flex_prefill/query_aware": 2}
    assert _value(reg, "sparse_prefill_density_count") == 1 and _value(reg, "sparse_prefill_density_sum") == 0.25
    assert _value(reg, "sparse_prefill_computed_pairs_total") == 1000
    assert _value(reg, "sparse_prefill_head_patterns_total", pattern="flex_prefill/query_aware") == 2
    # deferred dense-row flags (summed on the device) reach dense_reasons through the same readout
    st.defer_dense_rows("estimated density above max_density", torch.tensor([True, False, True]))
    st.flush_deferred(wait=False)
    assert st.as_dict()["dense_reasons"] == {"estimated density above max_density": 2}


def test_metric_names_have_no_vllm_prefix_and_route_series_start_at_zero():
    st, reg = _stats_with_registry()
    text = prometheus_client.generate_latest(reg).decode()
    names = {f.name for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
    assert names == {"sparse_prefill_" + n for n in metrics.METRICS}
    assert 'sparse_prefill_query_tokens_total{route="sparse"} 0.0' in text
    assert 'sparse_prefill_query_tokens_total{route="dense"} 0.0' in text


def test_label_value_of_free_text_reasons():
    assert metrics.label_value("budgets denser than max_density") == "budgets_denser_than_max_density"
    assert metrics.label_value("flex_prefill/query_aware") == "flex_prefill/query_aware"
    assert metrics.label_value("  ") == "unknown"


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_sampled_timer_times_one_of_n_forwards_on_the_host_clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    seen = []
    timer = SampledTimer(lambda stage, s: seen.append((stage, s)), every=3)
    sampled = []
    for _ in range(7):
        t = timer.sample("cpu")
        sampled.append(t.sampled)
        for _row in range(2):  # two rows: the stages add up over the forward
            clock.t += 5.0  # e.g. gathering K/V: not a stage
            t.mark()
            clock.t += 0.25
            t.lap("estimate")
            clock.t += 1.0
            t.lap("kernel")
        t.done()
    assert sampled == [True, False, False, True, False, False, True]
    assert seen == [("estimate", 0.5), ("kernel", 2.0)] * 3
    timer.every = 0
    assert not timer.sample("cpu").sampled


class _FakeEvent:
    """A CUDA event stand-in: a timestamp (ms) and whether the GPU got there. No synchronize():
    the timer must never wait for the device."""

    now_ms = 0.0

    def __init__(self):
        self.t, self.done = None, False

    def record(self):
        self.t = _FakeEvent.now_ms

    def query(self):
        return self.done

    def elapsed_time(self, end):
        assert self.done and end.done, "elapsed_time read before both events completed"
        return end.t - self.t


def test_sampled_timer_reads_device_events_only_once_they_are_done():
    made = []

    def factory():
        made.append(_FakeEvent())
        return made[-1]

    seen = []
    timer = SampledTimer(lambda stage, s: seen.append((stage, round(s, 6))), every=1, max_pending=2,
                         event_factory=factory)
    t = timer.sample("cuda")
    _FakeEvent.now_ms = 4.0
    t.lap("estimate")
    _FakeEvent.now_ms = 10.0
    t.mark()  # a dense fallback in between is not timed
    _FakeEvent.now_ms = 13.0
    t.lap("kernel")
    t.done()
    assert seen == [] and timer.pending == 1  # queued, nothing read yet
    assert timer.poll() == 0  # events not reached by the "GPU": still pending, no wait
    for e in made:
        e.done = True
    timer.sample(type("Dev", (), {"type": "cuda"})()).done()  # the next forward collects it
    assert seen == [("estimate", 0.004), ("kernel", 0.003)]
    # a GPU that never catches up cannot grow the queue without bound
    for _ in range(5):
        s = timer.sample("cuda")
        s.lap("kernel")
        s.done()
    assert timer.pending == 2 and timer.dropped >= 3


def test_no_prometheus_client_means_no_metrics_but_stats_still_work(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    st = SparseStats(_prom=metrics.create_metrics())
    st.record_sparse_row(10, causal=20, computed=5, head_patterns={"dense": 1})
    st.record_dense_reason("cached_context_on_cpu")
    assert st.prom is metrics.NO_METRICS
    assert st.as_dict()["sparse_query_tokens"] == 10
    assert metrics.serve_metrics(1) is False


def test_metrics_settings_are_validated_naming_the_variable():
    s = load_settings({"VLLM_SPARSE_METRICS_PORT": "9400", "VLLM_SPARSE_TIMING_SAMPLE_EVERY": "0"})
    assert (s.observability.metrics_port, s.observability.timing_sample_every) == (9400, 0)
    assert load_settings({}).observability.metrics_port is None
    with pytest.raises(ConfigError, match="VLLM_SPARSE_METRICS_PORT='70000'"):
        load_settings({"VLLM_SPARSE_METRICS_PORT": "70000"})
    with pytest.raises(ConfigError, match="VLLM_SPARSE_TIMING_SAMPLE_EVERY='-1'"):
        load_settings({"VLLM_SPARSE_TIMING_SAMPLE_EVERY": "-1"})


def test_metrics_host_is_validated_and_defaults_to_this_host_only():
    assert load_settings({}).observability.metrics_host == "127.0.0.1"
    for host in ("0.0.0.0", "::", "::1", "10.1.2.3", "localhost", "metrics.svc.cluster.local"):
        assert load_settings({"VLLM_SPARSE_METRICS_HOST": host}).observability.metrics_host == host
    for bad in ("0.0.0.0:9400", "http://localhost", "two words", "-leading-dash", "a..b", "", "300.1.2.3.4.5"):
        with pytest.raises(ConfigError, match="VLLM_SPARSE_METRICS_HOST="):
            load_settings({"VLLM_SPARSE_METRICS_HOST": bad})


@pytest.mark.parametrize("env,addr", [({}, "127.0.0.1"), ({"VLLM_SPARSE_METRICS_HOST": "0.0.0.0"}, "0.0.0.0")])
def test_the_metrics_port_binds_metrics_host(monkeypatch, env, addr):
    calls = []
    monkeypatch.setattr(prometheus_client, "start_http_server",
                        lambda port, addr, registry: calls.append((port, addr)))
    monkeypatch.setattr(metrics, "create_metrics", lambda: metrics.NO_METRICS)  # the process's are made once
    runtime = WorkerRuntime(load_settings({"VLLM_SPARSE_METRICS_PORT": "9400", **env}))
    assert calls == [(9400, addr)] and runtime.metrics_served
    assert WorkerRuntime(load_settings({"VLLM_SPARSE_METRICS_PORT": "9400", **env}), tp_rank=1).stats.prom \
        is metrics.NO_METRICS and calls == [(9400, addr)]  # other tensor-parallel ranks serve nothing


# A stand-in worker: records through the stats of a worker runtime, as the backends do.
_WORKER = textwrap.dedent("""
    import sys
    from vllm_sparse_backend.settings import load_settings
    from vllm_sparse_backend.runtime import WorkerRuntime
    stats = WorkerRuntime(load_settings()).stats
    stats.record_sparse_row(4096, causal=1000, computed=100, head_patterns={"vertical_slash": 4})
    stats.record_dense_tokens(8)
    print("kind", type(stats.prom).__name__, flush=True)
    if len(sys.argv) > 1:
        sys.stdin.read()  # stay up (serving) until the test closes stdin
""")


def _worker(env, *args, **kw):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_SPARSE_", "PROMETHEUS_MULTIPROC"))}
    return subprocess.Popen([sys.executable, "-c", _WORKER, *args], env={**full, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_worker_samples_reach_a_multiprocess_collector(tmp_path):
    """What vLLM's API server does at /metrics when PROMETHEUS_MULTIPROC_DIR is set: merge the
    files every process wrote. Two worker processes here; their counters add up."""
    for _ in range(2):
        out, err = _worker({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}).communicate(timeout=60)
        assert "kind PrometheusMetrics" in out, err
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    assert _value(reg, "sparse_prefill_query_tokens_total", route="sparse") == 2 * 4096
    assert _value(reg, "sparse_prefill_query_tokens_total", route="dense") == 16
    assert _value(reg, "sparse_prefill_density_count") == 2
    assert _value(reg, "sparse_prefill_head_patterns_total", pattern="vertical_slash") == 8


def test_unusable_multiproc_dir_leaves_serving_alone(tmp_path):
    out, err = _worker({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing")}).communicate(timeout=60)
    assert "kind _NoMetrics" in out
    assert "cannot create the metrics" in err


def _scrape(url, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_own_metrics_port_serves_the_worker_registry():
    from vllm_sparse_tools.demo import free_port

    port = free_port()
    proc = _worker({"VLLM_SPARSE_METRICS_PORT": str(port)}, "serve", stdin=subprocess.PIPE)
    try:
        assert "kind PrometheusMetrics" in proc.stdout.readline()
        text = _scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert 'sparse_prefill_query_tokens_total{route="sparse"} 4096.0' in text
    assert "sparse_prefill_density_count 1.0" in text


# ---------------------------------------------------------------------------------------------
# The real server
# ---------------------------------------------------------------------------------------------

def _samples(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.server
@pytest.mark.slow
def test_server_metrics_at_vllm_metrics_after_a_long_request(tmp_path):
    pytest.importorskip("vllm")
    from tiny_llama import make_tiny_llama
    from vllm_sparse_tools.demo import free_port, start_server, wait_ready

    model = make_tiny_llama(tmp_path / "tiny-llama")
    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    own_port = free_port()
    # budgets that skip keys of a 1500-token prompt (the defaults would select all of them: a
    # dense row); bands keep the 128 diagonals to 2 blocks per query block
    env = {"PROMETHEUS_MULTIPROC_DIR": str(prom_dir), "VLLM_SPARSE_MIN_SPARSE_QUERY_LEN": "512",
           "VLLM_SPARSE_VERTICAL_SIZE": "64", "VLLM_SPARSE_SLASH_SIZE": "128", "VLLM_SPARSE_SLASH_BAND": "64",
           "VLLM_SPARSE_TIMING_SAMPLE_EVERY": "1", "VLLM_SPARSE_METRICS_PORT": str(own_port),
           "VLLM_SPARSE_STATS_FILE": str(tmp_path / "stats.json"), "VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "0"}
    args = ["--attention-backend", "sparse-prefill", "--load-format", "dummy", "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "4096", "--kv-cache-memory-bytes", "128M",
            "--max-num-batched-tokens", "2048", "--seed", "0"]
    handle = start_server(model, args, env, tmp_path / "server.log")
    try:
        wait_ready(handle, timeout=400)
        prompt = [3 + (i * 7919) % 3000 for i in range(1500)]
        out = handle.request("POST", "/v1/completions", {
            "model": handle.model(), "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert out["usage"]["prompt_tokens"] == 1500
        vllm_text = _scrape(f"{handle.url}/metrics")
        own_text = _scrape(f"http://127.0.0.1:{own_port}/metrics")
    finally:
        handle.stop()
    s = _samples(vllm_text)
    ours = {name for name, _ in s if name.startswith("sparse_prefill_")}
    assert ours, "no sparse_prefill_ metric at vLLM's /metrics"
    assert not any("sparse_prefill" in name and name.startswith("vllm:") for name, _ in s)
    assert any(name.startswith("vllm:") for name, _ in s), "not vLLM's own /metrics"
    # 2 layers x 1500 prompt tokens went sparse; 4 query heads x 2 layers took the default pattern
    assert s[("sparse_prefill_query_tokens_total", (("route", "sparse"),))] == 2 * 1500
    assert s[("sparse_prefill_rows_total", ())] == 2
    assert s[("sparse_prefill_density_count", ())] == 2
    assert 0 < s[("sparse_prefill_density_sum", ())] < 2
    assert s[("sparse_prefill_head_patterns_total", (("pattern", "vertical_slash"),))] == 8
    assert s[("sparse_prefill_stage_seconds_count", (("stage", "estimate"),))] == 2
    assert s[("sparse_prefill_stage_seconds_count", (("stage", "kernel"),))] == 2
    # the JSON stats file tells the same story
    st = json.loads((tmp_path / "stats.json").read_text())
    assert st["sparse_query_tokens"] == 2 * 1500 and st["stage_samples"] == {"estimate": 2, "kernel": 2}
    # the plugin's own port serves the same (multiprocess) numbers
    own = _samples(own_text)
    assert own[("sparse_prefill_query_tokens_total", (("route", "sparse"),))] == 2 * 1500




def test_stats_file_without_waiting_catches_up(tmp_path):
    """dump(wait=False), as CUDA forwards call it: the file holds what has arrived and says how
    many counts are still on their way; refresh() rewrites it once they arrive, and only then."""
    import torch

    st, _ = _stats_with_registry()
    path = tmp_path / "s.json"
    first, second = ManualEvent(), ManualEvent()
    for event, value in ((first, 100), (second, 40)):
        st._readouts.append((event, torch.tensor([value]), lambda v: st.record_measured_pairs(400, v[0])))
    st.record_sparse_row(64, causal=None, computed=None, head_patterns={"vertical_slash": 2})
    st.dump(str(path), wait=False)
    d = json.loads(path.read_text())
    assert (d["pending_readouts"], d["causal_pairs"], d["sparse_rows"]) == (2, 0, 1)
    second.done = True  # in order: the second cannot be applied before the first
    st.refresh(str(path))
    assert json.loads(path.read_text())["pending_readouts"] == 2
    first.done = True
    st.refresh(str(path))
    d = json.loads(path.read_text())
    assert (d["pending_readouts"], d["causal_pairs"], d["computed_pairs"]) == (0, 800, 140)
    path.unlink()
    st.refresh(str(path))  # nothing new: no rewrite
    assert not path.exists()
    st.dump(str(path))  # the waiting dump writes in any case
    assert json.loads(path.read_text())["computed_pairs"] == 140
