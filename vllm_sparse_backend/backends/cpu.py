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

from .. import kernels
from .._compat import current_vllm_config, slice_rows, sparse_backend_selected, step_token_budget
from ..observability.record import record_layer
from ..prefill.run import run_sparse_rows
from ..runtime import worker_runtime
from ..prefill.route import group_dense_reason
from .host_kv import HostKV, check_vllm_cache_fits
from .common import (DenseRun, SparseStepMetadata, check_head_config_fits_model, count_dense_tokens,
                     distinct_head_sets, first_unsupported_layer, guard_stats, layer_heads, log_dense_group,
                     long_query_lens, plan_sparse_step, recoverable, resolve_group_heads, sparse_path_failed)


class SparsePrefillCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    _head_sets = None  # the group's head sets for the max_density gate (None: no gate)
    _step_token_budget: int | None = None  # the scheduler's tokens per step (None: unknown)

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.sparse_enabled = False
        self.runtime = None  # only where the sparse backend is selected (else this is vLLM's CPU_ATTN)
        if sparse_backend_selected(vllm_config):
            self.runtime = runtime = worker_runtime()  # settings read and validated: a bad one fails at start-up
            self._step_token_budget = step_token_budget(vllm_config)  # which chunks end their prompt (route.cut_row)
            cfg = runtime.settings
            unsupported = None
            if self.is_cross_attention or self.is_encoder_only_attention or self.window_size != -1:
                unsupported = ("non-decoder or sliding-window attention", "")
            elif cfg.gating.enabled:
                unsupported = first_unsupported_layer(vllm_config, layer_names)
            why = group_dense_reason(cfg, unsupported=unsupported and unsupported[0])
            if why is not None:
                log_dense_group(runtime, why, unsupported[1] if unsupported else "")
            else:
                layer_heads_of_group = resolve_group_heads(runtime, vllm_config, layer_names)
                self.sparse_enabled = True
                # rows no layer's budgets could make sparser than max_density (every key, on short
                # prompts with the default budgets) stay on vLLM's CPU kernel, far faster than the
                # PyTorch attention of the sparse path
                if self.sparse_enabled and cfg.gating.max_density < 1.0:
                    self._head_sets = distinct_head_sets(layer_heads_of_group)
            if cfg.kv_placement == "host":
                runtime.log_once("kv_placement=host on the CPU twin: pure decode steps run decode_mode=topk over "
                                 "the host pool (the top-k kernels, under Triton's interpreter on CPU); prefill stays "
                                 "on vLLM's CPU kernel, which reads vLLM's full page", info=True)
                check_vllm_cache_fits(cfg, vllm_config, kv_cache_spec)  # vLLM has sized its cache: before any request
            elif cfg.decode.mode != "dense":
                runtime.log_once("decode_mode=%s needs the CUDA backend (the CPU cache is not readable from Python); "
                                 "decode stays dense", cfg.decode.mode)
            if self.sparse_enabled:
                runtime.log_once("CPU twin active: pure prefills of >= %d tokens run sparse (default pattern %s); "
                                 "vLLM's 'Cannot use AttentionBackendEnum.CUSTOM backend on CPU' is expected: its CPU "
                                 "platform always picks CPU_ATTN, which this plugin replaces with the CPU twin",
                                 cfg.gating.min_sparse_query_len, cfg.default_pattern, info=True)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        try:
            planned = plan_sparse_step(self.runtime, cm, allow_context=False, head_sets=self._head_sets,
                                       step_token_budget=self._step_token_budget) if self.sparse_enabled else None
        except Exception as e:  # noqa: BLE001 - a planning error sends the step to the CPU kernel
            if not recoverable(e):
                raise
            sparse_path_failed(self.runtime, e, long_query_lens(self.runtime, cm))
            planned = None
        if planned is None:
            return super().build(common_prefix_len, cm, fast_build)
        plan, qsl, seq_lens = planned
        try:
            runs = []
            for a, b in plan.dense_runs:
                runs.append(DenseRun(qsl[a], qsl[b], super().build(0, slice_rows(cm, a, b, seq_lens), fast_build)))
            # each sparse row alone, for the CPU kernel should the sparse path fail
            fallback = {r.row: self._row_metadata(cm, r.row, seq_lens, fast_build) for r in plan.sparse_rows}
        except Exception as e:  # noqa: BLE001 - the step then runs on the CPU kernel whole
            if not recoverable(e):
                raise
            sparse_path_failed(self.runtime, e, [r.q_len for r in plan.sparse_rows])
            return super().build(common_prefix_len, cm, fast_build)
        return SparseStepMetadata(cm.num_actual_tokens, cm.max_query_len, runs, plan.sparse_rows,
                                  cm.block_table_tensor, cm.slot_mapping, fallback)

    def _row_metadata(self, cm, row: int, seq_lens: list[int], fast_build: bool):
        return super().build(0, slice_rows(cm, row, row + 1, seq_lens), fast_build)


class SparsePrefillCPUImpl(CPUAttentionBackendImpl):
    runtime = None  # only where the sparse backend is selected (else this is vLLM's CPU_ATTN)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Layers are built before the weights load: the earliest point the worker knows the model.
        vllm_config = current_vllm_config()
        self._vllm_config = vllm_config
        if vllm_config is not None and sparse_backend_selected(vllm_config):
            self.runtime = worker_runtime()
            check_head_config_fits_model(self.runtime, vllm_config)

    def _host_placement(self) -> HostKV | None:
        """kv_placement=host: the worker's host placement (None: off, or its kernels cannot run
        here, logged once). vLLM's CPU page stays whole (vLLM's CPU kernel reads it for prefill),
        so the summaries live beside it; on CPU host and device memory are one, so this path is
        there to run the placement's logic in a real server."""
        runtime = self.runtime
        if runtime is None or runtime.settings.kv_placement != "host":
            return None
        if runtime.host_kv is None:
            if kernels.UNAVAILABLE:
                runtime.log_once("kv_placement=host: the top-k decode kernels cannot run here (%s); decode stays "
                                 "dense on vLLM's CPU kernel", kernels.UNAVAILABLE)
                return None
            runtime.host_kv = HostKV.for_vllm(runtime.settings, self._vllm_config, summaries_in_page=False)
        return runtime.host_kv

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        host_kv = self._host_placement()
        if host_kv is not None:
            host_kv.write(layer.layer_name, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is not None and getattr(attn_metadata, "max_query_len", 0) == 1 and output_scale is None:
            host_kv = self._host_placement()
            if host_kv is not None and host_kv.placement is not None:  # a pure decode step
                self.runtime.log_once("kv_placement=host: decode steps read the host pool", info=True)
                n = attn_metadata.num_actual_tokens
                host_kv.decode(layer.layer_name, query[:n], kv_cache, attn_metadata.block_table[:n],
                               attn_metadata.seq_lens[:n], self.scale, output[:n], attn_metadata)
                return output
        if not isinstance(attn_metadata, SparseStepMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        for run in attn_metadata.dense_runs:
            s = slice(run.tok_start, run.tok_end)
            super().forward(layer, query[s], key[s], value[s], kv_cache, run.metadata, output[s],
                            output_scale, output_block_scale)
        runtime = self.runtime
        count_dense_tokens(runtime, attn_metadata)
        timing = runtime.stats.time_stages(query.device)  # a no-op unless this forward is sampled
        try:
            heads = layer_heads(runtime, self._vllm_config, layer.layer_name, self.num_heads, self.num_kv_heads)
            # Pure prefills only (planned with allow_context=False): the chunk's fresh K/V are all keys.
            outcome = run_sparse_rows(query, output, attn_metadata.sparse_rows,
                                      lambda r: (key[r.tok_start:r.tok_start + r.q_len],
                                                 value[r.tok_start:r.tok_start + r.q_len]),
                                      heads.heads, runtime.settings, self.scale, float(self.logits_soft_cap or 0.0),
                                      heads.share, timing)
        except Exception as e:  # noqa: BLE001 - the error boundary of the sparse path
            if not recoverable(e):
                raise
            sparse_path_failed(runtime, e, [r.q_len for r in attn_metadata.sparse_rows])
            for r in attn_metadata.sparse_rows:
                s = slice(r.tok_start, r.tok_start + r.q_len)
                super().forward(layer, query[s], key[s], value[s], kv_cache, attn_metadata.fallback[r.row], output[s],
                                output_scale, output_block_scale)
        else:  # what the layer did, recorded once
            guard_stats(runtime, record_layer, runtime.stats, outcome, runtime.settings.observability.stats_file, timing.sampled)
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
