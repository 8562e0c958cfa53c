"""Launcher-side handling of a quantized (fp8) KV cache, shared by the Triton kernels.

vLLM stores an fp8 cache as ``stored = value / scale`` with one fp32 scale per layer for K and
one for V (``layer._k_scale`` / ``_v_scale``, device tensors), so ``value = stored * scale``.
The kernels load fp8 tiles, widen them to the query's dtype in registers and apply the scales
once: k_scale inside the scores' scale, v_scale on the output. Scales are read on the device
inside the kernels (no host sync, the same launch for every scale value: CUDA-graph friendly).

Imports nothing from vLLM and not triton.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def scale_operand(scale, device) -> torch.Tensor | None:
    """A K or V scale as the kernels read it: None (no scaling: the stored values are the
    values) or a one-element fp32 tensor on ``device``.

    ``scale``: None, a number (1.0 means no scaling; others are put on the device without a
    host sync) or a tensor with one element (vLLM's per-layer scale), which must already be on
    ``device`` (never copied from the host behind the caller's back)."""
    if scale is None:
        return None
    if not isinstance(scale, torch.Tensor):
        if float(scale) == 1.0:
            return None
        return torch.full((1,), float(scale), dtype=torch.float32, device=device)
    if scale.numel() != 1:
        raise ValueError(f"one KV scale per layer expected, got {scale.numel()} values (per-head scales are not "
                         "supported)")
    if scale.device != torch.device(device):
        raise ValueError(f"KV scale on {scale.device}, the cache on {device}")
    return scale.reshape(1).to(torch.float32)


def check_kv_dtypes(q: torch.Tensor, *caches: torch.Tensor) -> None:
    """The query must be a compute dtype (a quantized query is dequantized by the caller); each
    cache holds either that kind of dtype or fp8 (e4m3 or e5m2)."""
    if is_fp8(q.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"query dtype {q.dtype}: fp16, bf16 or fp32 expected (dequantize an fp8 query first)")
    for c in caches:
        if not c.dtype.is_floating_point:
            raise ValueError(f"cache dtype {c.dtype}: view an fp8 cache stored as bytes as torch.float8_e4m3fn")
