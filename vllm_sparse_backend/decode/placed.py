"""Top-k decode over pages that a KV placement keeps (issue 54, item 2): summaries -> pages ->
fetch -> attention.

With ``kv_placement=host`` vLLM's GPU cache no longer holds every block's K/V: the placement
keeps them (a host pool) and makes the pages a step asks for resident in a fixed set of GPU
slots. One decode step of one layer then runs:

1. the same page selection as ``decode_mode=topk`` (:func:`.topk.topk_decode`), on the page
   summaries, which stay on the GPU (1/page of the cache's size);
2. the union of the blocks the batch selected is read back to the host (one synchronisation per
   layer and step: the placement's bookkeeping is host code) and fetched: hits stay where they
   are, misses are copied into free or least recently used slots;
3. the block table is rewritten to those slots (a lookup table indexed by block id, on the
   device), and the same attention kernel reads the resident pages instead of vLLM's cache.
   Pages kept as fp8 are widened to the query's dtype first (the attention kernel reads the
   model's dtypes only).

The selection and the attention are the top-k mode's own kernels; only where the pages are read
from changes, so with every page resident the output is the top-k mode's, bit for bit. The
read-back in step 2 makes a step with host pages uncapturable by a CUDA graph: the placement
says so when it is wired (it is not yet: docs/decode-offload.md). Pinning a request's sink and
recent pages (:meth:`..kv_placement.base.KVPlacement.set_pinned`) is the caller's, once per step.
"""

from __future__ import annotations

import torch

from ..kernels import topk_decode as kernels
from ..kv_placement.base import KVPlacement, Residency
from ..kv_placement.host import dequantize_pages
from .topk import PageSummaries, TopkDecodeBudget


def fold_page_summaries(summary_min: torch.Tensor, summary_max: torch.Tensor, key: torch.Tensor,
                        slot_mapping: torch.Tensor, page_size: int) -> None:
    """Bring the page summaries up to date with a step's new keys ``[n, Hkv, D]`` at vLLM's
    ``slot_mapping`` (-1 = padding), in place, from the new keys alone: with the pages in host
    memory the GPU holds no page to re-read. Pages fill from offset 0 in order, so a token at
    offset 0 starts its page's summary afresh (a block vLLM gave new content, or a first write)
    and every later token folds into the min / max. On the device, no host read: a decode step
    stays capturable."""
    valid = slot_mapping >= 0
    slots = slot_mapping.long().clamp(min=0)
    pages = slots // page_size
    starts = valid & (slots % page_size == 0)
    # pages starting in this call forget what they held (stale content of a reused block)
    reset = torch.zeros(summary_min.shape[0], dtype=torch.bool, device=key.device)
    reset[pages[starts]] = True
    summary_min[reset] = torch.finfo(summary_min.dtype).max
    summary_max[reset] = torch.finfo(summary_max.dtype).min
    # padding rows are folded into a page as +inf / -inf (no effect on its min / max)
    k = key.to(summary_min.dtype)
    index = pages[:, None, None].expand_as(k)
    big = torch.finfo(summary_min.dtype).max
    summary_min.scatter_reduce_(0, index, torch.where(valid[:, None, None], k, big), "amin")
    summary_max.scatter_reduce_(0, index, torch.where(valid[:, None, None], k, -big), "amax")


def selected_blocks(block_table: torch.Tensor, selected: torch.Tensor) -> list[int]:
    """The distinct block ids of the selected logical pages (``selected`` ``[batch, S, width]``,
    -1 padded, as :func:`select_pages` returns them), ascending. Reads both back to the host."""
    return sorted(set().union(*row_blocks(block_table, selected)))


def row_blocks(block_table: torch.Tensor, selected: torch.Tensor) -> list[set[int]]:
    """Each row's distinct selected block ids (one host read of both)."""
    sel, table = selected.cpu().long(), block_table.cpu().long()
    return [set(table[r][sel[r][sel[r] >= 0]].tolist()) for r in range(sel.shape[0])]


def row_groups(blocks_of_row: list[set[int]], slots: int | None, pinned: frozenset[int] = frozenset()) -> list[range]:
    """Consecutive rows grouped so that each group's blocks fit ``slots`` hot slots beside the
    pinned blocks it does not need (what :meth:`..kv_placement.host.HotPageCache.lookup` asks);
    one group where there is no limit. A row that does not fit alone is a group of its own (its
    fetch then raises, naming the setting)."""
    if slots is None or not blocks_of_row:
        return [range(len(blocks_of_row))]
    groups, start, union = [], 0, set()
    for r, blocks in enumerate(blocks_of_row):
        grown = union | blocks
        if r > start and len(grown) + len(pinned - grown) > slots:
            groups.append(range(start, r))
            start, grown = r, set(blocks)
        union = grown
    groups.append(range(start, len(blocks_of_row)))
    return groups


def slot_table(block_table: torch.Tensor, blocks: list[int], residency: Residency) -> torch.Tensor:
    """``block_table`` with every block id replaced by its resident slot. Blocks not fetched map to
    slot 0: the attention kernel reads only the selected pages, which were all fetched."""
    lookup = torch.zeros(int(max(blocks, default=0)) + 1, dtype=torch.int32, device=block_table.device)
    if blocks:
        lookup[torch.tensor(blocks, device=block_table.device)] = torch.tensor(
            residency.slots, dtype=torch.int32, device=block_table.device)
    ids = block_table.long().clamp(0, lookup.shape[0] - 1)
    return lookup[ids]


def topk_decode_placed(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       summaries: PageSummaries, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       budget: TopkDecodeBudget, scale: float, out: torch.Tensor, *,
                       placement: KVPlacement, layer: int, host_block_table: torch.Tensor | None = None) -> Residency:
    """:func:`.topk.topk_decode` over the pages ``placement`` keeps for ``layer``, into ``out``.

    Shapes as there; ``key_cache`` / ``value_cache`` are vLLM's views of the layer (what a ``gpu``
    placement reads; a ``host`` one ignores them). The summaries must cover every block of the
    batch. A batch whose selected pages do not fit the hot cache at once (``hot_slots``) runs in
    groups of consecutive rows, each fetched and attended in turn. Returns what the last fetch
    did (hits and copies; the placement counts them all). ``host_block_table``: ``block_table``
    already read back to the host, where the caller shares one read among a step's layers."""
    key, value = placement.resident_pages(layer, key_cache, value_cache)  # the fetch fills these in place
    page = key.shape[1]
    selected, counts = kernels.select_pages(query, summaries.min, summaries.max, block_table, seq_lens, page,
                                            sink_pages=budget.sink_pages, recent_pages=budget.recent_pages,
                                            num_pages_budget=budget.budget_pages)
    blocks_of_row = row_blocks(block_table if host_block_table is None else host_block_table, selected)
    # a batch whose pages outnumber the hot slots runs in groups of rows, one fetch each
    slots = getattr(placement, "hot_slots", None)
    for rows in row_groups(blocks_of_row, slots, getattr(placement, "pinned", frozenset())):
        r = slice(rows.start, rows.stop)
        blocks = sorted(set().union(*blocks_of_row[r]))
        residency = placement.fetch(layer, blocks)
        scales = getattr(placement, "resident_scales", lambda _layer: None)(layer)
        keys, values = key, value
        if scales is not None:  # fp8 pages: the attention kernel reads the model's dtypes only
            keys, values = (dequantize_pages(t, s).to(query.dtype) for t, s in zip((key, value), scales))
        kernels.topk_decode_attention(query[r], keys, values, slot_table(block_table[r], blocks, residency),
                                      seq_lens[r], selected[r], counts[r], scale, out[r],
                                      topk_tokens=budget.topk_tokens, sink_pages=budget.sink_pages,
                                      recent_pages=budget.recent_pages)
    return residency
