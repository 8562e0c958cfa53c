"""Decode modes beside FlashAttention's decode (issue 8): the one interface the CUDA backend calls.

``decode_mode=dense`` (the default) has no mode: decode is FlashAttention's. ``topk``
(:class:`..decode_topk.TopkDecode`) and ``spans`` (:class:`..decode_spans.SpanDecode`) are each a
:class:`DecodeMode`, selected once from the settings (:func:`decode_mode`). Two calls reach them:

* the metadata builder, once per step (:func:`with_step_plan`): the mode's plan of the step's
  prefill rows (spans: their segments), planned once for every layer of the group and carried in
  the step's metadata (:attr:`DecodePlanMetadata.decode_plan`, or the same field of
  :class:`.common.SparsePrefillMetadata`);
* each layer's impl, once per forward (:meth:`LayerDecode.forward`): the layer's state beside
  vLLM's paged cache follows the step's written pages, runs the plan, and in a pure decode batch
  computes the decode attention.

The prefill path reads none of this: it sees vLLM's metadata or ours, whatever the mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

from .._compat import seq_lens_host
from ..config import SparseSettings
from ..decode_spans import SpanDecode
from ..decode_topk import TopkDecode
from .common import SparsePrefillMetadata, log_once


class DecodeState(Protocol):
    """One layer's state beside vLLM's cache, indexed by physical page like the cache
    (:class:`..decode_topk.PageSummaries`, :class:`..decode_spans.SpanIndex`)."""

    key_cache_ptr: int  # the cache it describes (vLLM binds it once)
    nbytes: int

    def update(self, key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After vLLM's cache update of a step: follow the pages ``slot_mapping`` wrote."""

    def prefill(self, query: torch.Tensor, key: torch.Tensor, key_cache: torch.Tensor, plan: Any,
                block_table: torch.Tensor, scale: float) -> None:
        """The step's prefill rows, with the mode's plan of the step (after :meth:`update`: the
        cache holds the step's keys)."""

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
        """Decode attention of one query token per sequence, into ``out``."""


class DecodeMode(Protocol):
    name: str  # the decode_mode setting
    plans_steps: bool  # whether plan_step plans anything (else the builder skips the step's host lists)

    def plan_step(self, query_start_loc: list[int], seq_lens: list[int], page_size: int, device) -> Any | None:
        """The step's plan, shared by every layer (None: nothing to plan)."""

    def unsupported_page_size(self, page_size: int) -> str | None:
        """Why the mode cannot run on pages of this size, or None."""

    def allocate(self, key_cache: torch.Tensor) -> DecodeState:
        """A layer's state beside a ``[pages, page, Hkv, D]`` key cache."""


def decode_mode(settings: SparseSettings) -> DecodeMode | None:
    """The mode ``settings.decode_mode`` names; None for dense (FlashAttention's decode)."""
    if settings.decode_mode == "topk":
        return TopkDecode(settings)
    if settings.decode_mode == "spans":
        return SpanDecode(settings)
    return None


@dataclasses.dataclass
class DecodePlanMetadata(FlashAttentionMetadata):
    """FlashAttention's metadata of a step without sparse rows, with the decode mode's plan of the
    step. FlashAttention reads it as its own (a subclass, every field copied)."""

    decode_plan: Any = None


def with_step_plan(mode: DecodeMode | None, md, cm, page_size: int, device):
    """``md`` (FlashAttention's metadata or ours) with the decode mode's plan of the step, for a
    step with prefill rows; ``md`` itself where there is nothing to plan. ``cm``: the step's
    CommonAttentionMetadata."""
    if mode is None or not mode.plans_steps or cm.max_query_len <= 1:
        return md
    plan = mode.plan_step(cm.query_start_loc_cpu[:cm.num_reqs + 1].tolist(), seq_lens_host(cm), page_size, device)
    if plan is None:
        return md
    if isinstance(md, SparsePrefillMetadata):
        return dataclasses.replace(md, decode_plan=plan)
    fields = dataclasses.fields(md)  # whatever this vLLM version's FlashAttentionMetadata holds
    out = DecodePlanMetadata(**{f.name: getattr(md, f.name) for f in fields if f.init}, decode_plan=plan)
    for f in fields:
        if not f.init:
            setattr(out, f.name, getattr(md, f.name))
    return out


class LayerDecode:
    """One attention layer's decode mode: its state beside vLLM's cache, allocated on the layer's
    first forward with metadata (vLLM has bound the cache by then), and the one call the impl's
    forward makes."""

    def __init__(self, mode: DecodeMode, why_dense: str | None = None):
        self.mode = mode
        self.state: DecodeState | None = None
        # why this layer decodes dense whatever the mode (the impl's reasons; logged on its first forward)
        self._why_dense = why_dense
        self.off: str | None = None  # set once decided: the forward stops asking

    @property
    def active(self) -> bool:
        return self.off is None

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, key_cache: torch.Tensor,
                value_cache: torch.Tensor, md, scale: float, output: torch.Tensor) -> bool:
        """``md``: the step's metadata (FlashAttention's or ours); key_cache / value_cache:
        ``[pages, page, Hkv, D]`` views. True when ``output`` holds the layer's attention (a pure
        decode batch); False when the impl computes it (prefill rows, or decode stays dense)."""
        state = self._state(key_cache)
        if state is None:
            return False
        # vLLM wrote this step's K/V before attention: follow them beside the cache
        state.update(key_cache, md.slot_mapping)
        plan = md.decode_plan if isinstance(md, (DecodePlanMetadata, SparsePrefillMetadata)) else None
        if plan is not None and key is not None:
            state.prefill(query, key, key_cache, plan, md.block_table, scale)
        if isinstance(md, SparsePrefillMetadata) or md.max_query_len != 1:
            return False
        n = md.num_actual_tokens  # one token per sequence
        state.decode(query[:n], key_cache, value_cache, md.block_table[:n], md.seq_lens[:n], scale, output[:n])
        return True

    def _state(self, key_cache: torch.Tensor) -> DecodeState | None:
        """This layer's state for the cache, or None (this forward decodes dense)."""
        if self.state is not None and self.state.key_cache_ptr == key_cache.data_ptr():
            return self.state
        name = self.mode.name
        reason = self._why_dense or self.mode.unsupported_page_size(key_cache.shape[1])
        if reason is not None:
            self.off = reason
            log_once("decode_mode=%s: layers with %s decode dense", name, reason)
            return None
        # vLLM warms up eagerly first; never allocate in a graph
        if key_cache.is_cuda and torch.cuda.is_current_stream_capturing():
            log_once("decode_mode=%s: its state beside the cache is missing at CUDA-graph capture; that graph "
                     "decodes dense", name)
            return None
        try:
            self.state = self.mode.allocate(key_cache)
        except torch.OutOfMemoryError:
            self.off = "no memory left for its state beside the cache"
            log_once("decode_mode=%s: no GPU memory for its per-page state (1/%d of the KV cache); decode stays "
                     "dense (lower gpu_memory_utilization to leave room)", name, key_cache.shape[1])
            return None
        log_once("decode_mode=%s: per-page state takes %.2f GiB per layer beside the KV cache (1/%d of it), "
                 "allocated after vLLM sized the cache", name, self.state.nbytes / 2**30, key_cache.shape[1])
        return self.state
