"""The README's CPU serving command is the demo's server: the same sparse settings and server
flags (so it runs something sparse at its 8K context), and the variable that brings the
plugin's counters to vLLM's /metrics."""

from __future__ import annotations

import re
from pathlib import Path

from repo_files import REPO_ROOT as ROOT
from vllm_sparse_tools.demo import DEMO_SPARSE_ENV, demo_server_args


def _serve_block(page: Path) -> str:
    """The fenced bash block of ``page`` that runs the CPU ``vllm serve`` command."""
    blocks = re.findall(r"^```bash\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)
    (block,) = [b for b in blocks if "vllm serve ~/.cache/vllm-sparse-backend/smollm2-135m-instruct" in b]
    return " ".join(block.replace("\\\n", " ").split())


def test_readme_and_deployment_cpu_commands_use_the_demo_settings():
    for page in (ROOT / "README.md", ROOT / "docs" / "deployment.md"):
        command = _serve_block(page)
        for name, value in DEMO_SPARSE_ENV.items():
            assert f"{name}={value}" in command, (page.name, name)
        assert "PROMETHEUS_MULTIPROC_DIR=" in command, page.name
        for flag in _flags(demo_server_args(cuda=False)):
            if not flag.startswith("--served-model-name"):
                assert f" {flag} " in f"{command} ", (page.name, flag)


def _flags(args: list[str]) -> list[str]:
    """["--dtype", "float32", "--enforce-eager"] -> ["--dtype float32", "--enforce-eager"]."""
    out: list[str] = []
    for arg in args:
        if arg.startswith("--") or not out:
            out.append(arg)
        else:
            out[-1] += " " + arg
    return out
