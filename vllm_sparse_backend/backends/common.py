"""What the CUDA and CPU backends share: per-step metadata, per-layer head patterns, fallbacks.

vLLM glue only: no attention math here (that lives in patterns/, reference.py, sparse_prefill_kernels/).
"""

from __future__ import annotations

import functools
from collections import Counter
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..config import ConfigError, SparseSettings, load_settings
from ..head_configs import HeadConfigFile, ModelShape, check_fits_model, model_shape_from_hf_config, resolve_head_config
from ..prefill.plan import RankHeads, SparseRow, plan_step, rank_heads
from ..stats import STATS

logger = logging.getLogger("vllm.sparse_prefill")


@dataclass
class DenseRun:
    tok_start: int
    tok_end: int
    metadata: Any  # the wrapped backend's own metadata for rows of this run


@dataclass
class SparsePrefillMetadata:
    """Step metadata when at least one row runs sparse; otherwise builders return plain vLLM
    metadata, so decode and short prompts are untouched (and keep their CUDA graphs)."""

    num_actual_tokens: int
    max_query_len: int
    dense_runs: list[DenseRun]
    sparse_rows: list[SparseRow]
    block_table: Any = None  # [num_reqs, max_pages] of the whole step (sparse rows index it by row)
    # row index -> the wrapped backend's metadata for that row alone, so the impl can still send
    # a sparse row to the dense kernel when its estimated index turns out too dense
    fallback: dict[int, Any] = field(default_factory=dict)
    slot_mapping: Any = None  # [num_tokens] cache slots the step wrote (the decode modes' state follows them)
    # layer name -> that layer's head patterns on this rank, resolved by the builder at start-up
    # (prepare_group) for every layer of its group; the impl looks its own up by its layer's name
    layer_heads: Mapping[str, RankHeads] = field(default_factory=dict)
    decode_plan: Any = None  # decode_mode spans: the step's plan (backends/decode.py); the prefill path ignores it


def backend_settings() -> SparseSettings:
    """The settings of one backend object of this engine (a metadata builder or an attention
    impl), read from the environment when it is constructed, so that a malformed value fails at
    start-up naming the field. The object keeps them and hands them down (plan, estimate, kernel
    launch); every builder and impl of a worker reads the same environment, so they hold equal
    settings. Also applies them to this worker's stats: timing sample rate, metrics (and their
    own port); under tensor parallelism only rank 0 records and exports (see
    SparseStats.configure, which applying again leaves as it is)."""
    cfg = load_settings()
    STATS.configure(cfg, export=tensor_parallel_rank() == 0)
    return cfg


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed vLLM worker)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


@functools.lru_cache(maxsize=8)
def _head_config(spec: str) -> HeadConfigFile:
    """A path, or the name of a file shipped in head_configs/ (without .json); read once per
    process and name (every layer of every group asks)."""
    return resolve_head_config(spec)


def head_config(settings: SparseSettings) -> HeadConfigFile | None:
    return _head_config(settings.head_config) if settings.head_config else None


@functools.lru_cache(maxsize=8)
def _check_fit(spec: str, shape: ModelShape) -> None:
    check_fits_model(_head_config(spec), shape, spec)


def check_head_config_fits(vllm_config, cfg: SparseSettings) -> None:
    """Called where the worker first sees the model (its attention layers being built, before
    the weights load): the head-config file the settings name must have the model's layer and
    head counts and KV-group layout (ConfigError naming the file and field). Checked once per
    process, file and model."""
    model_config = getattr(vllm_config, "model_config", None)
    if not cfg.head_config or model_config is None:
        return
    hf = model_config.hf_text_config
    _check_fit(cfg.head_config, model_shape_from_hf_config(hf.to_dict(), f"model {model_config.model}"))


_logged: set[str] = set()


def log_once(msg: str, *args) -> None:
    key = msg % args if args else msg
    if key not in _logged:
        _logged.add(key)
        logger.warning("sparse-prefill: " + msg, *args)


def unsupported_reason(impl) -> str | None:
    """Why this layer cannot run sparse (it then runs the wrapped dense kernel), or None."""
    from vllm.v1.attention.backend import AttentionType

    if getattr(impl, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
        return f"attention type {impl.attn_type}"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        return f"sliding window {window}"
    if getattr(impl, "kv_sharing_target_layer_name", None):
        return "KV sharing across layers"
    kv_dtype = getattr(impl, "kv_cache_dtype", "auto")
    if kv_dtype not in getattr(impl, "sparse_kv_cache_dtypes", UNQUANTIZED_KV_CACHE_DTYPES):
        return f"KV cache dtype {kv_dtype}"
    return None


# KV cache dtypes every sparse path reads; an impl lists more in ``sparse_kv_cache_dtypes``
# (the CUDA impl: vLLM's fp8 e4m3 cache).
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")


def prepare_group(vllm_config, layer_names: list[str], settings: SparseSettings) -> dict[str, RankHeads] | None:
    """Decide at start-up whether a KV-cache group can run sparse: None if not, else each of its
    layers' head patterns on this rank (layer name -> :class:`RankHeads`), which the builder hands
    to the impls in :attr:`SparsePrefillMetadata.layer_heads`.

    Every layer of a group must support the sparse path, or the whole group runs dense (one
    metadata object serves all layers of a group). Resolving the head-config file here makes a
    file that does not fit the model fail at start-up, naming the file, not at the first long
    request.
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    for name, layer in layers.items():
        reason = unsupported_reason(layer.impl)
        if reason is not None:
            log_once("layer group with %s runs dense (first such layer: %s)", reason, name)
            return None
    return {name: resolve_layer_heads(vllm_config, settings, name, layer.impl.num_heads, layer.impl.num_kv_heads)
            for name, layer in layers.items()}


def resolve_layer_heads(vllm_config, settings: SparseSettings, layer_name: str, local_heads: int,
                        local_kv_heads: int) -> RankHeads:
    """This rank's query-head patterns of one attention layer (head-config file, else the
    default pattern) and its KV-group sharing (:func:`..plan.rank_heads`). ``local_heads`` /
    ``local_kv_heads``: the layer's heads on this rank (the impl's ``num_heads`` /
    ``num_kv_heads``). A file that does not fit the model raises ConfigError naming the file."""
    from vllm.model_executor.models.utils import extract_layer_index

    cfg, spec = head_config(settings), settings.head_config
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    tp_rank = tensor_parallel_rank() if tp_size > 1 else 0
    total_heads = local_heads * tp_size  # the file names global heads; the model's, all ranks
    total_kv = local_kv_heads * tp_size
    if local_kv_heads == 1 and tp_size > 1:  # one KV head per rank: the model may have fewer (replicated)
        total_kv = vllm_config.model_config.get_total_num_kv_heads()
    if cfg is not None and cfg.num_heads != total_heads:
        raise ConfigError(f"{spec}: num_heads is {cfg.num_heads} but layer {layer_name} has "
                          f"{total_heads} query heads ({local_heads} on each of {tp_size} tensor-parallel ranks)")
    try:
        return rank_heads(cfg, settings, extract_layer_index(layer_name), total_heads, total_kv, tp_size, tp_rank)
    except ConfigError as e:
        raise ConfigError(f"{spec}: {e}" if spec else str(e)) from None


def group_head_counts(layer_heads: Mapping[str, RankHeads]) -> list[Counter]:
    """The distinct per-layer head-pattern multisets of a group (what prepare_group gave)."""
    out: list[Counter] = []
    for heads in layer_heads.values():
        counts = Counter(heads.heads)
        if counts not in out:
            out.append(counts)
    return out


def build_sparse_metadata(cm, cfg: SparseSettings, layer_heads: Mapping[str, RankHeads], allow_context: bool,
                          dense_build: Callable[[Any, bool], Any], with_fallback: bool = False,
                          worth_estimating: Callable[[int, int], bool] | None = None) -> SparsePrefillMetadata | None:
    """Plan one step. Returns None when every row is dense (caller then builds plain metadata).

    layer_heads: the group's, from :func:`prepare_group`. dense_build(sub_metadata, first_run)
    builds the wrapped backend's metadata for a run of rows; with_fallback also builds it for
    each sparse row alone (the density fallback).
    """
    from .._compat import seq_lens_host, slice_rows

    if cm.max_query_len < cfg.min_sparse_query_len or cm.causal is not True \
            or getattr(cm, "mm_req_doc_ranges", None):
        return None
    n = cm.num_reqs
    qsl = cm.query_start_loc_cpu[: n + 1].tolist()
    seq_lens = seq_lens_host(cm)
    plan = plan_step(qsl, seq_lens, cfg, allow_context=allow_context, worth_estimating=worth_estimating)
    for reason, count in plan.dense_reasons.items():
        log_once("long rows with %s run dense", reason)
        STATS.record_dense_reason(reason, count)
    if plan.dense_reasons and cfg.stats_file:
        STATS.dump(cfg.stats_file, wait=False)
    if not plan.has_sparse:
        return None
    runs = [DenseRun(qsl[a], qsl[b], dense_build(slice_rows(cm, a, b, seq_lens), k == 0))
            for k, (a, b) in enumerate(plan.dense_runs)]
    fallback = {r.row: dense_build(slice_rows(cm, r.row, r.row + 1, seq_lens), False)
                for r in plan.sparse_rows} if with_fallback else {}
    return SparsePrefillMetadata(cm.num_actual_tokens, cm.max_query_len, runs, plan.sparse_rows,
                                 cm.block_table_tensor, fallback, cm.slot_mapping, layer_heads)


def count_dense_tokens(md: SparsePrefillMetadata) -> None:
    STATS.record_dense_tokens(sum(r.tok_end - r.tok_start for r in md.dense_runs))
