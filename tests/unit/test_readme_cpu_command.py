"""The README's CPU commands, in the order a new user runs them: the model fetched by the assets
command, served with the demo's server flags at the default settings (vLLM's speed: nothing
sparse at 8K), one example request to the served name; then, separately, the demo's sparse
settings and the variable that brings the plugin's counters to vLLM's /metrics. The demo's
server runs with these flags in the server tests, so the commands are the ones tested there."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from repo_files import REPO_ROOT as ROOT
from vllm_sparse_tools.assets import ASSETS
from vllm_sparse_tools.demo import DEMO_SPARSE_ENV, SERVED_MODEL_NAME, demo_server_args

PAGES = [ROOT / "README.md", ROOT / "docs" / "deployment.md"]
SERVE = 'vllm serve "$MODEL"'


def _blocks(page: Path) -> list[str]:
    """The page's fenced bash blocks, continuation lines joined."""
    blocks = re.findall(r"^```bash\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)
    return [block.replace("\\\n", " ") for block in blocks]


def _one_block(page: Path, needle: str) -> str:
    (block,) = [b for b in _blocks(page) if needle in b]
    return block


def _flags(args: list[str]) -> list[str]:
    """["--dtype", "float32", "--enforce-eager"] -> ["--dtype float32", "--enforce-eager"]."""
    out: list[str] = []
    for arg in args:
        if arg.startswith("--") or not out:
            out.append(arg)
        else:
            out[-1] += " " + arg
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cpu_serve_command_is_the_demo_server_at_default_settings(page):
    block = _one_block(page, SERVE)
    fetch = re.search(r"MODEL=\$\(\S*python -m vllm_sparse_tools\.assets (\S+)\)", block)
    assert fetch and fetch.group(1) in ASSETS and fetch.start() < block.index(SERVE), block
    command = " ".join(block[block.index(SERVE):].split())
    for flag in _flags(demo_server_args(cuda=False)):
        assert f" {flag} " in f"{command} ", (page.name, flag)
    # the defaults: the variables that make rows sparse (and slow) on a CPU live in their own block
    assert "VLLM_SPARSE_" not in block, page.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_example_request_asks_the_served_name(page):
    curl = shlex.split(" ".join(_one_block(page, "/v1/completions").split()))
    assert any(arg.endswith("localhost:8000/v1/completions") for arg in curl), curl
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["model"] == SERVED_MODEL_NAME and body["prompt"] and body["max_tokens"] > 0, body


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_sparse_rows_block_sets_the_demo_settings_and_the_metrics_folder(page):
    (block,) = [b for b in _blocks(page) if "VLLM_SPARSE_" in b]
    assignments = " ".join(block.split())
    for name, value in DEMO_SPARSE_ENV.items():
        assert f"{name}={value}" in assignments, (page.name, name)
    assert "PROMETHEUS_MULTIPROC_DIR=" in assignments, page.name
