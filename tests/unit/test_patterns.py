"""Pattern estimators: each selects what its paper defines, checked against brute force."""

import math

import pytest
import torch

from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_backend.head_configs import HeadPattern, resolve_head
from vllm_sparse_backend.prefill.index import build_index, count_pairs, num_blocks, range_stops
from vllm_sparse_kernels.reference.index import index_to_dense_mask
from vllm_sparse_backend.prefill.estimate import estimate_index
from vllm_sparse_backend.prefill.patterns.a_shape import a_shape_selection
from vllm_sparse_backend.prefill.patterns.block_sparse import block_sparse_selection
from vllm_sparse_backend.prefill.patterns.base import cumulative_budget, keep_top
from vllm_sparse_backend.prefill.patterns.flex_prefill import flex_prefill_selection, sqrt_js_divergence
from vllm_sparse_backend.prefill.patterns.vertical_slash import vertical_slash_selection, vertical_slash_to_selection
from vllm_sparse_kernels.prefill.estimate_math import antidiagonal_block_mass, mass_block_counts, sampled_block_mass


def _qk(q_len, ctx_len, h, hkv, d, gen):
    q = torch.randn(q_len, h, d, generator=gen)
    k = torch.randn(ctx_len + q_len, hkv, d, generator=gen)
    return q, k


@pytest.mark.parametrize("q_len,ctx_len,b", [(300, 0, 64), (200, 150, 64), (129, 40, 32)])
@pytest.mark.parametrize("slash_tiles", ["ranges", "blocks"])
def test_vertical_slash_conversion_covers_lines_with_minimal_tiles(q_len, ctx_len, b, slash_tiles, rng):
    h, kv_len = 3, ctx_len + q_len
    v_keep = torch.rand(h, kv_len, generator=rng) < 0.05
    s_keep = torch.rand(h, kv_len, generator=rng) < 0.03
    sel = vertical_slash_to_selection(v_keep, s_keep, q_len, ctx_len, b, slash_tiles)
    index = sel.to_index(b, q_len, ctx_len)
    mask = index_to_dense_mask(index, q_len, ctx_len)
    qpos = torch.arange(q_len) + ctx_len
    kpos = torch.arange(kv_len)
    diag = qpos[:, None] - kpos[None, :]  # [q, kv]
    causal = diag >= 0
    want = (v_keep[:, None, :] | s_keep[:, diag.clamp(min=0)]) & causal[None]
    assert (mask | ~want).all(), "every kept vertical and slash point must be computed"
    # every computed pair is counted once: the listed tiles and columns do not overlap
    assert count_pairs(index, q_len, ctx_len) == int(mask.sum())
    # Minimality: each listed key block / range holds at least one kept slash point of its query
    # block; ranges are at most b keys and strictly ascending.
    stops = range_stops(index.range_start, b)
    for hh in range(h):
        for qb in range(index.num_query_blocks):
            rows = slice(qb * b, min(q_len, (qb + 1) * b))
            spans = [(kb * b, (kb + 1) * b) for kb in index.block_index[hh, qb, : index.block_count[hh, qb]].tolist()]
            n_r = int(index.range_count[hh, qb])
            starts = index.range_start[hh, qb, :n_r].tolist()
            assert starts == sorted(set(starts))
            spans += list(zip(starts, stops[hh, qb, :n_r].tolist()))
            for k0, k1 in spans:
                assert 0 < k1 - k0 <= b
                cols = slice(k0, min(kv_len, k1))
                slash_pts = s_keep[hh][diag[rows, cols].clamp(min=0)] & causal[rows, cols]
                assert slash_pts.any(), (hh, qb, k0)
    if slash_tiles == "ranges":
        assert not index.block_count.any()
        assert index.range_count.any()


def test_slash_ranges_cost_one_tile_per_scattered_diagonal():
    # diagonals 200 keys apart cross two aligned blocks each in most query blocks, one range each
    q_len, ctx_len, b = 1024, 3072, 64
    s_keep = torch.zeros(1, ctx_len + q_len, dtype=torch.bool)
    s_keep[0, 7:ctx_len:200] = True
    n_diag = int(s_keep.sum())
    v_keep = torch.zeros_like(s_keep)
    tiles = {}
    for mode in ("ranges", "blocks"):
        sel = vertical_slash_to_selection(v_keep, s_keep, q_len, ctx_len, b, mode)
        ix = sel.to_index(b, q_len, ctx_len)
        tiles[mode] = ix.block_count[0, -1].item() + ix.range_count[0, -1].item()
    assert tiles["ranges"] == n_diag  # the last query block sees every diagonal
    assert tiles["blocks"] > 1.5 * n_diag


def test_vertical_slash_keeps_sinks_and_local_diagonals_and_budgets(rng):
    h, hkv, d, q_len = 4, 2, 64, 400
    q, k = _qk(q_len, 0, h, hkv, d, rng)
    sel = vertical_slash_selection(q, k, torch.arange(h) // 2, 0, torch.tensor([40, 40, 50, 60]),
                                   torch.tensor([30, 35, 40, 45]), last_q=64, keep_first_columns=30,
                                   keep_last_diagonals=30, block_size=64, scale=d ** -0.5)
    cols = [set(sel.columns[i][sel.column_keep[i]].tolist()) for i in range(h)]
    assert [len(c) for c in cols] == [40, 40, 50, 60]
    assert all(set(range(30)) <= c for c in cols)
    index = sel.to_index(64, q_len, 0)
    mask = index_to_dense_mask(index, q_len, 0)
    i = torch.arange(q_len)
    for dd in range(30):  # the 30 diagonals nearest the main one are always computed
        assert mask[:, i[dd:], i[dd:] - dd].all()


def test_vertical_slash_finds_planted_lines(rng):
    """Plant a strong column (key 300) and a strong diagonal (offset 100): the estimator picks them."""
    h, d, q_len = 1, 64, 512
    q = torch.randn(q_len, h, d, generator=rng) * 0.1
    k = torch.randn(q_len, h, d, generator=rng) * 0.1
    q[:, 0, 0] += 3.0
    k[300, 0, 0] += 12.0  # every later query attends to key 300 (a vertical line)
    sel = vertical_slash_selection(q, k, torch.zeros(1, dtype=torch.long), 0, torch.tensor([31]),
                                   torch.tensor([30]), last_q=64, keep_first_columns=30,
                                   keep_last_diagonals=30, block_size=64, scale=d ** -0.5)
    assert 300 in sel.columns[0][sel.column_keep[0]].tolist()


def test_block_sparse_picks_planted_blocks_and_diagonal(rng):
    h, d, b, q_len = 2, 64, 64, 640
    q, k = _qk(q_len, 0, h, 1, d, rng)
    q = q * 0.01
    k = k * 0.01
    q[:, :, 1] += 1.0
    k[3 * b:4 * b, 0, 1] += 5.0  # key block 3 stands out for every query block after it
    sel = block_sparse_selection(q, k, torch.zeros(h, dtype=torch.long), 0, torch.tensor([2, 3]), block_size=b)
    m = sel.block_mask
    nqb = num_blocks(q_len, b)
    for qb in range(nqb):
        assert m[:, qb, qb].all(), "diagonal block always kept"
        if qb > 3:
            assert m[:, qb, 3].all(), "planted block found"
            assert m[0, qb].sum() == 2 and m[1, qb].sum() == 3, "exactly top-k blocks"
        assert not m[:, qb, qb + 1:].any(), "never a future block"


def _antidiagonal_mass_brute_force(q, k, ctx_len, s, b, scale):
    """Cell by cell, in float64: the logits on each s x s cell's anti-diagonal and the one after
    it (query i*s + s-1-t with keys j*s + t and j*s + t + 1), summed, over s (queries and keys
    past the row are zero vectors), softmax over each strided query row's causal cells
    (a cell is causal when its first key is at or before the row's last query), summed per block."""
    q_len, h, d = q.shape
    kv_len = k.shape[0]
    nqs, nks = -(-q_len // s), -(-kv_len // s)
    qz = torch.zeros(nqs * s, h, d, dtype=torch.float64)
    qz[:q_len] = q.double()
    kz = torch.zeros(nks * s + 1, h, d, dtype=torch.float64)
    kz[:kv_len] = k.double()
    nqb, nkb = -(-q_len // b), -(-kv_len // b)
    mass = torch.zeros(h, nqb, nkb, dtype=torch.float64)
    for hh in range(h):
        for i in range(nqs):
            last_q = ctx_len + min(i * s + s - 1, q_len - 1)
            cells = torch.full((nks,), float("-inf"), dtype=torch.float64)
            for j in range(nks):
                if j * s <= last_q:
                    cells[j] = sum(float(qz[i * s + s - 1 - t, hh] @ kz[j * s + t + u, hh])
                                   for t in range(s) for u in (0, 1)) * scale / s
            p = torch.softmax(cells, 0)
            for j in range(nks):
                mass[hh, i * s // b, j * s // b] += p[j]
    return mass


@pytest.mark.parametrize("q_len,ctx_len,s,b", [(70, 37, 4, 16), (64, 0, 8, 32), (33, 100, 2, 16)])
def test_antidiagonal_block_mass_matches_cell_by_cell_sums(q_len, ctx_len, s, b, rng):
    h, hkv, d = 4, 2, 8
    q, k = _qk(q_len, ctx_len, h, hkv, d, rng)
    scale = d ** -0.5
    got = antidiagonal_block_mass(q, k, ctx_len, s, b, scale)
    want = _antidiagonal_mass_brute_force(q, k[:, torch.arange(h) // (h // hkv)], ctx_len, s, b, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # shared by KV group: the group's heads' mass added
    torch.testing.assert_close(antidiagonal_block_mass(q, k, ctx_len, s, b, scale, share=2).double(),
                               want.view(hkv, 2, *want.shape[1:]).sum(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_len,ctx_len,b,samples", [(200, 333, 64, 2), (130, 0, 32, 3), (64, 70, 64, 64)])
def test_sampled_block_mass_is_the_sampled_queries_real_attention(q_len, ctx_len, b, samples, rng):
    h, hkv, d = 4, 2, 8
    q, k = _qk(q_len, ctx_len, h, hkv, d, rng)
    scale = d ** -0.5
    kv_len = ctx_len + q_len
    kh = k[:, torch.arange(h) // (h // hkv)].double()
    s = torch.einsum("qhd,khd->hqk", q.double(), kh) * scale
    p = torch.softmax(s.masked_fill(torch.arange(kv_len)[None, :] > (torch.arange(q_len) + ctx_len)[:, None],
                                    float("-inf")), -1)  # [H, q_len, kv_len]
    nqb, nkb = -(-q_len // b), -(-kv_len // b)
    want = torch.zeros(h, nqb, nkb, dtype=torch.float64)
    for qb in range(nqb):
        start, last = qb * b, min(qb * b + b, q_len) - 1
        rows = [max(last - j * (b // samples), start) for j in range(samples)]
        for j in range(nkb):
            want[:, qb, j] = p[:, rows, j * b:(j + 1) * b].sum(-1).mean(-1)
    got = sampled_block_mass(q, k, ctx_len, b, scale, samples)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # in slices of a few query blocks (bounded scratch) and shared by KV group: the same sums
    small = sampled_block_mass(q, k, ctx_len, b, scale, samples, share=2, max_scores=h * samples * kv_len)
    torch.testing.assert_close(small.double(), want.view(hkv, 2, nqb, nkb).sum(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("delta", [700, 701])
def test_antidiagonal_scoring_finds_slash_lines_of_either_parity(delta):
    # query a holds c * (e_0 + e_(a mod 62)), key a - delta holds c * (e_(a mod 62) - e_0) and every
    # other key -c * e_0: query a scores 0 with its own line keys and -c^2 with every other key,
    # so no key stands out as a column. Each query attends to the keys delta + 62*m back, slash
    # lines far from the diagonal, all of the parity of delta (one anti-diagonal per cell would
    # meet either only the even or only the odd offsets).
    d, b, q_len, ctx_len, c = 64, 64, 512, 1024, 10.0
    qpos = torch.arange(q_len) + ctx_len
    eye = torch.eye(d)[1:63]
    q = c * eye[qpos % 62]
    q[:, 0] = c
    k = torch.zeros(ctx_len + q_len, d)
    k[:, 0] = -c
    k[qpos - delta] = c * eye[qpos % 62]
    k[qpos - delta, 0] = -c
    q, k = q[:, None], k[:, None]
    scale = d ** -0.5
    true = torch.softmax(((q[:, 0] @ k[:, 0].T) * scale).masked_fill(
        torch.arange(ctx_len + q_len)[None, :] > qpos[:, None], float("-inf")), -1)
    true_blocks = true.view(q_len // b, b, -1, b).sum((1, 3)) / b  # [NQB, NKB] mean mass per query
    assert (true_blocks.max(-1).values < 0.2).all(), "the mass is spread over several blocks"

    sel = block_sparse_selection(q, k, torch.zeros(1, dtype=torch.long), ctx_len, torch.tensor([12]), block_size=b,
                                 scoring="antidiagonal", stride=16, scale=scale).block_mask[0]
    assert (sel.sum(-1) == 12).all() and ((true_blocks * sel).sum(-1) > 0.98).all()


def test_mass_block_counts_are_the_least_blocks_reaching_the_share_capped_at_topk():
    mass = torch.tensor([[[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]])
    assert mass_block_counts(mass, torch.tensor([4]), 0.8).tolist() == [2, 4]
    assert mass_block_counts(mass, torch.tensor([3]), 0.8).tolist() == [2, 3]
    assert mass_block_counts(mass, torch.tensor([3]), None).tolist() == [3, 3]


def test_a_shape_blocks():
    b = 64
    sel = a_shape_selection(torch.tensor([10, 130]), torch.tensor([64, 200]), q_len=320, ctx_len=64, block_size=b)
    m = sel.block_mask  # [2, NQB=5, NKB=6]
    # query block qb covers absolute positions [64 + 64qb, 64 + 64qb + 63]
    for qb in range(5):
        first = 64 + 64 * qb
        for kb in range(6):
            want0 = kb * b < 10 or (kb * b + b - 1) >= first - 64
            want1 = kb * b < 130 or (kb * b + b - 1) >= first - 200
            assert bool(m[0, qb, kb]) == want0 and bool(m[1, qb, kb]) == want1, (qb, kb)


def test_sqrt_jsd_hand_computed():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.25, 0.75]])
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5], [0.75, 0.25]])
    got = sqrt_js_divergence(p, q)
    # JSD of disjoint distributions is ln 2; identical ones 0.
    third = 0.5 * (0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)) * 2
    torch.testing.assert_close(got, torch.tensor([math.sqrt(math.log(2)), 0.0, math.sqrt(third)]))


def test_cumulative_budget_and_keep_top_hand_computed():
    s = torch.tensor([[0.2, 0.5, 0.3], [0.2, 0.5, 0.3], [0.2, 0.5, 0.3], [1.0, 1.0, 2.0]])
    k = cumulative_budget(s, torch.tensor([0.8, 0.81, 0.5, 0.5]))
    assert k.tolist() == [2, 3, 1, 1]
    assert keep_top(s, k).tolist() == [[False, True, True], [True, True, True], [False, True, False],
                                       [False, False, True]]


def test_flex_prefill_decides_per_head(rng):
    """Head 0: keys identical within each block, so pooling is exact -> query-aware.
    Head 1: one spiky key per block that pooling averages away -> vertical-slash."""
    d, b, q_len = 64, 64, 1024
    q = torch.randn(q_len, 2, d, generator=rng) * 0.05
    k = torch.zeros(q_len, 2, d)
    block_keys = torch.randn(num_blocks(q_len, b), d, generator=rng)
    k[:, 0] = block_keys.repeat_interleave(b, 0)[:q_len]
    q[:, 0] += block_keys[2] * 0.5  # head 0 prefers key block 2
    k[:, 1] = torch.randn(q_len, d, generator=rng) * 0.05
    q[:, 1, 5] += 2.0
    spikes = [3 * b + 7, 9 * b + 20]  # two single keys take most of the attention: pooling misses them
    k[spikes, 1, 5] += 40.0
    sel, dec = flex_prefill_selection(q, k, torch.tensor([0, 1]), 0, torch.tensor([0.9, 0.9]), tau=0.1,
                                      flex_block_size=b, min_budget=64, max_budget=None, block_size=b,
                                      scale=d ** -0.5)
    assert dec.query_aware.tolist() == [True, False], dec.jsd
    cols = sel.columns[1][sel.column_keep[1]].tolist()
    assert set(spikes) <= set(cols), "the spike columns are selected for the VS head"
    assert sel.block_mask[0, :, 2][3:].all(), "query-aware head keeps the preferred block"
    assert sel.block_mask[:, :, 0].all(), "first block always kept"


def test_flex_budget_bounds(rng):
    d, q_len = 64, 512
    q, k = _qk(q_len, 0, 2, 1, d, rng)
    for min_budget, max_budget in [(300, None), (64, 100)]:
        sel, dec = flex_prefill_selection(q, k, torch.tensor([0, 0]), 0, torch.tensor([0.5, 0.5]), tau=0.0,
                                          flex_block_size=64, min_budget=min_budget, max_budget=max_budget,
                                          block_size=64, scale=d ** -0.5)
        assert not dec.query_aware.any()  # tau 0 forces vertical-slash
        n_cols = sel.column_keep.sum(-1)
        assert ((n_cols >= min(min_budget, q_len)) if max_budget is None else (n_cols <= max_budget)).all()


@pytest.mark.parametrize("ctx_len", [0, 100])
def test_every_pattern_lets_each_query_see_itself_and_counts_heads(ctx_len, rng):
    h, hkv, d, q_len = 10, 2, 64, 333
    q, k = _qk(q_len, ctx_len, h, hkv, d, rng)
    settings = SparseSettings(vertical_size=20, slash_size=10, keep_last_diagonals=0, keep_first_columns=0,
                              topk_blocks=1, sink_tokens=0, local_window=1, min_budget=0, gamma=0.3)
    names = ["dense", "a_shape", "vertical_slash", "block_sparse", "flex_prefill"] * 2
    heads = [resolve_head(HeadPattern(pattern=n), settings) for n in names]
    est = estimate_index(q, k, ctx_len, heads, settings, d ** -0.5)
    mask = index_to_dense_mask(est.index, q_len, ctx_len)
    i = torch.arange(q_len)
    assert mask[:, i, i + ctx_len].all()
    assert est.head_patterns["dense"] == 2 and est.head_patterns["block_sparse"] == 2
    assert est.head_patterns["flex_prefill/query_aware"] + est.head_patterns["flex_prefill/vertical_slash"] == 2
    dense_heads = [j for j, n in enumerate(names) if n == "dense"]
    causal = (torch.arange(ctx_len + q_len)[None, :] <= (i + ctx_len)[:, None])
    assert (mask[dense_heads] == causal).all()
    assert mask.sum() < causal.sum() * h


def test_slash_bands_keep_whole_bands_by_summed_score():
    """slash_band > 1: diagonals are kept in bands aligned so that a band meets two key blocks
    per query block; the kept bands are the ones with the largest summed scores, as many as
    the budget in diagonals rounded up to bands."""
    import torch

    from vllm_sparse_backend.prefill.patterns.vertical_slash import (band_shift, slash_band_scores,
                                                             slash_bands_to_diagonals)

    assert band_shift(0, 64) == 0 and band_shift(333, 64) == 51 and band_shift(320, 64) == 0
    slash = torch.zeros(1, 300)
    slash[0, 10] = 5.0  # band 0 (ctx 0: diagonals 0..63)
    slash[0, 130:190] = 0.1  # band 2: 6.0 in total, more than band 0's single strong diagonal
    scores = slash_band_scores(slash, 0, 64)
    assert scores.shape == (1, 5) and torch.allclose(scores[0], torch.tensor([5.0, 0.0, 6.0, 0.0, 0.0]))
    keep = slash_bands_to_diagonals(torch.tensor([[False, False, True, False, False]]), 300, 0, 64)
    assert keep.shape == (1, 300) and keep[0].nonzero().flatten().tolist() == list(range(128, 192))
    # ctx 333: bands start at diagonals = 333 (mod 64), i.e. 13, 77, ...; band 0 is 0..12
    shifted = slash_band_scores(slash, 333, 64)
    assert shifted.shape == (1, 6) and shifted[0, 0] == 5.0  # diagonal 10 lies in the partial band 0
    keep = slash_bands_to_diagonals(torch.tensor([[True, False, False, False, False, True]]), 300, 333, 64)
    assert keep[0].nonzero().flatten().tolist() == list(range(13)) + list(range(269, 300))


def test_slash_bands_cost_two_key_blocks_per_band():
    """A kept band of block_size diagonals meets exactly two key blocks in every query block
    (one where it starts at the main diagonal), whatever the context's alignment: the budget
    buys blocks, not scattered lines."""
    import torch

    from vllm_sparse_backend.prefill.patterns.vertical_slash import band_shift, slash_block_mask

    for ctx in (0, 64, 333, 1000):
        q_len, kv_len, b = 256, ctx + 256, 64
        shift = band_shift(ctx, b)
        keep = torch.zeros(1, kv_len, dtype=torch.bool)
        keep[0, 2 * b - shift: 3 * b - shift] = True  # band 2 (bands start at ctx_len mod b), away from both ends
        mask = slash_block_mask(keep, q_len, ctx, b)
        per_qb = mask[0].sum(-1)
        assert (per_qb[per_qb > 0] <= 2).all(), (ctx, per_qb)
        single = torch.zeros_like(keep)
        single[0, 2 * b - shift + 5] = True  # one diagonal of that band costs the same blocks
        assert (slash_block_mask(single, q_len, ctx, b) <= mask).all()
