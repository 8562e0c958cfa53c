"""RequireApiKey driven as an ASGI app without a server: start-up without a key, the message
kinds a server sends it (lifespan, websocket). The routes of a real vLLM server:
tests/server/test_api_key_routes.py."""

from __future__ import annotations

import asyncio

import pytest

from vllm_sparse_backend.serving_auth import RequireApiKey


def _run(mw, scope):
    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    mw.app = app
    asyncio.run(mw(scope, receive, send))
    return reached, sent


def _http(path, method="GET", headers=()):
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": list(headers)}


def test_without_a_key_it_refuses_to_start_naming_the_variable(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="VLLM_API_KEY is not set"):
        RequireApiKey(app=None)
    monkeypatch.setenv("VLLM_API_KEY", "")
    with pytest.raises(ValueError, match="VLLM_API_KEY is not set"):
        RequireApiKey(app=None)


def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k1")
    mw = RequireApiKey(app=None)
    assert _run(mw, _http("/tokenize", "POST", [(b"authorization", b"Bearer k1")]))[0] == ["http"]
    assert _run(mw, _http("/tokenize", "POST", [(b"authorization", b"Bearer k2")]))[0] == []
    assert _run(mw, _http("/tokenize", "POST", [(b"authorization", b"Basic k1")]))[0] == []


def test_lifespan_and_health_reads_pass_everything_else_is_refused():
    mw = RequireApiKey(app=None, api_key="k")
    assert _run(mw, {"type": "lifespan"})[0] == ["lifespan"]  # start-up must not need a key
    assert _run(mw, _http("/health", "HEAD"))[0] == ["http"]
    assert _run(mw, _http("/health/", "GET"))[0] == []
    reached, sent = _run(mw, _http("/v1/../tokenize", "POST"))
    assert reached == [] and sent[0]["status"] == 401
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]


def test_a_websocket_without_the_key_is_closed_before_accept():
    mw = RequireApiKey(app=None, api_key="k")
    reached, sent = _run(mw, {"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert reached == [] and sent == [{"type": "websocket.close", "code": 1008}]
    reached, _ = _run(mw, {"type": "websocket", "path": "/v1/realtime",
                           "headers": [(b"authorization", b"Bearer k")]})
    assert reached == ["websocket"]
