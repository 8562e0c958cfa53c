import pytest
import torch


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def load_script(relpath: str, name: str | None = None):
    """Import a script of the repository that is not in a package (``deploy/check.py``) as a module."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    # registered first, as an import would: dataclasses look their module up while it executes
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
