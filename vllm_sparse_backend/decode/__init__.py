"""Decode modes beside vLLM's own dense decode, by name: the one place that lists them.

``decode_mode=dense`` (the default) has no mode: decode is the wrapped backend's. Each other
mode is a file of this folder holding a :class:`.base.DecodeMode`, plus one line below.
"""

from __future__ import annotations

from ..settings import SparseSettings
from .base import DecodeMode
from .spans import SpanDecode
from .topk import TopkDecode

DECODE_MODES: dict[str, type] = {
    TopkDecode.name: TopkDecode,
    SpanDecode.name: SpanDecode,
}


def check_decode_mode_name(name: str) -> str:
    """``name`` if it is ``dense`` or a registered mode (the ``decode_mode`` setting); ValueError
    naming the known ones otherwise."""
    if name != "dense" and name not in DECODE_MODES:
        raise ValueError(f"unknown decode mode '{name}' (known: {', '.join(['dense', *DECODE_MODES])})")
    return name


def decode_mode(settings: SparseSettings) -> DecodeMode | None:
    """The mode ``settings.decode.mode`` names; None for dense (the wrapped backend's decode)."""
    if settings.decode.mode == "dense":
        return None
    return DECODE_MODES[settings.decode.mode](settings)
