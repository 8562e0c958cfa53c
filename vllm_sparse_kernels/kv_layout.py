"""How K and V are laid out for attention: query heads mapped to their KV head (GQA), and one
sequence's keys and values read out of vLLM's paged cache into contiguous tensors.

Production code (the CPU path's attention, the torch estimators, the CUDA backend's fallbacks)
runs these, so they live outside :mod:`.reference`, which keeps only the oracles tests compare
against. Torch only (no triton).
"""

from __future__ import annotations

import torch


def kv_head_map(num_heads: int, num_kv_heads: int, device=None) -> torch.Tensor:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Contiguous [kv_len, Hkv, D] of one sequence out of one paged cache
    ([num_blocks, block_size, Hkv, D] view, any strides: NHD and HND layouts both work; block_table:
    [max_blocks]). fp8 caches are gathered as bytes (indexing fp8 tensors is missing from some torch
    builds) and returned in their own dtype, not dequantised."""
    page = cache.shape[1]
    pages = block_table[: (kv_len + page - 1) // page].to(torch.int64)
    raw = cache.view(torch.uint8) if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else cache
    return raw[pages].reshape(-1, *cache.shape[2:])[:kv_len].view(cache.dtype)


def gather_paged_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous K/V [kv_len, Hkv, D] of one sequence from vLLM's paged cache
    (:func:`gather_pages` of each; key_cache/value_cache are what
    ``kv_cache.transpose(1, 2).split(head_size, -1)`` gives on CUDA)."""
    return gather_pages(key_cache, block_table, kv_len), gather_pages(value_cache, block_table, kv_len)
