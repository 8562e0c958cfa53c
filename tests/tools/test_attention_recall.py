"""benchmarks/attention_recall.py end to end on a tiny random-weight Llama on the CPU: one model
load, prompts at one length, the backend's default vertical-slash (shared per KV group),
FlexPrefill and a searched head-config file given by path, whole-prompt and chunked with the
library's gating and YaRN; the JSON and table it writes."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch


@pytest.fixture(scope="module")
def recall_module():
    from benchmarks import attention_recall

    return attention_recall


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tiny_llama import make_tiny_llama

    tmp = tmp_path_factory.mktemp("recall")
    model_dir = make_tiny_llama(tmp / "tiny-model", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(model_dir)
    text = tmp / "text.txt"
    text.write_text(pathlib.Path(json.__file__).with_name("decoder.py").read_text() * 12)
    return tmp, model_dir, text


def test_attention_recall_runs_end_to_end_on_cpu(recall_module, tiny, capsys):
    from vllm_sparse_tools.cli import main as cli

    tmp, model_dir, text = tiny
    searched = tmp / "searched.json"
    assert cli(["search-patterns", "--model", str(model_dir), "--out", str(searched), "--length", "1024",
                "--samples", "1", "--density", "0.4", "--rows", "64", "--device", "cpu", "--text", str(text),
                "--no-verify"]) == 0
    out = tmp / "plain"
    assert recall_module.main([
        "--model", str(model_dir), "--text", str(text), "--lengths", "1024", "--rows", "64", "--device", "cpu",
        "--variants", "vs=vertical_size=64,slash_size=128", "flex0.9", f"searched=head_config={searched}",
        "--per-layer", "--out", str(out)]) == 0
    log = capsys.readouterr().out
    assert "tok layer  1:" in log and "capture check" in log
    data = json.loads(out.with_suffix(".json").read_text())
    (n,) = data["summary"]
    assert abs(int(n) - 1024) < 64
    summary = data["summary"][n]
    assert list(summary) == ["vs", "flex0.9", "searched"]
    assert summary["vs"]["shared_layers"] == 2 and summary["flex0.9"]["shared_layers"] == 0
    assert summary["searched"]["shared_layers"] == 2  # one pattern per KV group: shared
    for m in summary.values():
        assert 0 < m["density"] <= 1 and 0 < m["recall"] <= 1 + 1e-9 and m["layers"] == 2
    assert data["meta"]["device"] == "cpu" and data["meta"]["dtype"] == "float32" and data["meta"]["yarn"] is None
    assert data["meta"]["capture_diff"][n] < 1e-4
    table = out.with_suffix(".txt").read_text()
    assert "# per layer at" in table and "searched" in table


def test_attention_recall_chunked_with_gating_and_yarn(recall_module, tiny):
    tmp, model_dir, text = tiny
    out = tmp / "chunked"
    assert recall_module.main([
        "--model", str(model_dir), "--text", str(text), "--lengths", "1024", "--rows", "64", "--device", "cpu",
        "--variants", "vs", "--chunk", "512", "--gating", "--yarn", "2", "--tail-rows", "16",
        "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    meta = data["meta"]
    assert meta["rope"]["rope_type"] == "yarn" and meta["rope"]["factor"] == 2.0 and meta["chunk"] == 512
    layers = next(iter(data["layers"].values()))
    # 512-query chunks are under min_sparse_query_len (4096): the backend runs them dense
    assert all(r["chunks"] == 2 and r["density"] == 1.0 and sum(r["dense_chunks"].values()) == 2 for r in layers)
