"""What the decode kernels read of vLLM's paged KV cache, shared by :mod:`.topk_decode` and
:mod:`.span_decode`: the cache's geometry check, the keys of one page, the last write of a page
in a slot mapping, and the best pages of per-page scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..topk_select import topk_ascending

# Cache (and page summary) dtypes the decode kernels take; fp8 caches, which need their scales,
# are not supported.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_cache(key_cache: torch.Tensor) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, head_dim) of a ``[num_pages, page_size, Hkv, D]`` cache view."""
    if key_cache.dim() != 4:
        raise ValueError(f"key cache must be [num_pages, page_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)}")
    if key_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"cache dtype {key_cache.dtype} not supported (fp16, bf16, fp32)")
    page, hkv, d = key_cache.shape[1:]
    if page & (page - 1):
        raise ValueError(f"page size {page} must be a power of two")
    return page, hkv, d


@triton.jit
def page_key_tile(k_ptr, page, n_valid, kvh, s_kp, s_kt, s_kh, s_kd,
                  PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The first ``n_valid`` keys of physical ``page`` and KV head ``kvh`` as fp32 ``[PAGE,
    BLOCK_D]`` (0 elsewhere: unused slots may hold NaN), the validity mask, offs_d and d_ok."""
    offs_t = tl.arange(0, PAGE)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    valid = (offs_t < n_valid)[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + page * s_kp + offs_t[:, None] * s_kt + kvh * s_kh + offs_d[None, :] * s_kd,
                mask=valid, other=0.0).to(tl.float32)
    return k, valid, offs_d, d_ok


@triton.jit
def last_written_slot(slot_ptr, i, num_slots, PAGE: tl.constexpr):
    """Slot ``i`` of a slot_mapping: (slot, physical page, offset, n_valid). ``n_valid`` = offset + 1
    when no later slot of this call continues the page (only the last write of a page recomputes
    it), else 0; 0 for padding (-1)."""
    slot = tl.load(slot_ptr + i).to(tl.int64)
    nxt = tl.load(slot_ptr + i + 1, mask=i + 1 < num_slots, other=-1).to(tl.int64)
    page = tl.maximum(slot // PAGE, 0)
    offset = slot % PAGE
    last_of_page = (nxt != slot + 1) | (offset == PAGE - 1)
    return slot, page, offset, tl.where((slot >= 0) & last_of_page, offset + 1, 0)


def top_pages(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` best pages of fp32 page scores ``[batch, S, score_width]``: (selected int32
    ``[batch, S, width]`` logical pages ascending, -1 where the score is -inf; counts ``[batch,
    S]``). Forced pages scored +inf always make the width; pages past the sequence are -inf and
    have the highest page numbers, so in ascending order they come last and are cut off there."""
    batch, n_sel, score_width = scores.shape
    ids, _, vals = topk_ascending(scores.view(batch * n_sel, score_width), width, return_values=True)
    ok = (vals > float("-inf")).view(batch, n_sel, width)
    return torch.where(ok, ids.view(batch, n_sel, width), -1), ok.sum(-1, dtype=torch.int32)
