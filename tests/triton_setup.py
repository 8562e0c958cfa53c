"""Shared start of the Triton test modules: Triton's interpreter where there is no CUDA (it must
be switched on before triton is first imported), and a clean skip where triton is absent (the
CPU project venv has none on purpose; `make test` runs these modules with a separate site)."""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (the project venv has none on purpose)")

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_module(name: str):
    """A kernel module by its name inside ``vllm_sparse_kernels`` (e.g. ``prefill.attention``). Not a
    skip: with triton present (checked above), a module that does not import is a failure."""
    return importlib.import_module(f"vllm_sparse_kernels.{name}")
