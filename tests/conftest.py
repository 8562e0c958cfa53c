import os

import pytest
import torch

# Variables that only say where downloaded files live (models and texts, vLLM source trees):
# they change no setting, and clearing them would make the suite fetch everything again.
LOCATION_ENV = frozenset({"VLLM_SPARSE_CACHE", "VLLM_SPARSE_VLLM_TREES"})

_CALLER_ENV = pytest.StashKey[pytest.MonkeyPatch]()


def caller_settings_env(environ) -> list[str]:
    """The variables of ``environ`` that would change what the suite tests: the plugin's settings
    (``VLLM_SPARSE_*``, its JSON file ``VLLM_SPARSE_CONFIG``) and prometheus-client's
    multiprocess folder, which the README's CPU command exports."""
    return sorted(k for k in environ if (k.startswith("VLLM_SPARSE_") and k not in LOCATION_ENV)
                  or k.upper() == "PROMETHEUS_MULTIPROC_DIR")


def pytest_configure(config):
    """Run the suite without the caller's plugin settings (a shell that ran the README's
    exports). Done here rather than in a fixture: a fixture runs after the test modules are
    imported, and prometheus-client picks its single- or multi-process counters at import.
    Server tests start vLLM from os.environ, so their children see the cleared environment too."""
    patch = pytest.MonkeyPatch()
    for key in caller_settings_env(os.environ):
        patch.delenv(key)
    config.stash[_CALLER_ENV] = patch


def pytest_unconfigure(config):
    patch = config.stash.get(_CALLER_ENV, None)
    if patch is not None:
        patch.undo()


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)
