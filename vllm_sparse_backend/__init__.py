"""vllm-sparse-backend: sparse prefill attention for vLLM, as a plugin.

Entry point (group ``vllm.general_plugins``): :func:`register`. Select the backend with
``vllm serve MODEL --attention-backend sparse-prefill``.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"


class _SourceCheckoutKernels(importlib.abc.MetaPathFinder):
    """Installs map the repository's top-level ``triton_kernels/`` to this package's
    ``triton_kernels`` subpackage. When Python imports this package straight from a source
    checkout instead (the checkout on ``sys.path``, e.g. ``vllm serve`` started in it), that
    subpackage is missing on disk and the CUDA backend would run every row dense; this finder
    serves it from the checkout. Consulted only after the normal finders failed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != f"{__name__}.triton_kernels":
            return None
        src = Path(__file__).resolve().parent.parent / "triton_kernels"
        if not (src / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, src / "__init__.py",
                                                      submodule_search_locations=[str(src)])


if not (Path(__file__).resolve().parent / "triton_kernels").is_dir():
    sys.meta_path.append(_SourceCheckoutKernels())


def register() -> None:
    """vLLM general-plugin entry point; runs in every vLLM process. Cheap and idempotent.

    Also checks the ``VLLM_SPARSE_*`` settings and the head-config file they name, so that a
    bad value stops ``vllm serve`` before the model loads (:mod:`vllm_sparse_backend.startup`)."""
    from ._compat import register_backends
    from .startup import check_at_registration

    register_backends()
    check_at_registration()
