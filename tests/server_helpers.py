"""Starting the real vLLM servers the server tests talk to."""

from __future__ import annotations

import os
from pathlib import Path

from vllm_sparse_tools.demo import ServerHandle, start_server, wait_ready


def ready_server(model_dir, args: list[str], env: dict[str, str], logs: Path, timeout: float = 600) -> ServerHandle:
    """A server on ``model_dir`` that answers, its log in ``logs``; ``handle.stats_path`` is where
    a sparse server given ``VLLM_SPARSE_STATS_FILE=logs/stats.json`` writes its stats. Stopped
    here if it never becomes ready; the caller stops it otherwise."""
    handle = start_server(model_dir, args, env, logs / "server.log")
    try:
        wait_ready(handle, timeout=timeout)
    except Exception:
        handle.stop()
        raise
    handle.stats_path = logs / "stats.json"
    return handle


def plugin_pythonpath(folder: Path, module: str, source: str, entry_point: str) -> str:
    """PYTHONPATH with a one-module vLLM general plugin in front: ``module``.py holding ``source``
    and the dist-info vLLM finds its ``entry_point`` (``register``, say) through, so that every
    server process loads it (a fault injected into the real server, for instance)."""
    (folder / f"{module}.py").write_text(source)
    info = folder / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{module} = {module}:{entry_point}\n")
    return os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


def greedy_tokens(server, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The server's greedy continuation of ``prompt`` (token ids), ``max_tokens`` long whatever
    it says, as token ids and their log-probabilities."""
    out = server.request("POST", "/v1/completions", {
        "model": server.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 1, "return_token_ids": True, "ignore_eos": True})
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]
