"""A head-config file that does not fit the model stops ``vllm serve`` like any other bad
setting: exit status 2 with the cause (file and field) as the last lines of stderr.

Only the worker knows the model's shape when the plugin runs, so the worker leaves the cause in
a report file that the plugin's ``vllm`` command (``vllm_sparse_backend.vllm_cli``) named, and
the command ends with it once vLLM's start-up has failed (``vllm_sparse_backend.startup``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest

from vllm_sparse_backend import startup, vllm_cli
from vllm_sparse_backend.config import ConfigError, load_settings
from vllm_sparse_backend.runtime import WorkerRuntime

OTHER_MODEL_CONFIG = "smollm2-135m-instruct"  # shipped for a 30-layer, 9-head model
TINY = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def other_models_head_config(monkeypatch):
    for key in [k for k in os.environ if k.startswith("VLLM_SPARSE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("VLLM_SPARSE_HEAD_CONFIG", OTHER_MODEL_CONFIG)


def test_the_worker_reports_a_misfit_where_the_command_asked_and_still_raises(
        other_models_head_config, monkeypatch, tmp_path):
    report = tmp_path / "error.txt"
    monkeypatch.setenv(startup.STARTUP_REPORT_ENV, str(report))
    with pytest.raises(ConfigError, match="head config does not fit the model"):
        WorkerRuntime(load_settings()).check_head_config_fits(TINY, "tiny")
    text = report.read_text()
    assert text.splitlines()[0] == "head config does not fit the model"
    assert f"{OTHER_MODEL_CONFIG}: field 'num_layers': 30, but model tiny has 2 layers" in text


def test_without_the_command_the_worker_only_raises(other_models_head_config, monkeypatch, tmp_path):
    monkeypatch.delenv(startup.STARTUP_REPORT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError):
        WorkerRuntime(load_settings()).check_head_config_fits(TINY, "tiny")
    assert list(tmp_path.iterdir()) == []


def _fake_vllm_main(monkeypatch, behaviour):
    """vLLM's CLI entry point replaced by ``behaviour`` (what the engine's processes would do)."""
    module = types.ModuleType("vllm.entrypoints.cli.main")
    module.main = behaviour
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", module)
    monkeypatch.setattr(vllm_cli, "vllm_version_for_cli", lambda: None)
    monkeypatch.setattr(sys, "argv", ["vllm_cli", "serve", "model"])


def test_the_command_ends_a_reported_start_up_failure_with_status_2(monkeypatch, capsys):
    def engine_fails_after_the_worker_reported():
        startup.report_startup_error(ConfigError("head config does not fit the model\nf.json: field 'num_heads': 9"))
        raise RuntimeError("Engine core initialization failed. See root cause above.")

    _fake_vllm_main(monkeypatch, engine_fails_after_the_worker_reported)
    assert vllm_cli.main() == startup.EXIT_STATUS
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "vllm-sparse-backend: error: head config does not fit the model",
        "vllm-sparse-backend: error: f.json: field 'num_heads': 9"]
    assert startup.STARTUP_REPORT_ENV in os.environ  # set for the engine's processes to inherit
    monkeypatch.delenv(startup.STARTUP_REPORT_ENV)


def test_the_command_leaves_other_failures_to_vllm(monkeypatch):
    def engine_fails():
        raise RuntimeError("something else")

    _fake_vllm_main(monkeypatch, engine_fails)
    with pytest.raises(RuntimeError, match="something else"):
        vllm_cli.main()
    monkeypatch.delenv(startup.STARTUP_REPORT_ENV)


# The whole start-up on this 2-core CI machine: the API server, the engine core and the worker each
# import vLLM (about 10 s each when idle: measured 31-44 s end to end under other load); the
# bound catches a server that hangs or goes on to load the weights.
START_UP_BOUND_S = 150


@pytest.mark.server
@pytest.mark.slow
def test_vllm_serve_with_another_models_head_config_exits_2_with_the_cause_last(tmp_path):
    pytest.importorskip("vllm")
    from tiny_llama import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-llama")  # 2 layers x 4 heads, 2 KV heads
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_SPARSE_")}
    env.update(HF_HUB_OFFLINE="1", VLLM_SPARSE_HEAD_CONFIG=OTHER_MODEL_CONFIG)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "vllm_sparse_backend.vllm_cli", "serve", str(model),
                           "--attention-backend", "sparse-prefill", "--port", "1", "--load-format", "dummy",
                           "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                           "--kv-cache-memory-bytes", "64M"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert done.returncode == startup.EXIT_STATUS, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"vllm-sparse-backend: error: {OTHER_MODEL_CONFIG}: field 'num_kv_heads': 3, but model "
                    f"{model} has 2 KV heads per layer (num_key_value_heads)"), last
    assert f"vllm-sparse-backend: error: {OTHER_MODEL_CONFIG}: field 'num_layers': 30" in done.stderr
    assert elapsed < START_UP_BOUND_S, elapsed
