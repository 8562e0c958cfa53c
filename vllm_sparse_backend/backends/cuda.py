"""CUDA backend: vLLM's FlashAttention for decode and short rows, long prefill rows sparse.

Selected with ``--attention-backend sparse-prefill`` (registered as vLLM's CUSTOM backend).
The builder returns FlashAttention's own metadata whenever no row of the step qualifies, so
decode batches, CUDA-graph capture and drafting are byte-for-byte FlashAttention. Steps with a
long prefill row get :class:`SparseStepMetadata`: contiguous runs of the other rows go to
FlashAttention, the long rows to the sparse path, which reads K/V through the paged cache (the
current chunk's K/V were written by vLLM's cache-update op before attention runs).

Decode modes (setting ``decode_mode`` topk / spans) sit behind one interface (``decode.py``): the
builder attaches the mode's plan of a step with prefill rows (spans: their segments) to the
step's :class:`SparseStepMetadata`, and the impl's forward makes one call into the layer's
:class:`LayerDecode`, which computes pure decode batches itself.

Sparse rows, Triton path (setting ``kernel`` = auto/triton, where the kernel supports the layer):
indices are estimated on the GPU straight from the paged cache and the block+column kernel reads
K/V through the block table; no gather, no host sync. Rows whose budgets alone are denser than
``max_density`` go to FlashAttention without estimation; rows whose estimated index is denser
are flagged on the GPU and run in the kernel's dense mode. With
``kernel`` = torch (debugging) indices are estimated in PyTorch on K/V gathered out of the cache
and the PyTorch sparse attention (``vllm_sparse_kernels.torch_attention``) computes the rows.
With ``auto`` where the Triton path cannot run (no triton, head size or dtype it lacks) the
layers run dense: the PyTorch path would be far slower.

fp8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e4m3``, where FlashAttention runs it: FA3 on
Hopper): the sparse path reads the e4m3 cache directly; estimation and kernel widen its tiles to
the model's dtype and apply the layer's ``_k_scale`` / ``_v_scale`` on the device. Where the
layer quantized the query for FlashAttention 3, the sparse rows widen it back and fold
``_q_scale`` into the k scale; the dense rows get it as vLLM passed it.

Memory: the Triton path's scratch (score buffers, index lists) is allocated per layer and freed
after it; the profiling run claims it so that vLLM sizes the KV cache with it (``claim.py``). The
decode modes' per-page state is claimed there too, before the scratch, and held until the layers
take it (``decode.py``).

Settings, stats and each layer's head patterns come from the worker's runtime
(:func:`..runtime.worker_runtime`), read once per process.
"""

from __future__ import annotations

import functools

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadata, FlashAttentionMetadataBuilder)
from vllm_sparse_kernels.kv_layout import gather_paged_kv

from .. import kernels
from .._compat import (FlashBackendVersions, FlashBuilderVersions, FlashImplVersions, attention_layers,
                       current_vllm_config, kv_cache_request, layer_kv_scales, last_tokens, slice_rows,
                       sparse_backend_selected, step_token_budget)
from ..decode import decode_mode
from ..decode.memory import StateCost
from ..prefill.estimate import HeadGroups
from ..prefill.plan import RankHeads, SparseRow
from ..prefill.cost import LayerDensityHistory
from ..observability.record import record_layer
from ..prefill.plan import LayerOutcome
from ..prefill.run import run_sparse_rows, run_sparse_rows_paged
from ..runtime import worker_runtime
from ..startup import load_checked_settings
from .claim import claim_scratch
from ..prefill.route import DenseReason, group_dense_reason
from .common import (UNQUANTIZED_KV_CACHE_DTYPES, DenseRun, SparseStepMetadata, check_head_config_fits_model,
                     cost_model_heads, count_dense_tokens, distinct_head_sets, first_unsupported_layer,
                     guard_stats, layer_heads, log_dense_group, long_query_lens, plan_sparse_step, recoverable,
                     resolve_group_heads, sparse_path_failed, unsupported_reason)
from .decode import LayerDecode, claim_decode_state, step_decode_plan
from .host_kv import HostKV, check_vllm_cache_fits

# vLLM's fp8 KV caches the sparse path reads (allocated as bytes; FlashAttention views them as
# e4m3, with per-layer k / v scales). e5m2 is not among them: FlashAttention, which runs decode
# and the dense rows, has no e5m2 path, so vLLM refuses it for this backend at start-up.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# the other --kv-cache-dtype values this backend declares ("auto": the model's dtype)
UNQUANTIZED_KV_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer's KV cache holds (an fp8 cache's: one byte per value)."""
    return FP8_KV_CACHE_DTYPES.get(kv_cache_dtype) or UNQUANTIZED_KV_TORCH_DTYPES.get(kv_cache_dtype, model_dtype)


class SparsePrefillMetadataBuilder(FlashBuilderVersions, FlashAttentionMetadataBuilder):
    # Mixed batches containing a sparse row must not replay FULL graphs (FA3 would say ALWAYS).
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    # FA's update_block_table would shallow-copy our wrapper and leave its runs on the old table.
    supports_update_block_table = False
    _step_token_budget: int | None = None  # the scheduler's tokens per step (None: unknown)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        selected = sparse_backend_selected(vllm_config)
        self.runtime = runtime = worker_runtime()
        cfg = runtime.settings
        group_heads = None  # this group's head patterns per layer (None: every row runs dense)
        if selected and cfg.kv_placement == "host":  # the sparse path reads vLLM's page: summaries only here
            runtime.log_once("kv_placement=host: prefill rows run dense over their K/V gathered from the host pool",
                             info=True)
            check_vllm_cache_fits(cfg, vllm_config, kv_cache_spec)  # vLLM has sized its cache: before any request
        elif selected:
            unsupported = first_unsupported_layer(vllm_config, layer_names) if cfg.gating.enabled else None
            # resolved before the other reasons are asked: a head-config file that does not fit fails here
            heads = resolve_group_heads(runtime, vllm_config, layer_names) if cfg.gating.enabled and unsupported is None else None
            # the model's dtype: the cache's (kv_cache_spec.dtype) is uint8 for an fp8 cache
            why = group_dense_reason(
                cfg, unsupported=unsupported and unsupported[0],
                dcp_size=vllm_config.parallel_config.decode_context_parallel_size,
                claim_failed=runtime.claim_failed,
                triton_why=triton_unusable_reason(kv_cache_spec.head_size, vllm_config.model_config.dtype,
                                                  cfg.block_size))
            if why is not None and why[0] is DenseReason.TRITON_UNUSABLE and cfg.kernel == "triton":
                raise RuntimeError(f"sparse-prefill: kernel=triton requested but not usable: {why[1]}")
            if why is None:
                group_heads = heads
            else:  # (auto with no Triton path: the PyTorch path would be far slower than FlashAttention)
                log_dense_group(runtime, why, unsupported[1] if unsupported else "")
        self.sparse_enabled = group_heads is not None
        # decode_mode topk / spans: the mode plans each step once for every layer of the group
        self._decode_mode = decode_mode(cfg) if selected else None
        # Rows that no layer's budgets could make sparser than max_density stay in FlashAttention's
        # runs (short long rows, mostly): no estimation, no per-row fallback.
        self._head_sets = distinct_head_sets(group_heads) \
            if self.sparse_enabled and cfg.gating.max_density < 1.0 else None
        # Rows on which even an empty selection would lose to FlashAttention (short prompts) stay
        # in FlashAttention's runs for every layer: no per-layer routing, no per-row metadata.
        # (The cost model is the Triton path's; the PyTorch path runs every planned row.
        # plan_step applies it where cost_model and max_density say so.)
        self._row_heads = cost_model_heads(group_heads, kv_cache_spec.head_size) \
            if self.sparse_enabled and cfg.kernel != "torch" else None
        self._uses_kernel_table = self.sparse_enabled and cfg.kernel != "torch"
        # Steps whose longest row is shorter have no row to route (decode batches, short prompts):
        # build() hands them to FlashAttention's builder without reading a setting.
        self._plan_from = cfg.gating.min_sparse_query_len if self.sparse_enabled else float("inf")
        # the stats file catches up once per step, not once per layer (stats.refresh)
        self._stats_file = cfg.observability.stats_file or None
        # which chunks end their prompt (gating.exact_prompt_end, route.cut_row)
        self._step_token_budget = step_token_budget(vllm_config)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # kv_placement=host: each layer's decode reads its selection back to the host and copies
        # pages from there (backends/host_kv.py), which a graph cannot replay
        if load_checked_settings().kv_placement == "host":
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        if self._stats_file is not None:
            guard_stats(self.runtime, self.runtime.stats.refresh, self._stats_file)  # counts the GPU has finished
        if cm.max_query_len < self._plan_from and self._decode_mode is None:
            return super().build(common_prefix_len, cm, fast_build)
        planned = None
        if cm.max_query_len >= self._plan_from:
            try:
                planned = plan_sparse_step(self.runtime, cm, allow_context=True, head_sets=self._head_sets,
                                           row_heads=self._row_heads, step_token_budget=self._step_token_budget)
            except Exception as e:  # noqa: BLE001 - a planning error sends the step to FlashAttention
                if not recoverable(e):
                    raise
                sparse_path_failed(self.runtime, e, long_query_lens(self.runtime, cm))
        decode_plan = None if self._decode_mode is None else \
            step_decode_plan(self._decode_mode, cm, self.kv_cache_spec.block_size, self.device)
        if planned is not None:
            plan, qsl, seq_lens = planned
            try:
                # Only the first dense run may use FA3's ahead-of-time scheduler: a second build() would
                # overwrite the persistent scheduler buffer the first run's metadata points at.
                runs = []
                for k, (a, b) in enumerate(plan.dense_runs):
                    runs.append(DenseRun(qsl[a], qsl[b], super().build(0, slice_rows(cm, a, b, seq_lens),
                                                                       fast_build or k > 0)))
                fallback = {}  # each sparse row alone: the density fallback, or a failed sparse path
                # each sparse row's last queries over every key (SparseRow.exact_rows; PyTorch path: run.py)
                exact_tails = {}
                for r in plan.sparse_rows:
                    one_row = slice_rows(cm, r.row, r.row + 1, seq_lens)
                    fallback[r.row] = super().build(0, one_row, True)
                    if r.exact_rows and self._uses_kernel_table:
                        exact_tails[r.row] = (r.exact_rows, super().build(0, last_tokens(one_row, r.exact_rows), True))
            except Exception as e:  # noqa: BLE001 - the step then runs on FlashAttention whole
                if not recoverable(e):
                    raise
                sparse_path_failed(self.runtime, e, [r.q_len for r in plan.sparse_rows])
                planned = None
        if planned is None:
            md = super().build(common_prefix_len, cm, fast_build)
            if decode_plan is None:
                return md  # nothing of ours this step: FlashAttention's own metadata
            return SparseStepMetadata(cm.num_actual_tokens, cm.max_query_len, [DenseRun(0, cm.num_actual_tokens, md)],
                                      [], cm.block_table_tensor, cm.slot_mapping, decode_plan=decode_plan)
        # the kernel's table of the step's sparse rows, copied to the device once for every layer
        # (without it, each layer's launch builds its own)
        row_table = None
        if self._uses_kernel_table:
            try:
                row_table = kernels.sparse_attention.plan_rows(plan.sparse_rows, self.runtime.settings.block_size,
                                                               self.device)
            except Exception as e:  # noqa: BLE001 - the layers then build the table themselves
                self.runtime.log_once("the step's row table could not be built (%s: %s); each layer builds its own",
                                      type(e).__name__, e)
        return SparseStepMetadata(cm.num_actual_tokens, cm.max_query_len, runs, plan.sparse_rows,
                                  cm.block_table_tensor, cm.slot_mapping, fallback, row_table, decode_plan,
                                  exact_tails)


def triton_unusable_reason(head_size: int, dtype, block_size: int) -> str | None:
    """Why the Triton sparse path cannot run a layer of this geometry, or None. ``dtype``: the
    model's (the queries'); the KV cache may also be fp8 (FP8_KV_CACHE_DTYPES)."""
    if head_size not in (64, 128) or dtype not in (torch.float16, torch.bfloat16):
        return f"head size {head_size} / dtype {dtype}"
    if block_size != 64:
        return f"block_size {block_size}"
    return kernels.UNAVAILABLE


class SparsePrefillImpl(FlashImplVersions, FlashAttentionImpl):
    sparse_kv_cache_dtypes = UNQUANTIZED_KV_CACHE_DTYPES + tuple(FP8_KV_CACHE_DTYPES)  # (common.unsupported_reason)
    _use_triton: bool | None = None  # decided on the first sparse forward, logged once
    _vllm_config = None  # the config current at construction (the layer's heads, the profiling-run claim)
    _head_groups: HeadGroups | None = None  # the same, by pattern, on the device (first sparse forward)
    _decode: LayerDecode | None = None  # decode_mode topk / spans: this layer's (None: FlashAttention decodes)
    # estimated_dense_rows="auto": whether this layer's last sparse call had too-dense rows (first sparse forward)
    _density_history: LayerDensityHistory | None = None  # this layer's (one impl per layer)
    # The metadata type forward hands to FlashAttention before anything of ours runs: what the
    # builder returns for a step without sparse rows. None with a decode mode, which computes
    # pure decode batches (FlashAttention's metadata) itself.
    _flash_only: type | None = FlashAttentionMetadata

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # vLLM builds this impl only where the backend is selected, in the worker
        self.runtime = worker_runtime()
        settings = self.runtime.settings
        # kv_placement=host: the top-k summaries are vLLM's own page (host_kv.py), no state beside it
        mode = decode_mode(settings) if settings.kv_placement != "host" else None
        self._use_decode(None if mode is None else LayerDecode(mode, self._decode_unsupported_reason(),
                                                               self.runtime.log_once, self.runtime.decode_memory))
        if settings.kv_placement == "host":
            self._flash_only = None  # every step reads the placement
        self._vllm_config = current_vllm_config()
        # Layers are built before the weights load: the earliest point the worker knows the model.
        if self._vllm_config is not None and sparse_backend_selected(self._vllm_config):
            check_head_config_fits_model(self.runtime, self._vllm_config)

    def _use_decode(self, layer_decode: LayerDecode | None) -> None:
        """This layer's decode mode (None: dense decode). A mode follows every step's cache writes,
        so with one no step takes the FlashAttention-only shortcut."""
        self._decode = layer_decode
        self._flash_only = None if layer_decode is not None else FlashAttentionMetadata

    def _claim_scratch(self, layer, query: torch.Tensor, output: torch.Tensor) -> None:
        """Profiling run (no metadata): see claim.py. Skipped where no row of this layer could run
        the Triton path."""
        vc, cfg = self._vllm_config, self.runtime.settings
        if vc is None or not query.is_cuda or cfg.kernel == "torch" or not sparse_backend_selected(vc) \
                or cfg.kv_placement == "host":  # no sparse rows with host placement (the builder's)
            return
        # the builder asks the same question of the layer's group
        if group_dense_reason(cfg, unsupported=unsupported_reason(self),
                              dcp_size=vc.parallel_config.decode_context_parallel_size,
                              claim_failed=self.runtime.claim_failed,
                              triton_why=triton_unusable_reason(self.head_size, output.dtype, cfg.block_size)):
            return
        claim_scratch(self.runtime, self, layer, query, output, vc, FP8_KV_CACHE_DTYPES.get(self.kv_cache_dtype))

    def _claim_decode_state(self, query: torch.Tensor) -> None:
        """Profiling run (no metadata), before the scratch claim: the memory of every layer's
        decode state (decode.py), once per process."""
        vc, memory = self._vllm_config, self.runtime.decode_memory
        if memory.claimed or vc is None or not query.is_cuda or torch.cuda.is_current_stream_capturing():
            return
        request = kv_cache_request(vc)
        claim_decode_state(memory, decode_state_cost(vc, request.page_size), request, self._decode.mode.name,
                           query.device, self.runtime.log_once)

    def _groups(self, heads: RankHeads, device) -> HeadGroups:
        if self._head_groups is None:
            cfg = self.runtime.settings
            if cfg.kv_group_shared and heads.share == 1 and self.num_heads != self.num_kv_heads:
                self.runtime.log_once("kv_group_shared: layers whose KV groups mix patterns or budgets, or whose "
                                      "pattern has no shared form, keep one selection per query head")
            self._head_groups = HeadGroups.from_heads(heads.heads, device, heads.share)
        return self._head_groups

    def _triton_kernel(self):
        """The Triton kernel's entry point unless kernel=torch. The builder has already checked at
        start-up that the Triton path can run this group (kernel=triton fails there otherwise,
        auto keeps the group dense), so the impl only follows the setting."""
        if self._use_triton is None:
            self._use_triton = self.runtime.settings.kernel != "torch"
            if not self._use_triton:
                self.runtime.log_once("sparse rows use the PyTorch sparse attention: kernel=torch", info=True)
        if not self._use_triton:
            return None
        return kernels.sparse_attention.sparse_prefill_attention

    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[pages, page, Hkv, D] key and value views of vLLM's FlashAttention cache (an fp8 cache,
        allocated as bytes, viewed as its fp8 dtype, as FlashAttention does)."""
        fp8 = FP8_KV_CACHE_DTYPES.get(self.kv_cache_dtype)
        if fp8 is not None and kv_cache.dtype != fp8:
            kv_cache = kv_cache.view(fp8)
        return kv_cache.transpose(1, 2).split(self.head_size, dim=-1)

    def _sparse_operands(self, layer, query: torch.Tensor, output: torch.Tensor):
        """(query, k_scale, v_scale) for the sparse path: the scales (one-element fp32 device
        tensors, dequantised = stored * scale) for an fp8 cache, else None. Where the layer
        quantized the query for FlashAttention 3 (stored = query / q_scale), it is widened to the
        model's dtype (exact for e4m3) and q_scale folded into k_scale: every score the sparse path
        computes is bilinear in q and k. No host sync."""
        if self.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
            return query, None, None
        q_scale, k_scale, v_scale = layer_kv_scales(layer)
        if query.dtype != output.dtype:
            return query.to(output.dtype), k_scale * q_scale, v_scale
        return query, k_scale, v_scale

    def _decode_unsupported_reason(self) -> str | None:
        """Why this layer decodes dense whatever decode_mode says, or None."""
        reason = unsupported_reason(self) or ("logits soft-capping" if self.logits_soft_cap else None)
        if reason is None and self.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            reason = "an fp8 KV cache"
        return reason

    def _host_placement(self) -> HostKV | None:
        """kv_placement=host: the worker's host placement, made by the first layer that asks (None:
        vLLM's cache holds the K/V)."""
        runtime = self.runtime
        if runtime.settings.kv_placement != "host":
            return None
        if runtime.host_kv is None:
            runtime.host_kv = HostKV.for_vllm(runtime.settings, self._vllm_config)
        return runtime.host_kv

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """vLLM's cache update before attention (this backend does not write the cache in
        forward): FlashAttention's, or with kv_placement=host the host pool and the summaries."""
        host_kv = self._host_placement()
        if host_kv is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        host_kv.write(layer.layer_name, key, value, kv_cache, slot_mapping)

    def _host_forward(self, layer, query, kv_cache, md, output):
        """kv_placement=host (FlashAttention's metadata: the builder plans no sparse rows): a pure
        decode batch is top-k attention over the placed pages; a step with prefill rows attends
        every row over K/V gathered from the pool (whole, as FlashAttention would over vLLM's
        cache, or the pages host_kv_prefill_pages chooses; vLLM's page holds summaries only)."""
        host_kv, n = self.runtime.host_kv, md.num_actual_tokens
        if md.max_query_len == 1:  # one token per sequence
            host_kv.decode(layer.layer_name, query[:n], kv_cache, md.block_table[:n], md.seq_lens[:n], self.scale,
                           output[:n], md)
        else:
            qsl = md.query_start_loc.tolist()
            host_kv.prefill(layer.layer_name, query[:n], qsl, md.seq_lens[:len(qsl) - 1].tolist(), md.block_table,
                            self.scale, output[:n], kv_cache)
        return output

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        # A step without sparse rows pays this one check per layer: nothing of ours runs for it.
        if attn_metadata.__class__ is self._flash_only:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        runtime = self.runtime
        if attn_metadata is not None and self._host_placement() is not None:
            return self._host_forward(layer, query, kv_cache, attn_metadata, output)
        if attn_metadata is None:  # vLLM's profiling run: count the decode state and the sparse scratch in it
            host_kv = self._host_placement()
            if host_kv is not None:  # and the host placement's hot cache, once for every layer
                hot = host_kv.claim_hot_cache(self.num_kv_heads, self.head_size, output.dtype, query.device)
                runtime.log_once("kv_placement=host: %.2f GiB of hot cache (host_kv_hot_pages=%d per layer) held in "
                                 "vLLM's profiling run", hot.nbytes / 2 ** 30, runtime.settings.host_kv_hot_pages,
                                 info=True)
            if self._decode is not None:
                self._claim_decode_state(query)
            self._claim_scratch(layer, query, output)
        elif self._decode is not None and self._decode.active and output_scale is None:
            if self._decode.forward(query, key, *self._kv_views(kv_cache), attn_metadata, self.scale, output):
                return output  # a pure decode batch, computed by the decode mode
        if not isinstance(attn_metadata, SparseStepMetadata):  # None (profiling) or FlashAttention's own
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        step = attn_metadata
        for run in step.dense_runs:  # FA slices by its metadata's num_actual_tokens
            self._dense(layer, query, key, value, kv_cache, run.metadata, slice(run.tok_start, run.tok_end), output,
                        output_scale, output_block_scale)
        if not step.sparse_rows:
            return output
        count_dense_tokens(runtime, step)
        if output_scale is not None or output_block_scale is not None:
            runtime.log_once("%s: sparse rows run on FlashAttention", DenseReason.FUSED_OUTPUT_QUANT.value)
            dense = step.sparse_rows
        else:
            timing = runtime.stats.time_stages(query.device)  # CUDA events on 1 of N forwards, read later
            try:
                outcome = self._sparse(layer, query, kv_cache, step, output, timing)
            except Exception as e:  # noqa: BLE001 - the error boundary of the sparse path
                if not recoverable(e):
                    raise
                sparse_path_failed(runtime, e, [r.q_len for r in step.sparse_rows])
                dense = step.sparse_rows
            else:  # what the layer did, recorded once
                guard_stats(runtime, record_layer, runtime.stats, outcome, runtime.settings.observability.stats_file, timing.sampled)
                dense = outcome.dense_rows
                done = {r.row for r in dense}
                for r in step.sparse_rows:  # their last queries over every key, in place of the sparse output
                    if r.row in step.exact_tails and r.row not in done:
                        n, tail = step.exact_tails[r.row]
                        end = r.tok_start + r.q_len
                        self._dense(layer, query, key, value, kv_cache, tail, slice(end - n, end), output)
                if dense and outcome.paged:
                    runtime.log_once("rows whose budgets or estimated index cover more than max_density=%s of the "
                                     "causal pairs run on FlashAttention (counted in the stats' dense_reasons)",
                                     runtime.settings.gating.max_density, info=True)
        for r in dense:
            self._dense(layer, query, key, value, kv_cache, step.fallback[r.row],
                        slice(r.tok_start, r.tok_start + r.q_len), output, output_scale, output_block_scale)
        return output

    def _sparse(self, layer, query, kv_cache, step: SparseStepMetadata, output, timing) -> LayerOutcome:
        """The step's sparse rows into ``output``; the outcome names the rows left to
        FlashAttention (the density fallback)."""
        runtime, cfg = self.runtime, self.runtime.settings
        heads = layer_heads(self.runtime, self._vllm_config, layer.layer_name, self.num_heads, self.num_kv_heads)
        key_cache, value_cache = self._kv_views(kv_cache)
        softcap = float(self.logits_soft_cap or 0.0)
        kernel = self._triton_kernel()
        # the dense rows above got the query as vLLM passed it (quantized for FlashAttention 3)
        q, k_scale, v_scale = self._sparse_operands(layer, query, output)
        if kernel is not None:
            if self._density_history is None:
                self._density_history = LayerDensityHistory()
            return run_sparse_rows_paged(q, output, step.sparse_rows, key_cache, value_cache, step.block_table,
                                         self._groups(heads, query.device), cfg, self.scale, softcap, kernel, timing,
                                         density_fallback=bool(step.fallback), k_scale=k_scale, v_scale=v_scale,
                                         history=self._density_history, row_table=step.row_table)

        def kv_for_row(r: SparseRow):
            k, v = gather_paged_kv(key_cache, value_cache, step.block_table[r.row], r.ctx_len + r.q_len)
            if k_scale is None:
                return k, v
            return (k.float() * k_scale).to(q.dtype), (v.float() * v_scale).to(q.dtype)  # fp8: dequantised

        return run_sparse_rows(q, output, step.sparse_rows, kv_for_row, heads.heads, cfg, self.scale, softcap,
                               heads.share, timing)

    def _dense(self, layer, query, key, value, kv_cache, metadata, tokens: slice, output, output_scale=None,
               output_block_scale=None) -> None:
        """FlashAttention on the tokens of some rows, with their own metadata."""
        super().forward(layer, query[tokens], None if key is None else key[tokens],
                        None if value is None else value[tokens], kv_cache, metadata, output[tokens],
                        output_scale, output_block_scale)


def decode_state_cost(vllm_config, page_size: int) -> StateCost:
    """The decode state of every attention layer of the model against its KV cache, for pages
    of ``page_size`` tokens: layers of this backend whose decode mode will run hold a state; every
    layer's cache counts (vLLM gives each the same pages)."""
    model_dtype = vllm_config.model_config.dtype
    layouts, kv_bytes_per_page = [], []
    for layer in attention_layers(vllm_config, None).values():
        kv_dtype = kv_cache_torch_dtype(layer.kv_cache_dtype, model_dtype)
        hkv, d = layer.num_kv_heads, layer.head_size
        kv_bytes_per_page.append(2 * page_size * hkv * d * kv_dtype.itemsize)
        decode = layer.impl._decode if isinstance(layer.impl, SparsePrefillImpl) else None
        if decode is not None and decode.needs_state(page_size):
            layouts.append(functools.partial(decode.mode.state_layout, num_kv_heads=hkv, head_size=d,
                                             kv_dtype=kv_dtype))
    return StateCost.of_layers(layouts, kv_bytes_per_page)


class SparsePrefillBackend(FlashBackendVersions, FlashAttentionBackend):
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps get_name() back to the enum member

    @staticmethod
    def get_impl_cls():
        return SparsePrefillImpl

    @staticmethod
    def get_builder_cls():
        return SparsePrefillMetadataBuilder

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """Asked by vLLM only when --block-size is not given: pages of 64 keys on Hopper and
        later, where the kernel loads a 64-key page as one TMA box (setting kv_block_size)."""
        cfg = load_checked_settings()  # a class method: no engine object holds them here
        if cfg.kv_block_size == "auto":
            # decode_mode topk / spans count their budgets in pages measured at vLLM's default
            size = 64 if current_platform.has_device_capability(90) and cfg.decode.mode == "dense" \
                else default_block_size
        else:
            size = int(cfg.kv_block_size)
        return size if cls.supports_block_size(size) else super().get_preferred_block_size(default_block_size)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        # ours, and only where FlashAttention (decode, dense rows) runs it too: fp8 needs FA3 on
        # Hopper (0.26) / FlashAttention's own probe (0.32+)
        return kv_cache_dtype is None or (kv_cache_dtype in cls.supported_kv_cache_dtypes
                                          and super().supports_kv_cache_dtype(kv_cache_dtype))

    @classmethod
    def supports_attn_type(cls, attn_type) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False
