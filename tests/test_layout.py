"""The package's layers: the serving core never reaches the offline tools.

Serving core: every module of ``vllm_sparse_backend`` outside ``tools/`` and ``cli.py``, and the
kernels (``vllm_sparse_kernels/``). Offline tools: ``vllm_sparse_backend.tools`` (assets, demo,
evaluation, search). ``cli.py`` is the ``vllm-sparse`` command, above both; vLLM never loads it.

Two checks, one per direction of failure: what a vLLM server actually imports (the plugin's
entry point, then the backend classes it registered) loads nothing of the tools, in a fresh
interpreter; and no core source file imports the tools anywhere, even inside a function, so
the first check cannot pass only because some code path was not taken.
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

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "vllm_sparse_backend"
TOOLS = f"{PACKAGE}.tools"
COMMAND_LINE = f"{PACKAGE}.cli"
# Import name -> folder of the modules that belong to the serving core.
CORE_FOLDERS = {PACKAGE: ROOT / PACKAGE, "vllm_sparse_kernels": ROOT / "vllm_sparse_kernels"}


def _tool_only_dependencies() -> set[str]:
    """Import names of the ``assets`` extra (GGUF conversion): only the tools use them."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["assets"]
    return {req.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip() for req in extra}


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
    # cwd: not the checkout, so that the installed plugin is what the child imports.
    proc = subprocess.run([sys.executable, "-c", _SERVER_IMPORTS], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["classes"] == ["vllm_sparse_backend.backends.cpu.SparsePrefillCPUBackend",
                                 "vllm_sparse_backend.backends.cuda.SparsePrefillBackend"]
    assert Path(report["plugin_file"]).resolve().parent.parent == ROOT, "the child ran another checkout"
    new = report["new_modules"]
    assert f"{PACKAGE}.backends.common" in new and f"{PACKAGE}.sparse_prefill" in new  # the core did load
    assert [m for m in new if m == TOOLS or m.startswith(TOOLS + ".") or m == COMMAND_LINE] == []
    tool_deps = _tool_only_dependencies()
    assert tool_deps, "pyproject.toml lists no tool dependencies to check"
    assert [m for m in new if m.split(".")[0] in tool_deps] == []


def _core_sources() -> list[tuple[str, Path]]:
    """(package the file's relative imports start from, path) for every core source file."""
    out = []
    for package, folder in CORE_FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if package == PACKAGE and (rel.parts[0] == "tools" or rel == Path("cli.py")):
                continue
            parts = [package, *rel.parent.parts]
            out.append((".".join(parts), path))
    return out


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


def test_no_core_module_imports_the_tools():
    sources = _core_sources()
    assert len(sources) > 20 and any(p.name == "sparse_prefill.py" for _, p in sources)
    offending = [f"{path.relative_to(ROOT)}: {name}"
                 for package, path in sources for name in _imported_modules(path, package)
                 if name == TOOLS or name.startswith(TOOLS + ".") or name == COMMAND_LINE]
    assert offending == []


def test_the_import_scan_resolves_relative_imports(tmp_path):
    """The scan above sees a relative import of the tools from any depth."""
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from ..tools import demo\n    from .. import cli\n")
    names = _imported_modules(source, f"{PACKAGE}.backends")
    assert f"{TOOLS}.demo" in names and COMMAND_LINE in names
    source.write_text("from . import tools\n")
    assert TOOLS in _imported_modules(source, PACKAGE)
