"""The repository's layers, bottom to top, and the rule that each imports only those below it.

* ``vllm_sparse_kernels``: the Triton kernels (torch and triton only).
* ``vllm_sparse_backend``: the plugin a vLLM server loads (the serving package).
* ``vllm_sparse_tools``: the offline tools (assets, demo, evaluation, search, layer budgets) and
  the ``vllm-sparse`` command. ``benchmarks/`` sits at the same level: scripts, never imported.

Three rules, a test each: the kernels import neither the plugin nor vLLM nor the tools; no
serving source file imports the tools or the benchmarks, at any depth (inside a function too);
and what a vLLM server actually imports (the plugin's entry point, then the backend classes it
registered) loads nothing of the tools nor of what only the tools need, in a fresh interpreter.
The source scans make sure the server check cannot pass only because a code path was not taken.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from repo_files import REPO_ROOT as ROOT

KERNELS = "vllm_sparse_kernels"
SERVING = "vllm_sparse_backend"
TOOLS = "vllm_sparse_tools"
BENCHMARKS = "benchmarks"


def _tool_only_dependencies() -> set[str]:
    """Import names of the ``tools`` extra (GGUF conversion, search): only the tools use them."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tools"]
    return {req.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip() for req in extra}


def _sources(package: str) -> list[tuple[str, Path]]:
    """(package the file's relative imports start from, path) for every source file of a
    top-level package of the checkout."""
    folder = ROOT / package
    return [(".".join([package, *path.relative_to(folder).parent.parts]), path)
            for path in sorted(folder.rglob("*.py"))]


def _imported_modules(path: Path, package: str) -> list[str]:
    """Absolute names of every module a file imports, at any depth (functions included); for
    ``from X import y`` both ``X`` and ``X.y`` (``y`` may be a submodule)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _imports_of(package: str, forbidden: set[str]) -> list[str]:
    """``file: module`` for every import in ``package`` of a module under a top-level name in
    ``forbidden``."""
    return [f"{path.relative_to(ROOT)}: {name}"
            for base, path in _sources(package) for name in _imported_modules(path, base)
            if name.split(".")[0] in forbidden]


def test_the_kernels_import_neither_the_plugin_nor_vllm_nor_the_tools():
    sources = _sources(KERNELS)
    assert len(sources) > 5 and any(p.name == "__init__.py" for _, p in sources)
    assert _imports_of(KERNELS, {SERVING, "vllm", TOOLS, BENCHMARKS}) == []


def test_the_serving_package_imports_neither_the_tools_nor_the_benchmarks():
    sources = _sources(SERVING)
    assert len(sources) > 20 and any(p.name == "run.py" and p.parent.name == "prefill" for _, p in sources)
    assert _imports_of(SERVING, {TOOLS, BENCHMARKS}) == []


def test_the_import_scan_resolves_relative_imports(tmp_path):
    """The scans above resolve relative imports from any package depth and see imports inside
    functions."""
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from ..config import x\n    from .. import startup\n"
                      "    import vllm_sparse_tools.demo\n")
    names = _imported_modules(source, f"{SERVING}.backends")
    assert {f"{SERVING}.config", f"{SERVING}.config.x", f"{SERVING}.startup", f"{TOOLS}.demo"} <= set(names)
    source.write_text("from . import estimate\n")
    assert f"{KERNELS}.estimate" in _imported_modules(source, KERNELS)


# What vLLM does in each of its processes: run the general plugins (our `register`), then
# resolve the attention backend classes the plugin registered. vLLM's own modules are imported
# first so that what they load themselves (transformers, for one) is not charged to the plugin.
_SERVER_IMPORTS = textwrap.dedent("""
    import json, sys
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    import vllm.v1.attention.backends.cpu_attn
    loaded_by_vllm = set(sys.modules)
    load_general_plugins()
    classes = [AttentionBackendEnum.CPU_ATTN.get_class(), AttentionBackendEnum.CUSTOM.get_class()]
    print(json.dumps({"classes": [f"{c.__module__}.{c.__qualname__}" for c in classes],
                      "plugin_file": sys.modules["vllm_sparse_backend"].__file__,
                      "new_modules": sorted(set(sys.modules) - loaded_by_vllm)}))
""")


def test_a_vllm_server_process_loads_no_offline_tool(tmp_path):
    pytest.importorskip("vllm")
    # cwd: not the checkout, so that the installed plugin (or PYTHONPATH's) is what the child imports.
    proc = subprocess.run([sys.executable, "-c", _SERVER_IMPORTS], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["classes"] == [f"{SERVING}.backends.cpu.SparsePrefillCPUBackend",
                                 f"{SERVING}.backends.cuda.SparsePrefillBackend"]
    assert Path(report["plugin_file"]).resolve().parent.parent == ROOT, "the child ran another checkout"
    new = report["new_modules"]
    assert f"{SERVING}.backends.common" in new and f"{SERVING}.prefill.run" in new  # the plugin did load
    assert [m for m in new if m.split(".")[0] in {TOOLS, BENCHMARKS}] == []
    tool_deps = _tool_only_dependencies()
    assert tool_deps, "pyproject.toml lists no tool dependencies to check"
    assert [m for m in new if m.split(".")[0] in tool_deps] == []
