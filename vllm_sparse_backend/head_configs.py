"""Per-model, per-layer, per-head pattern files (``head_configs/*.json``).

Schema (JSON, validated with pydantic; see head_configs/README.md)::

    {
      "format": "vllm-sparse-head-config", "version": 1,
      "model": "SmolLM2-135M-Instruct", "num_layers": 30, "num_heads": 9, "num_kv_heads": 3,
      "produced_by": "how the file was made (tool, settings, data)",
      "layers": [ {"heads": [ {"pattern": "vertical_slash", "vertical_size": 1000,
                               "slash_size": 6096, "score": 0.93}, ... one per query head ]},
                  ... one per layer ]
    }

Head numbers are global query-head indices; under tensor parallelism rank r uses heads
``r * local_heads .. (r+1) * local_heads - 1``. A head entry names its pattern and may set that
pattern's parameters (its ``head_params``, ``prefill/patterns``); anything left out comes from
the pattern's settings (``settings.patterns.<pattern>``). Nothing here names a pattern's
parameters: the registry says them.

The MInference format (a list of layers, each ``{"<head>": [pattern, vertical, slash, score]}``
with patterns ``vertical_and_slash``, ``stream_llm`` and ``block_sparse``) is converted by
:func:`import_minference`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from .config import ConfigError
from .settings import SparseSettings
from .prefill.patterns import check_pattern_name, get_pattern

FORMAT_NAME = "vllm-sparse-head-config"


def _registered_pattern(name: str) -> str:
    try:
        return check_pattern_name(name)
    except ValueError as e:  # pydantic's own wording would prefix "Value error, "
        raise PydanticCustomError("unknown_pattern", str(e)) from None


class HeadPattern(BaseModel):
    """One query head's entry: its pattern, the parameters of that pattern the entry sets
    (validated by the pattern's ``head_params``; the rest come from its pattern's settings), and
    the search's score. ``HeadPattern(pattern="a_shape", local_window=512)``."""

    # the parameters arrive as extra fields, checked against the pattern's model below
    model_config = ConfigDict(extra="allow", frozen=True)

    pattern: Annotated[str, AfterValidator(_registered_pattern)]
    score: float | None = None

    @model_validator(mode="after")
    def _parameters_of_its_pattern(self) -> "HeadPattern":
        params = get_pattern(self.pattern).head_params
        try:
            params.model_validate(self.params, strict=True)  # a head config is JSON: "7" or true is no budget
        except ValidationError as e:
            known = ", ".join(params.model_fields) or "none"
            problems = []
            for err in e.errors():
                field = ".".join(str(x) for x in err["loc"])
                if err["type"] == "extra_forbidden":
                    problems.append(f"field '{field}': not a parameter of pattern '{self.pattern}' (its "
                                    f"parameters: {known})")
                else:
                    problems.append(f"field '{field}': {err['msg']}")
            raise PydanticCustomError("head_parameters", "; ".join(problems)) from None
        return self

    @property
    def params(self) -> dict[str, Any]:
        """The pattern parameters this entry sets."""
        return dict(self.model_extra or {})


class LayerHeads(BaseModel):
    model_config = ConfigDict(extra="forbid")

    heads: list[HeadPattern]


class HeadConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["vllm-sparse-head-config"]
    version: Literal[1]
    model: str
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    # Optional (files written before it existed lack it): the model's KV heads, so that a file
    # whose per-KV-group patterns were made for another GQA layout is caught at start-up.
    num_kv_heads: int | None = Field(None, ge=1)
    produced_by: str = ""
    settings: dict[str, Any] = Field(default_factory=dict, description="Settings used when producing the file.")
    layers: list[LayerHeads]

    @model_validator(mode="after")
    def _check_shape(self) -> "HeadConfigFile":
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if len(self.layers) != self.num_layers:
            raise ValueError(f"'layers' has {len(self.layers)} entries but num_layers is {self.num_layers}")
        for i, layer in enumerate(self.layers):
            if len(layer.heads) != self.num_heads:
                raise ValueError(f"layer {i}: 'heads' has {len(layer.heads)} entries but num_heads is {self.num_heads}")
        return self


def _describe_loc(loc: tuple) -> str:
    """('layers', 3, 'heads', 5, 'slash_size') -> "layer 3, head 5, field 'slash_size'"."""
    parts, rest = [], list(loc)
    if len(rest) >= 2 and rest[0] == "layers" and isinstance(rest[1], int):
        parts.append(f"layer {rest[1]}")
        rest = rest[2:]
        if len(rest) >= 2 and rest[0] == "heads" and isinstance(rest[1], int):
            parts.append(f"head {rest[1]}")
            rest = rest[2:]
    if rest:
        parts.append("field '" + ".".join(str(x) for x in rest) + "'")
    return ", ".join(parts) or "file"


def parse_head_config(data: Any, source: str) -> HeadConfigFile:
    try:
        return HeadConfigFile.model_validate(data)
    except ValidationError as e:
        # a head's parameter errors name their fields already ("field 'x': ...")
        msgs = [f"{source}: {_describe_loc(tuple(err['loc']))}" + (", " if err["type"] == "head_parameters" else ": ")
                + err["msg"] for err in e.errors()]
        raise ConfigError("invalid head config\n" + "\n".join(msgs)) from None


def _read_json(path: str | Path, what: str = "head config") -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None


def load_head_config(path: str | Path) -> HeadConfigFile:
    """Read and validate a head-config file (plain JSON; nothing is ever unpickled)."""
    return parse_head_config(_read_json(path), str(path))


def _shipped_folder():
    """head_configs/ as installed (package data), or in a source checkout on sys.path."""
    try:
        return resources.files("vllm_sparse_backend.shipped_head_configs")
    except ModuleNotFoundError:  # a source checkout on sys.path: the folder is not mapped
        return Path(__file__).resolve().parent.parent / "head_configs"


def shipped_head_config_names() -> list[str]:
    """The names ``VLLM_SPARSE_HEAD_CONFIG`` accepts for the files shipped in head_configs/."""
    return sorted(f.name[:-len(".json")] for f in _shipped_folder().iterdir() if f.name.endswith(".json"))


def resolve_head_config(spec: str) -> HeadConfigFile:
    """The file the ``head_config`` setting (``VLLM_SPARSE_HEAD_CONFIG``) names. A missing or
    malformed file raises ConfigError naming the field and the value.

    The rule that tells the two spellings apart: a value that is an existing path, or ends in
    ``.json``, is a path and is read as given. Anything else is a shipped name: a bare file name
    of head_configs/ without ``.json``, so one with a path separator or ``..`` (``../../x``,
    ``/etc/x``) is refused rather than joined onto the folder, and a name can never reach a file
    outside the shipped folder."""
    path = Path(spec)
    if path.exists() or spec.endswith(".json"):
        return load_head_config(path)
    shipped_names = ", ".join(shipped_head_config_names())
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if ".." in spec or any(sep in spec for sep in separators) or not spec.strip():
        raise ConfigError(f"field 'head_config' = {spec!r}: no such head-config file, and not a shipped "
                          f"head-config name (a name is a bare file name, without '/', '\\' or '..'; shipped: "
                          f"{shipped_names})")
    shipped = _shipped_folder() / f"{spec}.json"
    if not shipped.is_file():
        raise ConfigError(f"field 'head_config' = {spec!r}: no such head-config file or shipped name "
                          f"(shipped: {shipped_names})")
    with resources.as_file(shipped) as p:
        return load_head_config(p)


@dataclass(frozen=True)
class ModelShape:
    """What a head-config file must fit: the model's attention layers and heads (all ranks)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    source: str = "the model"  # where the numbers come from, for messages


def model_shape_from_hf_config(config: dict, source: str) -> ModelShape:
    """The shape from a Hugging Face ``config.json`` (its ``text_config`` for multimodal
    models): ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (absent =
    one KV head per query head, as transformers reads it)."""
    text = config.get("text_config") or config
    values = {}
    for key in ("num_hidden_layers", "num_attention_heads"):
        v = text.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{source}: field '{key}': expected a positive integer, got {v!r}")
        values[key] = v
    kv = text.get("num_key_value_heads") or values["num_attention_heads"]
    if not isinstance(kv, int) or kv < 1 or values["num_attention_heads"] % kv:
        raise ConfigError(f"{source}: field 'num_key_value_heads': {kv!r} does not divide "
                          f"num_attention_heads={values['num_attention_heads']}")
    return ModelShape(values["num_hidden_layers"], values["num_attention_heads"], kv, source)


def read_model_shape(model_dir: str | Path) -> ModelShape:
    """:func:`model_shape_from_hf_config` of ``model_dir/config.json``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: not a Hugging Face model folder (no config.json)")
    data = _read_json(path, "the model config")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object (a Hugging Face model config)")
    return model_shape_from_hf_config(data, str(path))


class HeadConfigMisfit(ConfigError):
    """A valid head-config file made for a model of another shape (layers, heads, KV groups)."""


def check_fits_hf_config(cfg: HeadConfigFile, hf_config: dict, model: str, source: str) -> None:
    """:func:`check_fits_model` against a Hugging Face config of ``model`` (a ``config.json``, or
    the dict of the config vLLM built). A config that does not give the shape raises a plain
    ConfigError; one that gives it and does not fit, HeadConfigMisfit."""
    check_fits_model(cfg, model_shape_from_hf_config(hf_config, f"model {model}"), source)


def check_fits_model(cfg: HeadConfigFile, shape: ModelShape, source: str) -> None:
    """Raise HeadConfigMisfit, a ConfigError (one line per mismatch, each naming ``source`` and the field) unless
    the file has the model's layer and query-head counts and, where it says so, its KV-group
    layout: ``num_kv_heads`` if the file records it, and uniform KV groups where the file says
    it was searched per KV group (one selection shared by a group's heads; on another GQA
    layout its groups would split and the sharing would silently turn off)."""
    problems = []
    if cfg.num_layers != shape.num_layers:
        problems.append(f"field 'num_layers': {cfg.num_layers}, but {shape.source} has {shape.num_layers} "
                        "layers (num_hidden_layers)")
    if cfg.num_heads != shape.num_heads:
        problems.append(f"field 'num_heads': {cfg.num_heads}, but {shape.source} has {shape.num_heads} "
                        "query heads per layer (num_attention_heads)")
    if cfg.num_kv_heads is not None and cfg.num_kv_heads != shape.num_kv_heads:
        problems.append(f"field 'num_kv_heads': {cfg.num_kv_heads}, but {shape.source} has {shape.num_kv_heads} "
                        "KV heads per layer (num_key_value_heads)")
    if not problems and cfg.settings.get("selection") == "per_kv_group":
        group = shape.num_heads // shape.num_kv_heads
        for i, layer in enumerate(cfg.layers):
            for g in range(shape.num_kv_heads):
                heads = layer.heads[g * group:(g + 1) * group]
                if any(_without_score(h) != _without_score(heads[0]) for h in heads):
                    problems.append(
                        f"layer {i}, heads {g * group}..{(g + 1) * group - 1}: field 'settings.selection' says "
                        f"per_kv_group, but {shape.source}'s KV group {g} ({group} query heads per KV head) mixes "
                        "patterns or budgets (a file made for another GQA layout?)")
                    break
            if len(problems) >= 3:
                break
    if problems:
        raise HeadConfigMisfit("head config does not fit the model\n" + "\n".join(f"{source}: {p}" for p in problems))


def _without_score(h: HeadPattern) -> HeadPattern:
    return h.model_copy(update={"score": None})


def save_head_config(cfg: HeadConfigFile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cfg.model_dump(mode="json", exclude_none=True), indent=1) + "\n")


_MINFERENCE_PATTERNS = {
    "vertical_and_slash": "vertical_slash",
    "stream_llm": "a_shape",
    "block_sparse": "block_sparse",
}


def import_minference(data: Any, model: str, source: str = "<minference config>") -> HeadConfigFile:
    """Convert MInference's per-head format to ours.

    ``vertical_and_slash (v, s)`` keeps both budgets; ``stream_llm (v, s)`` becomes A-shape with
    v sink tokens and an s-token local window; ``block_sparse`` becomes block-sparse with the
    global ``topk_blocks`` (MInference's kernels ignore the stored numbers and use 100 blocks).
    """
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{source}: expected a non-empty JSON list of layers (MInference format)")
    num_heads = None
    layers = []
    for li, layer in enumerate(data):
        if not isinstance(layer, dict) or not layer:
            raise ConfigError(f"{source}: layer {li}: expected an object mapping head index to [pattern, vertical, slash, score]")
        try:
            by_head = {int(h): v for h, v in layer.items()}
        except ValueError:
            raise ConfigError(f"{source}: layer {li}: head keys must be integers, got {sorted(layer)[:5]}") from None
        if sorted(by_head) != list(range(len(by_head))):
            raise ConfigError(f"{source}: layer {li}: heads must be numbered 0..{len(by_head) - 1}")
        if num_heads is None:
            num_heads = len(by_head)
        elif len(by_head) != num_heads:
            raise ConfigError(f"{source}: layer {li}: {len(by_head)} heads, layer 0 has {num_heads}")
        heads = []
        for h in range(num_heads):
            entry = by_head[h]
            where = f"{source}: layer {li}, head {h}"
            if not isinstance(entry, (list, tuple)) or len(entry) != 4:
                raise ConfigError(f"{where}: expected [pattern, vertical_size, slash_size, score], got {entry!r}")
            name, vert, slash, score = entry
            if name not in _MINFERENCE_PATTERNS:
                raise ConfigError(f"{where}, field 'pattern': unknown pattern {name!r} (known: {sorted(_MINFERENCE_PATTERNS)})")
            for field, val in (("vertical_size", vert), ("slash_size", slash)):
                if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                    raise ConfigError(f"{where}, field '{field}': expected a positive integer, got {val!r}")
            if not isinstance(score, (int, float)) or isinstance(score, bool):
                raise ConfigError(f"{where}, field 'score': expected a number, got {score!r}")
            pattern = _MINFERENCE_PATTERNS[name]
            if pattern == "vertical_slash":
                hp = HeadPattern(pattern=pattern, vertical_size=vert, slash_size=slash, score=float(score))
            elif pattern == "a_shape":
                hp = HeadPattern(pattern=pattern, sink_tokens=vert, local_window=slash, score=float(score))
            else:
                hp = HeadPattern(pattern=pattern, score=float(score))
            heads.append(hp)
        layers.append(LayerHeads(heads=heads))
    return HeadConfigFile(
        format=FORMAT_NAME, version=1, model=model, num_layers=len(layers), num_heads=num_heads,
        produced_by=f"imported from MInference format ({source})", layers=layers)


@dataclass(frozen=True)
class ResolvedHead:
    """A head's pattern with each of that pattern's parameters filled in (what the planner and
    the estimators consume). Hashable: equal heads are counted and grouped together."""

    pattern: str  # a registered pattern's name (vllm_sparse_backend.prefill.patterns)
    params: tuple[tuple[str, int | float], ...] = ()  # (name, value), in the order of the pattern's head_params

    def param(self, name: str) -> int | float:
        for n, value in self.params:
            if n == name:
                return value
        raise KeyError(f"pattern {self.pattern!r} has no head parameter {name!r} "
                       f"(its parameters: {', '.join(n for n, _ in self.params) or 'none'})")


def resolve_head(hp: HeadPattern | None, settings: SparseSettings) -> ResolvedHead:
    """``hp``'s pattern with every parameter of it: the entry's value, else its pattern's setting
    of that name (``settings.patterns.<pattern>``), else the parameter's own default (``hp``
    None: ``default_pattern`` from the settings)."""
    pattern = get_pattern(hp.pattern if hp is not None else settings.default_pattern)
    given = hp.params if hp is not None else {}
    own = getattr(settings.patterns, pattern.name, None)  # None: a pattern with no settings (dense)
    defaults = pattern.head_params()
    params = []
    for name in pattern.head_fields:
        value = given.get(name)
        if value is None:
            value = getattr(own, name, None)
        if value is None:
            value = getattr(defaults, name)
        if value is None:
            raise ConfigError(f"pattern {pattern.name!r}: head parameter {name!r} has no value (no entry, "
                              f"no setting patterns.{pattern.name}.{name}, no default)")
        params.append((name, value))
    return ResolvedHead(pattern.name, tuple(params))


def layer_heads(
    cfg: HeadConfigFile | None,
    settings: SparseSettings,
    layer_index: int,
    num_local_heads: int,
    tp_rank: int = 0,
) -> list[ResolvedHead]:
    """Patterns of this rank's query heads for one layer; the global default where no file applies."""
    if cfg is None:
        return [resolve_head(None, settings)] * num_local_heads
    if not 0 <= layer_index < cfg.num_layers:
        raise ConfigError(f"head config for {cfg.model!r} has {cfg.num_layers} layers; layer {layer_index} requested")
    first = tp_rank * num_local_heads
    if first + num_local_heads > cfg.num_heads:
        raise ConfigError(
            f"head config for {cfg.model!r} has {cfg.num_heads} heads per layer; rank {tp_rank} needs heads "
            f"{first}..{first + num_local_heads - 1}")
    return [resolve_head(h, settings) for h in cfg.layers[layer_index].heads[first:first + num_local_heads]]
