"""The decode-mode interface: what the CUDA backend's decode glue (``backends/decode.py``) calls."""

from __future__ import annotations

from typing import Protocol

import torch

from .memory import EmptyTensor, StateLayout


class DecodeState(Protocol):
    """One layer's state beside vLLM's cache, indexed by physical page like the cache
    (:class:`.topk.PageSummaries`, :class:`.spans.SpanIndex`)."""

    key_cache_ptr: int  # the cache it describes (vLLM binds it once)
    nbytes: int

    def update(self, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After vLLM's cache update of a step: follow the pages ``slot_mapping`` wrote."""

    def prefill(self, query: torch.Tensor, key: torch.Tensor, key_cache: torch.Tensor, plan: StepDecodePlan,
                block_table: torch.Tensor, scale: float) -> None:
        """The step's prefill rows, with the mode's plan of the step (after :meth:`update`: the
        cache holds the step's keys)."""

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Decode attention of one query token per sequence, into ``out``."""


class StepDecodePlan(Protocol):
    """A decode mode's plan of one step (spans: :class:`SpanSegments`), made once by the builder
    for every layer of the step and read only by the mode's own layers: the backend carries it."""


class DecodeMode(Protocol):
    """A decode mode, made from the settings (``DECODE_MODES[name](settings)``)."""

    name: str  # the decode_mode setting
    plans_steps: bool  # whether plan_step plans anything (else the builder skips the step's host lists)

    def plan_step(self, query_start_loc: list[int], seq_lens: list[int], page_size: int,
                  device) -> StepDecodePlan | None:
        """The step's plan, shared by every layer (None: nothing to plan)."""

    def unsupported_page_size(self, page_size: int) -> str | None:
        """Why the mode cannot run on pages of this size, or None."""

    def state_layout(self, num_pages: int, num_kv_heads: int, head_size: int, kv_dtype: torch.dtype) -> StateLayout:
        """The tensors of a layer's state for a cache of ``num_pages`` pages (what :meth:`allocate`
        allocates): the profiling run reserves their memory before vLLM sizes the cache."""

    def allocate(self, key_cache: torch.Tensor, empty: EmptyTensor | None = None) -> DecodeState:
        """A layer's state beside a ``[pages, page, Hkv, D]`` key cache, its tensors from ``empty``
        (default: a plain allocation on the cache's device)."""
