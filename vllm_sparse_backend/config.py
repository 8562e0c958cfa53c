"""Settings of the sparse-prefill backend.

Sources, later wins: field defaults < JSON file named by ``VLLM_SPARSE_CONFIG`` < environment
variables ``VLLM_SPARSE_<FIELD>`` (e.g. ``VLLM_SPARSE_VERTICAL_SIZE=1000``). Each backend object
of an engine (metadata builder, attention impl) reads them when it is constructed and passes
them down; there is no process-wide copy. Every engine process sees the same values as long as
it inherits the environment (true for fork and spawn). Bad values fail at start-up with the
file or variable and the field named.

Shape (issue 52 step 3): the settings are being grouped into sub-models by the code that reads
them, so that a reader finds a field next to its user: ``gating`` (enabled, min_sparse_query_len,
min_sparse_seq_len, max_density, cost_model, estimated_dense_rows), ``patterns.<pattern name>``
(each pattern's parameters, its per-head ones included: vertical_size, slash_size, last_q, ...),
``decode`` (mode and page counts; its modes' own under ``decode.topk`` / ``decode.spans``),
``kernel`` (kernel, block_size, skip_tile_below, kv_block_size, ...), ``kv_placement`` and
``observability``. Done so far: ``gating``, ``patterns``, ``decode`` and ``observability``; the
other fields are still top-level. A grouped setting keeps its flat name (``decode_span_theta``;
the field's own name unless its ``json_schema_extra`` says ``flat``) as its only alias, on the way in only:
the variable ``VLLM_SPARSE_<NAME>`` and the key ``<name>`` of the JSON file, of
``SparseSettings(...)``, ``replace(...)`` and ``model_copy(update=...)`` land on the nested field
(``decode.spans.theta``), and the nested form (``{"decode": {"spans": {"theta": 0.8}}}``) is
accepted too. Code reads the nested field only; there is no flat attribute. Flat names are
unique across groups (``settings_of`` checks it when a settings class is made), so each says one
field.

This module holds the loading and the groups that are not a pattern's. Each pattern declares
its group in its own file (``Pattern.settings_model``, a :class:`PatternGroup`), and
:mod:`vllm_sparse_backend.settings`, above the pattern registry, assembles the final
``SparseSettings`` from :class:`SparseSettingsBase` and the registered patterns' groups: this
module imports nothing of the plugin, so no registry imports back into it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from types import MappingProxyType
from typing import Annotated, Any, Callable, ClassVar, Literal, Mapping, NamedTuple, Self, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

ENV_PREFIX = "VLLM_SPARSE_"
CONFIG_FILE_ENV = "VLLM_SPARSE_CONFIG"
# Variables with the prefix that are not settings: the settings file itself and the asset cache.
NON_SETTING_ENV = frozenset({CONFIG_FILE_ENV, "VLLM_SPARSE_CACHE"})


def check_host(host: str) -> str:
    """A pydantic validator: ``host`` must be an IP address or a DNS host name (what a server binds)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    # an all-digit last label is a mistyped address, not a name (RFC 1123 names end in a letter label)
    if len(host) > 253 or labels[-1].isdigit() or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise PydanticCustomError("bad_host", "'{host}' is neither an IP address nor a host name", {"host": host})
    return host


_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# An address to bind: an IP address or a host name such as localhost.
MetricsHost = Annotated[str, AfterValidator(check_host)]


class ConfigError(ValueError):
    """A configuration file or variable is malformed; the message names where and which field."""


class GatingSettings(BaseModel):
    """Which rows go sparse (read by prefill/route.py, the backends' builders and the profiling
    claim)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Kill switch: false routes every row to dense attention.")
    min_sparse_query_len: int = Field(4096, ge=1, description="Query chunks shorter than this run dense.")
    min_sparse_seq_len: int = Field(0, ge=0, description="Sequences (context + chunk) shorter than this run dense.")
    exact_last_rows: int = Field(0, ge=0, le=1024, description=(
        "The last N queries of each sparse chunk attend every key (CUDA: FlashAttention after the sparse kernel; "
        "PyTorch path: exactly, not with a logits soft cap): the rows a prompt's answer starts from. 0 = off."))
    exact_prompt_end: int = Field(0, ge=0, le=1048576, description=(
        "The chunk that ends a prompt computes its last N queries over every key, as exact_last_rows does (the "
        "larger of the two applies): the question's rows and the text just before them; a chunk of at most N "
        "queries runs dense. vLLM's scheduler cuts at most one chunk per step, the newest request's, and only "
        "where the step spends its whole token budget: every other chunk ends its prompt. The newest is taken to "
        "be the row with the least cached context; where that guess or another cap (long_prefill_token_threshold, "
        "speculative decoding's draft slots) misleads, a cut chunk runs exact (slower, not less accurate). 0 = off."))
    max_sparse_seq_len: int | None = Field(None, ge=1, description=(
        "Sequences (context + chunk) longer than this run dense: sparse only up to a length whose answers "
        "were checked (a long prompt's last chunks then run dense); none = no bound."))
    max_density: float = Field(0.4, gt=0.0, le=1.0, description=(
        "A row whose budgets alone allow more than this share of its causal (query, key) pairs runs on the "
        "dense kernel (FlashAttention, vLLM's CPU attention) without estimation; on CUDA one whose estimated "
        "index covers more runs dense as estimated_dense_rows says. 1.0 = never."))
    cost_model: bool = Field(True, description=(
        "CUDA: before estimating a row, predict its sparse cost (estimation, a fixed cost per row and layer, and "
        "the pairs its budgets are measured to compute in that layer) against FlashAttention's and run it dense "
        "where sparse would not win (rows on which even an empty selection would lose stay on FlashAttention for "
        "the whole step); false = only max_density decides."))
    estimated_dense_rows: Literal["flash", "kernel", "auto"] = Field("auto", description=(
        "CUDA: where rows whose estimated index is denser than max_density run. flash = read the flags on the "
        "host (one sync per layer) and run them on FlashAttention; kernel = the Triton kernel's dense mode, no "
        "host read; auto = flash while the layer's previous call had such rows, else kernel. CUDA-graph "
        "capture always uses kernel."))


class ObservabilitySettings(BaseModel):
    """What the worker reports and how often (read by observability/, runtime.py and the backends'
    stats-file writes)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    stats_file: str | None = Field(None, description=(
        "JSON file the worker keeps updated with sparse counters (rows, tokens, computed vs causal pairs, "
        "patterns, dense reasons); on CUDA written without waiting for the GPU."))
    stats_write_interval_s: float = Field(1.0, ge=0.0, le=3600.0, allow_inf_nan=False, description=(
        "Rewrite the stats file at most once per this many seconds (a write left for later is done at the "
        "interval's end and at exit); 0 = after every sparse layer forward, for a client that reads the file "
        "right after each request."))
    metrics_port: int | None = Field(None, ge=1, le=65535, description=(
        "Also serve the plugin's Prometheus metrics from the worker on this port; none = only through vLLM's "
        "/metrics (with PROMETHEUS_MULTIPROC_DIR set)."))
    metrics_host: MetricsHost = Field("127.0.0.1", description=(
        "Address the metrics_port server binds: an IP address or host name; the default answers this host "
        "only, 0.0.0.0 (or ::) every interface, e.g. for a Prometheus that scrapes the pod."))
    timing_sample_every: int = Field(16, ge=0, description=(
        "Time the estimator and the sparse kernel on 1 of every N sparse layer forwards (on CUDA these forwards "
        "also count computed pairs and density fallbacks); 0 = never."))


def _flat(name: str) -> dict[str, str]:
    """``json_schema_extra`` of a grouped field whose flat alias (variable suffix, flat JSON key)
    is not its own name."""
    return {"flat": name}


class TopkDecodeSettings(BaseModel):
    """decode_mode=topk only (read by decode/topk.py)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(0, ge=0, json_schema_extra=_flat("decode_topk_tokens"), description=(
        "topk decode: keep only this many best keys per head of the chosen pages (sink and recent pages stay "
        "whole); 0 = all."))


class SpansDecodeSettings(BaseModel):
    """decode_mode=spans only (read by decode/spans.py)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    persist_pages: int = Field(32, ge=0, json_schema_extra=_flat("decode_persist_pages"), description=(
        "spans decode: pages per KV head that the last last_q queries of a prompt's last chunk retrieve, "
        "attended at every decode step."))
    theta: float = Field(0.9, ge=0.0, le=1.0, json_schema_extra=_flat("decode_span_theta"),
                         description="spans: quantile of the local map's cell means subtracted as baseline.")
    iou: float = Field(0.01, ge=0.0, le=1.0, json_schema_extra=_flat("decode_span_iou"),
                       description="spans: NMS IoU threshold between spans.")
    index_lambda: float = Field(3.0, ge=0.0, json_schema_extra=_flat("decode_span_lambda"),
                                description="spans: lambda of the index-vector count (Eq. 7).")
    min_index: int = Field(6, ge=1, json_schema_extra=_flat("decode_span_min_index"),
                           description="spans: fewest index tokens per span.")
    max_index: int = Field(24, ge=1, json_schema_extra=_flat("decode_span_max_index"),
                           description="spans: most index tokens per span.")
    index: Literal["span", "page"] = Field("span", json_schema_extra=_flat("decode_span_index"), description=(
        "spans: page keys from the span's index tokens (span) or the page's most-voted token (page)."))
    persist: Literal["attention", "index"] = Field("attention", json_schema_extra=_flat("decode_span_persist"),
                                                   description=(
        "spans: persistent pages by the last queries' exact attention (attention) or by the span index decode "
        "uses (index)."))
    persist_next: int = Field(1, ge=0, json_schema_extra=_flat("decode_persist_next"), description=(
        "spans, persist by attention: each of the decode_persist_pages // (1 + N) best pages persists with the N "
        "pages after it; 0 = single pages. Setting it with decode_span_persist=index is an error."))

    @model_validator(mode="after")
    def _check(self) -> "SpansDecodeSettings":
        if "persist_next" in self.model_fields_set and self.persist_next and self.persist != "attention":
            raise ValueError("decode_persist_next runs of persistent pages need decode_span_persist=attention")
        if self.min_index > self.max_index:
            raise ValueError(f"decode_span_min_index={self.min_index} is above decode_span_max_index={self.max_index}")
        return self


class DecodeSettings(BaseModel):
    """How decode steps attend (read by decode/, the backends and kv_placement/host.py); the
    mode's own parameters under ``topk`` / ``spans``."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: str = Field("dense", json_schema_extra={"registry": "decode_mode", **_flat("decode_mode")}, description=(
        "Decode attention (CUDA): dense = vLLM's FlashAttention; topk = sink, recent and the best-bounded pages "
        "(Quest page summaries); spans = sink, recent, persistent and best-matching pages by span index "
        "(Ltri-LLM). topk and spans are opt-in and experimental; batches mixing prefills decode dense."))
    sink_pages: int = Field(1, ge=0, json_schema_extra=_flat("decode_sink_pages"),
                            description="topk/spans decode: leading pages always attended.")
    recent_pages: int = Field(8, ge=0, json_schema_extra=_flat("decode_recent_pages"),
                              description="topk/spans decode: trailing pages always attended.")
    budget_pages: int = Field(64, ge=0, json_schema_extra=_flat("decode_budget_pages"),
                              description="topk/spans decode: pages chosen by score per KV head.")
    topk: TopkDecodeSettings = Field(default_factory=TopkDecodeSettings, description="decode_mode=topk only.")
    spans: SpansDecodeSettings = Field(default_factory=SpansDecodeSettings, description="decode_mode=spans only.")

    @model_validator(mode="after")
    def _check(self) -> "DecodeSettings":
        if self.sink_pages + self.recent_pages + self.budget_pages == 0:
            raise ValueError("decode_sink_pages, decode_recent_pages and decode_budget_pages are all 0")
        return self


class PatternGroup(BaseModel):
    """The base of a pattern's settings model (``Pattern.settings_model``, declared in the
    pattern's own file): the group ``settings.patterns.<pattern name>``."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    def check_with(self, settings: "SparseSettingsBase") -> None:
        """Bounds that depend on settings outside the group (the sparse ``block_size``, say):
        ValueError naming the fields. Runs when the settings are built."""


class PatternGroups(BaseModel):
    """What ``settings.patterns`` is before the registry fills it in: the final model, one
    group per registered pattern that declares settings, is built in :mod:`.settings`."""
    model_config = ConfigDict(extra="forbid", frozen=True)


class SparseSettingsBase(BaseModel):
    """Every setting but the patterns' own: :class:`vllm_sparse_backend.settings.SparseSettings`
    is this with ``patterns`` narrowed to the registered patterns' groups (the patterns live
    above this module, and this module imports nothing of the plugin)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Every setting by its flat name, made for each subclass as pydantic completes it (the
    # before-validator needs its own class's: the final one's includes the pattern groups).
    flat_settings: ClassVar[Mapping[str, "Setting"]] = MappingProxyType({})

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.flat_settings = MappingProxyType(settings_of(cls))

    # Each description is the user-facing meaning; docs/configuration.md is generated from them
    # (python -m vllm_sparse_tools.config_docs). Why the defaults are what they are, with the
    # measurements behind them: docs/configuration-notes.md.
    gating: GatingSettings = Field(default_factory=GatingSettings, description="Which rows go sparse.")
    # default_pattern, decode.mode and kv_placement name registered things: the registries check
    # them (load_settings' ``names``), so that these settings import none of the modules using them;
    # "registry" tells the docs generator which names to list.
    default_pattern: str = Field(
        "vertical_slash", json_schema_extra={"registry": "pattern"},
        description="Pattern of heads that no head-config file covers (a registered pattern's name).")
    block_size: int = Field(64, description=(
        "Query and key block size of the sparse format (tokens; a power of two from 16 to 256)."))
    patterns: PatternGroups = Field(default_factory=PatternGroups, description=(
        "Each pattern's own parameters; a head-config entry overrides its per-head ones."))
    kv_group_shared: bool = Field(True, description=(
        "One key selection per KV head, shared by the query heads of its GQA group (their scores summed), so the "
        "kernel computes the group's heads together. Layers whose KV groups mix patterns or budgets, or have "
        "FlexPrefill heads, keep per-head selections; false = per head everywhere."))
    kernel: Literal["auto", "triton", "torch"] = Field("auto", description=(
        "Sparse rows on CUDA: auto = GPU estimation and the Triton kernel on the paged cache, and the layer runs "
        "dense where they cannot run (no triton, head size other than 64/128, model dtype other than "
        "fp16/bf16); triton = the same but a start-up error there; torch = estimation and PyTorch sparse attention "
        "on K/V gathered from the cache (slow, for debugging)."))
    skip_tile_below: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Skip-softmax filter in the Triton kernel (0 = off): a key tile of a sparse row's listed blocks below "
        "the diagonal is left out when each of its weights is below this share of its row's largest so far "
        "(e.g. 1e-4). Experimental: on an H200 the kernel takes 1.34-1.46x its time with it on, skipped tiles or "
        "not (docs/kernel-measurements.md); not calibrated. The torch path ignores it."))
    kv_block_size: Literal["auto", "16", "32", "64", "128"] = Field("auto", description=(
        "CUDA: KV-cache page size asked of vLLM when --block-size is not given. auto = 64 on compute capability "
        "9.0+ with decode_mode=dense (each 64-key kernel tile is then one page, loaded with TMA), vLLM's "
        "default (16) elsewhere. An explicit --block-size wins."))
    # Files.
    head_config: str | None = Field(None, description=(
        "Per-model head-config file (JSON): an existing path or one ending in .json, else the bare name (no "
        "'/' or '..') of a file in head_configs/, without .json."))
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings, description=(
        "The stats file, the Prometheus port and the timing sample rate."))

    # Decode (issue 8): how decode steps attend; widths are fixed so a step can be captured in a
    # CUDA graph. How the modes work: docs/decode-modes.md.
    decode: DecodeSettings = Field(default_factory=DecodeSettings, description="How decode steps attend.")

    # KV placement (issue 54): where each block's full K/V lives. docs/decode-offload.md.
    kv_placement: str = Field("gpu", json_schema_extra={"registry": "kv_placement"}, description=(
        "Where each KV-cache block's K/V lives: gpu = vLLM's cache. host (a pinned host pool with a GPU hot "
        "cache of host_kv_hot_pages pages per layer; vLLM's page keeps the key summaries; decode_mode=topk) "
        "is wired into the backends but has not run on a GPU server yet: setting it is a start-up error."))
    host_kv_hot_pages: int = Field(256, ge=1, description=(
        "kv_placement=host: GPU slots per layer for pages copied from the host pool (least recently used "
        "reused first; sink and recent pages never evicted); checked at start-up against the largest decode step: "
        "one sequence's decode_sink_pages + decode_recent_pages + decode_budget_pages x the model's KV heads "
        "beside the sink and recent pages of the other --max-num-seqs - 1 sequences."))
    host_kv_pool_bytes: int | None = Field(None, ge=1, description=(
        "kv_placement=host: host memory of the pool holding every block's K/V (all layers); vLLM's blocks "
        "must fit in it (cap them with --num-gpu-blocks-override). Required with kv_placement=host."))
    host_kv_prefill_pages: int = Field(0, ge=0, description=(
        "kv_placement=host: earlier pages a prefill chunk reads from the pool beside its decode_sink_pages and "
        "the decode_recent_pages before it, those whose summaries promise its last 64 queries the most "
        "attention; 0 = every page (dense prefill over the whole context)."))
    host_kv_dtype: Literal["auto", "fp8_e4m3"] = Field("auto", description=(
        "kv_placement=host: how pool and hot cache store pages: auto = the model's K/V dtype; fp8_e4m3 = fp8 "
        "with one scale per page, KV head and K/V (half the bytes of bf16)."))

    @model_validator(mode="after")
    def _check_kv_placement(self) -> Self:
        if self.kv_placement != "host":
            return self
        if self.decode.mode != "topk":  # vLLM's page then holds only what the top-k selection scores
            raise ValueError(f"kv_placement=host: needs decode_mode=topk (not {self.decode.mode})")
        if self.host_kv_pool_bytes is None:
            raise ValueError("host_kv_pool_bytes: must be set with kv_placement=host (the host memory of the pool)")
        return self

    def replace(self, **changes: Any) -> Self:
        """A validated copy with ``changes`` (flat names or nested groups, as the constructor takes)."""
        return type(self)(**nest_settings(self.flat_settings, _as_dict(self), changes))

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        # pydantic's copy does not validate: a grouped setting's flat name would become a stray
        # attribute and change nothing, so an update naming one goes through replace()
        if update and not set(update) <= set(type(self).model_fields):
            return self.replace(**update)
        return super().model_copy(update=update, deep=deep)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        return nest_settings(cls.flat_settings, data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _check_blocks(self) -> Self:
        # block_size's own check, then the pattern settings whose bounds depend on it
        v = self.block_size
        if v < 16 or v > 256 or v & (v - 1):
            raise ValueError(f"block_size={v}: must be a power of two between 16 and 256")
        for name in type(self.patterns).model_fields:
            getattr(self.patterns, name).check_with(self)
        return self


class Setting(NamedTuple):
    """One user-facing setting: where it lives in the model and its field (type, bounds, text)."""
    path: tuple[str, ...]  # ("decode", "spans", "theta"): its place in SparseSettings
    field: FieldInfo

    @property
    def key(self) -> str:
        """The nested JSON key, dotted: ``observability.stats_file``."""
        return ".".join(self.path)


def _group_model(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def settings_of(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> dict[str, Setting]:
    """Every setting of ``model`` by its flat name (TypeError where two share one)."""
    out: dict[str, Setting] = {}
    for name, field in model.model_fields.items():
        group = _group_model(field)
        flat = (field.json_schema_extra or {}).get("flat", name)
        found = settings_of(group, prefix + (name,)) if group else {flat: Setting(prefix + (name,), field)}
        for alias, setting in found.items():
            if alias in out:  # the flat alias must say one field (the env variable is built from it)
                raise TypeError(f"settings {out[alias].key} and {setting.key} share the name {alias!r}")
            out[alias] = setting
    return out


def _as_dict(value: Any) -> Any:
    """A group given as a model instance, as the fields it was given (so that it merges)."""
    if isinstance(value, BaseModel):
        return {name: getattr(value, name) for name in value.model_fields_set}
    return dict(value) if isinstance(value, Mapping) else value


def _merge(into: dict, path: tuple[str, ...], value: Any, *, later_wins: bool, given_as: str) -> None:
    *groups, leaf = path
    node = into
    for g in groups:
        group = _as_dict(node.get(g, {}))  # a model instance given for the group merges too
        if not isinstance(group, dict):  # a group given as a scalar: pydantic names it
            return
        node[g] = node = group
    old, new = _as_dict(node.get(leaf)), _as_dict(value)
    if isinstance(old, dict) and isinstance(new, dict):
        node[leaf] = old
        for name, v in new.items():
            _merge(old, (name,), v, later_wins=later_wins, given_as=f"{given_as}.{name}")
    elif leaf in node and not later_wins:
        raise ValueError(f"'{given_as}' is given twice (by its flat name and nested)")
    else:
        node[leaf] = value


def nest_settings(settings: Mapping[str, Setting], *layers: Mapping[str, Any]) -> dict[str, Any]:
    """Settings values with each flat alias of ``settings`` (a model's ``flat_settings``) moved
    to its nested place (``stats_file`` -> ``observability.stats_file``); with several layers a
    later layer's value wins. Within one layer a setting given both flat and nested is an error."""
    out: dict[str, Any] = {}
    for values in layers:
        layer: dict[str, Any] = {}
        for key, value in values.items():
            path = settings[key].path if key in settings else (key,)
            _merge(layer, path, value, later_wins=False, given_as=".".join(path))
        for key, value in layer.items():
            _merge(out, (key,), value, later_wins=True, given_as=key)
    return out


def _lookup(values: Mapping[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = values
    for name in path:
        if not isinstance(node, Mapping) or name not in node:
            return False, None
        node = node[name]
    return True, node


def _format_error(where: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "(settings)"
        lines.append(f"{where}: field '{field}': {e['msg']}")
    return "\n".join(lines)


S = TypeVar("S", bound=SparseSettingsBase)
# A check of a field whose value names a registered thing: returns the name, or raises ValueError
# saying which names are known.
NameCheck = Callable[[str], str]


def read_settings(model: type[S], env: Mapping[str, str] | None = None,
                  names: Mapping[str, NameCheck] | None = None) -> S:
    """Build settings of class ``model`` (:class:`.settings.SparseSettings`, whose
    ``settings.load_settings`` calls this) from ``VLLM_SPARSE_CONFIG`` (JSON file) and
    ``VLLM_SPARSE_*`` variables. ``names`` checks, by flat setting name, the values that name registered things (the
    registries own them: ``startup.load_checked_settings`` passes them all)."""
    env = os.environ if env is None else env
    settings = model.flat_settings
    names = names or {}
    from_file: dict[str, Any] = {}
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
            from_file = nest_settings(settings, data)
            model(**from_file)
        except ValueError as e:  # ValidationError included
            raise ConfigError(_format_error(path, e) if isinstance(e, ValidationError) else f"{path}: {e}") from None
        for name, check in names.items():
            given, value = _lookup(from_file, settings[name].path)
            if given:
                try:
                    check(value)
                except ValueError as e:
                    raise ConfigError(f"{path}: field '{settings[name].key}': {e}") from None
    from_env: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key in NON_SETTING_ENV:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in settings:
            known = ", ".join(ENV_PREFIX + f.upper() for f in settings)
            raise ConfigError(f"environment variable {key}: unknown setting (known: {known})")
        from_env[name] = None if raw.strip().lower() in ("", "none", "null") else raw
        field = settings[name].field
        try:  # the field alone, so the message names this variable
            TypeAdapter(Annotated[field.annotation, field]).validate_python(from_env[name])
        except ValidationError as e:
            raise ConfigError(f"environment variable {key}={raw!r}: {e.errors()[0]['msg']}") from None
        if name in names and from_env[name] is not None:
            try:
                names[name](from_env[name])
            except ValueError as e:
                raise ConfigError(f"environment variable {key}={raw!r}: {e}") from None
    try:
        return model(**nest_settings(settings, from_file, from_env))
    except ValidationError as e:
        where = " + ".join(filter(None, [path, "VLLM_SPARSE_* variables"]))
        raise ConfigError(_format_error(where, e)) from None
