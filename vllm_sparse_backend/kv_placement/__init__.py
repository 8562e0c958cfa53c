"""KV placements by name: the one place that lists them (issue 54).

Each placement is a file of this folder holding a :class:`.base.KVPlacement`, plus one line
below. ``kv_placement=gpu`` (the default) is what the backends do without any placement object.
"""

from __future__ import annotations

from ..settings import SparseSettings
from .base import KVLayout, KVPlacement, Residency
from .gpu import GPUPlacement
from .host import HostPlacement

KV_PLACEMENTS: dict[str, type] = {
    GPUPlacement.name: GPUPlacement,
    HostPlacement.name: HostPlacement,
}


def check_kv_placement_name(name: str) -> str:
    """``name`` if a placement is registered under it and serving runs it (the ``kv_placement``
    setting); ValueError naming the known ones, or saying it is not wired, otherwise."""
    if name not in KV_PLACEMENTS:
        raise ValueError(f"unknown KV placement '{name}' (known: {', '.join(KV_PLACEMENTS)})")
    if not KV_PLACEMENTS[name].wired:
        raise ValueError(f"kv_placement={name} is not wired into serving yet, see docs/decode-offload.md")
    return name


def kv_placement(settings: SparseSettings, layout: KVLayout) -> KVPlacement:
    """The placement ``settings.kv_placement`` names, for a cache of ``layout``."""
    return KV_PLACEMENTS[settings.kv_placement](settings, layout)


__all__ = ["KV_PLACEMENTS", "KVLayout", "KVPlacement", "Residency", "check_kv_placement_name", "kv_placement"]
