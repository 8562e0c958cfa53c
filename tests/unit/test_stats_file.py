"""The stats file's write rate: at most one write per ``stats_write_interval_s``, the counts a
write skipped written at the interval's end (a trailing write) or at exit, never lost; 0 writes on
every forward. A hand-driven clock and scheduler stand in for time and the timer thread."""

from __future__ import annotations

import json

import pytest

from vllm_sparse_backend.observability import metrics, stats as stats_module
from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.settings import load_settings
from vllm_sparse_backend.observability.stats import SparseStats
from fakes import ManualEvent


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now




@pytest.fixture
def rig(tmp_path, monkeypatch):
    """Stats configured with a 1 s interval, a fake clock, a scheduler that only records, and a
    count of the writes that replaced the file."""
    clock, scheduled, writes = _Clock(), [], []
    path = tmp_path / "stats.json"
    st = SparseStats(clock=clock, schedule=lambda delay, callback: scheduled.append((delay, callback)),
                     _prom=metrics.NO_METRICS)
    registered = []
    monkeypatch.setattr(stats_module.atexit, "register", registered.append)
    st.configure(load_settings({"VLLM_SPARSE_STATS_FILE": str(path), "VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "1",
                                "VLLM_SPARSE_TIMING_SAMPLE_EVERY": "0"}).observability)
    assert registered == [st.write_unwritten]  # the exit write
    real_replace = stats_module.os.replace

    def counting_replace(src, dst):
        if str(dst) == str(path):
            writes.append(clock.now)
        real_replace(src, dst)

    monkeypatch.setattr(stats_module.os, "replace", counting_replace)
    return st, clock, scheduled, writes, path


def _forward(st, path, q_len=10):
    """What one sparse layer forward does to the stats (the CPU path: record, then dump)."""
    st.record_sparse_row(q_len, causal=100, computed=40, head_patterns={"vertical_slash": 2})
    st.dump(str(path))


def _rows(path):
    return json.loads(path.read_text())["sparse_rows"]


def test_forwards_inside_the_interval_write_once_and_the_trailing_write_brings_the_rest(rig):
    st, clock, scheduled, writes, path = rig
    _forward(st, path)
    assert writes == [100.0] and _rows(path) == 1  # the first forward writes at once
    for _ in range(50):
        clock.now += 0.01
        _forward(st, path)
    assert writes == [100.0] and _rows(path) == 1  # 50 forwards, no write
    (delay, callback), = scheduled  # one trailing write, due when the interval ends
    assert delay == pytest.approx(0.99)  # set by the first forward inside the interval, at 100.01
    clock.now = 101.0
    callback()
    assert writes == [100.0, 101.0] and _rows(path) == 51
    callback()  # nothing new: no write
    assert len(writes) == 2


def test_a_forward_after_the_interval_writes_at_once_and_the_timer_finds_nothing_left(rig):
    st, clock, scheduled, writes, path = rig
    _forward(st, path)
    clock.now += 0.3
    _forward(st, path)
    clock.now += 0.7  # the interval since the last write is over
    _forward(st, path)
    assert writes == [100.0, 101.0] and _rows(path) == 3
    (_, callback), = scheduled
    callback()  # the timer set by the second forward: its counts were written by the third
    assert len(writes) == 2
    clock.now += 0.5
    _forward(st, path)
    assert len(scheduled) == 2  # a new trailing write for the fourth forward
    st.write_unwritten()  # what the exit does
    assert _rows(path) == 4 and len(writes) == 3


def test_counts_read_back_from_the_device_reach_the_file_at_the_bounded_rate(rig):
    import torch

    st, clock, scheduled, writes, path = rig
    event = ManualEvent()
    st._readouts.append((event, torch.tensor([30]), lambda v: st.record_measured_pairs(200, v[0])))
    st.record_sparse_row(64, causal=None, computed=None, head_patterns={"vertical_slash": 2})
    st.dump(str(path), wait=False)  # a CUDA forward
    d = json.loads(path.read_text())
    assert (d["pending_readouts"], d["computed_pairs"]) == (1, 0)
    clock.now += 0.2
    event.done = True
    st.refresh(str(path))  # the next forward applies the readout; the write waits for the interval
    assert len(writes) == 1 and st.computed_pairs == 30
    (_, callback), = scheduled
    clock.now = 101.0
    callback()
    d = json.loads(path.read_text())
    assert (d["pending_readouts"], d["causal_pairs"], d["computed_pairs"]) == (0, 200, 30)


def test_interval_zero_writes_every_forward(tmp_path):
    path = tmp_path / "stats.json"
    st = SparseStats(schedule=lambda *a: pytest.fail("no trailing write with interval 0"), _prom=metrics.NO_METRICS)
    st.configure(load_settings({"VLLM_SPARSE_STATS_FILE": str(path), "VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "0"}).observability)
    for n in range(1, 4):
        _forward(st, path)
        assert _rows(path) == n


def test_the_write_interval_is_validated_naming_the_variable():
    assert load_settings({}).observability.stats_write_interval_s == 1.0
    assert load_settings({"VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "0.25"}).observability.stats_write_interval_s == 0.25
    for bad in ("-1", "inf", "nan", "soon", "7200"):
        with pytest.raises(ConfigError, match=f"VLLM_SPARSE_STATS_WRITE_INTERVAL_S='{bad}'"):
            load_settings({"VLLM_SPARSE_STATS_WRITE_INTERVAL_S": bad})


def test_a_readout_whose_recording_raises_is_logged_once_and_the_next_ones_still_count(rig, caplog):
    # readouts are applied at the start of a later layer's forward, outside the sparse path's
    # error boundary: a recording that raises there must not reach vLLM
    import torch

    st, clock, scheduled, writes, path = rig

    def broken(values):
        raise RuntimeError("counter broke")

    for then in (broken, broken, lambda v: st.record_measured_pairs(200, v[0])):
        event = ManualEvent()
        event.done = True
        st._readouts.append((event, torch.tensor([30]), then))
    with caplog.at_level("WARNING", logger="vllm.sparse_prefill"):
        assert st.time_stages() is not None  # applies the three readouts
    assert st.computed_pairs == 30 and not st._readouts
    assert sum("counter broke" in r.getMessage() for r in caplog.records) == 1
