"""The ``vllm-sparse`` command's help: every subcommand answers ``--help`` with text meant for
its users, and ``demo`` takes the demo's own options."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from repo_files import REPO_ROOT as ROOT
from vllm_sparse_tools import demo
from vllm_sparse_tools.cli import build_parser

SUBCOMMANDS = ["import-minference", "check-head-config", "settings", "search-patterns", "layer-budgets", "demo"]
# Words of notes about the code's structure, which belong in docstrings, not in --help.
DEVELOPER_NOTES = re.compile(r"\bmodules?\b|:mod:|:func:|serving core|\bimport(s|ed)\b|\bboth layers\b"
                             r"|never loads", re.IGNORECASE)


def _help(*args: str) -> str:
    # cwd: the checkout, so that `python -m` finds this checkout's package first.
    proc = subprocess.run([sys.executable, "-m", "vllm_sparse_tools.cli", *args, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_parser_has_exactly_the_documented_subcommands():
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == SUBCOMMANDS


def test_top_level_help_lists_every_subcommand_without_developer_notes():
    text = _help()
    assert text.startswith("usage: vllm-sparse")
    assert all(name in text for name in SUBCOMMANDS)
    assert DEVELOPER_NOTES.search(text) is None, text


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_user_facing_help(name):
    text = _help(name)
    assert text.startswith(f"usage: vllm-sparse {name}")
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 8, text  # a sentence, not only the usage line
    assert DEVELOPER_NOTES.search(text) is None, text


def test_demo_help_shows_the_demos_options():
    text = _help("demo")
    assert all(flag in text for flag in ("--tokens", "--port", "--keep-server", "--depth", "--seed", "--dense",
                                         "--cache-dir", "--start-timeout"))


def test_demo_subcommand_parses_the_demos_flags():
    args = build_parser().parse_args(["demo", "--tokens", "3000", "--dense", "--port", "8123"])
    assert args.run is demo.run_demo
    assert (args.tokens, args.dense, args.port, args.keep_server) == (3000, True, 8123, False)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", "--tokens", "100"])
    assert exc.value.code == 2
