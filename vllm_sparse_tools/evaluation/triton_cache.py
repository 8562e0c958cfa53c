"""Which Triton kernels a server compiled after it said it was ready.

A kernel that compiles while serving costs its request seconds of time to first token. The
backend runs its kernels once in vLLM's profiling run so that they compile at start-up, but a
launch that differs in anything Triton specialises on (a ``constexpr``, an integer argument's
divisibility by 16 or being 1, a pointer's alignment) compiles again. Given a server of its own
``TRITON_CACHE_DIR``, :func:`snapshot` before and :func:`compiled_since` after a few requests
name the kernels compiled in between and, where the same kernel had compiled before, which of
its arguments are specialised differently (from the two compiles' TTIR signatures).

Reads the on-disk cache Triton 3.x writes (one folder per compile, holding ``NAME.json`` and
``NAME.ttir``); nothing here imports Triton.
"""

from __future__ import annotations

import json
import os
import pathlib
import re


def _entries(cache_dir: str | os.PathLike) -> dict[str, pathlib.Path]:
    """Compiled kernels in the cache: {folder name: its metadata file}."""
    root = pathlib.Path(cache_dir)
    if not root.is_dir():
        return {}
    out = {}
    for folder in root.iterdir():
        for meta in folder.glob("*.json"):
            if not meta.name.startswith("__grp__"):
                out[folder.name] = meta
                break
    return out


def snapshot(cache_dir: str | os.PathLike) -> set[str]:
    """The cache's compiled kernels now (folder names)."""
    return set(_entries(cache_dir))


def _signature(meta: pathlib.Path) -> list[str] | None:
    """Per argument, its type and attributes as the TTIR declares them (divisibility,
    alignment), from ``tt.func public @name(...)``; None without a TTIR file."""
    ttir = meta.with_suffix(".ttir")
    if not ttir.exists():
        return None
    text = ttir.read_text(errors="replace")
    m = re.search(r"tt\.func public @[\w$.]+\((.*?)\)\s*(?:attributes\b|\{)", _LOC.sub("", text), re.S)
    if m is None:
        return None
    return [re.sub(r"\s+", " ", a).strip() for a in re.split(r",\s*(?=%[\w.$]+\s*:)", m.group(1))]


_LOC = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")  # source locations (named arguments carry them)


def _name(meta: pathlib.Path) -> str:
    try:
        return json.loads(meta.read_text()).get("name") or meta.stem
    except (OSError, ValueError):
        return meta.stem


def compiled_since(cache_dir: str | os.PathLike, before: set[str]) -> list[dict]:
    """The kernels compiled since ``before`` (:func:`snapshot`), each as {"name", "differs"}:
    ``differs`` lists the arguments whose TTIR declaration differs from an earlier compile of
    the same kernel ("old -> new"), [] when only constexpr values differ (the signature is the
    same), None when the kernel had not compiled before."""
    entries = _entries(cache_dir)
    earlier: dict[str, list[list[str] | None]] = {}
    for key in before:
        if key in entries:
            earlier.setdefault(_name(entries[key]), []).append(_signature(entries[key]))
    out = []
    for key in sorted(set(entries) - before):
        name, sig = _name(entries[key]), _signature(entries[key])
        differs = None
        olds = [s for s in earlier.get(name, []) if s is not None]
        if name in earlier:
            differs = []
            if sig is not None and olds:
                # the earlier compile closest to this one: fewest differing arguments
                old = min(olds, key=lambda o: sum(a != b for a, b in zip(o, sig)) + abs(len(o) - len(sig)))
                differs = [f"{a} -> {b}" for a, b in zip(old, sig) if a != b]
                if len(old) != len(sig):
                    differs.append(f"{len(old)} -> {len(sig)} arguments")
        out.append({"name": name, "differs": differs})
    return out


def describe(compiled: list[dict]) -> str:
    """One line per compiled kernel, for a log."""
    if not compiled:
        return "no kernel compiled"
    lines = []
    for c in compiled:
        if c["differs"] is None:
            lines.append(f"{c['name']}: first compile")
        elif not c["differs"]:
            lines.append(f"{c['name']}: same signature, other constexpr values")
        else:
            lines.append(f"{c['name']}: " + "; ".join(c["differs"]))
    return "\n".join(lines)
