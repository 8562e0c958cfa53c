"""decode_mode=topk and spans start and serve with vLLM's default memory settings (issue 41).

A real vLLM server on CUDA, with no --gpu-memory-utilization and no --kv-cache-memory-bytes:
vLLM gives the KV cache all it may use, so the decode state must be claimed in its profiling run
(decode/memory.py) or vLLM's own warm-up runs out of memory. Each mode serves one long and one
short request, and the server's log shows what the profiling run held and what the state took.

The model is a Hugging Face folder named by ``SPARSE_PREFILL_TEST_MODEL`` (skipped when unset);
``SPARSE_PREFILL_TEST_MAX_MODEL_LEN`` (default 131072, which needs a model that reaches it, e.g.
Qwen2.5-Coder-1.5B-Instruct with YaRN x4) and ``SPARSE_PREFILL_TEST_LONG_PROMPT`` (tokens, default
20000) size the run.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.server, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not os.environ.get("SPARSE_PREFILL_TEST_MODEL"),
                                 reason="set SPARSE_PREFILL_TEST_MODEL to a model folder")]

MAX_TOKENS = 32


def _server_args() -> list[str]:
    """The issue's command, memory flags left at vLLM's defaults."""
    max_len = os.environ.get("SPARSE_PREFILL_TEST_MAX_MODEL_LEN", "131072")
    return ["--attention-backend", "sparse-prefill", "--dtype", "bfloat16", "--max-model-len", max_len,
            "--max-num-batched-tokens", "16384", "--no-enable-prefix-caching", "--max-num-seqs", "8"]


def _filler(server, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of numbered lines, with a question at the end."""
    lines, text = [], ""
    i = 0
    while True:
        lines.extend(f"Line {i + k}: the code for item {i + k} is {(37 * (i + k)) % 9973}." for k in range(200))
        i += 200
        text = "\n".join(lines)
        if len(server.tokenize(text)) >= n_tokens:
            break
    return text + "\n\nWhat is the code for item 17? Answer with the number."


def _complete(server, prompt: str) -> dict:
    return server.request("POST", "/v1/completions", {
        "model": server.model(), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})


@pytest.mark.parametrize("mode", ["topk", "spans"])
def test_decode_mode_starts_and_serves_with_default_memory_settings(mode, tmp_path):
    from server_helpers import ready_server

    model = os.environ["SPARSE_PREFILL_TEST_MODEL"]
    long_tokens = int(os.environ.get("SPARSE_PREFILL_TEST_LONG_PROMPT", "20000"))
    server = ready_server(model, _server_args(), {"VLLM_SPARSE_DECODE_MODE": mode}, tmp_path, timeout=1200)
    try:
        long_prompt = _filler(server, long_tokens)
        for prompt in (long_prompt, "Write one sentence about the sea."):
            out = _complete(server, prompt)
            assert out["usage"]["completion_tokens"] == MAX_TOKENS
            assert out["choices"][0]["text"].strip()
        assert out["usage"]["prompt_tokens"] < 64 < long_tokens
        log = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    held = re.search(rf"decode_mode={mode}: ([\d.]+) GiB held in vLLM's memory-profiling run", log)
    took = re.search(rf"decode_mode={mode}: per-page state of (\d+) layers takes ([\d.]+) GiB beside a KV cache of "
                     r"([\d.]+) GiB \(([\d.]+) GiB held", log)
    assert held and took, f"no decode-state lines in {server.log_path}"
    assert float(took.group(2)) <= float(held.group(1)) + 0.01  # the state came out of what vLLM counted
    assert float(took.group(3)) > 0
    assert "outside vLLM's accounting" not in log
    assert "decode stays dense" not in log and "OutOfMemoryError" not in log
    print(held.group(0))
    print(took.group(0))
