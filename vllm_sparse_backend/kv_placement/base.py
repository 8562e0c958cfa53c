"""The KV-placement interface: where a layer's K/V page for a vLLM block id lives, and how a
step's blocks are made resident on the GPU before attention reads them (issue 54).

vLLM allocates, shares (prefix caching) and frees blocks; a placement only decides where each
block's full K/V page is kept. ``gpu`` keeps it in vLLM's own cache; ``host`` keeps it in a pool
in host memory and copies the pages a step needs into a fixed set of GPU slots. Attention then
reads ``resident_pages(layer, ...)[slot]`` for the slot :meth:`KVPlacement.fetch` gave each block,
whatever the placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch



@dataclass(frozen=True)
class KVLayout:
    """The shape of a model's paged KV cache as vLLM built it: every attention layer has the
    same block ids (vLLM gives each layer of a KV-cache group the same block table)."""

    num_layers: int
    num_blocks: int  # vLLM's block ids are 0 .. num_blocks - 1
    page_size: int  # tokens per block
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype  # the model's K/V dtype (what a write brings)
    device: torch.device | str = "cpu"  # where attention runs (the resident pages)

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.page_size, self.num_kv_heads, self.head_size)


@dataclass
class Residency:
    """What :meth:`KVPlacement.fetch` did for one layer: ``slots[i]`` holds ``block_ids[i]``
    in the layer's resident pages; ``copied`` lists the blocks it had to bring in (in order),
    ``evicted`` those whose slots it took."""

    slots: list[int]
    copied: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)


class KVPlacement(Protocol):
    """A KV placement, made from the settings and the cache's layout
    (``KV_PLACEMENTS[name](settings, layout)``)."""

    name: str  # the kv_placement setting
    # whether the serving path can run it; a placement that cannot is refused by the settings at
    # start-up instead of running half-wired
    wired: bool

    def write(self, layer: int, block_ids: Sequence[int], key_pages: torch.Tensor,
              value_pages: torch.Tensor) -> None:
        """Whole pages ``[n, page, Hkv, D]`` of ``block_ids`` as the layer's K/V just became."""

    def fetch(self, layer: int, block_ids: Sequence[int]) -> Residency:
        """Make the layer's pages of ``block_ids`` resident for this step."""

    def resident_pages(self, layer: int, key_cache: torch.Tensor,
                       value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[slots, page, Hkv, D]`` K and V that :attr:`Residency.slots` index, given the
        layer's vLLM cache."""

    def set_pinned(self, block_ids: Sequence[int]) -> None:
        """Blocks that must stay resident once fetched (every running request's sink and recent
        pages), replacing the previous set."""

    def free(self, block_ids: Sequence[int]) -> None:
        """vLLM reallocates these block ids: their pages are gone."""
