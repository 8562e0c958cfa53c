"""The ``@triton.jit`` building blocks of the sparse prefill kernels (:mod:`.attention`): which
rows and keys a program owns, its lists, the online softmax over one key tile (gathered through
the block table or loaded with the tensor memory accelerator) and the tile loops over listed
key blocks, key ranges and single key columns, and the stores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..constants import BIG_KEY, BLOCK, LN2, LOG2E, NEG_INF
from .packing import META_BT_ROW, META_KVLEN, META_NQ, META_QPOS, META_TOK, META_WIDTH


@triton.jit
def _kv_offsets(bt_row_ptr, kpos, kv_ok, kvh, k_strides, v_strides, PAGE: tl.constexpr):
    """Row offsets (int64) of key positions kpos in the key and value caches (strides of their
    [pages, page, Hkv, D] views)."""
    page = tl.load(bt_row_ptr + kpos // PAGE, mask=kv_ok, other=0).to(tl.int64)
    slot = (kpos % PAGE).to(tl.int64)
    k_off = page * k_strides[0] + slot * k_strides[1] + kvh * k_strides[2]
    v_off = page * v_strides[0] + slot * v_strides[1] + kvh * v_strides[2]
    return k_off, v_off


@triton.jit
def _listed_block(blist, e, ok, whole, DENSE: tl.constexpr, FALLBACK: tl.constexpr):
    """Key block of list entry e: e itself in dense mode (or for a row running every causal block,
    ``whole``), else the listed one (0 where ``ok`` is false)."""
    if DENSE:
        return e
    elif FALLBACK:
        listed = (ok.to(tl.int32) * (1 - whole.to(tl.int32))) != 0  # ok and not whole (interpreter-safe)
        return tl.where(whole, e, tl.load(blist + e, mask=listed, other=0))
    else:
        return tl.load(blist + e, mask=ok, other=0)


@triton.jit
def _heads_using(bits, head_bit):
    """Merged lists: [BLOCK_M, BLOCK_N] mask of the stacked rows whose head (its bit, head_bit
    [BLOCK_M]) is set in the entry bits of each key column (bits [BLOCK_N])."""
    return ((bits[None, :] >> head_bit[:, None]) & 1) != 0


@triton.jit
def _fold_tile(m_i, l_i, acc, s, v):
    """The online softmax's update by one tile of scores s (log2 domain) and its values v."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _online_softmax(m_i, l_i, acc, q, kt, v, allow, qk_scale, softcap, skip_log2,
                    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, SKIP: tl.constexpr):
    """Fold one key tile (kt: [HEAD_DIM, BLOCK_N], v: [BLOCK_N, HEAD_DIM]) into the running
    online softmax (log2 domain): row maxima m_i, row sums l_i, output accumulator acc.

    SKIP: a tile whose every row's largest score lies more than ``skip_log2`` below that row's
    running maximum (each of its weights < 2^-skip_log2 of the row's largest so far) is left out:
    no exponentials, no P.V (the skip-softmax filter; only ever given to tiles of listed blocks
    below the diagonal, whose running maxima already hold earlier keys)."""
    # an fp8 cache is widened to the query's dtype here (its scales are in qk_scale and the
    # output); for a cache of the query's dtype these are no-ops
    kt = kt.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, kt)
    if SOFTCAP:
        # softcap * tanh(s * scale / softcap), tanh through exp2; then to the log2 domain
        x = s * (qk_scale / softcap)
        e = tl.exp2(x * (2.0 * LOG2E))
        s = softcap * (1.0 - 2.0 / (e + 1.0)) * LOG2E
    else:
        s = s * (qk_scale * LOG2E)
    if MASKED:
        s = tl.where(allow, s, NEG_INF)
    if SKIP:
        if tl.max(tl.max(s, 1) - m_i, 0) < -skip_log2:
            m_out, l_out, acc_out = m_i, l_i, acc
        else:
            m_out, l_out, acc_out = _fold_tile(m_i, l_i, acc, s, v)
    else:
        m_out, l_out, acc_out = _fold_tile(m_i, l_i, acc, s, v)
    return m_out, l_out, acc_out


@triton.jit
def _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, kv_ok, allow,
                 s_kd, s_vd, qk_scale, softcap, skip_log2,
                 MASKED: tl.constexpr, LOAD_MASKED: tl.constexpr, SOFTCAP: tl.constexpr, SKIP: tl.constexpr):
    """One BLOCK_N-wide key tile gathered through per-key row offsets k_off/v_off ([BLOCK_N])."""
    if LOAD_MASKED:
        kt = tl.load(k_ptr + k_off[None, :] + offs_d[:, None] * s_kd, mask=kv_ok[None, :], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :] * s_vd, mask=kv_ok[:, None], other=0.0)
    else:
        kt = tl.load(k_ptr + k_off[None, :] + offs_d[:, None] * s_kd)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :] * s_vd)
    return _online_softmax(m_i, l_i, acc, q, kt, v, allow, qk_scale, softcap, skip_log2, MASKED, SOFTCAP, SKIP)


@triton.jit
def _tile_page_slot(bt_row_ptr, kb, ok, PAGE: tl.constexpr):
    """(page, first slot) of key block kb, whose BLOCK keys lie in one page (PAGE % BLOCK == 0)."""
    page = tl.load(bt_row_ptr + (kb * BLOCK) // PAGE, mask=ok, other=0)
    return page, (kb * BLOCK) % PAGE


@triton.jit
def _attend_tile_tma(m_i, l_i, acc, q, k_desc, v_desc, page, slot, kvh, kv_ok, allow, qk_scale, softcap, skip_log2,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     MASKED: tl.constexpr, SOFTCAP: tl.constexpr, SKIP: tl.constexpr):
    """One key tile of BLOCK_N consecutive keys of one page, loaded with the tensor memory
    accelerator (4-D descriptors over the [pages, page, Hkv, D] caches)."""
    k = tl.reshape(k_desc.load([page, slot, kvh, 0]), [BLOCK_N, HEAD_DIM])
    v = tl.reshape(v_desc.load([page, slot, kvh, 0]), [BLOCK_N, HEAD_DIM])
    if MASKED:
        # the page's keys past the row's end hold whatever the cache holds: keep them out of p @ v
        v = tl.where(kv_ok[:, None], v, tl.zeros_like(v))
    return _online_softmax(m_i, l_i, acc, q, tl.trans(k), v, allow, qk_scale, softcap, skip_log2, MASKED, SOFTCAP,
                           SKIP)


@triton.jit
def _key_lanes(BLOCK_N: tl.constexpr):
    """Per key column of a tile: (offs_n, sub, within, zero_n): its index; which of the tile's
    KPT = BLOCK_N // BLOCK listed blocks or ranges it comes from (a scalar 0 with one per tile, so
    that list entries and their masks stay scalars); its key within that block or range; and
    zeros that widen a scalar to [BLOCK_N]."""
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_N == BLOCK:
        sub = tl.program_id(0) * 0
    else:
        sub = offs_n // BLOCK
    return offs_n, sub, offs_n % BLOCK, offs_n * 0


@triton.jit
def program_ids(num_qb, num_lists, LPK: tl.constexpr, KV_MAJOR: tl.constexpr):
    """(list owner, query block) of this program. KV_MAJOR: the programs of one KV head run
    together (its K/V stays in L2), query blocks from the last (heaviest) to the first, the KV
    head's LPK list owners innermost; else list owners innermost over all KV heads."""
    pid = tl.program_id(0)
    if KV_MAJOR:
        per_kv = num_qb * LPK
        kvh_i = pid // per_kv
        rem = pid % per_kv
        qb = num_qb - 1 - rem // LPK
        pid_h = kvh_i * LPK + rem % LPK
    else:
        pid_h = pid % num_lists
        qb = num_qb - 1 - pid // num_lists
    return pid_h, qb


@triton.jit
def program_rows(q_ptr, q_strides, meta_ptr, bt_ptr, s_bt, pid_h, qb,
                  GROUP: tl.constexpr, GH: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """List owner pid_h's rows of query block qb: GH heads of one KV group stacked along M (row r:
    the group's head (pid_h % LPK) * GH + r // BLOCK, query r % BLOCK of the block).

    Returns (rows, keys, lanes, out_rows, nq, qpos0):
    rows = (q, qpos, head_bit): per row its query vector, absolute position and head bit;
    keys = (bt_row_ptr, kvh_i, kvh, kv_len): the row's block-table row, the KV head (int32,
    int64) and the row's kv length; lanes: :func:`_key_lanes`; out_rows = (tok, head, row_ok): per
    row its token and query head in q / out, and whether it is a real query of a real head (not a
    padding head >= GROUP); nq, qpos0: the block's valid queries and first query position."""
    BLOCK_M: tl.constexpr = GH * BLOCK
    LPK: tl.constexpr = (GROUP + GH - 1) // GH  # list owners per KV head
    kvh_i = pid_h // LPK
    kvh = kvh_i.to(tl.int64)

    mrow = meta_ptr + qb * META_WIDTH
    bt_row = tl.load(mrow + META_BT_ROW)
    tok0 = tl.load(mrow + META_TOK)
    nq = tl.load(mrow + META_NQ)
    qpos0 = tl.load(mrow + META_QPOS)
    kv_len = tl.load(mrow + META_KVLEN)
    bt_row_ptr = bt_ptr + bt_row.to(tl.int64) * s_bt

    offs_m = tl.arange(0, BLOCK_M)
    r_in = offs_m % BLOCK  # query within the block
    head_bit = offs_m // BLOCK
    hg = (pid_h % LPK) * GH + head_bit  # head within the KV group (>= GROUP: padding rows, masked)
    head = kvh_i * GROUP + hg
    offs_d = tl.arange(0, HEAD_DIM)
    lanes = _key_lanes(BLOCK_N)
    row_ok = r_in < nq
    if GROUP % GH != 0:
        row_ok = row_ok & (hg < GROUP)
        head = tl.minimum(head, kvh_i * GROUP + GROUP - 1)
    qpos = qpos0 + r_in
    tok = (tok0 + r_in).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * q_strides[0] + head[:, None] * q_strides[1] + offs_d[None, :] * q_strides[2],
                mask=row_ok[:, None], other=0.0)
    return (q, qpos, head_bit), (bt_row_ptr, kvh_i, kvh, kv_len), lanes, (tok, head, row_ok), nq, qpos0


@triton.jit
def block_list(bcnt_ptr, bidx_ptr, whole_ptr, maxb, s_lh, pid_h, qb, qpos0, nq,
                DENSE: tl.constexpr, FALLBACK: tl.constexpr):
    """(lrow, blist, n_full, n_all, whole): the program's row of the [lists, TQB(, width)] lists
    (list owner pid_h, query block qb; s_lh = TQB), its list of key blocks, how many of the
    entries end at or before the first query (no causal mask needed), how many there are, and
    whether the row runs every causal key block instead of its list (FALLBACK: flagged in
    whole_ptr; in dense mode there is no list and every causal block counts)."""
    kb_full = (qpos0 + 1) // BLOCK  # key blocks kb < kb_full end at or before the first query
    lrow = pid_h.to(tl.int64) * s_lh + qb
    blist = bidx_ptr + lrow * maxb
    n_causal = (qpos0 + nq - 1) // BLOCK + 1
    whole = n_causal < 0  # (false; a placeholder unless FALLBACK)
    if DENSE:
        n_full = kb_full
        n_all = n_causal
    else:
        n_all = tl.load(bcnt_ptr + lrow)
        last1 = tl.load(blist + n_all - 1, mask=n_all >= 1, other=-1)
        last2 = tl.load(blist + n_all - 2, mask=n_all >= 2, other=-1)
        n_full = n_all - (last1 >= kb_full).to(tl.int32) - (last2 >= kb_full).to(tl.int32)
        if FALLBACK:
            whole = tl.load(whole_ptr + qb) != 0
            n_all = tl.where(whole, n_causal, n_all)
            n_full = tl.where(whole, kb_full, n_full)
    return lrow, blist, n_full, n_all, whole


@triton.jit
def list_row(cnt_ptr, idx_ptr, width, lrow, whole, FALLBACK: tl.constexpr):
    """(entries, count) of row lrow of a [lists, TQB, width] list: none where the row runs every
    causal key block instead (FALLBACK, ``whole``)."""
    n = tl.load(cnt_ptr + lrow)
    if FALLBACK:
        n = tl.where(whole, 0, n)
    return idx_ptr + lrow * width, n


@triton.jit
def block_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, skip_log2, blist, bits_row, n_full,
                 n_all, whole, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DENSE: tl.constexpr,
                 MERGED: tl.constexpr, PREFETCH: tl.constexpr, FALLBACK: tl.constexpr, SOFTCAP: tl.constexpr,
                 TMA: tl.constexpr, SKIP: tl.constexpr):
    """The listed key blocks (:func:`block_list`), KPT = BLOCK_N // BLOCK per key tile: 1) the
    tiles of blocks strictly below the diagonal, unmasked (but for merged heads' bits); 2) the
    rest, causally masked: the (at most two) blocks reaching the queries' own positions, an odd
    block left. TMA: tiles loaded through the descriptors (one 64-key block per tile), else
    gathered per key. bits_row: the entries' head bits (MERGED only). SKIP: the skip-softmax
    filter (:func:`_online_softmax`) on the tiles of 1)."""
    KPT: tl.constexpr = BLOCK_N // BLOCK  # listed key blocks per key tile (1 or 2)
    n_full_tiles = n_full // KPT
    n_tiles = (n_all + KPT - 1) // KPT
    q, qpos, head_bit = rows
    bt_row_ptr, kvh_i, kvh, kv_len = keys
    offs_n, sub, within, zero_n = lanes
    k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc = cache
    offs_d = tl.arange(0, HEAD_DIM)

    # 1) tiles of whole key blocks strictly below the diagonal: no masks (unless merged heads).
    n_full_e = n_full_tiles * KPT
    if TMA:
        # one page lookup per tile, a scalar; the next tile's is issued before this tile's math
        kb = _listed_block(blist, sub, sub < n_full_e, whole, DENSE, FALLBACK)
        page, slot = _tile_page_slot(bt_row_ptr, kb, sub < n_full_e, PAGE)
        for t in range(0, n_full_tiles):
            e_n = t + 1
            ok_n = e_n < n_full_e
            kb_n = _listed_block(blist, e_n, ok_n, whole, DENSE, FALLBACK)
            page_n, slot_n = _tile_page_slot(bt_row_ptr, kb_n, ok_n, PAGE)
            if MERGED:
                allow = _heads_using(tl.load(bits_row + t) + zero_n, head_bit)
                m_i, l_i, acc = _attend_tile_tma(m_i, l_i, acc, q, k_desc, v_desc, page, slot, kvh_i, within >= 0,
                                                 allow, qk_scale, softcap, skip_log2, BLOCK_N, HEAD_DIM, True, SOFTCAP,
                                                 SKIP)
            else:
                m_i, l_i, acc = _attend_tile_tma(m_i, l_i, acc, q, k_desc, v_desc, page, slot, kvh_i, within >= 0,
                                                 within >= 0, qk_scale, softcap, skip_log2, BLOCK_N, HEAD_DIM, False,
                                                 SOFTCAP, SKIP)
            page = page_n
            slot = slot_n
    else:
        # With PREFETCH the next tile's list entries and page lookups are issued before this
        # tile's math, so the K/V loads of a tile depend only on loop-carried offsets.
        if PREFETCH:
            kb = _listed_block(blist, sub, sub < n_full_e, whole, DENSE, FALLBACK)
            kpos = kb * BLOCK + within
            k_off, v_off = _kv_offsets(bt_row_ptr, kpos, (sub + zero_n) < n_full_e, kvh, k_strides, v_strides, PAGE)
        for t in range(0, n_full_tiles):
            e = t * KPT + sub
            if PREFETCH:
                e_n = e + KPT
                ok_n = e_n < n_full_e
                kb_n = _listed_block(blist, e_n, ok_n, whole, DENSE, FALLBACK)
                kpos_n = kb_n * BLOCK + within
                k_off_n, v_off_n = _kv_offsets(bt_row_ptr, kpos_n, (e_n + zero_n) < n_full_e, kvh, k_strides,
                                               v_strides, PAGE)
            else:
                kb = _listed_block(blist, e, e >= 0, whole, DENSE, FALLBACK)
                kpos = kb * BLOCK + within
                k_off, v_off = _kv_offsets(bt_row_ptr, kpos, kpos >= 0, kvh, k_strides, v_strides, PAGE)
            if MERGED:
                allow = _heads_using(tl.load(bits_row + e) + zero_n, head_bit)  # e: a scalar or [BLOCK_N]
                m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, within >= 0, allow,
                                             k_strides[3], v_strides[3], qk_scale, softcap, skip_log2, True, False,
                                             SOFTCAP, SKIP)
            else:
                m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, within >= 0,
                                             within >= 0, k_strides[3], v_strides[3], qk_scale, softcap, skip_log2,
                                             False, False, SOFTCAP, SKIP)
            if PREFETCH:
                k_off = k_off_n
                v_off = v_off_n

    # 2) the rest: the (at most two) blocks reaching the queries' own positions, an odd block left
    for t in range(n_full_tiles, n_tiles):
        e = t * KPT + sub
        e_ok = e < n_all
        kb = _listed_block(blist, e, e_ok, whole, DENSE, FALLBACK)
        kpos = kb * BLOCK + within
        kv_ok = ((e + zero_n) < n_all) & (kpos < kv_len)  # (vector form: the interpreter mis-types scalar & vector)
        allow = (kpos[None, :] <= qpos[:, None]) & kv_ok[None, :]
        if MERGED:
            allow = allow & _heads_using(tl.load(bits_row + e, mask=e_ok, other=0) + zero_n, head_bit)
        if TMA:
            page, slot = _tile_page_slot(bt_row_ptr, kb, e_ok, PAGE)
            m_i, l_i, acc = _attend_tile_tma(m_i, l_i, acc, q, k_desc, v_desc, page, slot, kvh_i, kv_ok, allow,
                                             qk_scale, softcap, 0.0, BLOCK_N, HEAD_DIM, True, SOFTCAP, False)
        else:
            k_off, v_off = _kv_offsets(bt_row_ptr, kpos, kv_ok, kvh, k_strides, v_strides, PAGE)
            m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, kv_ok, allow,
                                         k_strides[3], v_strides[3], qk_scale, softcap, 0.0, True, True, SOFTCAP,
                                         False)
    return m_i, l_i, acc


@triton.jit
def range_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, rlist, n_rng,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr):
    """The listed key ranges (slash lines), ascending: each covers BLOCK keys from its start, cut
    where the next one starts; KPT of them per key tile. Always masked (causal, the cut, the
    row's end); gathered per key."""
    KPT: tl.constexpr = BLOCK_N // BLOCK
    q, qpos, head_bit = rows
    bt_row_ptr, kvh_i, kvh, kv_len = keys
    offs_n, sub, within, zero_n = lanes
    k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc = cache
    offs_d = tl.arange(0, HEAD_DIM)
    for t in range(0, (n_rng + KPT - 1) // KPT):
        e = t * KPT + sub
        e_ok = (e + zero_n) < n_rng
        start = tl.load(rlist + e, mask=e < n_rng, other=0)
        stop = tl.load(rlist + e + 1, mask=e + 1 < n_rng, other=BIG_KEY)
        kpos = start + within
        kv_ok = e_ok & (kpos < stop) & (kpos < kv_len)
        k_off, v_off = _kv_offsets(bt_row_ptr, kpos, kv_ok, kvh, k_strides, v_strides, PAGE)
        allow = (kpos[None, :] <= qpos[:, None]) & kv_ok[None, :]
        m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, kv_ok, allow,
                                     k_strides[3], v_strides[3], qk_scale, softcap, 0.0, True, True, SOFTCAP, False)
    return m_i, l_i, acc


@triton.jit
def column_tiles(m_i, l_i, acc, rows, keys, lanes, cache, qk_scale, softcap, clist, n_col, bits_row,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MERGED: tl.constexpr,
                  SOFTCAP: tl.constexpr):
    """The listed single key columns, BLOCK_N per key tile, gathered and masked (causal, the
    row's end; merged heads: the entries' head bits in bits_row)."""
    q, qpos, head_bit = rows
    bt_row_ptr, kvh_i, kvh, kv_len = keys
    offs_n, sub, within, zero_n = lanes
    k_ptr, v_ptr, k_strides, v_strides, k_desc, v_desc = cache
    offs_d = tl.arange(0, HEAD_DIM)
    for j in range(0, n_col, BLOCK_N):
        c_ok = (j + offs_n) < n_col
        kpos = tl.load(clist + j + offs_n, mask=c_ok, other=0)
        c_ok = c_ok & (kpos >= 0) & (kpos < kv_len)
        k_off, v_off = _kv_offsets(bt_row_ptr, kpos, c_ok, kvh, k_strides, v_strides, PAGE)
        allow = (kpos[None, :] <= qpos[:, None]) & c_ok[None, :]
        if MERGED:
            allow = allow & _heads_using(tl.load(bits_row + j + offs_n, mask=c_ok, other=0), head_bit)
        m_i, l_i, acc = _attend_tile(m_i, l_i, acc, q, k_ptr, v_ptr, k_off, v_off, offs_d, c_ok, allow,
                                     k_strides[3], v_strides[3], qk_scale, softcap, 0.0, True, True, SOFTCAP, False)
    return m_i, l_i, acc


@triton.jit
def store_rows(o_ptr, o_strides, acc, l_i, tok, head, row_ok, v_scale_ptr,
                HEAD_DIM: tl.constexpr, KV_SCALED: tl.constexpr):
    """The normalised output of the program's real rows (zero where a query selected nothing)."""
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_SCALED:
        o = o * tl.load(v_scale_ptr)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(o_ptr + tok[:, None] * o_strides[0] + head[:, None] * o_strides[1] + offs_d[None, :] * o_strides[2],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def store_lse(lse_ptr, s_lse_h, m_i, l_i, tok, head, row_ok):
    """Natural-log LSE of the program's real rows into lse [H, T] (-inf where a query selected
    nothing)."""
    has = l_i > 0.0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, NEG_INF)
    tl.store(lse_ptr + head.to(tl.int64) * s_lse_h + tok, lse, mask=row_ok)

