"""Starting the real vLLM servers the server tests talk to."""

from __future__ import annotations

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
