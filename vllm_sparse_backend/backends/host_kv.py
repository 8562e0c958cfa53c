"""``kv_placement=host`` as the backends drive it (issue 54): the K/V write of a step, the page
summaries in vLLM's shrunk page, the top-k decode over placed pages, and (CUDA) dense prefill rows
over K/V gathered from the pool. The CPU twin keeps vLLM's page whole and the summaries beside it
(:class:`HostKV` ``summaries_in_page=False``).

vLLM's page of each layer is shrunk (:func:`.._compat.summary_page_spec`) to what the top-k
selection scores: one key min and max per block and KV head. vLLM binds it to the layer as its
logical ``[blocks, Hkv, states, content]`` view, here ``[blocks, Hkv, 1, 2 x D]`` in the model's
dtype: the first D values are the min, the last D the max (:func:`summary_views`). The full K/V
of every block go to the worker's one :class:`.HostPlacement`, which holds every layer (a pool
entry per vLLM block id), made at the first write, once vLLM's block count is known. Its hot
cache is allocated before that, in vLLM's profiling run (:meth:`HostKV.claim_hot_cache`), so
that vLLM sizes its KV cache with it counted; :func:`check_host_kv_fits` refuses, at start-up,
a pool or hot cache that a step could outgrow.

Pure torch and plain tensors: a test drives it without a running vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import ConfigError
from ..settings import SparseSettings
from ..decode.placed import fold_page_summaries, topk_decode_placed
from ..decode.topk import TopkDecodeBudget
from ..kv_placement.base import KVLayout
from ..kv_placement.host import (HostPlacement, HotPages, hot_slots_needed, pool_block_bytes, pool_capacity,
                                 storage_dtype)
from ..startup import report_startup_error
from ..prefill.placed import dense_prefill_placed, selected_prefill_placed


@dataclass(frozen=True)
class SummaryViews:
    """Key min / max ``[blocks, Hkv, D]`` of one layer: views into vLLM's shrunk page (what the
    top-k selection reads as :class:`..decode.topk.PageSummaries`)."""

    min: torch.Tensor
    max: torch.Tensor


def summary_views(kv_cache: torch.Tensor) -> SummaryViews:
    """The min and max halves of vLLM's shrunk page ``[blocks, Hkv, 1, 2 x D]`` (no copy)."""
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] % 2:
        raise ValueError(f"vLLM's page {tuple(kv_cache.shape)} is not a page summary [blocks, Hkv, 1, 2 x head_size]: "
                         f"kv_placement=host needs the backend's customize_spec applied (vLLM with customize_spec)")
    d = kv_cache.shape[3] // 2
    return SummaryViews(kv_cache[:, :, 0, :d], kv_cache[:, :, 0, d:])


def pinned_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                  budget: TopkDecodeBudget) -> list[int]:
    """The block ids of every running sequence's sink and recent pages (what each of its decode
    steps selects whatever the scores): read back to the host."""
    table, lens = block_table.cpu().long(), seq_lens.cpu().long()
    blocks: set[int] = set()
    for row, seq_len in zip(table, lens.tolist()):
        pages = -(-seq_len // page_size)
        ends = list(range(min(budget.sink_pages, pages))) + list(range(max(pages - budget.recent_pages, 0), pages))
        blocks.update(row[ends].tolist())
    return sorted(blocks)


@dataclass(frozen=True)
class DecodeStep:
    """What every layer of one decode step shares: the block table read back to the host (each
    layer maps its own selection through it) by the step's first layer, which also pins the
    batch's sink and recent pages (one pinned set for all layers; each layer's fetch brings its
    own pages of those blocks). ``metadata``: the step's attention metadata, the object vLLM
    builds once per step and hands to every layer. It is held, not only its ``id``, so that no
    later step's metadata can take its address while a layer compares the two."""

    metadata: object
    host_block_table: torch.Tensor


class HostKV:
    """One worker's host placement and the map from vLLM's layer names to its layers.

    ``layer_names``: every attention layer of the model this backend serves (vLLM gives each the
    same block ids); ``page_size``: tokens per vLLM block. ``summaries_in_page``: the summaries
    are vLLM's shrunk page (CUDA); False keeps them in tensors of their own beside vLLM's full
    page (the CPU twin, whose own kernel still reads that page). ``max_num_seqs`` /
    ``max_model_len``: vLLM's, for :func:`check_host_kv_fits` at the first write (None: the pool
    alone is checked there)."""

    def __init__(self, settings: SparseSettings, layer_names: Sequence[str], page_size: int,
                 summaries_in_page: bool = True, max_num_seqs: int | None = None, max_model_len: int | None = None):
        self.settings = settings
        self.page_size = page_size
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.hot: HotPages | None = None  # claimed in vLLM's profiling run (claim_hot_cache)
        self.layer_of = {name: i for i, name in enumerate(layer_names)}
        self.budget = TopkDecodeBudget.from_settings(settings)
        self.summaries_in_page = summaries_in_page
        self.placement: HostPlacement | None = None  # made at the first write (vLLM's cache exists then)
        self.own_summaries: list[SummaryViews] = []  # per layer, where not in vLLM's page
        self.step: DecodeStep | None = None  # the decode step the layers are in (decode_step)

    @classmethod
    def for_vllm(cls, settings: SparseSettings, vllm_config, summaries_in_page: bool = True) -> "HostKV":
        """The placement of every attention layer of ``vllm_config``'s model, with vLLM's block
        size, ``max_num_seqs`` and ``max_model_len`` (what both backends make at their first use)."""
        from .._compat import attention_layers

        return cls(settings, list(attention_layers(vllm_config, None)), vllm_config.cache_config.block_size,
                   summaries_in_page, max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                   max_model_len=vllm_config.model_config.max_model_len)

    def layer(self, layer_name: str) -> int:
        index = self.layer_of.get(layer_name)
        if index is None:
            raise ValueError(f"layer {layer_name} is not among the {len(self.layer_of)} attention layers the host "
                             f"KV pool was made for")
        return index

    def claim_hot_cache(self, num_kv_heads: int, head_size: int, dtype: torch.dtype, device) -> HotPages:
        """The hot cache of every layer, allocated on the first call and kept for the placement:
        called in vLLM's profiling run, whose measurement then counts it when vLLM sizes its KV
        cache (with ``--kv-cache-memory-bytes`` nothing is measured: it comes on top). ``dtype``:
        the model's K/V dtype."""
        if self.hot is None:
            page_shape = (self.page_size, num_kv_heads, head_size)
            self.hot = HotPages.allocate(len(self.layer_of), self.settings.host_kv_hot_pages, page_shape,
                                         storage_dtype(self.settings.host_kv_dtype, dtype), device)
        return self.hot

    def placement_for(self, kv_cache: torch.Tensor, key: torch.Tensor) -> HostPlacement:
        """The placement, made on the first call from vLLM's cache (its block count) and the
        step's keys (heads, head size, dtype, device). Every vLLM block id must have its pool
        entry, so that a block's write never finds the pool full: ConfigError naming
        ``--num-gpu-blocks-override`` otherwise."""
        if self.placement is None:
            if self.summaries_in_page and (not kv_cache.dtype.is_floating_point or kv_cache.element_size() < 2):
                raise ConfigError(f"kv_placement=host: vLLM's KV cache dtype {kv_cache.dtype} cannot hold the page "
                                  f"summaries; run with the model's dtype (--kv-cache-dtype auto)")
            layout = KVLayout(num_layers=len(self.layer_of), num_blocks=kv_cache.shape[0], page_size=self.page_size,
                              num_kv_heads=key.shape[1], head_size=key.shape[2], dtype=key.dtype, device=key.device)
            if self.max_num_seqs is None or self.max_model_len is None:
                check_pool_holds_vllm_blocks(self.settings, layout)
            else:
                check_host_kv_fits(self.settings, layout, self.max_num_seqs, self.max_model_len)
            # without a profiling run (the CPU twin) the hot cache is allocated here
            self.placement = HostPlacement(self.settings, layout, self.claim_hot_cache(
                layout.num_kv_heads, layout.head_size, layout.dtype, layout.device))
            if not self.summaries_in_page:
                shape = (layout.num_blocks, layout.num_kv_heads, layout.head_size)
                self.own_summaries = [SummaryViews(torch.zeros(shape, dtype=key.dtype, device=key.device),
                                                   torch.zeros(shape, dtype=key.dtype, device=key.device))
                                      for _ in range(layout.num_layers)]
        return self.placement

    def summaries(self, layer: int, kv_cache: torch.Tensor) -> SummaryViews:
        return summary_views(kv_cache) if self.summaries_in_page else self.own_summaries[layer]

    def write(self, layer_name: str, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """What ``do_kv_cache_update`` does for a layer: the step's new tokens ``[n, Hkv, D]`` at
        vLLM's ``slot_mapping`` into the host pool, their keys folded into the page summaries."""
        placement = self.placement_for(kv_cache, key)
        # key / value may carry padding rows past the slot mapping (vLLM pads them for CUDA graphs)
        n = slot_mapping.shape[0]
        key, value = key[:n], value[:n]
        layer = self.layer(layer_name)
        placement.write_tokens(layer, key, value, slot_mapping)
        summaries = self.summaries(layer, kv_cache)
        fold_page_summaries(summaries.min, summaries.max, key, slot_mapping, self.page_size)

    def decode_step(self, metadata: object, block_table: torch.Tensor, seq_lens: torch.Tensor) -> DecodeStep:
        """The shared part of the step whose attention metadata is ``metadata``: made, and the
        batch's sink and recent pages pinned, by the first of its layers to ask; the same object
        for the others. A step is told apart by its metadata object, not by the tensors: vLLM's
        block table and sequence lengths are persistent buffers rewritten in place (same address,
        new content), while the metadata is a new object every step, built after requests joined
        or left."""
        step = self.step
        if step is None or step.metadata is not metadata:
            step = self.step = DecodeStep(metadata, block_table.cpu().long())
            self.placement.set_pinned(pinned_blocks(step.host_block_table, seq_lens, self.page_size, self.budget))
        return step

    def decode(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, out: torch.Tensor, metadata: object) -> None:
        """Top-k decode attention of one query token per sequence over the placed pages, into
        ``out``. ``metadata``: the step's attention metadata as vLLM hands it to the layer (what
        :meth:`decode_step` tells steps apart by)."""
        if self.placement is None:
            raise RuntimeError("kv_placement=host: a decode step before any K/V was written")
        step = self.decode_step(metadata, block_table, seq_lens)
        layer = self.layer(layer_name)
        # the host placement reads its resident pages, not vLLM's page
        topk_decode_placed(query, None, None, self.summaries(layer, kv_cache), block_table, seq_lens, self.budget,
                           scale, out, placement=self.placement, layer=layer, host_block_table=step.host_block_table)

    def prefill(self, layer_name: str, query: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                block_table: torch.Tensor, scale: float, out: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """A step with prefill rows, into ``out``: every row over K/V gathered from the pool (host
        lists of the step), whole (:func:`..prefill.placed.dense_prefill_placed`) or, with
        ``host_kv_prefill_pages``, the pages the summaries choose
        (:func:`..prefill.placed.selected_prefill_placed`)."""
        if self.placement is None:
            raise RuntimeError("kv_placement=host: a prefill step before any K/V was written")
        layer, placement = self.layer(layer_name), self.placement

        def gather(blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            return placement.gather(layer, blocks)

        pages = self.settings.host_kv_prefill_pages
        if not pages:
            dense_prefill_placed(query, query_start_loc, seq_lens, block_table, self.page_size, scale, out, gather)
            return
        views = self.summaries(layer, kv_cache)
        selected_prefill_placed(query, query_start_loc, seq_lens, block_table, self.page_size, scale, out, gather,
                                lambda blocks: (views.min[blocks], views.max[blocks]), pages,
                                self.budget.sink_pages, self.budget.recent_pages)


def check_pool_holds_vllm_blocks(settings: SparseSettings, layout: KVLayout) -> None:
    """ConfigError unless ``host_kv_pool_bytes`` holds a pool entry for every block id vLLM
    made (``layout.num_blocks``), naming the flag that caps vLLM's blocks."""
    block_bytes = pool_block_bytes(layout, settings.host_kv_dtype)
    holds = pool_capacity(layout, settings.host_kv_pool_bytes or 0, settings.host_kv_dtype)
    if layout.num_blocks > holds:
        raise ConfigError(f"kv_placement=host: vLLM made {layout.num_blocks} KV-cache blocks but host_kv_pool_bytes="
                          f"{settings.host_kv_pool_bytes} holds {holds} (one block of all {layout.num_layers} layers "
                          f"takes {block_bytes} bytes); start vLLM with --num-gpu-blocks-override {holds} or raise "
                          f"host_kv_pool_bytes")


def check_host_kv_fits(settings: SparseSettings, layout: KVLayout, max_num_seqs: int, max_model_len: int) -> None:
    """ConfigError, before any request runs, where a step could fail inside forward: vLLM's
    blocks beyond the pool (:func:`check_pool_holds_vllm_blocks`), or a decode step needing more
    hot slots than ``host_kv_hot_pages`` (:func:`..kv_placement.host.hot_slots_needed`, from
    vLLM's ``max_num_seqs`` and ``max_model_len``). Each names the value that would fit."""
    check_pool_holds_vllm_blocks(settings, layout)
    d = settings.decode
    need = hot_slots_needed(d.sink_pages, d.recent_pages, d.budget_pages, layout.num_kv_heads, layout.page_size,
                            layout.num_blocks, max_num_seqs, max_model_len)
    if settings.host_kv_hot_pages < need:
        raise ConfigError(f"kv_placement=host: host_kv_hot_pages={settings.host_kv_hot_pages} is below the {need} "
                          f"slots per layer a decode step can need (one sequence's decode_sink_pages + "
                          f"decode_recent_pages + decode_budget_pages x {layout.num_kv_heads} KV heads, within "
                          f"--max-model-len {max_model_len}, beside the sink and recent pages pinned for each of "
                          f"--max-num-seqs {max_num_seqs} - 1 other sequences); set host_kv_hot_pages={need}, or "
                          f"lower --max-num-seqs")


def check_vllm_cache_fits(settings: SparseSettings, vllm_config, kv_cache_spec) -> None:
    """:func:`check_host_kv_fits` with vLLM's numbers, from a metadata builder, which vLLM makes
    once it has sized its KV cache and before any request (the ConfigError stops the start-up,
    also left for the plugin's ``vllm`` command). Skipped while vLLM's block count is unset (a
    minimal cache of its profiling run): the first K/V write then checks."""
    from .._compat import attention_layers

    num_blocks = vllm_config.cache_config.num_gpu_blocks
    if num_blocks is None:
        return
    layout = KVLayout(num_layers=len(attention_layers(vllm_config, None)), num_blocks=num_blocks,
                      page_size=kv_cache_spec.block_size, num_kv_heads=kv_cache_spec.num_kv_heads,
                      head_size=kv_cache_spec.head_size, dtype=vllm_config.model_config.dtype)
    try:
        check_host_kv_fits(settings, layout, vllm_config.scheduler_config.max_num_seqs,
                           vllm_config.model_config.max_model_len)
    except ConfigError as error:
        report_startup_error(error)
        raise
