"""What the CUDA and CPU backends share: the step metadata, the start-up checks of a layer group,
and the planning of a step.

vLLM glue only: no attention math here (that lives in ``prefill/`` and the kernels).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from .._compat import (attention_layers, impl_unsupported_reason, layer_index, seq_lens_host,
                       step_has_multimodal_prefix_ranges, tensor_parallel_rank)
from ..config import ConfigError
from ..decode.base import StepDecodePlan
from ..head_configs import HeadConfigFile
from ..prefill.plan import RankHeads, SparseRow, StepPlan, rank_heads
from ..prefill.route import DenseReason, plan_step, step_may_be_sparse
from ..runtime import WorkerRuntime

if TYPE_CHECKING:  # the kernel package needs Triton, which a CPU install lacks
    from vllm_sparse_kernels.prefill.packing import RowTable


# The wrapped backend's metadata type (CUDA: FlashAttentionMetadata; CPU: vLLM's CPU backend's).
WrappedMetadata = TypeVar("WrappedMetadata")


@dataclass
class DenseRun(Generic[WrappedMetadata]):
    tok_start: int
    tok_end: int
    metadata: WrappedMetadata  # the wrapped backend's own, for the rows of this run alone


@dataclass
class SparseStepMetadata(Generic[WrappedMetadata]):
    """The metadata of a step with work of ours: sparse rows, or a decode mode's plan of its
    prefill rows. A step with neither gets the wrapped backend's own metadata, untouched, so
    decode batches, short prompts and CUDA-graph capture are the wrapped backend's.

    A step's tokens, rows in vLLM's order (here two decode rows, a long prefill row, a short one)::

        tokens   | d | d | long prefill row ............ | short prefill |
        runs     |  dense_runs[0] |                       | dense_runs[1] |
        sparse   |                | sparse_rows[0]        |               |

    The wrapped backend computes each of :attr:`dense_runs` (contiguous rows, with metadata of
    their own; the whole step when no row is sparse), the sparse path :attr:`sparse_rows`.
    """

    num_actual_tokens: int
    max_query_len: int
    dense_runs: list[DenseRun[WrappedMetadata]]
    sparse_rows: list[SparseRow]
    block_table: torch.Tensor | None = None  # [num_reqs, max_pages], the whole step's (rows index it)
    slot_mapping: torch.Tensor | None = None  # [num_tokens] cache slots the step wrote (decode modes follow them)
    # row index -> the wrapped backend's metadata for that row alone, so the impl can still send
    # a sparse row to the dense kernel: its estimated index turned out too dense, or the sparse
    # path failed
    fallback: dict[int, WrappedMetadata] = field(default_factory=dict)
    # the kernel's table of the sparse rows (CUDA, Triton path): built once per step, reused by
    # every layer that runs all of the step's sparse rows
    row_table: RowTable | None = None
    decode_plan: StepDecodePlan | None = None  # decode_mode spans: the step's plan; the prefill path ignores it
    # row index -> (n, the wrapped backend's metadata for that row's last n queries alone, over
    # all its keys; n: SparseRow.exact_rows): run after the sparse path, they replace its output there
    exact_tails: dict[int, tuple[int, WrappedMetadata]] = field(default_factory=dict)


def layer_heads(runtime: WorkerRuntime, vllm_config, layer_name: str, local_heads: int,
                local_kv_heads: int) -> RankHeads:
    """This rank's head patterns of one attention layer, resolved once per process and layer
    (:attr:`WorkerRuntime.layer_heads`): the builder of the layer's group plans with them, the
    layer's impl runs them."""
    heads = runtime.layer_heads.get(layer_name)
    if heads is None:
        heads = resolve_heads(vllm_config, runtime.settings, layer_name, local_heads, local_kv_heads,
                              runtime.head_config)
        runtime.layer_heads[layer_name] = heads
    return heads


def check_head_config_fits_model(runtime: WorkerRuntime, vllm_config) -> None:
    """The head-config file the settings name must fit the model vLLM is building (ConfigError
    naming the file and field otherwise); nothing to do without one. Called where a worker first
    sees the model: its attention layers being built, before the weights load."""
    if runtime.head_config is None:
        return
    model_config = vllm_config.model_config
    runtime.check_head_config_fits(model_config.hf_text_config.to_dict(), model_config.model)


def resolve_heads(vllm_config, settings, layer_name: str, local_heads: int, local_kv_heads: int,
                  head_config: HeadConfigFile | None = None) -> RankHeads:
    """This rank's query-head patterns of one attention layer (``head_config``, else the default
    pattern) and its KV-group sharing (:func:`..prefill.plan.rank_heads`). ``local_heads`` /
    ``local_kv_heads``: the layer's heads on this rank (the impl's ``num_heads`` /
    ``num_kv_heads``). A file that does not fit the model raises ConfigError naming the file."""
    spec = settings.head_config
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    tp_rank = tensor_parallel_rank() if tp_size > 1 else 0
    total_heads = local_heads * tp_size  # the file names global heads; the model's, all ranks
    total_kv = local_kv_heads * tp_size
    if local_kv_heads == 1 and tp_size > 1:  # one KV head per rank: the model may have fewer (replicated)
        total_kv = vllm_config.model_config.get_total_num_kv_heads()
    if head_config is not None and head_config.num_heads != total_heads:
        raise ConfigError(f"{spec}: num_heads is {head_config.num_heads} but layer {layer_name} has "
                          f"{total_heads} query heads ({local_heads} on each of {tp_size} tensor-parallel ranks)")
    try:
        return rank_heads(head_config, settings, layer_index(layer_name), total_heads, total_kv, tp_size, tp_rank)
    except ConfigError as e:
        raise ConfigError(f"{spec}: {e}" if spec else str(e)) from None


def unsupported_reason(impl) -> str | None:
    """Why this layer cannot run sparse (it then runs the wrapped dense kernel), or None."""
    return impl_unsupported_reason(impl, getattr(impl, "sparse_kv_cache_dtypes", UNQUANTIZED_KV_CACHE_DTYPES))


# KV cache dtypes every sparse path reads; an impl lists more in ``sparse_kv_cache_dtypes``
# (the CUDA impl: vLLM's fp8 e4m3 cache).
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")


def first_unsupported_layer(vllm_config, layer_names: list[str]) -> tuple[str, str] | None:
    """(reason, layer name) of the first layer of a KV-cache group that cannot run sparse, or
    None. Every layer of a group must support the sparse path, or the whole group runs dense (one
    metadata object serves all layers of a group): :func:`..prefill.route.group_dense_reason`."""
    for name, layer in attention_layers(vllm_config, layer_names).items():
        reason = unsupported_reason(layer.impl)
        if reason is not None:
            return reason, name
    return None


def resolve_group_heads(runtime: WorkerRuntime, vllm_config, layer_names: list[str]) -> dict[str, RankHeads]:
    """Each layer's head patterns on this rank (layer name -> :class:`RankHeads`) of a group that
    can run sparse. Resolving the head-config file here makes a file that does not fit the model
    fail at start-up, naming the file, not at the first long request."""
    return {name: layer_heads(runtime, vllm_config, name, layer.impl.num_heads, layer.impl.num_kv_heads)
            for name, layer in attention_layers(vllm_config, layer_names).items()}


def log_dense_group(runtime: WorkerRuntime, why: tuple[DenseReason, str], layer: str = "") -> None:
    """Log once that a group's rows all run dense (``why``: :func:`..prefill.route.group_dense_reason`)."""
    reason, detail = why
    runtime.log_once("every row of a layer group runs dense: %s%s%s", reason.value, f" ({detail})" if detail else "",
                     f"; first such layer: {layer}" if layer else "", info=reason is DenseReason.DISABLED)


def distinct_head_sets(layer_heads: dict[str, RankHeads]) -> list[Counter]:
    """The distinct per-layer head-pattern multisets of a group (what :func:`resolve_group_heads` gave)."""
    out: list[Counter] = []
    for heads in layer_heads.values():
        counts = Counter(heads.heads)
        if counts not in out:
            out.append(counts)
    return out


def cost_model_heads(group_heads: dict[str, RankHeads], head_size: int) -> tuple[int, int] | None:
    """(the most query heads of a group's layers on this rank, head size): what the step's cost
    gate (:func:`plan_step`'s ``row_heads``) needs; None for a group without layers."""
    if not group_heads:
        return None
    return max(len(h.heads) for h in group_heads.values()), head_size


def plan_sparse_step(runtime: WorkerRuntime, cm, allow_context: bool,
                     head_sets: list[Counter] | None = None,
                     row_heads: tuple[int, int] | None = None, *,
                     step_token_budget: int | None = None) -> tuple[StepPlan, list[int], list[int]] | None:
    """Plan one step from vLLM's CommonAttentionMetadata ``cm``: None when no row can run
    sparse (the caller then builds the wrapped backend's metadata), else the plan with the
    step's host-side query start locations and sequence lengths. ``head_sets``: the group's
    (:func:`distinct_head_sets`) where rows whose budgets no layer could make sparser than
    ``max_density`` should stay dense without estimation; ``row_heads`` (:func:`cost_model_heads`):
    where rows the cost model says sparse cannot pay on should stay dense too; ``step_token_budget``
    (:func:`.._compat.step_token_budget`): which chunks end their prompt, for ``exact_prompt_end``
    (:func:`..prefill.route.plan_step`)."""
    cfg = runtime.settings
    if not step_may_be_sparse(cfg, cm.max_query_len, cm.causal is True, step_has_multimodal_prefix_ranges(cm)):
        return None
    n = cm.num_reqs
    qsl = cm.query_start_loc_cpu[: n + 1].tolist()
    seq_lens = seq_lens_host(cm)
    plan = plan_step(qsl, seq_lens, cfg, allow_context=allow_context, head_sets=head_sets, row_heads=row_heads,
                     step_token_budget=step_token_budget)
    for reason in plan.dense_reasons:
        runtime.log_once("long rows with %s run dense", reason, info=True)  # routing, counted in the metrics
    # after the plan is made: an error counting it is no planning error (its rows would count twice)
    guard_stats(runtime, _count_dense_reasons, runtime, plan.dense_reasons)
    if not plan.has_sparse:
        return None
    return plan, qsl, seq_lens


def _count_dense_reasons(runtime: WorkerRuntime, reasons: dict) -> None:
    for reason, count in reasons.items():
        runtime.stats.record_dense_reason(reason, count)
    if reasons and runtime.settings.observability.stats_file:
        runtime.stats.dump(runtime.settings.observability.stats_file, wait=False)


# cudaErrorMemoryAllocation: the one CUDA error after which the context still works
CUDA_OUT_OF_MEMORY = 2
# how torch (c10's CUDA checks), Triton's launcher and the driver API start the text of a CUDA
# error they raise as a plain RuntimeError (torch before AcceleratorError, Triton)
CUDA_ERROR_MARKS = ("CUDA error: ", "Triton Error [CUDA]: ", "CUDA driver error: ")


def recoverable(error: BaseException) -> bool:
    """Whether serving can go on after the sparse path raised ``error`` (the step's sparse rows
    then run dense): a Python-level error, or running out of device memory. Any other CUDA error
    (an illegal or misaligned address, a launch failure, a device-side assert) has lost the CUDA
    context: vLLM must stop. Decided by type and CUDA error code where torch gives them
    (``torch.OutOfMemoryError``, ``torch.AcceleratorError.error_code``); the text only where the
    error is a plain RuntimeError that a CUDA check raised."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        code = getattr(error, "error_code", None)  # set by torch where the C++ side raised it
        if isinstance(code, int):
            return code == CUDA_OUT_OF_MEMORY
        return (_cuda_error_text(error) or "").startswith("out of memory")
    if not isinstance(error, RuntimeError):
        return True
    text = _cuda_error_text(error)
    return text is None or text.startswith("out of memory")


def _cuda_error_text(error: BaseException) -> str | None:
    """What follows a CUDA error mark in ``error``'s text (cudaGetErrorString's words), or None
    where it has none."""
    text = str(error)
    for mark in CUDA_ERROR_MARKS:
        at = text.find(mark)
        if at >= 0:
            return text[at + len(mark):].strip()
    return None


def guard_stats(runtime: WorkerRuntime, record, *args) -> None:
    """Call ``record(*args)``, a recording of counts; an error in it is logged once and changes
    neither the step's output nor its routing (the output is already right), so the counts come
    out short, never twice. A device error still reaches vLLM."""
    try:
        record(*args)
    except Exception as e:  # noqa: BLE001 - the stats' own boundary
        if not recoverable(e):
            raise
        runtime.log_once("recording the sparse path's counts raised %s: %s; the output is unaffected, the counts "
                         "miss it", type(e).__name__, e)


def long_query_lens(runtime: WorkerRuntime, cm) -> list[int]:
    """The query lengths of a step's rows long enough to go sparse (``min_sparse_query_len``):
    what a step whose planning failed counts as sparse path errors."""
    qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
    return [b - a for a, b in zip(qsl, qsl[1:]) if b - a >= runtime.settings.gating.min_sparse_query_len]


def sparse_path_failed(runtime: WorkerRuntime, error: BaseException, q_lens: list[int]) -> None:
    """Log (once per distinct cause) and count a step whose sparse rows (``q_lens``: their query
    lengths) go to the dense kernel because the sparse path raised ``error``."""
    runtime.log_once("the sparse path raised %s: %s; the step's sparse rows ran dense (later steps try the "
                     "sparse path again; counted in dense_fallbacks_total{reason=\"sparse_path_error\"})",
                     type(error).__name__, error)
    guard_stats(runtime, _count_failed, runtime, q_lens)


def _count_failed(runtime: WorkerRuntime, q_lens: list[int]) -> None:
    runtime.stats.record_dense_reason(DenseReason.SPARSE_PATH_ERROR, rows=len(q_lens), tokens=sum(q_lens))
    if runtime.settings.observability.stats_file:
        runtime.stats.dump(runtime.settings.observability.stats_file, wait=False)


def count_dense_tokens(runtime: WorkerRuntime, md: SparseStepMetadata) -> None:
    """The query tokens of a step with sparse rows that ran on the dense kernel (a recording:
    guarded, as the layer's own is, since it runs before the sparse path's boundary)."""
    guard_stats(runtime, runtime.stats.record_dense_tokens, sum(r.tok_end - r.tok_start for r in md.dense_runs))
