"""Settings of the sparse-prefill backend.

Sources, later wins: field defaults < JSON file named by ``VLLM_SPARSE_CONFIG`` < environment
variables ``VLLM_SPARSE_<FIELD>`` (e.g. ``VLLM_SPARSE_VERTICAL_SIZE=1000``). Each backend object
of an engine (metadata builder, attention impl) reads them when it is constructed and passes
them down; there is no process-wide copy. Every engine process sees the same values as long as
it inherits the environment (true for fork and spawn). Bad values fail at start-up with the
file or variable and the field named.
"""

from __future__ import annotations

import json
import os
from enum import Enum
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

ENV_PREFIX = "VLLM_SPARSE_"
CONFIG_FILE_ENV = "VLLM_SPARSE_CONFIG"
# Variables with the prefix that are not settings: the settings file itself and the asset cache.
NON_SETTING_ENV = frozenset({CONFIG_FILE_ENV, "VLLM_SPARSE_CACHE"})


class PatternName(str, Enum):
    """Prefill patterns. Names follow the papers: MInference's A-shape, vertical-slash and
    block-sparse heads, FlexPrefill's adaptive heads, and plain dense attention."""

    DENSE = "dense"
    A_SHAPE = "a_shape"
    VERTICAL_SLASH = "vertical_slash"
    BLOCK_SPARSE = "block_sparse"
    FLEX_PREFILL = "flex_prefill"


class ConfigError(ValueError):
    """A configuration file or variable is malformed; the message names where and which field."""


class SparseSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Kill switch: false routes every row to dense attention.")
    default_pattern: PatternName = Field(
        PatternName.VERTICAL_SLASH, description="Pattern of heads that no head-config file covers.")
    block_size: int = Field(64, description="Query and key block size of the sparse format (tokens).")
    # MInference vertical-slash (Alg. 2): budgets and last-q estimation.
    vertical_size: int = Field(1000, ge=1, description="Vertical (column) budget per head.")
    slash_size: int = Field(6096, ge=1, description="Slash (diagonal) budget per head.")
    # Budgets that grow with the context: a row's vertical (slash) budget is the larger of the
    # size above and this share of the row's keys (context + chunk). None = fixed budgets.
    vertical_share: float | None = Field(None, gt=0.0, le=1.0,
                                         description="Vertical budget at least this share of the row's keys.")
    slash_share: float | None = Field(None, gt=0.0, le=1.0,
                                      description="Slash budget at least this share of the row's keys.")
    slash_band: int = Field(1, ge=1, le=1024, description=(
        "Diagonals kept together as one slash unit: 1 = single diagonals (MInference), block_size = "
        "bands of whole key blocks chosen by their summed scores (slash_size / band of them)."))
    # How the kernel computes a kept diagonal in a query block: "blocks" = the (at most two)
    # aligned key blocks it crosses, "ranges" = its 64 keys as one key tile starting anywhere
    # (touching diagonals merged, index.py). Ranges compute 7-20% fewer pairs on Qwen2.5-Coder-
    # 1.5B's real layers, but the kernel's range tiles (masked, unaligned, no prefetch) run
    # 1.2-1.4x slower than the block tiles they replace: blocks stay the default until the range
    # loop pays (benchmarks/KERNEL_NOTES.md, session 2026-11-24 part 2).
    slash_tiles: Literal["blocks", "ranges"] = Field(
        "blocks", description="Slash lines as the aligned key blocks they cross, or as unaligned 64-key ranges.")
    last_q: int = Field(64, ge=1, description="Queries at the end of the chunk used to estimate vertical/slash.")
    keep_first_columns: int = Field(30, ge=0, description="Columns always kept (attention sinks).")
    keep_last_diagonals: int = Field(30, ge=0, description="Diagonals nearest the main one always kept.")
    # MInference block-sparse (Alg. 3).
    topk_blocks: int = Field(100, ge=1, description="Key blocks per query block for block-sparse heads.")
    # How block-sparse heads score key blocks: MInference's mean-pooled Q . K, or the estimated
    # softmax mass of each block from the anti-diagonals of stride x stride cells (XAttention's
    # scoring; keeps slash and vertical lines that pooling averages away). The kernel computes
    # 64 x 64 tiles, so a selection of whole blocks pays for exactly what it keeps, where a
    # scattered diagonal of vertical-slash costs a whole tile per query block.
    # "sampled": the exact attention of a few of each query block's own queries
    # (block_samples), summed per key block: real mass, so block_mass is a share of real attention.
    block_scoring: Literal["pooled", "antidiagonal", "sampled"] = Field(
        "pooled", description="Block-sparse scores: mean-pooled Q . K, anti-diagonal block mass, or the mass of "
                              "sampled queries of each query block.")
    block_samples: int = Field(2, ge=1, le=256, description="Sampled block scores: queries per query block.")
    antidiagonal_stride: int = Field(16, description="Anti-diagonal scoring: cell size (a power of two dividing "
                                                     "block_size; 1 / stride of the QK work).")
    block_mass: float | None = Field(None, gt=0.0, le=1.0, description=(
        "Anti-diagonal or sampled scoring: keep the fewest key blocks reaching this share of a query block's "
        "estimated mass (at most topk_blocks); none = always topk_blocks."))
    # A-shape (StreamingLLM-style sink + local window).
    sink_tokens: int = Field(128, ge=0, description="A-shape: leading tokens every query sees.")
    local_window: int = Field(2048, ge=1, description="A-shape: trailing window every query sees.")
    # FlexPrefill.
    gamma: float = Field(0.95, gt=0.0, le=1.0, description="FlexPrefill cumulative attention to cover.")
    tau: float = Field(0.1, ge=0.0, le=1.0, description="FlexPrefill sqrt-JSD threshold for query-aware heads.")
    flex_block_size: int = Field(128, description="FlexPrefill block size (64 or 128).")
    min_budget: int = Field(1024, ge=0, description="FlexPrefill minimum tokens per head (vertical and slash).")
    max_budget: int | None = Field(None, ge=1, description="FlexPrefill maximum tokens per head, none = unbounded.")
    # GQA: one key selection per KV head, shared by the query heads of its group (column and
    # diagonal scores / block-sparse scores summed over the group). The kernel then computes the
    # group's heads in one program and loads each K/V tile once for all of them: 1.5x faster at
    # the same density (head dim 128, H200), and 1.4x / 1.2x end to end at 128K / 256K; Qwen2.5
    # keeps its accuracy and recall (benchmarks/KERNEL_NOTES.md runs 15-18). Applies to layers
    # whose KV groups are uniform (every head of a group has the same pattern and budgets) and
    # have no FlexPrefill heads; other layers, or false, keep one selection per query head.
    kv_group_shared: bool = Field(True, description="One key selection per KV head, shared by its query heads.")
    # Gating: which rows go sparse.
    min_sparse_query_len: int = Field(4096, ge=1, description="Query chunks shorter than this run dense.")
    min_sparse_seq_len: int = Field(0, ge=0, description="Sequences (context + chunk) shorter than this run dense.")
    # Dense fallback (CUDA, Triton path), on the share of a row's causal (query, key) pairs: a row
    # whose budgets alone allow more runs on FlashAttention without being estimated; a row whose
    # estimated index computes more is flagged on the GPU and runs the kernel's dense mode (every
    # causal key; no host sync decides it). Sparse tiles run at 50-75% of FlashAttention's FLOP
    # rate (per-head lists / KV-group-shared lists, benchmarks/KERNEL_NOTES.md), so above ~0.4 a
    # sparse row gains little or loses. 1.0 = never fall back.
    max_density: float = Field(0.4, gt=0.0, le=1.0, description="Rows denser than this run dense (CUDA).")
    # Rows whose estimated index is denser than max_density (decided on the GPU): "flash" reads
    # the flags on the host (one sync per layer: the GPU queue drains) and runs those rows on
    # FlashAttention; "kernel" runs them in the Triton kernel's dense mode with no host read
    # (1.21x cuDNN's time at 128K on an H200); "auto" reads on the host only while the layer's
    # previous call had flagged rows (sparse_prefill.DenseRowHistory), measured as fast as the
    # faster of the two at both ends (README, Accuracy). Under CUDA-graph capture "kernel" is
    # used whatever this says.
    estimated_dense_rows: Literal["flash", "kernel", "auto"] = Field(
        "auto", description="Where rows whose estimated index is too dense run (CUDA): FlashAttention, the kernel, "
                            "or auto (FlashAttention while the layer's previous call had such rows).")
    # Which implementation computes sparse rows on CUDA: "triton" (GPU index estimation and the
    # block+column kernel, both reading the paged cache), "torch" (estimation and the reference on
    # K/V gathered out of the cache; slow, for debugging), or "auto" (triton where the kernel
    # supports the layer: head size 64/128, fp16/bf16, block_size 64; torch elsewhere).
    kernel: Literal["auto", "triton", "torch"] = Field("auto", description="Sparse attention kernel on CUDA.")
    # KV-cache page size the CUDA backend asks vLLM for when --block-size is not given. With
    # pages of 64 keys each 64-key tile of the kernel is one page, which the kernel loads with
    # Hopper's tensor memory accelerator instead of gathering it key by key through the block
    # table: 1.25x at 128K on the sparse and dense tiles of a Qwen2.5-1.5B-shaped layer, 1.08x
    # for Llama-3-8B's (H200, benchmarks/KERNEL_NOTES.md). "auto": 64 on compute capability 9.0+
    # (where the TMA path runs), vLLM's default elsewhere. An explicit --block-size wins; the
    # kernel gathers pages of any power-of-two size.
    kv_block_size: Literal["auto", "16", "32", "64", "128"] = Field(
        "auto", description="KV-cache block size asked of vLLM when --block-size is not given (CUDA).")
    # Files.
    head_config: str | None = Field(None, description="Per-model per-head pattern file (JSON).")
    stats_file: str | None = Field(None, description="JSON file the worker keeps updated with sparse counters.")
    # Metrics (metrics.py). With PROMETHEUS_MULTIPROC_DIR exported they reach vLLM's own /metrics;
    # metrics_port also serves them from the worker itself (prometheus_client's HTTP server).
    metrics_port: int | None = Field(None, ge=1, le=65535,
                                     description="Port of the worker's own Prometheus endpoint; none = off.")
    # Estimator and kernel time of 1 of every N sparse layer forwards (CUDA events read later, no
    # sync; host clock on CPU). Sampled forwards also measure the computed density on CUDA.
    timing_sample_every: int = Field(16, ge=0, description="Time 1 of every N sparse forwards; 0 = never.")

    # Decode (issue 8). "dense": vLLM's FlashAttention (the default). "topk": each decode step
    # attends to the sink and recent pages plus the decode_budget_pages pages of highest Quest
    # bound (per-page key min/max kept beside the cache), optionally only the decode_topk_tokens
    # best keys of those; widths are fixed so a step can be captured in a CUDA graph.
    # "spans" (Ltri-LLM): prefill chunks are divided into semantic spans (triangles of the local
    # attention map, NMS), each page keeps its span's index vector, and decode steps attend to the
    # sink, recent and persistent pages plus the decode_budget_pages best-matching pages; the
    # persistent pages are the prompt's last chunk's retrieval (vllm_sparse_kernels/decode/span_decode.py).
    decode_mode: Literal["dense", "topk", "spans"] = Field(
        "dense", description="Decode attention: dense, top-k pages, or span retrieval.")
    decode_sink_pages: int = Field(1, ge=0, description="topk/spans decode: leading pages always attended.")
    decode_recent_pages: int = Field(8, ge=0, description="topk/spans decode: trailing pages always attended.")
    decode_budget_pages: int = Field(64, ge=0, description="topk/spans decode: pages chosen by score per KV head.")
    decode_topk_tokens: int = Field(0, ge=0, description="topk decode: keep only this many best keys; 0 = all.")
    decode_persist_pages: int = Field(
        32, ge=0, description="spans decode: pages the prompt's last queries retrieve, kept for the whole decode.")
    decode_span_theta: float = Field(
        0.9, ge=0.0, le=1.0, description="spans: quantile of the local map's cell means subtracted as baseline.")
    decode_span_iou: float = Field(0.01, ge=0.0, le=1.0, description="spans: NMS IoU threshold between spans.")
    decode_span_lambda: float = Field(3.0, ge=0.0, description="spans: lambda of the index-vector count (Eq. 7).")
    decode_span_min_index: int = Field(6, ge=1, description="spans: fewest index tokens per span.")
    decode_span_max_index: int = Field(24, ge=1, description="spans: most index tokens per span.")
    decode_span_index: Literal["span", "page"] = Field(
        "span", description="spans: page keys from the span's index tokens (span) or the page's most-voted token (page).")
    decode_span_persist: Literal["attention", "index"] = Field(
        "attention", description="spans: persistent pages by the last queries' exact attention (attention) or "
                                 "by the span index decode uses (index).")
    decode_persist_next: int = Field(
        1, ge=0, description="spans, persist by attention: each of the persist_pages // (1 + N) best pages "
                             "persists with the N pages after it (index: no runs).")

    @model_validator(mode="after")
    def _check_blocks(self) -> "SparseSettings":
        for name in ("block_size", "flex_block_size"):
            v = getattr(self, name)
            if v < 16 or v > 256 or v & (v - 1):
                raise ValueError(f"{name}={v}: must be a power of two between 16 and 256")
        s = self.antidiagonal_stride
        if s < 1 or s & (s - 1) or self.block_size % s:
            raise ValueError(f"antidiagonal_stride={s}: must be a power of two dividing block_size={self.block_size}")
        if self.block_mass is not None and self.block_scoring == "pooled":
            raise ValueError("block_mass applies to block_scoring=antidiagonal or sampled only")
        if self.flex_block_size % self.block_size and self.block_size % self.flex_block_size:
            raise ValueError("flex_block_size and block_size must divide one another")
        if self.decode_sink_pages + self.decode_recent_pages + self.decode_budget_pages == 0:
            raise ValueError("decode_sink_pages, decode_recent_pages and decode_budget_pages are all 0")
        if ("decode_persist_next" in self.model_fields_set and self.decode_persist_next
                and self.decode_span_persist != "attention"):
            raise ValueError("decode_persist_next runs of persistent pages need decode_span_persist=attention")
        if self.decode_span_min_index > self.decode_span_max_index:
            raise ValueError(f"decode_span_min_index={self.decode_span_min_index} is above "
                             f"decode_span_max_index={self.decode_span_max_index}")
        if self.max_budget is not None and self.max_budget < self.min_budget:
            raise ValueError(f"max_budget={self.max_budget} is below min_budget={self.min_budget}")
        return self


def _format_error(where: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "(settings)"
        lines.append(f"{where}: field '{field}': {e['msg']}")
    return "\n".join(lines)


def load_settings(env: Mapping[str, str] | None = None) -> SparseSettings:
    """Build settings from ``VLLM_SPARSE_CONFIG`` (JSON file) and ``VLLM_SPARSE_*`` variables."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = env.get(CONFIG_FILE_ENV)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ConfigError(f"{path} (from {CONFIG_FILE_ENV}): cannot read: {e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} (from {CONFIG_FILE_ENV}): invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object of settings, got {type(data).__name__}")
        try:
            SparseSettings(**data)
        except ValidationError as e:
            raise ConfigError(_format_error(path, e)) from None
        values.update(data)
    fields = SparseSettings.model_fields
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key in NON_SETTING_ENV:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in fields:
            known = ", ".join(ENV_PREFIX + f.upper() for f in fields)
            raise ConfigError(f"environment variable {key}: unknown setting (known: {known})")
        values[name] = None if raw.strip().lower() in ("", "none", "null") else raw
        field = fields[name]
        try:  # the field alone, so the message names this variable
            TypeAdapter(Annotated[field.annotation, field]).validate_python(values[name])
        except ValidationError as e:
            raise ConfigError(f"environment variable {key}={raw!r}: {e.errors()[0]['msg']}") from None
    try:
        return SparseSettings(**values)
    except ValidationError as e:
        where = " + ".join(filter(None, [path, "VLLM_SPARSE_* variables"]))
        raise ConfigError(_format_error(where, e)) from None
