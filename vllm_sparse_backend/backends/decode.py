"""The CUDA backend's glue to the decode modes (``decode/``): the one interface its builder and
impl call.

``decode_mode=dense`` (the default) has no mode: decode is FlashAttention's. Two calls reach a
mode (:func:`vllm_sparse_backend.decode.decode_mode`):

* the metadata builder, once per step (:func:`step_decode_plan`): the mode's plan of the step's
  prefill rows (spans: their segments), planned once for every layer of the group and carried in
  :attr:`.common.SparseStepMetadata.decode_plan`;
* each layer's impl, once per forward (:meth:`LayerDecode.forward`): the layer's state beside
  vLLM's paged cache follows the step's written pages, runs the plan, and in a pure decode batch
  computes the decode attention.

The prefill path reads none of this.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .._compat import seq_lens_host
from ..decode.base import DecodeMode, DecodeState
from .common import SparseStepMetadata


def step_decode_plan(mode: DecodeMode | None, cm, page_size: int, device) -> Any | None:
    """The decode mode's plan of a step with prefill rows (None: nothing to plan). ``cm``: the
    step's CommonAttentionMetadata."""
    if mode is None or not mode.plans_steps or cm.max_query_len <= 1:
        return None
    return mode.plan_step(cm.query_start_loc_cpu[:cm.num_reqs + 1].tolist(), seq_lens_host(cm), page_size, device)


class LayerDecode:
    """One attention layer's decode mode: its state beside vLLM's cache, allocated on the layer's
    first forward with metadata (vLLM has bound the cache by then), and the one call the impl's
    forward makes."""

    def __init__(self, mode: DecodeMode, why_dense: str | None, log_once: Callable[..., None]):
        self.mode = mode
        self.log_once = log_once
        self.state: DecodeState | None = None
        # why this layer decodes dense whatever the mode (the impl's reasons; logged on its first forward)
        self._why_dense = why_dense
        self.off: str | None = None  # set once decided: the forward stops asking

    @property
    def active(self) -> bool:
        return self.off is None

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, key_cache: torch.Tensor,
                value_cache: torch.Tensor, md, scale: float, output: torch.Tensor) -> bool:
        """``md``: the step's metadata (FlashAttention's, or ours for a step with prefill rows); key_cache / value_cache:
        ``[pages, page, Hkv, D]`` views. True when ``output`` holds the layer's attention (a pure
        decode batch); False when the impl computes it (prefill rows, or decode stays dense)."""
        state = self._state(key_cache)
        if state is None:
            return False
        # vLLM wrote this step's K/V before attention: follow them beside the cache
        state.update(key_cache, md.slot_mapping)
        plan = md.decode_plan if isinstance(md, SparseStepMetadata) else None
        if plan is not None and key is not None:
            state.prefill(query, key, key_cache, plan, md.block_table, scale)
        if md.max_query_len != 1:  # prefill rows in the step (ours always has some): the impl computes it
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
            self.log_once("decode_mode=%s: layers with %s decode dense", name, reason)
            return None
        # vLLM warms up eagerly first; never allocate in a graph
        if key_cache.is_cuda and torch.cuda.is_current_stream_capturing():
            self.log_once("decode_mode=%s: its state beside the cache is missing at CUDA-graph capture; that graph "
                     "decodes dense", name)
            return None
        try:
            self.state = self.mode.allocate(key_cache)
        except torch.OutOfMemoryError:
            self.off = "no memory left for its state beside the cache"
            self.log_once("decode_mode=%s: no GPU memory for its per-page state (1/%d of the KV cache); decode stays "
                     "dense (lower gpu_memory_utilization to leave room)", name, key_cache.shape[1])
            return None
        self.log_once("decode_mode=%s: per-page state takes %.2f GiB per layer beside the KV cache (1/%d of it), "
                 "allocated after vLLM sized the cache", name, self.state.nbytes / 2**30, key_cache.shape[1], info=True)
        return self.state
