"""Where the tests find the repository's own files, whatever folder under tests/ a test module sits in."""

import importlib.util
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
TEST_DATA = TESTS_DIR / "data"


def load_script(relpath: str, name: str | None = None):
    """Import a script of the repository that is not in a package (``deploy/check.py``) as a module."""
    path = REPO_ROOT / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    # registered first, as an import would: dataclasses look their module up while it executes
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
