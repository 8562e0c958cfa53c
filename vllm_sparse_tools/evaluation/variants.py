"""Named configurations compared by the accuracy runs and the attention check.

A variant is a label and a set of :class:`~vllm_sparse_backend.settings.SparseSettings` overrides
(``None`` for the dense baseline: vLLM's own backend, no plugin). The accuracy runs pass the
overrides to the server as ``VLLM_SPARSE_<FIELD>`` variables; the attention check builds the same
settings in process, so both measure the same selections.

Spec strings (command lines): a preset name (``dense``, ``vs``, ``flex0.9``, ...), or
``LABEL=FIELD=VALUE[,FIELD=VALUE...]`` with settings field names, e.g.
``vs-small=vertical_size=250,slash_size=500`` or ``searched=head_config=qwen.json``; or
``LABEL=peer``: another project's sparse attention in the same ``vllm serve`` (:mod:`.peers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from vllm_sparse_backend.config import ENV_PREFIX
from vllm_sparse_backend.settings import SETTINGS, SparseSettings, nest_settings

# The library's defaults ("default", and "vs" spelled out): vertical-slash with 1000 columns and
# 6096 diagonals per head (MInference's). FlexPrefill at the paper's two gammas. A-shape and block-sparse at
# their defaults, for the attention check.
PRESETS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "default": {},  # the library's settings as they are (what `vllm serve` runs)
    "vs": {"default_pattern": "vertical_slash"},
    "flex0.9": {"default_pattern": "flex_prefill", "gamma": 0.9},
    "flex0.95": {"default_pattern": "flex_prefill", "gamma": 0.95},
    "ashape": {"default_pattern": "a_shape"},
    "block": {"default_pattern": "block_sparse"},
}


PEER = "peer"  # the spec LABEL=peer: a peer variant (.peers)


@dataclass(frozen=True)
class Variant:
    label: str
    overrides: dict[str, Any] | None  # None: dense baseline, or a peer
    peer: bool = False  # served by a peer's worker class on FLASH_ATTN, without this plugin

    @property
    def dense(self) -> bool:
        return self.overrides is None and not self.peer

    @property
    def ours(self) -> bool:
        """Served by this plugin: ``VLLM_SPARSE_*`` settings and a statistics file."""
        return self.overrides is not None

    def settings(self, **base: Any) -> SparseSettings:
        """Settings of this variant on top of ``base`` (e.g. gating used by every variant); either
        may use flat names or the nested form (``SparseSettings.model_dump()``)."""
        if self.overrides is None:
            raise ValueError(f"variant {self.label!r} is the dense baseline: it has no settings")
        return SparseSettings(**nest_settings(base, self.overrides))

    def env(self, **base: Any) -> dict[str, str]:
        """``VLLM_SPARSE_*`` variables for a server (validated through :meth:`settings`); ``base``
        by flat names, as the variables are."""
        self.settings(**base)
        return {ENV_PREFIX + k.upper(): str(v) for k, v in {**base, **(self.overrides or {})}.items()
                if v is not None}


def parse_variant(spec: str, peers: bool = False) -> Variant:
    """A preset name or ``LABEL=FIELD=VALUE[,FIELD=VALUE...]`` (see the module docstring);
    ``LABEL=peer`` only where ``peers``: a benchmark that does not serve peers would serve one dense."""
    if "=" not in spec:
        if spec not in PRESETS:
            raise ValueError(f"unknown variant {spec!r}: presets are {', '.join(PRESETS)}, or "
                             f"LABEL=FIELD=VALUE[,FIELD=VALUE...], or LABEL={PEER}")
        return Variant(spec, PRESETS[spec])
    label, _, rest = spec.partition("=")
    if rest == PEER:
        if not peers:
            raise ValueError(f"variant {spec!r}: peers run in python -m benchmarks.paired only")
        return Variant(label, None, peer=True)
    overrides: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in SETTINGS:
            raise ValueError(f"variant {spec!r}: {item!r} is not FIELD=VALUE with a settings field "
                             f"(fields: {', '.join(SETTINGS)})")
        overrides[name] = value
    if "head_config" in overrides:
        overrides["head_config"] = str(Path(overrides["head_config"]).expanduser().resolve())
    variant = Variant(label, overrides)
    variant.settings()  # fail now, naming the field, rather than when a server starts
    return variant


def searched_variant(names: Sequence[str], head_config_dir: str | Path) -> Variant | None:
    """``searched``: the first per-head file ``<dir>/<name>.json`` that exists among ``names``
    (shipped files are named after the model's folder, e.g. ``smollm2-135m-instruct.json``)."""
    for name in names:
        path = Path(head_config_dir) / f"{name}.json"
        if path.is_file():
            return Variant("searched", {"head_config": str(path.resolve())})
    return None
