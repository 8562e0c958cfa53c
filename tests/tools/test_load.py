"""benchmarks/load.py: its verdicts on made-up answers, and a tiny run against real CPU servers
(vLLM's dense backend and sparse-prefill at density 1 on the tiny random-weight Llama)."""

from __future__ import annotations

import json
import pathlib

import pytest


@pytest.fixture(scope="module")
def load():
    from benchmarks import load as load_bench

    return load_bench


def _greedy(load, tokens, gaps=None, density=None):
    top2 = [[-0.1, -0.1 - g] for g in (gaps or [5.0] * len(tokens))]
    return load.Greedy(100, list(tokens), top2, density)


def test_greedy_tokens_agree_only_when_equal_or_first_different_at_a_near_tie(load):
    ref = _greedy(load, [1, 2, 3], gaps=[5.0, 1e-4, 5.0])
    assert load.compare_greedy(ref, _greedy(load, [1, 2, 3]), 1e-3) == (True, "same tokens")
    agree, why = load.compare_greedy(ref, _greedy(load, [1, 9, 7]), 1e-3)
    assert agree and why.startswith("near tie at token 1")
    agree, why = load.compare_greedy(ref, _greedy(load, [5, 2, 3]), 1e-3)
    assert not agree and why.startswith("differs at token 0")
    assert not load.compare_greedy(ref, _greedy(load, [1, 2]), 1e-3)[0]


def test_density_one_prompts_must_all_agree_others_by_the_stated_share(load):
    dense = load.Report(target=None, before=[_greedy(load, [1, 2])] * 4)
    target = load.Target("sparse", "http://x", "", sparse=True)
    same, other = [1, 2], [7, 7]
    sparse = load.Report(target=target, before=[_greedy(load, same, density=1.0), _greedy(load, same, density=1.0),
                                                _greedy(load, same, density=0.3), _greedy(load, other, density=0.3)])
    dense.target = load.Target("dense", "http://y", "", sparse=False)
    full, skipping = load.agreement_checks(dense, sparse, min_agreement=0.5, near_tie=1e-3)
    assert full[0] and "2/2" in full[1]
    assert skipping[0] and "1/2" in skipping[1]
    assert not load.agreement_checks(dense, sparse, min_agreement=0.6, near_tie=1e-3)[1][0]
    sparse.before[0] = _greedy(load, other, density=1.0)  # a density-1 prompt that differs: never allowed
    assert not load.agreement_checks(dense, sparse, min_agreement=0.0, near_tie=1e-3)[0][0]


def test_trace_has_every_kind_counted_and_prompts_past_max_model_len(load):
    tokens = list(range(3, 3000))
    inputs = load.Inputs("m", 512, tokens, 4.0, references=[], warmup=[], cancel_after=0.5)
    counts = load.parse_counts(["chat=3", "bad_params=0"], scale=2)
    trace = load.build_trace(inputs, "some text " * 500, counts, [128, 256], seed=0, long_max_tokens=4,
                             chat_max_tokens=4)
    assert {k: sum(s.kind == k for s in trace) for k in counts if counts[k]} == {k: n for k, n in counts.items() if n}
    assert counts["chat"] == 6 and counts["long"] == 2 * load.DEFAULT_COUNTS["long"]
    for spec in trace:
        if spec.kind == "over_max_len" and spec.path == "/v1/completions":
            assert len(json.loads(spec.body)["prompt"]) == 513 and spec.expect == load.HTTP_400
        if spec.kind == "cancel_prefill":
            assert spec.cancel_after == 0.5 and len(json.loads(spec.body)["prompt"]) == 256
    assert trace == load.build_trace(inputs, "some text " * 500, counts, [128, 256], seed=0, long_max_tokens=4,
                                     chat_max_tokens=4)  # every server gets the same bytes
    with pytest.raises(ValueError, match="KIND=N"):
        load.parse_counts(["no_such_kind=3"], scale=1)


def test_log_errors_after_the_offset_only(load, tmp_path):
    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=1) ERROR 11-24 start-up noise\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("INFO: fine\n(APIServer pid=2) ERROR 11-24 [core.py:1] boom\nTraceback (most recent call last):\n")
    assert load.log_errors(log, offset) == ["(APIServer pid=2) ERROR 11-24 [core.py:1] boom",
                                            "Traceback (most recent call last):"]


@pytest.mark.server
@pytest.mark.slow
def test_load_and_faults_against_dense_then_density_one_sparse_cpu_servers(load, tmp_path):
    """A dense server, then (a second run, the first one's file as the reference) a sparse one:
    every request ends as its kind should, both servers stay healthy, and the density-1 sparse
    server gives the dense one's greedy tokens. About a minute on 2 cores."""
    pytest.importorskip("vllm")
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
    dense, sparse = json.loads(dense_json.read_text()), json.loads(sparse_json.read_text())
    assert status == 0, json.dumps(sparse, indent=1)[:4000]
    assert sparse["trace_sha256"] == dense["trace_sha256"] and sparse["cancel_after_s"] == dense["cancel_after_s"]
    for server in dense["servers"] + sparse["servers"]:
        total = server["rows"][-1]
        assert total["kind"] == "total" and total["unexpected"] == 0 and total["sent"] >= 40
        assert all(passed for passed, _ in server["checks"])
        rss = server["memory"]["rss_bytes"]  # the server's RSS over the load, from before it
        assert len(rss) >= 2 and all(2**27 < b < 2**36 for b in rss)
    (server,) = sparse["servers"]
    assert any("plugin metrics at /metrics" in text for _, text in server["checks"])
    # at 1-2K tokens the default budgets select every key: density 1, so dense's tokens (ties
    # of the random weights may break either way)
    assert [g["density"] for g in server["reference"]] == [1.0, 1.0]
    assert len(sparse["agreement"]) == 1 and "skipped no key" in sparse["agreement"][0][1]
    assert sparse["agreement"][0][0]


def test_memory_trend_tells_a_plateau_from_growth(load):
    g = 2**30
    plateau = load.memory_trend([70 * g, 73 * g, 73 * g, 73 * g])
    assert plateau == "70.00 -> peak 73.00 -> 73.00 GiB; second half's peak +0.00 GiB over the first half's"
    assert "second half's peak +2.00 GiB" in load.memory_trend([70 * g, 71 * g, 72 * g, 73 * g])
    assert load.memory_trend([5 * g]) == "5.00 -> peak 5.00 -> 5.00 GiB"
