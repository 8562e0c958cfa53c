"""Top-k decode attention over vLLM's paged KV cache: page summaries, page selection, attention.

Kernel layer of the opt-in decode-side top-k mode (issue 8, item 1), driven by
``vllm_sparse_backend/decode/topk.py`` for ``decode_mode=topk``. One decode step of one layer runs,
after vLLM has written the new token's K/V into the cache:

1. :func:`update_page_summaries` (Triton): for every page a new slot was written to, recompute the
   channel-wise min and max of the page's keys per KV head (Quest-style summaries, kept in two
   tensors ``[num_pages, num_kv_heads, head_dim]`` beside the cache and indexed by physical page).
   :func:`build_page_summaries` does every page of every sequence at once (after a prefill).
2. :func:`select_pages` (Triton scores + :func:`topk_select.topk_ascending`): per sequence and KV head (or per query
   head), the Quest upper bound of every page of the sequence,
   ``sum_d max(q_d * min_d, q_d * max_d)`` summed over the query heads that share the selection;
   the first ``sink_pages`` and last ``recent_pages`` pages are always kept, and the
   ``num_pages_budget`` best of the others. Output: *logical* page indices (position in the
   sequence, ascending, -1 padded) and counts, of a fixed width.
3. :func:`topk_decode_attention` (Triton): one query token per sequence attends to the tokens of
   its selected pages only (causal by ``seq_lens``: the last page's unfilled slots are excluded),
   online softmax in fp32, flash-decoding splits over the selected pages when the batch is too
   small to fill the GPU. With ``topk_tokens`` it keeps, per query head, only the k best-scoring
   keys of the budget pages (plus every token of the sink and recent pages): a first kernel
   writes the scores of the selected tokens, ``torch.topk`` gives the k-th largest per (sequence,
   query head), and the attention kernel reuses the stored scores (it reads no K) and skips the
   V of tokens no head keeps.

Everything has shapes fixed by host ints (no ``.item()``, no host synchronisation, no
data-dependent shapes), so a decode step can be captured in a CUDA graph.

Design notes:

- **Summary dtype**: the caller's choice; :func:`allocate_page_summaries` defaults to the cache
  dtype (fp32 also works). A min or max of bf16/fp16 keys *is* one of those keys, so storing it in the cache dtype
  is exact and costs half the memory of fp32 (2 * head_dim values per page and KV head: 1/8 of the
  keys' size at page 16). The bound itself is computed in fp32. fp8 caches (which need their
  scales) are not supported.
- **Logical page ids** in the selection: the attention kernel needs each page's position in the
  sequence anyway (causal mask of the last page, sink/recent pages for the token top-k), and the
  physical id is one block-table load away; a physical id would need the inverse lookup.
- **Filled prefix** assumption of :func:`update_page_summaries`: the tokens of a page are written
  in order, so a slot at offset ``o`` of a page means offsets ``0..o`` hold valid keys. In one call
  the slots of one page must be consecutive in ``slot_mapping`` (vLLM: a request's new tokens are
  contiguous); only the last of them recomputes the page, so no two programs write one summary.
  Re-reading the prefix (rather than folding the new key into the old summary) means a freed and
  reused page never keeps a stale summary; pages shared through prefix caching are full and
  never rewritten. Slots written and then dropped (rejected speculative tokens) stay in the
  summary until the page is written again: the bound gets looser, never wrong for the valid keys.
- Unused cache slots may hold anything (NaN included): every K/V load is masked by validity.
- GQA: one selection per KV head by default (its query heads' bounds summed: one page list that
  every head of the group reads, so each K/V tile is loaded once for the group);
  ``per_query_head=True`` gives every query head its own pages (group times the K/V reads).
- ``tl.dot`` runs on fp32 copies of q, K and V: tf32 holds bf16/fp16 mantissas exactly, so the
  scores are the exact products summed in fp32 (fp32 inputs use ``ieee``). Decode reads each K/V
  byte once for at most a group of query heads, so the slower fp32 MMA should not show (not yet
  measured on a GPU), and Triton's interpreter computes bf16 dots wrongly, which this avoids.

Imports nothing from vLLM; torch, triton and this package only. Its plain torch references
(float64, loops over sequences) for tests and debugging are in
:mod:`vllm_sparse_kernels.reference.topk_decode`; tests/kernels/test_topk_decode.py checks the kernels
against them and against references of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_cache import SUPPORTED_DTYPES, check_cache, last_written_slot, page_key_tile, top_pages

# Programs that keep an H100/H200 busy for a decode step; below that, split the selected pages
# (flash-decoding). A guess of the SM count, not a measurement.
_TARGET_PROGRAMS = 132
# Keys the attention kernel gathers per tile (whole pages: several small pages, or one larger page).
KEYS_PER_TILE = 64


def _check_summaries(summary_min: torch.Tensor, summary_max: torch.Tensor, key_cache: torch.Tensor) -> None:
    want = (key_cache.shape[0], key_cache.shape[2], key_cache.shape[3])
    for s in (summary_min, summary_max):
        if tuple(s.shape) != want:
            raise ValueError(f"summaries must be [num_pages, num_kv_heads, head_dim] = {want}, got {tuple(s.shape)}")
        if s.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"summary dtype {s.dtype} not supported")
    if summary_min.stride() != summary_max.stride():
        raise ValueError("summary_min and summary_max must have the same strides")


# --------------------------------------------------------------------------------------------
# 1. Page summaries
# --------------------------------------------------------------------------------------------

def allocate_page_summaries(key_cache: torch.Tensor,
                            dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (min, max) summaries ``[num_pages, num_kv_heads, head_dim]`` for a ``[num_pages,
    page_size, num_kv_heads, head_dim]`` key cache, one per physical page, on its device.
    ``dtype``: default the cache dtype (exact, see the module notes), or fp32. Contents are
    undefined until the pages are summarised; only pages inside a sequence are ever read."""
    check_cache(key_cache)
    shape = (key_cache.shape[0], key_cache.shape[2], key_cache.shape[3])
    dtype = dtype or key_cache.dtype
    return (torch.empty(shape, dtype=dtype, device=key_cache.device),
            torch.empty(shape, dtype=dtype, device=key_cache.device))


@triton.jit
def _summarise_page(k_ptr, smin_ptr, smax_ptr, page, n_valid, kvh,
                    s_kp, s_kt, s_kh, s_kd, s_sp, s_sh, s_sd,
                    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """min / max over the first ``n_valid`` keys of physical ``page`` (int64) and KV head ``kvh``.
    ``n_valid`` <= 0 writes nothing."""
    k, valid, offs_d, d_ok = page_key_tile(k_ptr, page, n_valid, kvh, s_kp, s_kt, s_kh, s_kd, PAGE, HEAD_DIM, BLOCK_D)
    # invalid slots may hold NaN or stale keys: replace them (never multiply them away)
    k_min = tl.min(tl.where(valid, k, float("inf")), 0)
    k_max = tl.max(tl.where(valid, k, float("-inf")), 0)
    out = page * s_sp + kvh * s_sh + offs_d * s_sd
    store_ok = d_ok & ((offs_d * 0 + n_valid) > 0)  # vector form (the interpreter mis-types scalar & vector)
    tl.store(smin_ptr + out, k_min.to(smin_ptr.dtype.element_ty), mask=store_ok)
    tl.store(smax_ptr + out, k_max.to(smax_ptr.dtype.element_ty), mask=store_ok)


@triton.jit
def _update_summaries_kernel(k_ptr, smin_ptr, smax_ptr, slot_ptr, num_slots,
                             s_kp, s_kt, s_kh, s_kd, s_sp, s_sh, s_sd,
                             PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    # the page's next slot written by this same call recomputes the page (over more tokens)
    _, page, _, n_valid = last_written_slot(slot_ptr, i, num_slots, PAGE)
    _summarise_page(k_ptr, smin_ptr, smax_ptr, page, n_valid, kvh,
                    s_kp, s_kt, s_kh, s_kd, s_sp, s_sh, s_sd, PAGE, HEAD_DIM, BLOCK_D)


@triton.jit
def _build_summaries_kernel(k_ptr, smin_ptr, smax_ptr, bt_ptr, seq_lens_ptr,
                            s_kp, s_kt, s_kh, s_kd, s_sp, s_sh, s_sd, s_bt,
                            PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0)  # logical page (axis 0: up to 2^31 programs, long contexts have many pages)
    b = tl.program_id(1)
    kvh = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    n_valid = tl.minimum(tl.maximum(seq_len - j * PAGE, 0), PAGE)
    page = tl.load(bt_ptr + b.to(tl.int64) * s_bt + j, mask=n_valid > 0, other=0).to(tl.int64)
    _summarise_page(k_ptr, smin_ptr, smax_ptr, page, n_valid, kvh,
                    s_kp, s_kt, s_kh, s_kd, s_sp, s_sh, s_sd, PAGE, HEAD_DIM, BLOCK_D)


def update_page_summaries(key_cache: torch.Tensor, summary_min: torch.Tensor, summary_max: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Recompute, in place, the summaries of the pages that ``slot_mapping`` wrote to.

    key_cache: ``[num_pages, page_size, Hkv, D]`` view (any strides), already holding the new keys;
    summary_min / summary_max: ``[num_pages, Hkv, D]``; slot_mapping: int ``[num_tokens]``, slot =
    physical page * page_size + offset, -1 = padding (vLLM's). A page is summarised over offsets
    ``0..o``, ``o`` the offset of its last slot in this call: pages fill in order, and a page's
    slots in one call are consecutive in ``slot_mapping``. One program per (slot, KV head); those
    of a page's earlier slots read two slot ids and nothing else (their loads are masked off).
    """
    page, hkv, d = check_cache(key_cache)
    _check_summaries(summary_min, summary_max, key_cache)
    n = slot_mapping.shape[0]
    if n == 0:
        return
    _update_summaries_kernel[(n, hkv)](
        key_cache, summary_min, summary_max, slot_mapping, n,
        *key_cache.stride(), *summary_min.stride(),
        PAGE=page, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
    )


def build_page_summaries(key_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         summary_min: torch.Tensor, summary_max: torch.Tensor, max_pages: int | None = None) -> None:
    """Summarise every page of every sequence, in place (after a prefill, or to rebuild).

    block_table: int32 ``[batch, >= max_pages]`` physical pages; seq_lens: int32 ``[batch]`` tokens in
    the cache; ``max_pages`` (host int, default ``block_table.shape[1]``): pages per sequence to
    cover, at least ``ceil(max(seq_lens) / page_size)``. Pages past a sequence's length are left
    untouched (their block-table entries are never read).
    """
    page, hkv, d = check_cache(key_cache)
    _check_summaries(summary_min, summary_max, key_cache)
    max_pages = block_table.shape[1] if max_pages is None else max_pages
    batch = seq_lens.shape[0]
    if batch == 0 or max_pages == 0:
        return
    _build_summaries_kernel[(max_pages, batch, hkv)](
        key_cache, summary_min, summary_max, block_table, seq_lens,
        *key_cache.stride(), *summary_min.stride(), block_table.stride(0),
        PAGE=page, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
    )


# --------------------------------------------------------------------------------------------
# 2. Page selection
# --------------------------------------------------------------------------------------------

@triton.jit
def _page_scores_kernel(q_ptr, smin_ptr, smax_ptr, bt_ptr, seq_lens_ptr, score_ptr,
                        s_qb, s_qh, s_qd, s_sp, s_sh, s_sd, s_bt, s_ob, s_oh,
                        max_pages, width, sink_pages, recent_pages,
                        GROUP: tl.constexpr, HPS: tl.constexpr, PAGE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_P: tl.constexpr):
    """Scores of BLOCK_P logical pages for one (sequence, selection head): the Quest bound summed
    over the selection's HPS query heads; +inf for sink / recent pages, -inf past the sequence."""
    pb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    sel = tl.program_id(2)
    kvh = (sel * HPS // GROUP).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    head = sel * HPS + offs_h
    q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=(offs_h < HPS)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    # max(q*mn, q*mx) = max(q, 0) * mx + min(q, 0) * mn (mn <= mx), and the sum over heads is
    # linear: one [D] vector each for the positive and the negative parts of the group's queries
    q_pos = tl.sum(tl.maximum(q, 0.0), 0)
    q_neg = tl.sum(tl.minimum(q, 0.0), 0)

    seq_len = tl.load(seq_lens_ptr + b)
    n_pages = (seq_len + PAGE - 1) // PAGE
    j = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    in_seq = (j < n_pages) & (j < max_pages)
    phys = tl.load(bt_ptr + b * s_bt + j, mask=in_seq, other=0).to(tl.int64)
    s_off = phys[:, None] * s_sp + kvh * s_sh + offs_d[None, :] * s_sd
    m = in_seq[:, None] & d_ok[None, :]
    mn = tl.load(smin_ptr + s_off, mask=m, other=0.0).to(tl.float32)
    mx = tl.load(smax_ptr + s_off, mask=m, other=0.0).to(tl.float32)
    score = tl.sum(mx * q_pos[None, :] + mn * q_neg[None, :], 1)
    forced = (j < sink_pages) | (j >= n_pages - recent_pages)
    score = tl.where(forced, float("inf"), score)
    score = tl.where(in_seq, score, float("-inf"))
    tl.store(score_ptr + b * s_ob + sel * s_oh + j, score, mask=j < width)


def select_pages(q: torch.Tensor, summary_min: torch.Tensor, summary_max: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, page_size: int, *, sink_pages: int, recent_pages: int,
                 num_pages_budget: int, per_query_head: bool = False,
                 max_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages each decode query attends to.

    q: ``[batch, H, D]`` (one decode token per sequence, any strides); summaries ``[num_pages,
    Hkv, D]``; block_table int32 ``[batch, >= max_pages]``; seq_lens int32 ``[batch]`` (the decode
    token included); page_size: tokens per page of the cache. Per sequence and selection head (a
    KV head, or a query head with ``per_query_head``): the first ``sink_pages`` and the last
    ``recent_pages`` pages of the sequence, plus the ``num_pages_budget`` other pages with the
    highest Quest bound ``sum_heads sum_d max(q_d * min_d, q_d * max_d)`` (ties: any of them).

    Returns ``(selected, counts)``: selected int32 ``[batch, S, sink_pages + recent_pages +
    num_pages_budget]`` logical page indices (page j holds tokens ``j*page_size ..``), ascending,
    -1 after ``counts`` (int32 ``[batch, S]``; = min(pages of the sequence, the width)); S = Hkv,
    or H with ``per_query_head``. ``max_pages`` (host int, default ``block_table.shape[1]``) bounds
    the pages looked at and must cover the longest sequence. One fp32 score per page and selection
    head is materialised (``[batch, S, max(max_pages, width)]``).
    """
    batch, h, d = q.shape
    hkv = summary_min.shape[1]
    if summary_min.shape[2] != d or h % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not match summaries {tuple(summary_min.shape)}")
    if min(sink_pages, recent_pages, num_pages_budget) < 0:
        raise ValueError("sink_pages, recent_pages and num_pages_budget must be >= 0")
    group = h // hkv
    hps = 1 if per_query_head else group  # query heads per selection
    n_sel = h // hps
    width = sink_pages + recent_pages + num_pages_budget
    if width == 0:
        raise ValueError("nothing to select (all of sink_pages, recent_pages, num_pages_budget are 0)")
    max_pages = block_table.shape[1] if max_pages is None else max_pages
    score_width = max(max_pages, width)
    scores = torch.empty(batch, n_sel, score_width, dtype=torch.float32, device=q.device)
    if batch == 0:
        empty = torch.empty(0, n_sel, width, dtype=torch.int32, device=q.device)
        return empty, empty[..., 0]
    block_p = 32
    _page_scores_kernel[(triton.cdiv(score_width, block_p), batch, n_sel)](
        q, summary_min, summary_max, block_table, seq_lens, scores,
        *q.stride(), *summary_min.stride(), block_table.stride(0), scores.stride(0), scores.stride(1),
        max_pages, score_width, sink_pages, recent_pages,
        GROUP=group, HPS=hps, PAGE=page_size, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_H=triton.next_power_of_2(hps), BLOCK_P=block_p,
    )
    return top_pages(scores, width)


# --------------------------------------------------------------------------------------------
# 3. Attention over the selected pages
# --------------------------------------------------------------------------------------------

@triton.jit
def _selected_tokens(sel_row_ptr, bt_row_ptr, e, e_end, seq_len, offs_n, PAGE: tl.constexpr):
    """The BLOCK_N tokens of selected entries ``e ..`` (entries >= e_end are empty): logical page
    of each token's entry, its physical page (int64), its offset in the page, whether it is a
    key of the sequence."""
    entry = e + offs_n // PAGE
    within = offs_n % PAGE
    lp = tl.load(sel_row_ptr + entry, mask=entry < e_end, other=-1)
    valid = (lp >= 0) & (lp * PAGE + within < seq_len)
    phys = tl.load(bt_row_ptr + lp, mask=valid, other=0).to(tl.int64)
    return lp, phys, within, valid


@triton.jit
def _load_group_q(q_ptr, b, head, h_ok, offs_d, d_ok, s_qb, s_qh, s_qd):
    return tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                   mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _token_scores_kernel(q_ptr, k_ptr, bt_ptr, seq_lens_ptr, sel_ptr, cnt_ptr, ts_ptr,
                         s_qb, s_qh, s_qd, s_kp, s_kt, s_kh, s_kd, s_bt, s_selb, s_selh, s_cb, s_tb, s_th,
                         tokens_width,
                         GROUP: tl.constexpr, HPS: tl.constexpr, PAGE: tl.constexpr, PPT: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """Raw scores q.k (fp32, unscaled) of the tokens of PPT selected entries for the HPS query heads
    of one selection; -inf for tokens that are not keys of the sequence. Layout ``[B, H, width *
    PAGE]``: token t of entry e at column ``e * PAGE + t``."""
    BLOCK_N: tl.constexpr = PPT * PAGE
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    sel = tl.program_id(2)
    kvh = (sel * HPS // GROUP).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < HPS
    d_ok = offs_d < HEAD_DIM
    head = sel * HPS + offs_h
    q = _load_group_q(q_ptr, b, head, h_ok, offs_d, d_ok, s_qb, s_qh, s_qd)
    count = tl.load(cnt_ptr + b * s_cb + sel)
    seq_len = tl.load(seq_lens_ptr + b)
    lp, phys, within, valid = _selected_tokens(sel_ptr + b * s_selb + sel * s_selh, bt_ptr + b * s_bt,
                                               tile * PPT, count, seq_len, offs_n, PAGE)
    kt = tl.load(k_ptr + phys[None, :] * s_kp + within[None, :] * s_kt + kvh * s_kh + offs_d[:, None] * s_kd,
                 mask=valid[None, :] & d_ok[:, None], other=0.0).to(tl.float32)
    s = tl.dot(q, kt, input_precision=DOT_PRECISION)
    s = tl.where(valid[None, :], s, float("-inf"))
    col = tile * BLOCK_N + offs_n
    tl.store(ts_ptr + b * s_tb + head[:, None] * s_th + col[None, :], s,
             mask=h_ok[:, None] & (col < tokens_width)[None, :])


@triton.jit
def _topk_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_lens_ptr, sel_ptr, cnt_ptr,
                        ts_ptr, thr_ptr, part_o_ptr, part_lse_ptr,
                        s_qb, s_qh, s_qd, s_kp, s_kt, s_kh, s_kd, s_vp, s_vt, s_vh, s_vd,
                        s_ob, s_oh, s_od, s_bt, s_selb, s_selh, s_cb, s_tb, s_th, s_thr,
                        num_heads, sink_pages, recent_pages, qk_scale,
                        GROUP: tl.constexpr, HPS: tl.constexpr, PAGE: tl.constexpr, PPT: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, TOKEN_TOPK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program per (sequence, selection, split): the HPS query heads of a selection stacked
    along M (padded to BLOCK_H >= 16 for tl.dot), so each K/V tile is read once for all of them;
    the split takes an equal share of the selection's entries, PPT pages per tile."""
    BLOCK_N: tl.constexpr = PPT * PAGE
    b = tl.program_id(0).to(tl.int64)
    sel = tl.program_id(1)
    split = tl.program_id(2)
    kvh = (sel * HPS // GROUP).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < HPS
    d_ok = offs_d < HEAD_DIM
    head = sel * HPS + offs_h
    count = tl.load(cnt_ptr + b * s_cb + sel)
    seq_len = tl.load(seq_lens_ptr + b)
    n_pages = (seq_len + PAGE - 1) // PAGE
    # this split's entries: a whole number of tiles, from the actual count (short sequences
    # spread over all splits, not piled into the first)
    per_split = ((count + NUM_SPLITS - 1) // NUM_SPLITS + PPT - 1) // PPT * PPT
    e0 = split * per_split
    e1 = tl.minimum(e0 + per_split, count)
    sel_row = sel_ptr + b * s_selb + sel * s_selh
    bt_row = bt_ptr + b * s_bt
    if TOKEN_TOPK:
        thr = tl.load(thr_ptr + b * s_thr + head, mask=h_ok, other=float("inf"))
    else:
        q = _load_group_q(q_ptr, b, head, h_ok, offs_d, d_ok, s_qb, s_qh, s_qd)
    qk_scale_log2 = qk_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for e in range(e0, e1, PPT):
        lp, phys, within, valid = _selected_tokens(sel_row, bt_row, e, e1, seq_len, offs_n, PAGE)
        if TOKEN_TOPK:
            # the scores of pass 1; tokens of sink / recent pages always, the others at or above
            # the head's k-th largest
            col = e * PAGE + offs_n
            s = tl.load(ts_ptr + b * s_tb + head[:, None] * s_th + col[None, :],
                        mask=h_ok[:, None] & valid[None, :], other=float("-inf"))
            forced = (lp < sink_pages) | (lp >= n_pages - recent_pages)
            keep = valid[None, :] & h_ok[:, None] & (forced[None, :] | (s >= thr[:, None]))
            v_needed = tl.max(keep.to(tl.int32), 0) > 0  # V only of tokens some head keeps
        else:
            kt = tl.load(k_ptr + phys[None, :] * s_kp + within[None, :] * s_kt + kvh * s_kh + offs_d[:, None] * s_kd,
                         mask=valid[None, :] & d_ok[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION)
            keep = valid[None, :] & (offs_h >= 0)[:, None]
            v_needed = valid
        s = tl.where(keep, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + phys[:, None] * s_vp + within[:, None] * s_vt + kvh * s_vh + offs_d[None, :] * s_vd,
                    mask=v_needed[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # nothing selected: zero output, never NaN
    store_ok = h_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + b * s_ob + head[:, None] * s_oh + offs_d[None, :] * s_od,
                 o.to(o_ptr.dtype.element_ty), mask=store_ok)
    else:
        part = (b * num_heads + head) * NUM_SPLITS + split  # [BLOCK_H] rows of [B, H, NUM_SPLITS]
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=store_ok)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # log2 domain
        tl.store(part_lse_ptr + part, lse, mask=h_ok)


@triton.jit
def _combine_splits_kernel(part_o_ptr, part_lse_ptr, o_ptr, s_ob, s_oh, s_od, num_heads,
                           NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    part = (b * num_heads + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    o_s = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    den = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o_s, 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(o_ptr + b * s_ob + h * s_oh + offs_d * s_od, o.to(o_ptr.dtype.element_ty), mask=d_ok)


def pages_per_tile(page_size: int) -> int:
    """Selected pages gathered per key tile: KEYS_PER_TILE keys a tile (one page when pages are larger)."""
    return max(1, KEYS_PER_TILE // page_size)


def default_num_splits(batch: int, num_selections: int, width: int, page_size: int) -> int:
    """Splits of each selection's pages (flash-decoding), from host ints only (fixed per CUDA-graph
    batch size): enough programs to occupy about ``_TARGET_PROGRAMS`` SMs, at least one tile per
    split, at most 16. Not tuned on a GPU yet."""
    programs = batch * num_selections
    if programs >= _TARGET_PROGRAMS:
        return 1
    tiles = triton.cdiv(width, pages_per_tile(page_size))
    return max(1, min(triton.cdiv(_TARGET_PROGRAMS, programs), tiles, 16))


def token_topk_thresholds(token_scores: torch.Tensor, selected: torch.Tensor, seq_lens: torch.Tensor,
                          page_size: int, topk_tokens: int, sink_pages: int, recent_pages: int) -> torch.Tensor:
    """Per (sequence, query head): the ``topk_tokens``-th largest score among the tokens of the
    selected pages that are not sink or recent pages (-inf where there are fewer). token_scores:
    fp32 ``[B, H, width * page_size]`` (from pass 1); selected: ``[B, S, width]``. Returns fp32
    ``[B, H]``. Torch, fixed shapes."""
    batch, h, tokens_width = token_scores.shape
    n_sel, width = selected.shape[1:]
    n_pages = (seq_lens.to(torch.int64) + page_size - 1) // page_size
    lp = selected.to(torch.int64)
    forced = (lp < sink_pages) | (lp >= (n_pages[:, None, None] - recent_pages))  # [B, S, width]
    forced = forced.repeat_interleave(page_size, dim=-1)[:, :, None, :]  # [B, S, 1, width * page]
    cand = token_scores.view(batch, n_sel, h // n_sel, tokens_width).masked_fill(forced, float("-inf"))
    k = min(topk_tokens, tokens_width)
    return cand.topk(k, dim=-1, sorted=False).values.amin(-1).reshape(batch, h)


def topk_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, selected: torch.Tensor,
                          counts: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                          topk_tokens: int = 0, sink_pages: int = 0, recent_pages: int = 0,
                          num_splits: int | None = None, num_warps: int = 8) -> torch.Tensor:
    """Decode attention of one query token per sequence over the selected pages only.

    q, out: ``[batch, H, D]`` (any strides; out defaults to a new tensor like q); key_cache,
    value_cache: ``[num_pages, page_size, Hkv, D]`` views (any strides); block_table int32
    ``[batch, max_pages]``; seq_lens int32 ``[batch]`` (keys in the cache, the query's own
    included: the query is at position seq_len - 1); selected / counts from :func:`select_pages`
    (``[batch, S, width]`` logical pages, S = Hkv for group-shared or H for per-query-head
    selections). Keys at positions >= seq_len are never read.

    ``topk_tokens`` > 0: per query head, among the tokens of the selected pages other than the
    first ``sink_pages`` and last ``recent_pages`` pages of the sequence (pass the values given to
    :func:`select_pages`), only those scoring at least the k-th largest score (ties: all of them);
    the sink and recent pages' tokens are always used. Costs a pass over the selected keys that
    writes fp32 scores ``[batch, H, width * page_size]``, and a ``torch.topk`` over them.

    A sequence with nothing selected (seq_len 0, e.g. a padded CUDA-graph slot) gets zeros.
    ``num_splits``: flash-decoding splits of each selection's pages (default
    :func:`default_num_splits`). ``num_warps`` of the attention kernel: 8 because ptxas (sm_90,
    Triton 3.9) spills 0.5 KB per thread at 4 warps for head dim 128 and 64-key tiles (the
    gathered tiles' 64-bit addresses), none at 8; not timed yet. Returns ``out``.
    """
    page, hkv, d = check_cache(key_cache)
    batch, h, dq = q.shape
    if dq != d or value_cache.shape[-1] != d or tuple(value_cache.shape[:3]) != tuple(key_cache.shape[:3]):
        raise ValueError("q, key cache and value cache head sizes / shapes disagree")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported")
    if h % hkv:
        raise ValueError(f"{h} query heads not a multiple of {hkv} KV heads")
    n_sel, width = selected.shape[1:]
    if selected.shape[0] != batch or tuple(counts.shape) != (batch, n_sel) or h % n_sel or n_sel % hkv:
        raise ValueError(f"selection {tuple(selected.shape)} / counts {tuple(counts.shape)} "
                         f"do not fit q {tuple(q.shape)}")
    group = h // hkv
    hps = h // n_sel  # query heads sharing a selection: the group, or 1
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    ppt = pages_per_tile(page)
    splits = num_splits or default_num_splits(batch, n_sel, width, page)
    block_h = max(16, triton.next_power_of_2(hps))
    block_d = max(16, triton.next_power_of_2(d))
    precision = "ieee" if q.dtype == torch.float32 or key_cache.dtype == torch.float32 else "tf32"
    consts = dict(GROUP=group, HPS=hps, PAGE=page, PPT=ppt, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_H=block_h,
                  DOT_PRECISION=precision)

    token_topk = topk_tokens > 0
    if token_topk:
        tokens_width = width * page
        token_scores = torch.empty(batch, h, tokens_width, dtype=torch.float32, device=q.device)
        _token_scores_kernel[(triton.cdiv(width, ppt), batch, n_sel)](
            q, key_cache, block_table, seq_lens, selected, counts, token_scores,
            *q.stride(), *key_cache.stride(), block_table.stride(0), selected.stride(0), selected.stride(1),
            counts.stride(0), token_scores.stride(0), token_scores.stride(1), tokens_width,
            num_warps=4, **consts,
        )
        thresholds = token_topk_thresholds(token_scores, selected, seq_lens, page, topk_tokens, sink_pages,
                                           recent_pages)
    else:
        token_scores = thresholds = counts  # unused pointers
    if splits > 1:
        part_o = torch.empty(batch, h, splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, h, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = counts  # unused pointers
    _topk_decode_kernel[(batch, n_sel, splits)](
        q, key_cache, value_cache, out, block_table, seq_lens, selected, counts,
        token_scores, thresholds, part_o, part_lse,
        *q.stride(), *key_cache.stride(), *value_cache.stride(), *out.stride(),
        block_table.stride(0), selected.stride(0), selected.stride(1), counts.stride(0),
        token_scores.stride(0) if token_topk else 0, token_scores.stride(1) if token_topk else 0,
        thresholds.stride(0) if token_topk else 0,
        h, sink_pages, recent_pages, float(scale),
        NUM_SPLITS=splits, TOKEN_TOPK=token_topk, num_warps=num_warps, **consts,
    )
    if splits > 1:
        _combine_splits_kernel[(batch, h)](
            part_o, part_lse, out, *out.stride(), h,
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=d, BLOCK_D=block_d,
        )
    return out
