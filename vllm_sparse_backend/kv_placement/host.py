"""``kv_placement=host`` (issue 54, not wired into serving yet): every block's full K/V in a pool
in host memory, indexed by vLLM's block id and layer, and a GPU hot cache of a fixed number of
slots per layer that a step's blocks are copied into (least recently used slots reused first).

- :class:`HostKVPool`: the host pages. Pinned where the hot cache is on a CUDA device, so a
  page's copy to the GPU is an asynchronous DMA; plain CPU tensors elsewhere (tests). Pages are
  stored in the model's dtype or as fp8 e4m3 with one scale per page, KV head and K/V (the
  page's largest magnitude maps to fp8's largest finite value). A block id gets a pool entry at
  its first write and gives it back when freed; a pool with no entry left refuses the write
  with :class:`HostKVPoolFull` (the caller fails that request, not the server).
- :class:`HotPageCache`: one layer's slot bookkeeping, host only.
- :class:`HotPages`: the hot tensors, ``host_kv_hot_pages`` slots per layer, allocated once
  (the backend does it in vLLM's profiling run, so that vLLM sizes its KV cache with them
  counted) and handed to :class:`HostPlacement`, the two above together: a step copies pages
  into existing slots and never allocates, which a CUDA graph of the attention that reads them
  needs. :func:`hot_slots_needed`: the slots no decode step can outgrow.

Why a block's hot copy is dropped on :meth:`HostPlacement.free` and refreshed on a write: vLLM
reuses a block id for other content once it reallocates it, and rewrites the last page of a
decoding sequence every step; either way a stale resident copy would be read as a hit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..settings import SparseSettings
from .base import KVLayout, Residency

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class HostKVPoolFull(RuntimeError):
    """The host pool has no entry left for a new block (the request that wrote it cannot run)."""


class HotCacheTooSmall(ValueError):
    """A step needs more blocks resident at once than the hot cache has slots."""


def storage_dtype(host_kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return FP8 if host_kv_dtype == "fp8_e4m3" else model_dtype


def quantize_pages(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, page, Hkv, D]`` -> (fp8 pages, fp32 scale ``[n, Hkv]``), dequantised = fp8 x scale."""
    amax = pages.float().abs().amax(dim=(1, 3))
    # an all-zero page keeps scale 1: any scale stores its zeros exactly
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (pages.float() / scale[:, None, :, None]).to(FP8), scale


def dequantize_pages(pages: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize_pages`: fp8 ``[n, page, Hkv, D]`` x scale ``[n, Hkv]``, float32."""
    return pages.float() * scale[:, None, :, None]


def pool_block_bytes(layout: KVLayout, host_kv_dtype: str = "auto") -> int:
    """Host bytes of one block's pool entry: its K and V pages of every layer (and their fp8 scales)."""
    dtype = storage_dtype(host_kv_dtype, layout.dtype)
    page_elems = layout.page_size * layout.num_kv_heads * layout.head_size
    scale_bytes = 2 * layout.num_kv_heads * 4 if dtype == FP8 else 0
    return layout.num_layers * (2 * page_elems * dtype.itemsize + scale_bytes)


def pool_capacity(layout: KVLayout, pool_bytes: int, host_kv_dtype: str = "auto") -> int:
    """The blocks a pool of ``pool_bytes`` holds (``layout.num_blocks`` is not read): the most
    vLLM may make, ``--num-gpu-blocks-override`` of a host-KV server."""
    return pool_bytes // pool_block_bytes(layout, host_kv_dtype)


def hot_slots_needed(sink_pages: int, recent_pages: int, budget_pages: int, num_kv_heads: int, page_size: int,
                     num_blocks: int, max_num_seqs: int, max_model_len: int) -> int:
    """The hot slots per layer that make :class:`HotCacheTooSmall` impossible in a decode step.
    A step runs in groups of rows (:func:`..decode.placed.row_groups`), the smallest being one
    row: its selection (sink + recent + a budget per KV head, at most the pages of a
    ``max_model_len`` sequence) beside the pinned sink and recent pages of every other running
    sequence (``max_num_seqs`` - 1 of them). No step names more than vLLM's ``num_blocks``."""
    pages = -(-max_model_len // page_size)
    row = min(sink_pages + recent_pages + num_kv_heads * budget_pages, pages)
    pinned = min(sink_pages + recent_pages, pages)
    return min(row + (max_num_seqs - 1) * pinned, num_blocks)


@dataclass
class HotPages:
    """The hot cache's tensors: K and V ``[layers, slots, page, Hkv, D]`` in the pool's storage
    dtype and, for fp8, their scales ``[layers, slots, Hkv]`` (float32)."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_layers: int, slots: int, page_shape: tuple[int, int, int], dtype: torch.dtype,
                 device) -> "HotPages":
        shape, scale_shape = (num_layers, slots, *page_shape), (num_layers, slots, page_shape[1])
        scales = [torch.ones(scale_shape, device=device) for _ in range(2)] if dtype == FP8 else [None, None]
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device),
                   *scales)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.key, self.value, self.key_scale, self.value_scale) if t is not None)


class HostKVPool:
    """Every layer's K/V pages of the blocks written so far, in host memory."""

    def __init__(self, layout: KVLayout, pool_bytes: int, host_kv_dtype: str = "auto"):
        self.layout = layout
        self.dtype = storage_dtype(host_kv_dtype, layout.dtype)
        self.quantized = self.dtype == FP8
        self.block_bytes = pool_block_bytes(layout, host_kv_dtype)
        self.capacity = pool_capacity(layout, pool_bytes, host_kv_dtype)
        if self.capacity < 1:
            raise ValueError(f"host_kv_pool_bytes={pool_bytes} holds no block: one block of every layer takes "
                             f"{self.block_bytes} bytes")
        pin = torch.device(layout.device).type == "cuda"
        shape = (layout.num_layers, self.capacity, *layout.page_shape)
        self.key = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        self.value = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        scale_shape = (layout.num_layers, self.capacity, layout.num_kv_heads)
        self.key_scale = torch.ones(scale_shape, pin_memory=pin) if self.quantized else None
        self.value_scale = torch.ones(scale_shape, pin_memory=pin) if self.quantized else None
        # a layer's page of an entry is readable only once that layer wrote it (layers write
        # one after another within a step)
        self.written = torch.zeros((layout.num_layers, self.capacity), dtype=torch.bool)
        self.entry_of_block: dict[int, int] = {}
        self.free_entries = list(range(self.capacity - 1, -1, -1))  # pop() hands out entry 0 first

    @property
    def nbytes(self) -> int:
        return self.capacity * self.block_bytes

    def write(self, layer: int, block_ids: Sequence[int], key_pages: torch.Tensor,
              value_pages: torch.Tensor) -> list[int]:
        """Store whole pages ``[n, page, Hkv, D]``; the pool entries they went to."""
        expected = (len(block_ids), *self.layout.page_shape)
        for name, pages in (("key_pages", key_pages), ("value_pages", value_pages)):
            if tuple(pages.shape) != expected:
                raise ValueError(f"{name}: shape {tuple(pages.shape)}, expected {expected} "
                                 f"(blocks, page_size, num_kv_heads, head_size)")
        self._check_ids(block_ids)
        new = {b for b in block_ids if b not in self.entry_of_block}
        if len(new) > len(self.free_entries):
            raise HostKVPoolFull(
                f"host KV pool full: {len(new)} new blocks, {len(self.free_entries)} of {self.capacity} entries free "
                f"(host_kv_pool_bytes holds {self.capacity} blocks of {self.block_bytes} bytes)")
        for b in block_ids:
            if b not in self.entry_of_block:
                self.entry_of_block[b] = self.free_entries.pop()
        entries = [self.entry_of_block[b] for b in block_ids]
        index = torch.tensor(entries, dtype=torch.long)
        key_pages, value_pages = key_pages.cpu(), value_pages.cpu()
        if self.quantized:
            key_pages, key_scale = quantize_pages(key_pages)
            value_pages, value_scale = quantize_pages(value_pages)
            self.key_scale[layer][index] = key_scale
            self.value_scale[layer][index] = value_scale
        self.key[layer][index] = key_pages.to(self.dtype)
        self.value[layer][index] = value_pages.to(self.dtype)
        self.written[layer][index] = True
        return entries

    def entry(self, layer: int, block_id: int) -> int:
        """The pool entry holding the layer's page of ``block_id`` (ValueError if it was never
        written since vLLM last (re)allocated the block)."""
        entry = self.entry_of_block.get(block_id)
        if entry is None or not self.written[layer, entry]:
            raise ValueError(f"block {block_id} of layer {layer} is not in the host KV pool (never written, or freed)")
        return entry

    def page(self, layer: int, entry: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V page of a pool entry, float32 (dequantised where stored as fp8)."""
        at = slice(entry, entry + 1)
        if self.quantized:
            return (dequantize_pages(self.key[layer, at], self.key_scale[layer, at])[0],
                    dequantize_pages(self.value[layer, at], self.value_scale[layer, at])[0])
        return self.key[layer, entry].float(), self.value[layer, entry].float()

    def free(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            entry = self.entry_of_block.pop(b, None)
            if entry is not None:
                self.written[:, entry] = False
                self.free_entries.append(entry)

    def _check_ids(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.layout.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:8]} outside vLLM's 0..{self.layout.num_blocks - 1}")


class HotPageCache:
    """One layer's GPU slots: which block each holds, least recently used first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        self.free_slots = list(range(num_slots - 1, -1, -1))

    def lookup(self, block_ids: Sequence[int], pinned: frozenset[int]) -> Residency:
        """A slot for each block, taking a free slot or the least recently used one whose block
        is neither pinned nor needed by this call; raises before changing anything when the call
        cannot fit."""
        needed = set(block_ids)
        held_pinned = sum(1 for b in pinned if b in self.slot_of and b not in needed)
        if len(needed) + held_pinned > self.num_slots:
            raise HotCacheTooSmall(
                f"a step needs {len(needed)} blocks resident beside {held_pinned} pinned ones, but the hot cache "
                f"has host_kv_hot_pages={self.num_slots} slots per layer")
        residency = Residency(slots=[])
        for b in block_ids:
            slot = self.slot_of.get(b)
            if slot is not None:
                self.slot_of.move_to_end(b)
            else:
                if not self.free_slots:
                    victim = next(v for v in self.slot_of if v not in pinned and v not in needed)
                    self.free_slots.append(self.slot_of.pop(victim))
                    residency.evicted.append(victim)
                slot = self.free_slots.pop()
                self.slot_of[b] = slot
                residency.copied.append(b)
            residency.slots.append(slot)
        return residency

    def drop(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            slot = self.slot_of.pop(b, None)
            if slot is not None:
                self.free_slots.append(slot)


@dataclass
class HotCacheStats:
    """Lookups of one placement since start: ``hits + misses`` blocks asked for."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0


class HostPlacement:
    name = "host"
    wired = False  # the backends do not call it yet: docs/decode-offload.md

    def __init__(self, settings: SparseSettings | None, layout: KVLayout, hot: HotPages | None = None):
        """``hot``: the hot cache allocated beforehand (in vLLM's profiling run); None allocates it here."""
        s = settings or SparseSettings()
        if s.host_kv_pool_bytes is None:
            raise ValueError("host_kv_pool_bytes: must be set with kv_placement=host (the host memory of the pool)")
        self.layout = layout
        self.pool = HostKVPool(layout, s.host_kv_pool_bytes, s.host_kv_dtype)
        self.caches = [HotPageCache(s.host_kv_hot_pages) for _ in range(layout.num_layers)]
        shape = (layout.num_layers, s.host_kv_hot_pages, *layout.page_shape)
        if hot is None:
            hot = HotPages.allocate(layout.num_layers, s.host_kv_hot_pages, layout.page_shape, self.pool.dtype,
                                    layout.device)
        elif tuple(hot.key.shape) != shape or hot.key.dtype != self.pool.dtype:
            raise ValueError(f"the hot cache allocated beforehand is {tuple(hot.key.shape)} {hot.key.dtype}; this "
                             f"cache needs {shape} {self.pool.dtype} (layers, host_kv_hot_pages, page, KV heads, "
                             f"head size)")
        self.hot = hot
        self.pinned: frozenset[int] = frozenset()
        self.stats = HotCacheStats()
        # copies from pinned memory run after the host moves on: a write must not change a pool
        # page that a queued copy has yet to read
        self.copies_queued = torch.cuda.Event() if torch.device(layout.device).type == "cuda" else None

    @property
    def hot_slots(self) -> int:
        """Slots per layer: the most blocks one fetch can make resident."""
        return self.caches[0].num_slots if self.caches else 0

    @property
    def hot_nbytes(self) -> int:
        """GPU memory of the hot cache."""
        return self.hot.nbytes

    def write(self, layer: int, block_ids: Sequence[int], key_pages: torch.Tensor,
              value_pages: torch.Tensor) -> None:
        if self.copies_queued is not None:
            self.copies_queued.synchronize()
        entries = self.pool.write(layer, block_ids, key_pages, value_pages)
        cache = self.caches[layer]
        for b, entry in zip(block_ids, entries):
            slot = cache.slot_of.get(b)
            if slot is not None:
                self._copy_in(layer, entry, slot)
        self._mark_copies()

    def write_tokens(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """A step's new tokens ``[n, Hkv, D]`` at vLLM's ``slot_mapping`` (block id x page size +
        offset, -1 = padding), as vLLM's cache update gets them: each touched page is read back
        from the pool, the tokens are put at their offsets, and the whole page is written again.
        A page written at offset 0 starts from zeros instead: pages fill in order, so that is its
        first write since vLLM (re)allocated the block, and whatever the pool held there belonged
        to the block's previous owner (vLLM does not tell the worker it reused a block id). One
        host copy of the tokens per call. fp8 pages are
        quantised again from their dequantised values with the page's new scale, so a token
        written earlier in a page that is still filling takes one more fp8 rounding per later
        write of its page (at most page size - 1 of them)."""
        slots = slot_mapping.cpu().long()
        keep = slots >= 0
        slots = slots[keep]
        if not slots.numel():
            return
        key, value = key.cpu()[keep], value.cpu()[keep]
        page = self.layout.page_size
        page_of = slots // page
        blocks = sorted(set(page_of.tolist()))
        self.pool._check_ids(blocks)
        key_pages = torch.zeros((len(blocks), *self.layout.page_shape), dtype=self.layout.dtype)
        value_pages = torch.zeros_like(key_pages)
        fresh = set(page_of[slots % page == 0].tolist())
        for i, b in enumerate(blocks):
            entry = self.pool.entry_of_block.get(b)
            if entry is not None and self.pool.written[layer, entry] and b not in fresh:
                key_pages[i], value_pages[i] = (t.to(self.layout.dtype) for t in self.pool.page(layer, entry))
        row = {b: i for i, b in enumerate(blocks)}
        index = torch.tensor([row[b] for b in page_of.tolist()])
        key_pages[index, slots % page] = key.to(self.layout.dtype)
        value_pages[index, slots % page] = value.to(self.layout.dtype)
        self.write(layer, blocks, key_pages, value_pages)

    def fetch(self, layer: int, block_ids: Sequence[int]) -> Residency:
        entries = {b: self.pool.entry(layer, b) for b in block_ids}  # before any slot changes hands
        residency = self.caches[layer].lookup(block_ids, self.pinned)
        slot_of = self.caches[layer].slot_of
        for b in residency.copied:
            self._copy_in(layer, entries[b], slot_of[b])
        self._mark_copies()
        self.stats.misses += len(residency.copied)
        self.stats.hits += len(block_ids) - len(residency.copied)
        self.stats.evictions += len(residency.evicted)
        return residency

    def gather(self, layer: int, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V of ``block_ids`` in order, ``[n x page, Hkv, D]`` float32 on the hot
        cache's device (dequantised where stored as fp8), outside the hot cache: a prefill row
        reads its whole context once, which would only evict the decode steps' pages."""
        index = torch.tensor([self.pool.entry(layer, b) for b in block_ids], dtype=torch.long)
        key, value = self.pool.key[layer][index], self.pool.value[layer][index]
        if self.pool.quantized:
            key = dequantize_pages(key, self.pool.key_scale[layer][index])
            value = dequantize_pages(value, self.pool.value_scale[layer][index])
        return tuple(t.float().flatten(0, 1).to(self.layout.device) for t in (key, value))

    def resident_pages(self, layer: int, key_cache: torch.Tensor | None = None,
                       value_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hot.key[layer], self.hot.value[layer]

    def resident_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp8 storage: the ``[slots, Hkv]`` K and V scales of the resident pages."""
        if self.hot.key_scale is None:
            return None
        return self.hot.key_scale[layer], self.hot.value_scale[layer]

    def dequantized(self, layer: int, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The resident K and V of ``slots`` as float32 ``[n, page, Hkv, D]``."""
        index = torch.tensor(list(slots), dtype=torch.long, device=self.hot.key.device)
        key, value = self.hot.key[layer][index], self.hot.value[layer][index]
        scales = self.resident_scales(layer)
        if scales is None:
            return key.float(), value.float()
        return dequantize_pages(key, scales[0][index]), dequantize_pages(value, scales[1][index])

    def set_pinned(self, block_ids: Sequence[int]) -> None:
        self.pinned = frozenset(block_ids)

    def free(self, block_ids: Sequence[int]) -> None:
        self.pool.free(block_ids)
        for cache in self.caches:
            cache.drop(block_ids)
        self.pinned = self.pinned.difference(block_ids)

    def _mark_copies(self) -> None:
        if self.copies_queued is not None:
            self.copies_queued.record()

    def _copy_in(self, layer: int, entry: int, slot: int) -> None:
        # one copy per page into a slot that exists: no allocation, asynchronous from pinned memory
        pool = self.pool
        self.hot.key[layer, slot].copy_(pool.key[layer, entry], non_blocking=True)
        self.hot.value[layer, slot].copy_(pool.value[layer, entry], non_blocking=True)
        if pool.quantized:
            self.hot.key_scale[layer, slot].copy_(pool.key_scale[layer, entry], non_blocking=True)
            self.hot.value_scale[layer, slot].copy_(pool.value_scale[layer, entry], non_blocking=True)
