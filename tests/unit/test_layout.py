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

Then the guards of issue 52: no test imports ``benchmarks.studies``; every file in
``benchmarks/results/`` is cited by its ``SUMMARY.md`` and every file the summary names exists;
no two modules of the serving package need each other at import time; the serving package runs
no oracle (nothing of ``vllm_sparse_kernels.reference``); the kernel tests (``tests/kernels/``,
and the shared test helpers they import) import nothing of the plugin; the manual stays under 2,000 lines and
the benchmarks under 6,000 lines of Python.
"""

from __future__ import annotations

import ast
import json
import re
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
    return _names_of(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), package)


def _names_of(tree: ast.AST, package: str) -> list[str]:
    """The imports in ``tree`` (a module or one statement), relative ones resolved from ``package``."""
    names = []
    for node in ast.walk(tree):
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


def test_the_serving_package_imports_no_oracle():
    """``vllm_sparse_kernels.reference`` holds what the tests compare against; production code
    that lived there (the CPU path's attention, the paged-cache gathers) moved out (issue 52), so
    that no test's oracle is the code it checks."""
    oracles = f"{KERNELS}.reference"
    assert [f"{path.relative_to(ROOT)}: {name}" for base, path in _sources(SERVING)
            for name in _imported_modules(path, base) if name == oracles or name.startswith(oracles + ".")] == []


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


def _plugin_imports_of_the_kernel_tests(tests: Path) -> tuple[list[str], set[Path]]:
    """``file: module`` for every import of the plugin in ``tests/kernels/`` or in a top-level
    helper of ``tests/`` that those files import (followed transitively), and the files scanned."""
    todo, seen, found = sorted((tests / "kernels").glob("*.py")), set(), []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported_modules(path, "kernels"):
            top = name.split(".")[0]
            if top == SERVING:
                found.append(f"{path.relative_to(tests.parent)}: {name}")
            elif (tests / f"{top}.py").is_file():
                todo.append(tests / f"{top}.py")
    return found, seen


def test_the_kernel_tests_import_nothing_of_the_plugin():
    """``tests/kernels/`` checks the kernel package on its own (issue 52): tests of the plugin's
    Triton path live in ``tests/plugin_triton/``. The shared helpers a kernel test imports
    (``kernel_helpers``, ``decode_helpers``, ...) are followed: they must not bring the plugin in."""
    tests = ROOT / "tests"
    found, seen = _plugin_imports_of_the_kernel_tests(tests)
    assert len([p for p in seen if p.parent.name == "kernels"]) >= 5
    assert {tests / "kernel_helpers.py", tests / "decode_helpers.py"} <= seen
    assert found == []


# The notebook stays closed (issue 52): benchmark studies are scripts nobody imports, and the
# results folder holds only what its summary cites; the rest lives in git history.
RESULTS = ROOT / BENCHMARKS / "results"
SUMMARY = RESULTS / "SUMMARY.md"


def test_no_test_imports_a_benchmark_study():
    tests = _sources("tests")
    assert len(tests) > 20
    studies = f"{BENCHMARKS}.studies"
    assert [f"{path.relative_to(ROOT)}: {name}" for base, path in tests for name in _imported_modules(path, base)
            if name == studies or name.startswith(studies + ".")] == []


def _cited_by_summary(name: str, summary: str) -> bool:
    """A result file is cited when the summary names it, or names its stem followed by a dot
    (``NAME.*``, ``NAME.{json,txt}``: the files of one run)."""
    return name in summary or name.rsplit(".", 1)[0] + "." in summary


def test_every_result_file_is_cited_by_the_summary():
    summary = SUMMARY.read_text(encoding="utf-8")
    files = sorted(p.name for p in RESULTS.iterdir() if p != SUMMARY)
    assert len(files) > 20
    assert [name for name in files if not _cited_by_summary(name, summary)] == [], \
        "cite each file in benchmarks/results/SUMMARY.md or delete it (git history keeps it)"


def test_every_file_the_summary_names_exists():
    summary = SUMMARY.read_text(encoding="utf-8")
    files = {p.name for p in RESULTS.iterdir()}
    named = [n for n in re.findall(r"`([\w.+-]+\.(?:json|txt|log|xml|\*))`", summary) if n[0] not in ".*"
             and n.split(".")[0] != "NAME"]
    assert len(named) > 20
    missing = [n for n in named if n not in files and not (n.endswith(".*") and any(f.startswith(n[:-1]) for f in files))]
    assert missing == []


def test_the_citation_rule_tells_a_stem_from_a_longer_name():
    assert _cited_by_summary("run_2026-11-26.json", "`run_2026-11-26.*`")
    assert _cited_by_summary("run_2026-11-26.txt", "`run_2026-11-26.{json,txt}`")
    assert not _cited_by_summary("run_2026-11-26b.txt", "`run_2026-11-26.*`")
    assert not _cited_by_summary("run_2026-11-26.txt", "`run_2026-11-26b.txt`")


def _module_level_imports(path: Path, package: str) -> list[str]:
    """Like ``_imported_modules``, but only what runs when the module is first imported: its
    top-level statements (inside ``if`` and ``try`` too), not function bodies nor ``if
    TYPE_CHECKING:`` blocks."""
    names = []

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.extend(_names_of(node, package))
            elif isinstance(node, ast.If):
                test = node.test
                if getattr(test, "id", getattr(test, "attr", None)) != "TYPE_CHECKING":
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body)
    return names


def _runtime_imports(path: Path, package: str) -> list[str]:
    """Like ``_imported_modules`` (function bodies included), less ``if TYPE_CHECKING:`` blocks,
    which never run."""
    names = []

    def visit(node):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.extend(_names_of(node, package))
        elif isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
        else:
            for child in ast.iter_child_nodes(node):
                visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return names


def _import_circles(root: Path, package: str, deferred: bool = False) -> list[list[str]]:
    """Groups of modules of ``package`` (under ``root``) that import each other in a circle at
    module level, or with ``deferred`` also through imports inside functions (strongly connected
    components of more than one module)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, ".".join(parts if is_package else parts[:-1]))
    scan = _runtime_imports if deferred else _module_level_imports
    graph = {name: {m for m in scan(path, base) if m in modules and m != name}
             for name, (path, base) in modules.items()}
    reach = {name: set() for name in graph}
    for name in graph:  # transitive closure; the package has a few dozen modules
        todo = list(graph[name])
        while todo:
            m = todo.pop()
            if m not in reach[name]:
                reach[name].add(m)
                todo += graph[m]
    circles = {frozenset({a} | {b for b in reach[a] if a in reach[b]}) for a in graph if a in reach[a]}
    return sorted(sorted(c) for c in circles)


def test_no_import_circle_in_the_serving_package():
    """A module of the plugin that needs another one's names at import time must not be needed
    by it at import time too: such circles break with the import order (the settings and the
    registries had one, issue 52). Deferred imports inside functions do not count."""
    assert len(_sources(SERVING)) > 20
    assert _import_circles(ROOT, SERVING) == []


def test_no_import_circle_in_the_serving_package_even_through_deferred_imports():
    """An import inside a function that closes a circle hides the dependency instead of removing
    it (the settings validated pattern, decode-mode and placement names that way, issue 52): the
    registries check the names, the settings import none of them."""
    assert _import_circles(ROOT, SERVING, deferred=True) == []


def test_the_settings_loading_imports_nothing_of_the_plugin():
    """``config.py`` (the loading and the groups) sits below every registry: each pattern
    declares its settings in its own file and ``settings.py``, above the registry, assembles them
    (issue 52), so no registry can import back into the settings."""
    path = ROOT / SERVING / "config.py"
    assert [name for name in _imported_modules(path, SERVING) if name.split(".")[0] == SERVING] == []


def test_the_circle_scan_sees_deferred_imports_when_asked(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert _import_circles(tmp_path, "pkg", deferred=True) == []
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    assert _import_circles(tmp_path, "pkg") == []
    assert _import_circles(tmp_path, "pkg", deferred=True) == [["pkg.a", "pkg.b"]]


def test_the_circle_scan_sees_module_level_circles_only(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("try:\n    from ..c import x\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
                              "def f():\n    from . import a\n")
    assert _import_circles(tmp_path, "pkg") == []
    (pkg / "c.py").write_text("import pkg.a\n")
    assert _import_circles(tmp_path, "pkg") == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_the_manual_stays_under_two_thousand_lines():
    # docs/*.md is the manual a user and a maintainer read; run logs and superseded measurements
    # go to docs/history/ (issue 52)
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "docs").glob("*.md"))
    assert lines < 2000, f"docs/*.md has {lines} lines: move history to docs/history/ or cut"


def test_the_benchmarks_stay_under_six_thousand_lines_of_python():
    # a study whose question is answered leaves benchmarks/ once its finding is in docs/ (git
    # history keeps the script), and scripts share helpers instead of copying them (issue 52)
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / BENCHMARKS).rglob("*.py"))
    assert lines < 6000, f"benchmarks/ has {lines} lines of Python: close answered studies or cut duplication"
