"""Run by tests/backend/test_vllm_versions.py in a subprocess whose sys.path starts with one vLLM release's
Python sources: registers the plugin, builds the CUDA backend's attention layers and metadata
builder with that release's own classes (VllmConfig, Attention, FlashAttention's builder,
CommonAttentionMetadata) and builds the metadata of one mixed step. Prints one JSON line; the test
asserts on it. Nothing here needs a GPU: FlashAttention's kernels are never called.

Not collected by pytest (leading underscore); usable by hand:
    PYTHONPATH=<vllm tree>:<repo> python tests/_vllm_classes_driver.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

# Settings the step below is sized for (read once by the backend, so set before it is imported).
os.environ.update({
    "VLLM_SPARSE_KERNEL": "torch",  # the builder would keep every row dense where Triton is missing
    "VLLM_SPARSE_MIN_SPARSE_QUERY_LEN": "256",
    "VLLM_SPARSE_VERTICAL_SIZE": "16", "VLLM_SPARSE_SLASH_SIZE": "16",  # budgets well under max_density
    "VLLM_SPARSE_KEEP_FIRST_COLUMNS": "4", "VLLM_SPARSE_KEEP_LAST_DIAGONALS": "4",
    # rows of a few hundred tokens: the cost model would keep them all in FlashAttention's runs
    # (tests/unit/test_plan.py); this step is about how sparse and dense rows are split
    "VLLM_SPARSE_COST_MODEL": "0",
})
for key in ("VLLM_SPARSE_CONFIG", "VLLM_SPARSE_HEAD_CONFIG", "VLLM_SPARSE_DECODE_MODE", "VLLM_SPARSE_ENABLED",
            "VLLM_SPARSE_MAX_DENSITY", "VLLM_SPARSE_STATS_FILE", "VLLM_SPARSE_METRICS_PORT"):
    os.environ.pop(key, None)

BLOCK = 16
# (query tokens, sequence length as the device sees it, host upper bound): decodes first, as
# vLLM's runners order a batch. Row 1 is an async speculative decode whose host bound is
# optimistic; row 2 a prefill chunk with 400 tokens of context; row 4 a whole prompt; row 5 a
# cudagraph padding row.
ROWS = [(1, 40, 40), (1, 100, 103), (300, 700, 700), (20, 20, 20), (260, 260, 260), (0, 0, 0)]
PADDED_TOKENS = 8  # tokens after the last row's (cudagraph padding)


def _tiny_llama(folder: str) -> str:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 8192,
              "rms_norm_eps": 1e-5, "torch_dtype": "float16"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def _step(torch, CommonAttentionMetadata):
    q_lens = [q for q, _, _ in ROWS]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    n, tokens = len(ROWS), qsl[-1] + PADDED_TOKENS
    pages = max(-(-max(ub, 1) // BLOCK) for _, _, ub in ROWS)
    table = torch.arange(n * pages, dtype=torch.int32).view(n, pages)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl_t.clone(), query_start_loc_cpu=qsl_t,
        seq_lens=torch.tensor([s for _, s, _ in ROWS], dtype=torch.int32),
        num_reqs=n, num_actual_tokens=tokens, max_query_len=max(q_lens),
        max_seq_len=max(ub for _, _, ub in ROWS), block_table_tensor=table,
        slot_mapping=torch.arange(tokens, dtype=torch.int64) + 1000,
        seq_lens_cpu_upper_bound=torch.tensor([ub for _, _, ub in ROWS], dtype=torch.int32),
        is_prefilling=torch.tensor([q > 1 for q in q_lens]))


def _fa(md) -> dict:
    """The fields of FlashAttention's metadata the dense runs hand to its kernel."""
    return {"type": type(md).__qualname__, "module": type(md).__module__,
            "num_actual_tokens": md.num_actual_tokens, "max_query_len": md.max_query_len,
            "max_seq_len": md.max_seq_len, "query_start_loc": md.query_start_loc.tolist(),
            "seq_lens": md.seq_lens.tolist(), "block_table_rows": md.block_table[:, 0].tolist(),
            "slots": [int(md.slot_mapping[0]), int(md.slot_mapping[-1]), len(md.slot_mapping)]}


def main() -> dict:
    import torch
    import vllm

    out: dict = {"vllm_version": vllm.__version__, "vllm_file": vllm.__file__}

    # Registration, as every vLLM process does it first.
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    members_before = [m.name for m in E]
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.config.attention import AttentionConfig
    out["spellings"] = {s: AttentionConfig.validate_backend_before(s).name
                        for s in ("sparse-prefill", "sparse_prefill", "custom")}
    out["custom_path"] = E.CUSTOM.get_path()
    out["cpu_attn_path"] = E.CPU_ATTN.get_path()
    out["members_unchanged"] = [m.name for m in E] == members_before

    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata

    from vllm_sparse_backend.backends.common import SparseStepMetadata
    from vllm_sparse_backend.backends.cuda import SparsePrefillBackend

    model = ModelConfig(model=_tiny_llama(tempfile.mkdtemp()), skip_tokenizer_init=True, dtype="float16",
                        max_model_len=8192)
    config = VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"),
                        cache_config=CacheConfig(block_size=BLOCK),
                        attention_config=AttentionConfig(backend="sparse-prefill"))
    with set_current_vllm_config(config):
        layers = [Attention(4, 64, 0.125, num_kv_heads=2, cache_config=config.cache_config,
                            prefix=f"model.layers.{i}.self_attn.attn", attn_backend=SparsePrefillBackend)
                  for i in range(2)]
    out["impl"] = type(layers[0].impl).__qualname__
    spec = layers[0].get_kv_cache_spec(config)
    builder = SparsePrefillBackend.get_builder_cls()(spec, [x.layer_name for x in layers], config,
                                                     torch.device("cpu"))
    out["sparse_enabled"] = builder.sparse_enabled
    out["cudagraph_support"] = builder.get_cudagraph_support(config, spec).name
    out["uniform_batch"] = AttentionCGSupport.UNIFORM_BATCH.name

    # vLLM's tokens per step (gating.exact_prompt_end), as the builder read it from the config, and
    # from that release's SchedulerConfig alone, with and without a smaller max_num_scheduled_tokens
    from types import SimpleNamespace

    from vllm.config import SchedulerConfig

    from vllm_sparse_backend._compat import step_token_budget
    sched = config.scheduler_config
    out["step_token_budget"] = {
        "builder": builder._step_token_budget,
        "config": [sched.max_num_scheduled_tokens, sched.max_num_batched_tokens],
        "given": [step_token_budget(SimpleNamespace(scheduler_config=SchedulerConfig(
            max_model_len=8192, is_encoder_decoder=False, max_num_batched_tokens=8192, **extra)))
            for extra in ({}, {"max_num_scheduled_tokens": 6000})]}

    cm = _step(torch, CommonAttentionMetadata)
    md = builder.build(0, cm)
    out["metadata_type"] = type(md).__qualname__
    if isinstance(md, SparseStepMetadata):
        out["num_actual_tokens"] = md.num_actual_tokens
        # each layer's heads, resolved once for the worker and looked up by the layer's name
        out["heads_given_to_layers"] = [len(builder.runtime.layer_heads[x.layer_name].heads) for x in layers]
        out["sparse_rows"] = [[r.row, r.tok_start, r.q_len, r.ctx_len] for r in md.sparse_rows]
        out["dense_runs"] = [{"tokens": [run.tok_start, run.tok_end], **_fa(run.metadata)} for run in md.dense_runs]
        out["fallback"] = {str(row): _fa(m) for row, m in sorted(md.fallback.items())}

    # A step of decodes only: FlashAttention's own metadata, untouched.
    decodes = CommonAttentionMetadata(
        query_start_loc=cm.query_start_loc[:3], query_start_loc_cpu=cm.query_start_loc_cpu[:3],
        seq_lens=cm.seq_lens[:2], num_reqs=2, num_actual_tokens=2, max_query_len=1, max_seq_len=103,
        block_table_tensor=cm.block_table_tensor[:2], slot_mapping=cm.slot_mapping[:2],
        seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound[:2], is_prefilling=cm.is_prefilling[:2])
    out["decode_only"] = _fa(builder.build(0, decodes))

    # Backend hooks that differ between releases (absent ones reported as None).
    def hook(name, *args):
        fn = getattr(SparsePrefillBackend, name, None)
        return None if fn is None else fn(*args)

    out["query_lens_mismatch_ok"] = hook("supports_device_cpu_query_lens_mismatch")
    # what vLLM's CUDA platform asks of a backend selected by name (it raises on any reason)
    import inspect

    from vllm.platforms.interface import DeviceCapability
    params = inspect.signature(SparsePrefillBackend.validate_configuration).parameters
    question = dict(head_size=64, dtype=torch.float16, kv_cache_dtype="auto", block_size=BLOCK, use_mla=False,
                    has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                    device_capability=DeviceCapability(9, 0), attn_type="decoder")
    out["refusals"] = SparsePrefillBackend.validate_configuration(**question)
    out["refusals_adaptive_verification"] = (
        SparsePrefillBackend.validate_configuration(**question, use_adaptive_verification=True)
        if "use_adaptive_verification" in params else None)
    out["backend_supports_dcp"] = hook("supports_dcp")
    out["impl_supports_dcp"] = SparsePrefillBackend.get_impl_cls().supports_dcp
    out["kv_cache_update_bypass"] = getattr(SparsePrefillBackend, "supports_kv_cache_update_bypass", None)
    out["preferred_block_size"] = SparsePrefillBackend.get_preferred_block_size(16)
    return out


if __name__ == "__main__":
    print("DRIVER-RESULT " + json.dumps(main()))
    sys.stdout.flush()
