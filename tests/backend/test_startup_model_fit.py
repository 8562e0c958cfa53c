"""A head-config file that does not fit the model stops ``vllm serve`` like any other bad
setting: exit status 2 with the cause (file and field) as the last lines of stderr.

On a local model folder the plugin's ``vllm`` command (``vllm_sparse_backend.vllm_cli``) checks
the file against the folder's config.json before it imports vLLM. Elsewhere only the worker
knows the model's shape, so the worker leaves the cause in a report file that the command named,
and the command ends with it once vLLM's start-up has failed (``vllm_sparse_backend.startup``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import pytest

from vllm_sparse_backend import startup, vllm_cli
from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.settings import load_settings
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


def _model_folder(path, **shape):
    """A model folder holding only a config.json: all the pre-engine check reads."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **shape}))
    return path


SERVE_SPARSE = ["--attention-backend", "sparse-prefill", "--port", "1"]


def test_the_served_folder_is_found_only_where_its_config_json_is_what_vllm_builds(tmp_path):
    model = str(_model_folder(tmp_path / "m", **TINY))
    assert vllm_cli.served_model_folder(["serve", model, *SERVE_SPARSE]) == model
    assert vllm_cli.served_model_folder(["serve", "--model", model, "--attention_backend=SPARSE_PREFILL"]) == model
    assert vllm_cli.served_model_folder(["serve", model, "--attention-backend", "CUSTOM"]) == model
    assert vllm_cli.served_model_folder(["serve", model]) is None  # vLLM's own attention: the file is unused
    assert vllm_cli.served_model_folder(["serve", model, "--attention-backend", "FLASH_ATTN"]) is None
    assert vllm_cli.served_model_folder(["serve", "org/name", *SERVE_SPARSE]) is None  # a hub name
    assert vllm_cli.served_model_folder(["serve", model, *SERVE_SPARSE, "--hf-overrides",
                                         '{"num_hidden_layers": 30}']) is None
    assert vllm_cli.served_model_folder(["bench", "serve", model, *SERVE_SPARSE]) is None


def test_the_pre_engine_check_leaves_a_config_without_plain_counts_to_the_worker(
        other_models_head_config, tmp_path):
    multimodal = _model_folder(tmp_path / "mm", text_config={"model_type": "llama"})  # counts from class defaults
    startup.check_model_folder(str(multimodal))
    no_config = tmp_path / "empty"
    no_config.mkdir()
    startup.check_model_folder(str(no_config))
    with pytest.raises(ConfigError, match="field 'num_heads': 9, but model .* has 4 query heads"):
        startup.check_model_folder(str(_model_folder(tmp_path / "tiny", **TINY)))


def test_vllm_serve_on_a_local_folder_stops_before_vllm_starts(tmp_path):
    """A real ``vllm serve`` through the plugin's command: stderr is the cause alone (no vLLM
    log line: vLLM was not imported, no engine started)."""
    model = _model_folder(tmp_path / "tiny", **TINY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_SPARSE_")}
    env.update(HF_HUB_OFFLINE="1", VLLM_SPARSE_HEAD_CONFIG=OTHER_MODEL_CONFIG)
    done = subprocess.run([sys.executable, "-m", "vllm_sparse_backend.vllm_cli", "serve", str(model), *SERVE_SPARSE,
                           "--dtype", "float32", "--enforce-eager"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == startup.EXIT_STATUS, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (f"vllm-sparse-backend: error: {OTHER_MODEL_CONFIG}: field 'num_kv_heads': 3, but model "
                         f"{model} has 2 KV heads per layer (num_key_value_heads)"), lines[-1]
    assert lines == [
        "vllm-sparse-backend: error: head config does not fit the model",
        f"vllm-sparse-backend: error: {OTHER_MODEL_CONFIG}: field 'num_layers': 30, but model {model} has 2 layers "
        "(num_hidden_layers)",
        f"vllm-sparse-backend: error: {OTHER_MODEL_CONFIG}: field 'num_heads': 9, but model {model} has 4 query "
        "heads per layer (num_attention_heads)",
        lines[-1]], done.stderr[-3000:]
    assert done.stdout == ""


# The whole start-up on this 2-core CI machine: the API server, the engine core and the worker each
# import vLLM (about 10 s each when idle: measured 31-44 s end to end under other load); the
# bound catches a server that hangs or goes on to load the weights.
START_UP_BOUND_S = 150


@pytest.mark.server
@pytest.mark.slow
def test_the_worker_stops_vllm_serve_where_the_command_cannot_read_the_shape(tmp_path):
    """``--hf-overrides`` (even an empty one) means the folder's config.json is not what vLLM
    builds, so the command leaves the check to the worker: vLLM starts, and fails."""
    pytest.importorskip("vllm")
    from tiny_llama import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-llama")  # 2 layers x 4 heads, 2 KV heads
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_SPARSE_")}
    env.update(HF_HUB_OFFLINE="1", VLLM_SPARSE_HEAD_CONFIG=OTHER_MODEL_CONFIG)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "vllm_sparse_backend.vllm_cli", "serve", str(model),
                           "--attention-backend", "sparse-prefill", "--port", "1", "--load-format", "dummy",
                           "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                           "--kv-cache-memory-bytes", "64M", "--hf-overrides", "{}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    assert done.returncode == startup.EXIT_STATUS, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"vllm-sparse-backend: error: {OTHER_MODEL_CONFIG}: field 'num_kv_heads': 3, but model "
                    f"{model} has 2 KV heads per layer (num_key_value_heads)"), last
    assert f"vllm-sparse-backend: error: {OTHER_MODEL_CONFIG}: field 'num_layers': 30" in done.stderr
    assert elapsed < START_UP_BOUND_S, elapsed
