"""The CPU twin: vLLM's CPU_ATTN backend with long pure prefills computed sparse in PyTorch.

vLLM's CPU platform ignores --attention-backend and always resolves CPU_ATTN, so the plugin
overrides CPU_ATTN with these classes; they behave exactly like vLLM's CPU backend unless the
engine was started with --attention-backend sparse-prefill.

The CPU paged cache holds ISA-specific packed tiles that are not readable from Python, so only
rows without cached context (whole prompts in one chunk, no prefix-cache hit) go sparse, using
the fresh K/V of the step; rows with context stay on the CPU kernel (counted as a dense reason).
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from .._compat import current_vllm_config, sparse_backend_selected
from ..prefill.run import run_sparse_rows
from .common import (SparsePrefillMetadata, backend_settings, build_sparse_metadata, check_head_config_fits,
                     count_dense_tokens, log_once, prepare_group)


class SparsePrefillCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.sparse_enabled = False
        self._layer_heads = None
        self.sparse_settings = None  # read only where the sparse backend is selected (else this is vLLM's CPU_ATTN)
        if sparse_backend_selected(vllm_config):
            self.sparse_settings = cfg = backend_settings()  # read and validated here: a bad config fails at start-up
            if not cfg.enabled:
                log_once("disabled by VLLM_SPARSE_ENABLED; every row runs dense")
            elif self.is_cross_attention or self.is_encoder_only_attention or self.window_size != -1:
                log_once("non-decoder or sliding-window layer group runs dense")
            else:
                # this group's head patterns per layer (None: it runs dense), handed to the impls in
                # the sparse steps' metadata
                self._layer_heads = prepare_group(vllm_config, layer_names, cfg)
                self.sparse_enabled = self._layer_heads is not None
            if cfg.decode_mode != "dense":
                log_once("decode_mode=%s needs the CUDA backend (the CPU cache is not readable from Python); "
                         "decode stays dense", cfg.decode_mode)
            if self.sparse_enabled:
                log_once("CPU twin active: pure prefills of >= %d tokens run sparse (default pattern %s); vLLM's "
                         "'Cannot use AttentionBackendEnum.CUSTOM backend on CPU' is expected: its CPU platform "
                         "always picks CPU_ATTN, which this plugin replaces with the CPU twin",
                         cfg.min_sparse_query_len, cfg.default_pattern)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        if self.sparse_enabled:
            md = build_sparse_metadata(
                common_attn_metadata, self.sparse_settings, self._layer_heads, allow_context=False,
                dense_build=lambda sub, first: super(SparsePrefillCPUMetadataBuilder, self).build(0, sub, fast_build))
            if md is not None:
                return md
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class SparsePrefillCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Layers are built before the weights load: the earliest point the worker knows the model.
        vllm_config = current_vllm_config()
        self.sparse_settings = None  # read only where the sparse backend is selected (else this is vLLM's CPU_ATTN)
        if vllm_config is not None and sparse_backend_selected(vllm_config):
            self.sparse_settings = backend_settings()
            check_head_config_fits(vllm_config, self.sparse_settings)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if not isinstance(attn_metadata, SparsePrefillMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        for run in attn_metadata.dense_runs:
            s = slice(run.tok_start, run.tok_end)
            super().forward(layer, query[s], key[s], value[s], kv_cache, run.metadata, output[s],
                            output_scale, output_block_scale)
        count_dense_tokens(attn_metadata)
        heads = attn_metadata.layer_heads[layer.layer_name]
        # Pure prefills only (planned with allow_context=False): the chunk's fresh K/V are all keys.
        run_sparse_rows(query, output, attn_metadata.sparse_rows,
                        lambda r: (key[r.tok_start:r.tok_start + r.q_len], value[r.tok_start:r.tok_start + r.q_len]),
                        heads.heads, self.sparse_settings, self.scale, float(self.logits_soft_cap or 0.0), heads.share)
        return output


class SparsePrefillCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # vLLM maps get_name() back to the enum member

    @staticmethod
    def get_impl_cls():
        return SparsePrefillCPUImpl

    @staticmethod
    def get_builder_cls():
        return SparsePrefillCPUMetadataBuilder
