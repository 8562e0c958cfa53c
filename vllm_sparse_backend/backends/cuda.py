"""CUDA backend: vLLM's FlashAttention for decode and short rows, long prefill rows sparse.

Selected with ``--attention-backend sparse-prefill`` (registered as vLLM's CUSTOM backend).
The builder returns FlashAttention's own metadata whenever no row of the step qualifies, so
decode batches, CUDA-graph capture and drafting are byte-for-byte FlashAttention. Steps with a
long prefill row get :class:`SparsePrefillMetadata`: contiguous runs of the other rows go to
FlashAttention, the long rows to the sparse path, which reads K/V through the paged cache (the
current chunk's K/V were written by vLLM's cache-update op before attention runs).

Decode modes (setting ``decode_mode`` topk / spans) sit behind one interface (``decode.py``): the
builder attaches the mode's plan of a step (spans: its prefill rows' segments; FlashAttention's
metadata then arrives as its subclass ``DecodePlanMetadata``), and the impl's forward makes one
call into the layer's :class:`LayerDecode`, which computes pure decode batches itself.

Sparse rows, Triton path (setting ``kernel`` = auto/triton, where the kernel supports the layer):
indices are estimated on the GPU straight from the paged cache and the block+column kernel reads
K/V through the block table; no gather, no host sync. Rows whose budgets alone are denser than
``max_density`` go to FlashAttention without estimation; rows whose estimated index is denser
are flagged on the GPU and run in the kernel's dense mode. With
``kernel`` = torch (debugging) indices are estimated in PyTorch on K/V gathered out of the cache
and the PyTorch reference computes the rows. With ``auto`` where the Triton path cannot run (no
triton, head size or dtype it lacks) the layers run dense: the reference would be far slower.

fp8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e4m3``, where FlashAttention runs it: FA3 on
Hopper): the sparse path reads the e4m3 cache directly; estimation and kernel widen its tiles to
the model's dtype and apply the layer's ``_k_scale`` / ``_v_scale`` on the device. Where the
layer quantized the query for FlashAttention 3, the sparse rows widen it back and fold
``_q_scale`` into the k scale; the dense rows get it as vLLM passed it.

Memory: the Triton path's scratch (score buffers, index lists; ~0.5 GiB per layer for a 16K
chunk at 128K context, Llama-3-8B shape) is allocated per layer and freed after it. vLLM sizes
the KV cache from the peak memory of its profiling run, whose forward passes carry no metadata;
there the impl runs the sparse path on the largest steps a chunk can hold (a chunk of
``max_num_batched_tokens`` at the end of ``max_model_len``, as one row and split into the most
sparse rows it can hold, whose index lists all live until the kernel), so that peak includes
the scratch.
The builders, which hand each layer its head patterns, only exist after that run: the impl
resolves its own patterns from its layer name and the config current at its construction.
"""

from __future__ import annotations

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)
from vllm_sparse_kernels.reference.attention import gather_paged_kv

from .. import kernels
from .._compat import current_vllm_config, layer_kv_scales, sparse_backend_selected
from ..budgets import budget_density
from ..config import load_settings
from ..paged_estimate import HeadGroups
from ..plan import RankHeads, SparseRow
from ..sparse_prefill import DenseRowHistory, run_sparse_rows, run_sparse_rows_paged, run_worst_case_steps
from ..stats import STATS
from .common import (UNQUANTIZED_KV_CACHE_DTYPES, SparsePrefillMetadata, backend_settings, build_sparse_metadata,
                     check_head_config_fits, count_dense_tokens, group_head_counts, log_once, logger,
                     prepare_group, resolve_layer_heads, unsupported_reason)
from .decode import LayerDecode, decode_mode, with_step_plan

# vLLM's fp8 KV caches the sparse path reads (allocated as bytes; FlashAttention views them as
# e4m3, with per-layer k / v scales). e5m2 is not among them: FlashAttention, which runs decode
# and the dense rows, has no e5m2 path, so vLLM refuses it for this backend at start-up.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}

# Set when the profiling-run scratch claim failed in this process: sparse rows would then use
# memory the KV cache was sized without, so every group runs dense.
_scratch_claim_failed: str | None = None
_scratch_claimed: set = set()  # (head-pattern signature, row shape) already run in this process


class SparsePrefillMetadataBuilder(FlashAttentionMetadataBuilder):
    # Mixed batches containing a sparse row must not replay FULL graphs (FA3 would say ALWAYS).
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    # FA's update_block_table would shallow-copy our wrapper and leave its runs on the old table.
    supports_update_block_table = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # this engine's settings, validated at start-up: a malformed config fails here, naming the field
        self.sparse_settings = cfg = backend_settings()
        # this group's head patterns per layer (None: the group runs dense), handed to the impls in
        # the sparse steps' metadata
        self._layer_heads = prepare_group(vllm_config, layer_names, cfg) \
            if cfg.enabled and sparse_backend_selected(vllm_config) else None
        self.sparse_enabled = self._layer_heads is not None
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            log_once("decode context parallelism is not supported; every row runs dense")
            self.sparse_enabled = False
        if self.sparse_enabled and _scratch_claim_failed is not None:
            log_once("the sparse path could not run in the memory-profiling run (%s); every row runs dense",
                     _scratch_claim_failed)
            self.sparse_enabled = False
        if self.sparse_enabled and cfg.kernel != "torch":
            # the model's dtype: the cache's (kv_cache_spec.dtype) is uint8 for an fp8 cache
            why = triton_unusable_reason(kv_cache_spec.head_size, vllm_config.model_config.dtype, cfg.block_size)
            if why is not None and cfg.kernel == "triton":
                raise RuntimeError(f"sparse-prefill: kernel=triton requested but not usable: {why}")
            if why is not None:  # auto: the reference would be far slower than FlashAttention
                log_once("the Triton sparse path cannot run here (%s); every row runs dense", why)
                self.sparse_enabled = False
        # decode_mode topk / spans: the mode plans each step once for every layer of the group
        self._decode_mode = decode_mode(cfg) if sparse_backend_selected(vllm_config) else None
        # Rows that no layer's budgets could make sparser than max_density stay in FlashAttention's
        # runs (short long rows, mostly): no estimation, no per-row fallback.
        self._worth_estimating = None
        if self.sparse_enabled and cfg.max_density < 1.0:
            head_sets = group_head_counts(self._layer_heads)
            self._worth_estimating = lambda q_len, ctx_len: any(
                budget_density(h, q_len, ctx_len, cfg) <= cfg.max_density for h in head_sets)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return cls._cudagraph_support

    def use_cascade_attention(self, *args, **kwargs) -> bool:  # 0.26 only; keeps rows independent
        return False

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = None
        if self.sparse_enabled:
            # Only the first dense run may use FA3's ahead-of-time scheduler: a second build()
            # would overwrite the persistent scheduler buffer the first run's metadata points at.
            md = build_sparse_metadata(
                common_attn_metadata, self.sparse_settings, self._layer_heads, allow_context=True,
                dense_build=lambda sub, first: super(SparsePrefillMetadataBuilder, self).build(
                    0, sub, fast_build or not first),
                with_fallback=self.sparse_settings.max_density < 1.0, worth_estimating=self._worth_estimating)
        if md is None:
            md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        return with_step_plan(self._decode_mode, md, common_attn_metadata, self.kv_cache_spec.block_size, self.device)


def triton_unusable_reason(head_size: int, dtype, block_size: int) -> str | None:
    """Why the Triton sparse path cannot run a layer of this geometry, or None. ``dtype``: the
    model's (the queries'); the KV cache may also be fp8 (FP8_KV_CACHE_DTYPES)."""
    if head_size not in (64, 128) or dtype not in (torch.float16, torch.bfloat16):
        return f"head size {head_size} / dtype {dtype}"
    if block_size != 64:
        return f"block_size {block_size}"
    return kernels.UNAVAILABLE


class SparsePrefillImpl(FlashAttentionImpl):
    supports_dcp = False  # 0.26's default is True
    sparse_kv_cache_dtypes = UNQUANTIZED_KV_CACHE_DTYPES + tuple(FP8_KV_CACHE_DTYPES)  # (common.unsupported_reason)
    _use_triton: bool | None = None  # decided on the first sparse forward, logged once
    _head_groups: HeadGroups | None = None  # this layer's heads by pattern, on the device (first sparse forward)
    _decode: LayerDecode | None = None  # decode_mode topk / spans: this layer's (None: FlashAttention decodes)
    # estimated_dense_rows="auto": whether this layer's last sparse call had too-dense rows (first sparse forward)
    _dense_rows: DenseRowHistory | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # this engine's settings (vLLM builds this impl only where the backend is selected)
        self.sparse_settings = backend_settings()
        mode = decode_mode(self.sparse_settings)
        self._decode = None if mode is None else LayerDecode(mode, self._decode_unsupported_reason())
        # Only the profiling-run claim needs these; the builders get the config from vLLM.
        self._vllm_config = current_vllm_config()
        # Layers are built before the weights load: the earliest point the worker knows the model.
        if self._vllm_config is not None and sparse_backend_selected(self._vllm_config):
            check_head_config_fits(self._vllm_config, self.sparse_settings)

    def _claim_scratch(self, layer, query: torch.Tensor, output: torch.Tensor) -> None:
        """Profiling run (no metadata): run the sparse path on the largest steps a chunk can hold
        (one row of the whole chunk, and the chunk split into several rows), so that vLLM's
        peak-memory measurement, which sizes the KV cache, sees its scratch.
        Once per process and head-pattern signature (layers with the same patterns share it)."""
        global _scratch_claim_failed
        vc, cfg = self._vllm_config, self.sparse_settings
        if (vc is None or _scratch_claim_failed is not None or not query.is_cuda or not cfg.enabled
                or cfg.kernel == "torch" or not sparse_backend_selected(vc)
                or unsupported_reason(self) is not None
                or triton_unusable_reason(self.head_size, output.dtype, cfg.block_size) is not None):
            return
        kv_len = vc.model_config.max_model_len
        q_len = min(query.shape[0], vc.scheduler_config.max_num_batched_tokens, kv_len)
        if q_len < cfg.min_sparse_query_len or kv_len < cfg.min_sparse_seq_len:
            return  # no step can hold a sparse row
        heads = resolve_layer_heads(vc, cfg, layer.layer_name, self.num_heads, self.num_kv_heads)
        groups = HeadGroups.from_heads(heads.heads, query.device, heads.share)
        # an fp8 layer's kernel variants, and the page size serving uses (the kernels specialise on
        # it: with 64-key pages the TMA variant), compile here rather than in the first request
        kv_dtype = FP8_KV_CACHE_DTYPES.get(self.kv_cache_dtype)
        signature = (tuple((g.pattern, tuple(sorted(g.max_params.items()))) for g in groups.groups), groups.share,
                     q_len, kv_len, self.num_heads, self.num_kv_heads, self.head_size, output.dtype, kv_dtype)
        if signature in _scratch_claimed:
            return
        _scratch_claimed.add(signature)
        attention = kernels.sparse_attention.sparse_prefill_attention
        try:
            # (an fp8 layer's query may arrive quantized: the sparse path widens it, as in forward)
            steps = run_worst_case_steps(query[:q_len].to(output.dtype), output[:q_len], self.num_kv_heads, kv_len,
                                         groups, cfg, self.scale, float(self.logits_soft_cap or 0.0), attention,
                                         page_size=vc.cache_config.block_size or 16, kv_dtype=kv_dtype)
        except Exception as e:  # noqa: BLE001 - a failed claim must not take the server down
            _scratch_claim_failed = f"{type(e).__name__}: {e}"
            logger.exception("sparse-prefill: the profiling run of the sparse path failed; every row will run "
                             "dense")
            return
        logger.info("sparse-prefill: profiling run included the sparse path's scratch for a %d-token chunk at "
                    "%d tokens of context, as 1 to %d sparse rows (%s)", q_len, kv_len, len(steps[-1]),
                    layer.layer_name)

    def _groups(self, heads: RankHeads, device) -> HeadGroups:
        """``heads``: this layer's, from the step's metadata (the same every step)."""
        if self._head_groups is None:
            cfg = self.sparse_settings
            share = heads.share
            if cfg.kv_group_shared and share == 1 and self.num_heads != self.num_kv_heads:
                log_once("kv_group_shared: layers whose KV groups mix patterns or budgets, or have FlexPrefill "
                         "heads, keep one selection per query head")
            self._head_groups = HeadGroups.from_heads(heads.heads, device, share)
        return self._head_groups

    def _triton_kernel(self, query):
        """The Triton kernel's entry point unless kernel=torch. The builder has already checked at
        start-up that the Triton path can run this group (kernel=triton fails there otherwise,
        auto keeps the group dense), so the impl only follows the setting."""
        if self._use_triton is None:
            self._use_triton = self.sparse_settings.kernel != "torch"
            if not self._use_triton:
                log_once("sparse rows use the PyTorch reference attention: kernel=torch")
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

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        cfg = self.sparse_settings
        if cfg.stats_file and query.is_cuda and not torch.cuda.is_current_stream_capturing():
            STATS.refresh(cfg.stats_file)  # counts of earlier forwards the GPU has finished
        if attn_metadata is None:  # vLLM's profiling run: count the sparse scratch in its peak
            self._claim_scratch(layer, query, output)
        elif self._decode is not None and self._decode.active and output_scale is None:
            if self._decode.forward(query, key, *self._kv_views(kv_cache), attn_metadata, self.scale, output):
                return output  # a pure decode batch, computed by the decode mode
        if not isinstance(attn_metadata, SparsePrefillMetadata):  # None (profiling) or plain FA
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("sparse-prefill: fused output quantization is not supported")
        for run in attn_metadata.dense_runs:  # FA slices by its metadata's num_actual_tokens
            s = slice(run.tok_start, run.tok_end)
            super().forward(layer, query[s], None if key is None else key[s],
                            None if value is None else value[s], kv_cache, run.metadata, output[s])
        count_dense_tokens(attn_metadata)
        heads = attn_metadata.layer_heads[layer.layer_name]
        key_cache, value_cache = self._kv_views(kv_cache)
        block_table = attn_metadata.block_table
        softcap = float(self.logits_soft_cap or 0.0)
        kernel = self._triton_kernel(query)
        # the dense rows above got the query as vLLM passed it (quantized for FlashAttention 3)
        q, k_scale, v_scale = self._sparse_operands(layer, query, output)
        if kernel is not None:
            if self._dense_rows is None:
                self._dense_rows = DenseRowHistory()

            def dense_row(r: SparseRow) -> None:
                log_once("rows whose budgets cover more than max_density=%s of the causal pairs run on "
                         "FlashAttention (counted in the stats' dense_reasons)", cfg.max_density)
                s = slice(r.tok_start, r.tok_start + r.q_len)
                super(SparsePrefillImpl, self).forward(
                    layer, query[s], None if key is None else key[s], None if value is None else value[s],
                    kv_cache, attn_metadata.fallback[r.row], output[s])

            run_sparse_rows_paged(q, output, attn_metadata.sparse_rows, key_cache, value_cache, block_table,
                                  self._groups(heads, query.device), cfg, self.scale, softcap, kernel,
                                  dense_row if attn_metadata.fallback else None, k_scale, v_scale,
                                  self._dense_rows)
            return output

        def kv_for_row(r: SparseRow):
            k, v = gather_paged_kv(key_cache, value_cache, block_table[r.row], r.ctx_len + r.q_len)
            if k_scale is None:
                return k, v
            return (k.float() * k_scale).to(q.dtype), (v.float() * v_scale).to(q.dtype)  # fp8: dequantised

        run_sparse_rows(q, output, attn_metadata.sparse_rows, kv_for_row, heads.heads, cfg, self.scale, softcap,
                        heads.share)
        return output


class SparsePrefillBackend(FlashAttentionBackend):
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES]
    supports_kv_cache_update_bypass = False  # 0.33: forward always receives key/value

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
        cfg = load_settings()  # a class method: no engine object holds them here
        if cfg.kv_block_size == "auto":
            # decode_mode topk / spans count their budgets in pages measured at vLLM's default
            size = 64 if current_platform.has_device_capability(90) and cfg.decode_mode == "dense" \
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

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # 0.32+: the builder cuts a step into row runs at the host's query_start_loc_cpu, which
        # adaptive verification (speculative decoding) leaves stale when it trims drafts on the
        # device; vLLM then refuses this backend at start-up instead
        return False
