"""The README stays an operator's page, and the documentation's links and names stay true."""

import re
from pathlib import Path

import pytest

from repo_files import REPO_ROOT as ROOT
from vllm_sparse_backend.config import ENV_PREFIX, NON_SETTING_ENV
from vllm_sparse_backend.settings import SETTINGS

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250

# Targets that other parts of the issue-39 reorganisation create; checked once they exist.
PENDING_TARGETS = ("vllm_sparse_tools/", "vllm_sparse_kernels/", "benchmarks/studies/", "benchmarks/infra/",
                   "benchmarks/README.md", "benchmarks/results/SUMMARY.md")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(page: Path) -> list[str]:
    """Link and image targets of a Markdown page, outside fenced code blocks."""
    return LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8")))


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces as
    hyphens, repeats numbered)."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {MAX_README_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        relative = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(resolved)
        if relative.startswith(PENDING_TARGETS):
            continue
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_names_only_real_settings():
    known = {ENV_PREFIX + name.upper() for name in SETTINGS} | set(NON_SETTING_ENV)
    named = set(re.findall(r"\bVLLM_SPARSE_[A-Z0-9_]*[A-Z0-9]\b", README.read_text(encoding="utf-8")))
    assert named <= known, f"README.md names variables that are not settings: {sorted(named - known)}"


def test_readme_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.M))
    named = set(re.findall(r"`make ([a-z][a-z0-9-]*)`", README.read_text(encoding="utf-8")))
    assert named and named <= targets, f"README.md names make targets the Makefile lacks: {sorted(named - targets)}"
