"""Shared start of the Triton test modules: Triton's interpreter where there is no CUDA (it must
be switched on before triton is first imported), and a clean skip where triton is absent (the
CPU project venv has none on purpose; `make test` runs these modules with a separate site)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="triton is not installed (the project venv has none on purpose)")

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def kernel_module(name: str):
    return pytest.importorskip(f"vllm_sparse_kernels.{name}",
                               reason="vllm_sparse_kernels is not installed (pip install -e .)")
