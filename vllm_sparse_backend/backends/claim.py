"""The CUDA impl's side of the profiling-run scratch claim: when to run it, and once per shape.

vLLM's profiling run calls every attention layer's forward with no metadata and sizes the KV
cache from the run's peak memory. There the impl runs the sparse path on the largest steps a
chunk can hold (:func:`..prefill.claim.run_worst_case_steps`: a chunk of
``max_num_batched_tokens`` at the end of ``max_model_len``, as one row and split into the most
sparse rows it can hold), so that the peak includes the path's scratch. Layers of one shape
share a claim. A claim that fails turns the sparse path off for the whole process
(:attr:`..runtime.WorkerRuntime.claim_failed`): sparse rows would then use memory the cache was
sized without.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..prefill.claim import run_worst_case_steps
from ..prefill.estimate import HeadGroups
from ..runtime import WorkerRuntime, logger
from .common import layer_heads


def claim_scratch(runtime: WorkerRuntime, impl, layer, query: torch.Tensor, output: torch.Tensor, vllm_config,
                  kv_dtype: torch.dtype | None) -> None:
    """Run the sparse path on the worst-case steps of this layer's shape, once per process and
    shape. ``impl``: the layer's CUDA impl (heads, scale, soft cap); ``kv_dtype``: an fp8 cache's
    dtype, whose scaled kernel variants then compile here too (None: the query's dtype)."""
    cfg = runtime.settings
    kv_len = vllm_config.model_config.max_model_len
    q_len = min(query.shape[0], vllm_config.scheduler_config.max_num_batched_tokens, kv_len)
    if q_len < cfg.gating.min_sparse_query_len or kv_len < cfg.gating.min_sparse_seq_len:
        return  # no step can hold a sparse row
    heads = layer_heads(runtime, vllm_config, layer.layer_name, impl.num_heads, impl.num_kv_heads)
    groups = HeadGroups.from_heads(heads.heads, query.device, heads.share)
    # the page size serving uses is part of the shape: the kernels specialise on it (with 64-key
    # pages, the TMA variant), so it compiles here rather than in the first request
    signature = (tuple((g.pattern.name, tuple(sorted(g.max_params.items()))) for g in groups.groups), groups.share,
                 q_len, kv_len, impl.num_heads, impl.num_kv_heads, impl.head_size, output.dtype, kv_dtype)
    if signature in runtime.claimed:
        return
    runtime.claimed.add(signature)
    try:
        # (an fp8 layer's query may arrive quantized: the sparse path widens it, as in forward)
        steps = run_worst_case_steps(query[:q_len].to(output.dtype), output[:q_len], impl.num_kv_heads, kv_len,
                                     groups, cfg, impl.scale, float(impl.logits_soft_cap or 0.0),
                                     kernels.sparse_attention.sparse_prefill_attention,
                                     page_size=vllm_config.cache_config.block_size or 16, kv_dtype=kv_dtype)
    except Exception as e:  # noqa: BLE001 - a failed claim must not take the server down
        runtime.claim_failed = f"{type(e).__name__}: {e}"
        logger.exception("sparse-prefill: the profiling run of the sparse path failed; every row will run dense")
        return
    logger.info("sparse-prefill: profiling run included the sparse path's scratch for a %d-token chunk at "
                "%d tokens of context, as 1 to %d sparse rows (%s)", q_len, kv_len, len(steps[-1]), layer.layer_name)
