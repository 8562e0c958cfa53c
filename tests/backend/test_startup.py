"""Settings and the head-config file are checked when vLLM loads the plugin, before any model:
in vLLM's command line a bad value ends ``vllm serve`` with the error as its last line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from repo_files import REPO_ROOT
from vllm_sparse_backend import startup
from vllm_sparse_backend.config import ConfigError

pytest.importorskip("vllm")


def _serve(tmp_path, env):
    """``vllm serve`` (through the plugin's CLI wrapper) with ``env`` added; the model folder
    does not matter: nothing may get as far as reading it."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_SPARSE_")}
    full_env.update(HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-m", "vllm_sparse_backend.vllm_cli", "serve", str(tmp_path / "no-model"),
                           "--attention-backend", "sparse-prefill", "--port", "1"],
                          cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=300)


def _write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("case", ["variable", "settings_file", "missing_head_config", "malformed_head_config",
                                  "stats_file_folder"])
def test_bad_settings_stop_vllm_serve_with_the_error_as_last_line(tmp_path, case):
    env, want = {
        "variable": ({"VLLM_SPARSE_DEFAULT_PATTERN": "banana"},
                     "environment variable VLLM_SPARSE_DEFAULT_PATTERN='banana': unknown pattern 'banana' (known: "
                     "dense, a_shape, vertical_slash, block_sparse, flex_prefill)"),
        "settings_file": ({"VLLM_SPARSE_CONFIG": _write(tmp_path / "s.json", {"vertical_size": 0})},
                          f"{tmp_path / 's.json'}: field 'patterns.vertical_slash.vertical_size': Input should be "
                          "greater than or equal to 1"),
        "missing_head_config": ({"VLLM_SPARSE_HEAD_CONFIG": str(tmp_path / "nope.json")},
                                f"{tmp_path / 'nope.json'}: cannot read head config"),
        "malformed_head_config": ({"VLLM_SPARSE_HEAD_CONFIG": _write(tmp_path / "h.json", "{\"format\": ")},
                                  f"{tmp_path / 'h.json'}: invalid JSON"),
        "stats_file_folder": ({"VLLM_SPARSE_STATS_FILE": str(tmp_path / "no-such-folder" / "stats.json")},
                              f"VLLM_SPARSE_STATS_FILE='{tmp_path / 'no-such-folder' / 'stats.json'}': folder "
                              f"{tmp_path / 'no-such-folder'} does not exist"),
    }[case]
    done = _serve(tmp_path, env)
    assert done.returncode == startup.EXIT_STATUS, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-sparse-backend: error: " + want), last
    # stopped while vLLM built its argument parser: no engine process, no model config read
    assert "EngineCore" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_outside_vllm_cli_a_bad_setting_raises(monkeypatch):
    """vLLM's Python API (and its engine and worker processes) get an exception, not an exit."""
    monkeypatch.delitem(sys.modules, "vllm.entrypoints.cli.main", raising=False)
    monkeypatch.setenv("VLLM_SPARSE_GAMMA", "2")
    with pytest.raises(ConfigError, match="VLLM_SPARSE_GAMMA"):
        startup.check_at_registration()


def test_valid_settings_explain_vllm_unknown_variable_warning_once(monkeypatch):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.sparse_prefill")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        for k in [k for k in os.environ if k.startswith("VLLM_SPARSE_")]:
            monkeypatch.delenv(k)
        startup.check_at_registration()
        assert records == []  # nothing set: nothing to check or explain
        monkeypatch.setenv("VLLM_SPARSE_GAMMA", "0.9")
        monkeypatch.setenv("VLLM_SPARSE_HEAD_CONFIG", str(
            REPO_ROOT / "head_configs" / "smollm2-135m-instruct.json"))
        startup.check_at_registration()
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    assert len(records) == 1
    msg = records[0].getMessage()
    assert "2 VLLM_SPARSE_* variable(s) checked and valid" in msg and "Unknown vLLM environment variable" in msg
