"""One smoke test per product benchmark script (``benchmarks/*.py``): it starts and parses its
options (``--help``, in a fresh interpreter, as ``python -m benchmarks.NAME`` runs it), or, where a
tiny CPU configuration exists, it runs that. What the scripts measure is checked by their runs
(``benchmarks/results/SUMMARY.md``), not by tests of their internals: the scripts change with
every question, and a test pinning a helper only made each change twice as long."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from repo_files import REPO_ROOT

# Modules of benchmarks/ that are shared code, not scripts.
NOT_SCRIPTS = {"__init__", "common"}
# Scripts that import the Triton kernels at start-up: run where triton is (make test's kernel run).
NEEDS_TRITON = {"kernels"}
SCRIPTS = sorted(p.stem for p in (REPO_ROOT / "benchmarks").glob("*.py") if p.stem not in NOT_SCRIPTS)


def _help_params():
    return [pytest.param(name, marks=pytest.mark.kernels) if name in NEEDS_TRITON else name for name in SCRIPTS]


@pytest.mark.parametrize("name", _help_params())
def test_script_starts_and_lists_its_options(name):
    if name in NEEDS_TRITON and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (the project venv has none on purpose)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--help"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = proc.stdout.split()
    assert usage[:2] == ["usage:", f"{name}.py"] and "--help" in proc.stdout, proc.stdout[:2000]


def test_every_product_script_is_found():
    """The parametrization above comes from the folder: a script added there is smoke-tested."""
    assert {"e2e", "kernels", "load", "ruler", "attention_recall"} <= set(SCRIPTS)


@pytest.fixture(scope="module")
def tiny_llama_with_weights(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch
    from tiny_llama import make_tiny_llama

    tmp = tmp_path_factory.mktemp("recall")
    model_dir = make_tiny_llama(tmp / "tiny-model", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(model_dir)
    text = tmp / "text.txt"
    text.write_text(pathlib.Path(json.__file__).with_name("decoder.py").read_text() * 12)
    return tmp, model_dir, text


@pytest.mark.slow
def test_attention_recall_tiny_cpu_run(tiny_llama_with_weights):
    """attention_recall's tiny CPU configuration: a random-weight Llama, one length, two variants;
    every variant's recall and density are shares of the true attention."""
    from benchmarks import attention_recall

    tmp, model_dir, text = tiny_llama_with_weights
    out = tmp / "recall"
    assert attention_recall.main([
        "--model", str(model_dir), "--text", str(text), "--lengths", "1024", "--rows", "64", "--device", "cpu",
        "--variants", "vs=vertical_size=64,slash_size=128", "flex0.9", "--out", str(out)]) == 0
    (summary,) = json.loads(out.with_suffix(".json").read_text())["summary"].values()
    assert list(summary) == ["vs", "flex0.9"]
    for m in summary.values():
        assert 0 < m["density"] <= 1 and 0 < m["recall"] <= 1 + 1e-9 and m["layers"] == 2


@pytest.mark.server
@pytest.mark.slow
def test_load_tiny_cpu_run_against_dense_then_density_one_sparse_servers(tmp_path):
    """load's tiny CPU configuration: a dense server, then (its file as the reference) a sparse
    one; every request ends as its kind should, both servers pass their checks, and the density-1
    sparse server gives the dense one's greedy tokens. About a minute on 2 cores."""
    pytest.importorskip("vllm")
    from benchmarks import load
    from tiny_llama import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-llama")
    text = tmp_path / "text.txt"
    text.write_text(pathlib.Path(json.__file__).with_name("decoder.py").read_text())
    common = ["--model", str(model), "--server-args", "--load-format dummy", "--text", str(text),
              "--long-lengths", "1024", "2048", "--start-timeout", "400"]
    dense_json, sparse_json = tmp_path / "dense.json", tmp_path / "sparse.json"
    assert load.main([*common, "--sparse", "--out", str(dense_json)]) == 0, dense_json.read_text()[:4000]
    status = load.main([*common, "--reference-json", str(dense_json), "--sparse", "default",
                        "--out", str(sparse_json)])
    sparse = json.loads(sparse_json.read_text())
    assert status == 0, json.dumps(sparse, indent=1)[:4000]
    (server,) = sparse["servers"]
    assert server["rows"][-1]["kind"] == "total" and server["rows"][-1]["unexpected"] == 0
    assert all(passed for passed, _ in server["checks"])
    # at 1-2K tokens the default budgets select every key: density 1, so dense's tokens
    assert [g["density"] for g in server["reference"]] == [1.0, 1.0]
    assert sparse["agreement"][0][0]
