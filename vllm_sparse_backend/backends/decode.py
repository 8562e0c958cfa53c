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

The state grows with vLLM's cache, so its memory is claimed in vLLM's profiling run, before vLLM
sizes the cache (:func:`claim_decode_state`), and the layers take their state out of that claim
(:class:`..decode.memory.DecodeStateMemory`). The prefill path reads none of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .._compat import KVCacheRequest, seq_lens_host
from ..config import ConfigError
from ..decode.base import DecodeMode, DecodeState, StepDecodePlan
from ..decode.memory import DecodeStateMemory, StateBuffer, StateCost
from ..startup import report_startup_error
from .common import SparseStepMetadata

GIB = 2 ** 30


def step_decode_plan(mode: DecodeMode | None, cm, page_size: int, device) -> StepDecodePlan | None:
    """The decode mode's plan of a step with prefill rows (None: nothing to plan). ``cm``: the
    step's CommonAttentionMetadata."""
    if mode is None or not mode.plans_steps or cm.max_query_len <= 1:
        return None
    return mode.plan_step(cm.query_start_loc_cpu[:cm.num_reqs + 1].tolist(), seq_lens_host(cm), page_size, device)


class LayerDecode:
    """One attention layer's decode mode: its state beside vLLM's cache, made on the layer's first
    forward with metadata (vLLM has bound the cache by then) out of the memory the profiling run
    claimed for it, and the one call the impl's forward makes."""

    def __init__(self, mode: DecodeMode, why_dense: str | None, log_once: Callable[..., None],
                 memory: DecodeStateMemory | None = None):
        self.mode = mode
        self.log_once = log_once
        # the process's memory for decode state (None: each layer allocates its own)
        self.memory = memory
        self.state: DecodeState | None = None
        # why this layer decodes dense whatever the mode (the impl's reasons; logged on its first forward)
        self._why_dense = why_dense
        self.off: str | None = None  # set once decided: the forward stops asking

    @property
    def active(self) -> bool:
        return self.off is None

    def needs_state(self, page_size: int) -> bool:
        """Whether this layer will allocate a state for a cache of ``page_size``-token pages."""
        return self.off is None and self._why_dense is None and self.mode.unsupported_page_size(page_size) is None

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
        memory = self.memory
        try:
            self.state = self.mode.allocate(key_cache, memory.empty(key_cache.device) if memory else None)
        except torch.OutOfMemoryError:
            self.off = "no memory left for its state beside the cache"
            self.log_once("decode_mode=%s: no GPU memory for its per-page state (1/%d of the KV cache); decode stays "
                          "dense (lower --gpu-memory-utilization to leave room)", name, key_cache.shape[1])
            return None
        if memory is not None and memory.record(self.state.nbytes, 2 * key_cache.nbytes):
            report_decode_state(memory, name, self.log_once)
        return self.state


@dataclass(frozen=True)
class DecodeClaim:
    """What the profiling run claims for the decode state: ``nbytes``, for a KV cache of
    ``kv_cache_bytes`` expected; ``error``: why the configuration cannot start (None: it can)."""

    nbytes: int
    kv_cache_bytes: int
    error: str | None = None


def plan_decode_claim(cost: StateCost, request: KVCacheRequest, total_memory: int, measured: int,
                      mode_name: str) -> DecodeClaim:
    """The claim for the state of ``cost``'s layers. With ``--kv-cache-memory-bytes`` vLLM's cache
    has that size: the claim is its state. Otherwise vLLM gives the cache what it may use
    (:meth:`KVCacheRequest.requested_memory`) less what its profiling run measures, the claim
    included, so the claim is :meth:`StateCost.reservation` of that; ``measured``: what the run
    has used so far (the torch peak), short of what vLLM will measure by the rest of the run, so
    the claim errs on the large side."""
    if cost.layers == 0:
        return DecodeClaim(0, 0)
    setting = f"VLLM_SPARSE_DECODE_MODE={mode_name}"
    if request.kv_cache_memory_bytes:
        return DecodeClaim(cost.state_for_cache(request.kv_cache_memory_bytes), request.kv_cache_memory_bytes)
    available = request.requested_memory(total_memory) - measured
    nbytes = cost.reservation(available)
    kv_cache = available - nbytes
    error = None
    if request.max_model_len is not None and available > 0:
        one_sequence = -(-request.max_model_len // request.page_size) * cost.kv_per_page
        if kv_cache < one_sequence <= available:  # it would fit without the state
            error = (f"{setting}: its per-page state ({nbytes / GIB:.2f} GiB) leaves the KV cache about "
                     f"{kv_cache / GIB:.2f} GiB, less than one sequence of --max-model-len {request.max_model_len} "
                     f"needs ({one_sequence / GIB:.2f} GiB); raise --gpu-memory-utilization (now "
                     f"{request.gpu_memory_utilization}), lower --max-model-len, or set VLLM_SPARSE_DECODE_MODE=dense")
    return DecodeClaim(nbytes, kv_cache, error)


def claim_decode_state(memory: DecodeStateMemory, cost: StateCost, request: KVCacheRequest, mode_name: str,
                       device: torch.device, log_once: Callable[..., None]) -> None:
    """In vLLM's profiling run, on the first forward without metadata of any layer, before the
    sparse path's scratch claim: hold the buffer the layers' decode state will come from, for the
    rest of the run (so that vLLM's measurement counts it) and until the layers take it. Once per
    process. A configuration that cannot fit stops the start-up (:class:`ConfigError` naming the
    setting and the flag, also left for the plugin's ``vllm`` command)."""
    if memory.claimed:
        return
    memory.claimed = True
    memory.layers_expected = cost.layers
    _, total = torch.cuda.mem_get_info(device)
    claim = plan_decode_claim(cost, request, total, torch.cuda.max_memory_allocated(device), mode_name)
    if claim.error is None and claim.nbytes > 0:
        try:
            memory.buffer = StateBuffer(torch.empty(claim.nbytes, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            free, _ = torch.cuda.mem_get_info(device)
            flag = "lower --kv-cache-memory-bytes" if request.kv_cache_memory_bytes else \
                "lower --gpu-memory-utilization (other processes hold memory on this GPU)"
            claim = DecodeClaim(claim.nbytes, claim.kv_cache_bytes,
                                f"VLLM_SPARSE_DECODE_MODE={mode_name}: its per-page state needs "
                                f"{claim.nbytes / GIB:.2f} GiB beside a KV cache of {claim.kv_cache_bytes / GIB:.2f} "
                                f"GiB and the GPU has {free / GIB:.2f} GiB free; {flag}, or set "
                                f"VLLM_SPARSE_DECODE_MODE=dense")
    if claim.error is not None:
        error = ConfigError(claim.error)
        report_startup_error(error)
        raise error
    if claim.nbytes > 0:
        log_once("decode_mode=%s: %.2f GiB held in vLLM's memory-profiling run for the per-page state of %d layers "
                 "(%.4f of the KV cache's bytes; the cache is expected at about %.2f GiB)", mode_name,
                 claim.nbytes / GIB, cost.layers, cost.fraction, claim.kv_cache_bytes / GIB, info=True)


def report_decode_state(memory: DecodeStateMemory, mode_name: str, log_once: Callable[..., None]) -> None:
    """Once every layer the claim counted has its state: how it compares with the claim."""
    claimed = memory.buffer.nbytes if memory.buffer is not None else 0
    log_once("decode_mode=%s: per-page state of %d layers takes %.2f GiB beside a KV cache of %.2f GiB (%.2f GiB "
             "held for it in the profiling run, %.0f MiB of that unused)", mode_name, memory.layers,
             memory.state_bytes / GIB, memory.kv_cache_bytes / GIB, claimed / GIB,
             (memory.buffer.left if memory.buffer is not None else 0) / 2 ** 20, info=True)
    if memory.beyond_bytes:
        log_once("decode_mode=%s: %.0f MiB of the per-page state did not fit in what the profiling run held and was "
                 "allocated beside it, outside vLLM's accounting; if the start-up runs out of memory, lower "
                 "--gpu-memory-utilization", mode_name, memory.beyond_bytes / 2 ** 20)
