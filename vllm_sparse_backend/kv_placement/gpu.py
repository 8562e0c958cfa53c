"""``kv_placement=gpu`` (the default): every block's K/V stays in vLLM's own cache, where
vLLM's cache update already wrote it; a block's slot is its block id."""

from __future__ import annotations

from typing import Sequence

import torch

from ..settings import SparseSettings
from .base import KVLayout, Residency


class GPUPlacement:
    name = "gpu"
    wired = True  # what the backends do today, with no placement object at all

    def __init__(self, settings: SparseSettings | None = None, layout: KVLayout | None = None):
        pass

    def write(self, layer: int, block_ids: Sequence[int], key_pages: torch.Tensor,
              value_pages: torch.Tensor) -> None:
        """Nothing: vLLM's cache update wrote the pages in place."""

    def fetch(self, layer: int, block_ids: Sequence[int]) -> Residency:
        return Residency(slots=list(block_ids))

    def resident_pages(self, layer: int, key_cache: torch.Tensor,
                       value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return key_cache, value_cache

    def set_pinned(self, block_ids: Sequence[int]) -> None:
        """Nothing: every block is resident."""

    def free(self, block_ids: Sequence[int]) -> None:
        """Nothing: vLLM owns the pages."""
