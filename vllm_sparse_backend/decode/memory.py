"""The decode modes' per-page state, accounted for before vLLM sizes the KV cache.

vLLM gives the KV cache what its profiling run leaves of the memory it may use
(``gpu_memory_utilization`` x the GPU's memory) and never hears of memory allocated after that.
A decode mode's state grows with the cache (top-k: a key min / max per page; spans: a key vector
and a flag per page), so it is claimed during the profiling run instead: a buffer that vLLM's
measurement counts, sized so that it holds the state of the cache vLLM will then size, and handed
out to the layers (views into it) when they first see their cache. The vLLM side (when, from
which of vLLM's numbers) is :func:`vllm_sparse_backend.backends.decode.reserve_decode_state`; the
arithmetic and the buffer are here, torch only. Why this design: docs/decode-modes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# A state tensor's offset in the buffer is rounded up to this (the CUDA caching allocator's own
# granularity), so every view is aligned for any dtype and the kernels' vector loads.
ALIGNMENT = 512

# (shape, dtype) of each tensor of one layer's state
StateLayout = Sequence[tuple[tuple[int, ...], torch.dtype]]
# allocates one uninitialised state tensor: (shape, dtype) -> tensor
EmptyTensor = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def layout_bytes(layout: StateLayout) -> int:
    """Bytes of a layer's state tensors, before alignment."""
    return sum(_numel(shape) * dtype.itemsize for shape, dtype in layout)


@dataclass(frozen=True)
class StateCost:
    """The state of a model's layers as a function of the KV cache: ``per_page`` x pages +
    ``fixed`` bytes, where a page of the cache takes ``kv_per_page`` bytes over all layers (vLLM
    gives every layer the same number of pages). ``fixed``: rows beyond the pages and alignment,
    an upper bound."""

    per_page: int
    fixed: int
    kv_per_page: int
    layers: int  # layers with a state

    @classmethod
    def of_layers(cls, state_layouts: Sequence[Callable[[int], StateLayout]],
                  kv_bytes_per_page: Sequence[int]) -> "StateCost":
        """``state_layouts``: for each layer with a state, its layout for a cache of n pages;
        ``kv_bytes_per_page``: each attention layer's bytes per page of the KV cache (every layer,
        with a state or not). A layout is affine in the pages, so two sizes give it; each tensor
        may round up by less than :data:`ALIGNMENT`."""
        per_page = fixed = 0
        for layout in state_layouts:
            empty, one_page = layout(0), layout(1)
            per_page += layout_bytes(one_page) - layout_bytes(empty)
            fixed += layout_bytes(empty) + ALIGNMENT * len(empty)  # alignment adds less than this
        return cls(per_page, fixed, sum(kv_bytes_per_page), len(state_layouts))

    @property
    def fraction(self) -> float:
        """State bytes per KV-cache byte."""
        return self.per_page / self.kv_per_page if self.kv_per_page else 0.0

    def state_for_cache(self, kv_cache_bytes: int) -> int:
        """The state of a KV cache of ``kv_cache_bytes`` (vLLM's pages: whole pages of every layer)."""
        if self.layers == 0 or self.kv_per_page == 0:
            return 0
        return self.per_page * (kv_cache_bytes // self.kv_per_page) + self.fixed

    def reservation(self, available: int) -> int:
        """The buffer ``R`` to hold while vLLM measures, when ``available`` bytes would go to
        the KV cache without it: the cache then gets ``available - R``, whose state must fit in
        ``R``. ``R = per_page * (available - R) / kv_per_page + fixed``, solved for R (rounded up),
        covers ``state_for_cache(available - R)``."""
        if self.layers == 0 or self.kv_per_page == 0 or available <= 0:
            return 0
        numerator = self.per_page * available + self.fixed * self.kv_per_page
        return -(-numerator // (self.kv_per_page + self.per_page))


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel


class StateBuffer:
    """The memory claimed for every layer's state, handed out front to back as aligned views.
    A request it cannot hold gets None (the caller allocates it elsewhere)."""

    def __init__(self, buffer: torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError("the state buffer is a flat uint8 tensor")
        self.buffer = buffer
        self.used = 0  # bytes handed out, alignment included

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def left(self) -> int:
        return self.nbytes - self.used

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised tensor of ``shape`` and ``dtype`` inside the buffer, or None."""
        nbytes = _numel(shape) * dtype.itemsize
        if aligned(nbytes) > self.left:
            return None
        start = self.used
        self.used += aligned(nbytes)
        return self.buffer[start:start + nbytes].view(dtype).view(shape)


def empty_on(device) -> EmptyTensor:
    """Plain allocation on ``device`` (a state nobody reserved memory for)."""
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


class DecodeStateMemory:
    """One worker's memory for its layers' decode state: the buffer claimed in vLLM's profiling
    run (:attr:`buffer`, None before or where none was claimed) and the tally of what the layers
    took, in it and beyond it."""

    def __init__(self):
        self.claimed = False  # the profiling run's claim was made (or found nothing to claim)
        self.buffer: StateBuffer | None = None
        self.layers_expected = 0  # layers the claim counted
        self.layers = 0  # layers that took their state
        self.state_bytes = 0
        self.beyond_bytes = 0  # allocated outside the buffer: vLLM did not count them
        self.kv_cache_bytes = 0  # the KV cache of those layers

    def empty(self, device) -> EmptyTensor:
        """Tensors from the buffer while it has room, else plain allocations on ``device``."""
        def take(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            tensor = self.buffer.take(shape, dtype) if self.buffer is not None else None
            if tensor is None:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                self.beyond_bytes += tensor.nbytes
            return tensor
        return take

    def record(self, state_bytes: int, kv_cache_bytes: int) -> bool:
        """Count a layer's state; True when it is the last layer the claim counted."""
        self.layers += 1
        self.state_bytes += state_bytes
        self.kv_cache_bytes += kv_cache_bytes
        return self.layers == self.layers_expected
