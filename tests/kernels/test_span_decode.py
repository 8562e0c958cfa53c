"""Span-retrieval decode kernels (vllm_sparse_kernels/decode/span_decode.py) vs float64 references
(vllm_sparse_kernels/reference/span_decode.py).

CPU: Triton's interpreter at tiny sizes (segments of 256 tokens, pages of 16/32). GPU: the same
checks at realistic sizes. Inputs have planted spans (runs of pages whose queries and keys share a
direction, so the local maps show triangles), caches are paged in random physical order with NaN
in unused slots, and block-table entries past a sequence hold garbage:

(a) local maps and votes equal float64 softmax sums over each segment;
(b) the division kernels equal the loop reference on the same maps (spans and index tokens), edge
    cases included (one-page segments, partial last pages, zero and uniform maps, tied scores);
(c) span keys written through the block table equal the reference's sum of index keys, chunked
    prefill included (a chunk boundary inside a page keeps the page's fallback key);
(d) the per-slot fallback key is min_index x the mean of the page's keys, and a page written from
    offset 0 loses its persistent flag;
(e) persistent flags mark the pages the chunk's last queries score highest, nothing else;
(f) the selection equals the float64 reference and always holds sink, recent and flagged pages;
    attention over it (topk_decode's kernel) equals float64 attention over those pages.

Without CUDA this module sets TRITON_INTERPRET=1 for the whole pytest process (triton_setup).
"""

from __future__ import annotations

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module

from vllm_sparse_kernels.reference import span_decode as span_ref
from vllm_sparse_kernels.reference.dense import masked_attention_f64

from vllm_sparse_backend.decode.spans import plan_span_segments

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

sd = kernel_module("decode.span_decode")
tk = kernel_module("decode.topk_decode")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"
GARBAGE_PAGE = 10**6
SEG = 256 if INTERPRET else 1024


def cdiv(a, b):
    return -(-a // b)


def planted(n, h, hkv, d, gen, page, strength=1.5):
    """q [n, H, D], k/v [n, Hkv, D]: runs of 1-5 pages sharing a random direction; each page and
    each key of a run gets its own share of it, so that neither the sub-intervals of a run (NMS
    candidates) nor its keys (votes) come out nearly tied, where fp32 rounding could order them
    otherwise than the float64 references."""
    q = torch.randn(n, h, d, generator=gen) * 0.3
    k = torch.randn(n, hkv, d, generator=gen) * 0.3
    v = torch.randn(n, hkv, d, generator=gen)
    t = 0
    while t < n:
        length = int(torch.randint(1, 6, (1,), generator=gen)) * page
        base = torch.randn(d, generator=gen) * strength
        q[t:t + length] += base
        m = min(length, n - t)
        page_share = (0.4 + 1.2 * torch.rand(-(-m // page), generator=gen)).repeat_interleave(page)[:m]
        share = page_share * (0.8 + 0.4 * torch.rand(m, generator=gen))
        k[t:t + length] += base * share[:, None, None]
        t += length
    return q, k, v


def paged(keys, values, seq_len, page, dtype, gen, device, spare_pages=3):
    """One sequence in a NaN-filled paged cache (random physical order): (key_cache, value_cache,
    block_table [1, pages + 2] int32 with garbage past the sequence)."""
    n_pages = cdiv(seq_len, page)
    num_pages = n_pages + spare_pages
    hkv, d = keys.shape[1:]
    kv = torch.full((num_pages, page, hkv, 2 * d), float("nan"), dtype=dtype, device=device)
    key_cache, value_cache = kv.split(d, -1)
    perm = torch.randperm(num_pages, generator=gen)[:n_pages].to(torch.int32)
    table = torch.full((1, n_pages + 2), GARBAGE_PAGE, dtype=torch.int32)
    table[0, :n_pages] = perm
    pos = torch.arange(seq_len)
    phys = perm.long()[pos // page]
    key_cache[phys.to(device), (pos % page).to(device)] = keys[:seq_len].to(dtype).to(device)
    value_cache[phys.to(device), (pos % page).to(device)] = values[:seq_len].to(dtype).to(device)
    return key_cache, value_cache, table.to(device)


def slots(table, positions, page):
    positions = torch.as_tensor(positions, dtype=torch.int64)
    return table[0].cpu().to(torch.int64)[positions // page] * page + positions % page


# ------------------------------------------------------------------------------------------
# (a) + (b): maps and division
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page,n,h,hkv,d", [(16, 300, 4, 2, 64), (32, 200, 4, 1, 32)] if INTERPRET
                         else [(16, 3000, 32, 8, 128), (32, 2500, 14, 2, 64)])
def test_maps_and_division(page, n, h, hkv, d):
    gen = torch.Generator().manual_seed(n + page)
    q, k, _ = planted(n, h, hkv, d, gen, page)
    params = sd.SpanParams(segment_tokens=SEG)
    segs = plan_span_segments([0, n], [n], page, SEG, 64, DEV)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    qd, kd = q.to(dtype).to(DEV), k.to(dtype).to(DEV)
    maps, votes = sd.local_attention_maps(qd, kd, segs, page, d ** -0.5)
    div = sd.divide_segments(maps.double(), votes.double(), segs.table[:, 2], page, h, params)
    assert segs.num_segments == cdiv(n, SEG)
    spans_seen = 0
    for s in range(segs.num_segments):
        r0, nt = s * SEG, min(SEG, n - s * SEG)
        rm, rv = span_ref.reference_local_map(qd[r0:r0 + nt].cpu(), kd[r0:r0 + nt].cpu(), page, d ** -0.5, SEG)
        tol = 1e-4 if INTERPRET else 2e-3
        assert torch.allclose(maps[s].double().cpu(), rm, rtol=tol, atol=tol * h)
        assert torch.allclose(votes[s].double().cpu(), rv, rtol=tol, atol=tol * h)
        # division of the kernel's maps: division kernels vs loops, on the same float64 input
        span, sel = span_ref.reference_divide(maps[s].double().cpu(), votes[s].double().cpu(), nt, page, h, params)
        n_pages = cdiv(nt, page)
        assert div.span_of_page[s, :n_pages].tolist() == span
        assert (div.span_of_page[s, n_pages:] == -1).all()
        assert div.selected[s].nonzero().flatten().tolist() == sel
        spans_seen += len(set(span))
        # every span has between min_index and max_index index tokens (or all its tokens)
        for sid in set(span):
            toks = [t for t in sel if span[t // page] == sid]
            size = sum(min(page, nt - a * page) for a in range(n_pages) if span[a] == sid)
            assert min(params.min_index, size) <= len(toks) <= params.max_index
    assert spans_seen > segs.num_segments  # the planted structure splits segments


def tile_cells(n_tok, n, page, h):
    """float64 [n, n]: causal (query, key) pairs x heads of each page tile of a segment."""
    pt = (n_tok - torch.arange(n) * page).clamp(0, page).double()
    lower = torch.where(torch.ones(n, n, dtype=torch.bool).tril(-1), pt[:, None] * pt[None, :], 0.0)
    return (lower + torch.diag(pt * (pt + 1) / 2)) * h


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("page", [16, 32])
def test_division_kernel_edge_cases(page, dtype):
    """Segments of different lengths in one call (one token, one page, a partial last page, full),
    with all-zero maps (one gap span, ratio 1), uniform maps (every score 0: one gap span),
    integer multiples of the cells (tied scores and votes), planted triangles and random maps; NaN
    in the cells and votes no query reaches. Equal to the loop reference on the same maps."""
    h, n = 3, SEG // page
    params = sd.SpanParams(segment_tokens=SEG)
    gen = torch.Generator().manual_seed(page)
    cases = [(1, "random"), (page, "zero"), (page + 5, "random"), (SEG, "zero"), (SEG - 3, "uniform"),
             (SEG, "planted"), (5 * page + 7, "ties"), (SEG - page // 2, "random"), (2 * page, "planted")]
    maps = torch.full((len(cases), n, n), float("nan"), dtype=torch.float64)
    votes = torch.full((len(cases), SEG), float("nan"), dtype=torch.float64)
    for s, (n_tok, kind) in enumerate(cases):
        cells = tile_cells(n_tok, n, page, h)
        if kind == "zero":
            m = torch.zeros(n, n, dtype=torch.float64)
        elif kind == "uniform":
            m = 0.5 * cells
        elif kind == "ties":
            m = cells * torch.randint(0, 3, (n, n), generator=gen)
        elif kind == "planted":  # runs of about n / 4 pages attending mostly inside the run
            run = torch.cumsum(torch.rand(n, generator=gen) < 4 / n, 0)
            m = cells * (0.2 + 3.0 * (run[:, None] == run[None, :]) + 0.3 * torch.rand(n, n, generator=gen))
        else:
            m = cells * torch.rand(n, n, generator=gen, dtype=torch.float64)
        maps[s] = torch.where(cells > 0, m, float("nan"))
        tied = kind == "ties"
        votes[s, :n_tok] = torch.randint(0, 4, (n_tok,), generator=gen) if tied else torch.rand(n_tok, generator=gen)
    maps = maps.to(dtype)
    n_tok = torch.tensor([c[0] for c in cases], dtype=torch.int32)
    div = sd.divide_segments(maps.to(DEV), votes.to(dtype).to(DEV), n_tok.to(DEV), page, h, params)
    span_of_page, selected, count = div.span_of_page.cpu(), div.selected.cpu(), div.index_count.cpu()
    for s, (nt, kind) in enumerate(cases):
        n_pages = cdiv(nt, page)
        span, sel = span_ref.reference_divide(maps[s].double(), votes[s].to(dtype).double(), nt, page, h, params)
        assert span_of_page[s, :n_pages].tolist() == span, (s, kind)
        assert (span_of_page[s, n_pages:] == -1).all()
        assert selected[s].nonzero().flatten().tolist() == sel, (s, kind)
        for sid in range(n):  # index_count: per span id, its index tokens
            assert int(count[s, sid]) == sum(1 for t in sel if span[t // page] == sid), (s, sid)
        cells = tile_cells(nt, n, page, h)
        valid = cells > 0
        m = maps[s].double()
        want_theta = max(float(torch.quantile(m[valid] / cells[valid], params.theta_quantile)),
                         float(m[valid].sum() / cells[valid].sum()))
        assert abs(float(div.theta[s]) - want_theta) <= 1e-5 * max(1.0, abs(want_theta)), (s, kind)
        if kind in ("zero", "uniform"):  # nothing stands out: one span of all pages, ratio 1
            assert span == [0] * n_pages
            assert count[s].tolist() == [min(nt, params.max_index)] + [0] * (n - 1)
        if kind == "planted" and nt == SEG:  # the triangles split the segment
            assert len(set(span)) > 1


def test_nms_matches_reference():
    gen = torch.Generator().manual_seed(5)
    s_count, c, n = 6, 31, 16
    x = torch.randint(0, n, (s_count, c), generator=gen)
    y = (x + torch.randint(0, 6, (s_count, c), generator=gen)).clamp(max=n - 1)
    score = torch.randn(s_count, c, generator=gen).sort(1, descending=True).values
    for iou in (0.0, 0.01, 0.3, 1.0):
        keep = sd.span_nms(x.to(torch.int32).to(DEV), y.to(torch.int32).to(DEV), score.to(DEV), iou).cpu()
        for s in range(s_count):
            assert keep[s].tolist() == span_ref.reference_nms(x[s].tolist(), y[s].tolist(), score[s].tolist(), iou)


def test_plan_segments():
    # row 0: decode (skipped); row 1: chunk at positions 10..700 (first full page 1); row 2: 5 tokens
    segs = plan_span_segments([0, 1, 691, 696], [50, 700, 5], 16, 256, 64, "cpu")
    rows = segs.table.tolist()
    assert rows[0] == [1, 1 + 16 - 10, 256, 1, 16]   # tokens 16..271 of row 1 (batch index 7)
    assert rows[1] == [1, 7 + 256, 256, 17, 16]
    assert rows[2] == [1, 7 + 512, 700 - 528, 33, 11]  # last partial page included
    assert rows[3] == [2, 691, 5, 0, 1]
    assert segs.persist_row.tolist() == [1, 2]
    assert segs.persist_tok[0].tolist() == list(range(691 - 64, 691))
    assert segs.persist_weight[1].tolist() == [1.0] * 5 + [0.0] * 59
    assert segs.persist_tok[1, :5].tolist() == list(range(691, 696))
    assert segs.persist_seq_len.tolist() == [700, 5]
    assert len(segs.page_lp) == 16 + 16 + 11 + 1
    assert plan_span_segments([0, 1, 2], [9, 9], 16, 256, 64, "cpu") is None  # decode only


# ------------------------------------------------------------------------------------------
# (c) + (d) + (e): the state beside the cache through a chunked prefill
# ------------------------------------------------------------------------------------------

def run_prefill(seq_len, chunks, page, h, hkv, d, dtype, seed, params, persist_pages=4, sink=1, recent=2):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = planted(seq_len, h, hkv, d, gen, page)
    q = q.to(dtype)
    k = k.to(dtype)
    key_cache, value_cache, table = paged(k, v, seq_len, page, dtype, gen, DEV)
    span_keys, flags = sd.allocate_span_index(key_cache)
    flags.fill_(1)  # a reused page starts with a stale flag: the first write must clear it
    start = 0
    divisions = []  # per chunk: (segment table, the division build_span_keys made)
    for end in chunks + [seq_len]:
        qs = q[start:end].to(DEV)
        ks = k[start:end].to(DEV)
        slot = slots(table, range(start, end), page).to(DEV)
        sd.update_span_keys(key_cache, span_keys, flags, slot, params.min_index)
        segs = plan_span_segments([0, end - start], [end], page, params.segment_tokens, 64, DEV)
        divisions.append((segs.table.cpu(), sd.build_span_keys(qs, ks, segs, span_keys, table, page, d ** -0.5,
                                                               params)))
        sd.mark_persistent_pages(qs, span_keys, flags, table, segs, page, sink_pages=sink, recent_pages=recent,
                                 persist_pages=persist_pages)
        start = end
    run_prefill.divisions = divisions
    return q, k, v, key_cache, value_cache, table, span_keys, flags


@pytest.mark.parametrize("page,chunks", [(16, []), (16, [200]), (32, [64])] if INTERPRET
                         else [(16, []), (16, [5000]), (32, [2048])])
def test_span_keys_through_chunks(page, chunks):
    seq_len = 420 if INTERPRET else 7000
    h, hkv, d = (4, 2, 64) if INTERPRET else (28, 4, 128)
    # fp32 (exact dots): the division compares scores, so bf16 rounding of the maps could flip a
    # near-tie against the float64 reference; bf16 maps are checked in test_maps_and_division
    dtype = torch.float32
    params = sd.SpanParams(segment_tokens=SEG)
    q, k, v, key_cache, _, table, span_keys, flags = run_prefill(seq_len, chunks, page, h, hkv, d, dtype,
                                                                 seed=page, params=params)
    phys = table[0, :cdiv(seq_len, page)].long()
    got = span_keys[phys].double().cpu()
    # expected: each chunk divided from its first full page on, every page holding the float64 sum
    # of its span's index keys as the chunk's division chose them (the division itself is held to
    # the loop reference on identical maps in test_maps_and_division: across fp32 and float64 maps
    # planted runs give near-ties, e.g. a run split either way into a page and two); a page begun
    # by an earlier chunk keeps the fallback key of its last write (min_index x mean key)
    want = torch.full_like(got, float("nan"))
    start = 0
    for end, (table_s, division) in zip(chunks + [seq_len], run_prefill.divisions):
        for s, (_, _, n_tok, first_page, n_pages) in enumerate(table_s.tolist()):
            span = division.span_of_page[s].cpu()
            chosen = division.selected[s].cpu().nonzero().flatten()
            assert (span[n_pages:] == -1).all() and (span[:n_pages] >= 0).all()
            for a in range(n_pages):
                mine = chosen[span[chosen // page] == span[a]]
                assert 0 < len(mine) <= params.max_index
                want[first_page + a] = k[first_page * page + mine].double().sum(0)
        if start % page:
            a = start // page
            block = k[a * page:min(end, (a + 1) * page)].double()
            want[a] = params.min_index * block.mean(0)
        start = end
    tol = 1e-4 if INTERPRET else 1e-3
    assert torch.allclose(got, want, rtol=tol, atol=tol), (got - want).abs().max()
    assert (flags[-1] == 0).all()


def test_fallback_keys_and_flags():
    page, hkv, d = 16, 2, 64
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(40, hkv, d, generator=gen)
    key_cache, _, table = paged(k, k, 40, page, torch.float32, gen, DEV)
    span_keys, flags = sd.allocate_span_index(key_cache)
    flags.fill_(1)
    for start, end in ((0, 20), (20, 21), (21, 40)):
        sd.update_span_keys(key_cache, span_keys, flags, slots(table, range(start, end), page).to(DEV), 6)
        for a in range(cdiv(end, page)):
            block = k[a * page:min(end, (a + 1) * page)].double()
            assert torch.allclose(span_keys[int(table[0, a])].double().cpu(), 6 * block.mean(0), atol=1e-5)
    written = table[0, :3].long()
    assert (flags[written] == 0).all()
    untouched = torch.ones(flags.shape[0], dtype=torch.bool)
    untouched[written.cpu()] = False
    assert (flags.cpu()[untouched] == 1).all()


def test_persistent_flags_follow_last_queries():
    page, h, hkv, d = 16, 4, 2, 64
    params = sd.SpanParams(segment_tokens=SEG)
    seq_len, persist, sink, recent = 400, 3, 1, 2
    q, k, v, key_cache, _, table, span_keys, flags = run_prefill(seq_len, [], page, h, hkv, d, torch.float32, 11,
                                                                 params, persist, sink, recent)
    n_pages = cdiv(seq_len, page)
    phys = table[0, :n_pages].long()
    q_sum = q[seq_len - 64:].double().sum(0)  # [H, D]
    for g in range(hkv):
        score = span_keys[phys, g].double().cpu() @ q_sum[g * (h // hkv):(g + 1) * (h // hkv)].sum(0)
        check_flags([j for j in range(n_pages) if flags[phys[j], g]], score, n_pages, sink, recent, persist)


# ------------------------------------------------------------------------------------------
# (f) selection and attention
# ------------------------------------------------------------------------------------------

def check_selection(sel, counts, q, span_keys, flags, table, seq_lens, page, **widths):
    """The kernel's selection equals the float64 reference's up to ties: pages of one span share
    their key, so where the budget cuts a span any of its pages may be taken."""
    rsel, rcounts = span_ref.reference_select_span_pages(q, span_keys, flags, table, seq_lens, page, **widths)
    assert torch.equal(counts.cpu(), rcounts)
    h, hkv = q.shape[1], span_keys.shape[1]
    group = h // hkv
    for b in range(q.shape[0]):
        phys = table[b].cpu().long()
        for g in range(hkv):
            got = set(sel[b, g, :int(counts[b, g])].tolist())
            want = set(rsel[b, g, :int(rcounts[b, g])].tolist())
            if got == want:
                continue
            qg = q[b, g * group:(g + 1) * group].double().cpu().sum(0)
            score = {j: float(span_keys[phys[j], g].double().cpu() @ qg) for j in got | want}
            cut = min(score[j] for j in want - got)
            for j in got ^ want:
                assert abs(score[j] - cut) <= 1e-5 * max(1.0, abs(cut)), (b, g, j, score[j], cut)
    return rsel, rcounts


@pytest.mark.parametrize("budget", [3, 100])
def test_selection_and_attention(budget):
    page = 16
    h, hkv, d = (4, 2, 64) if INTERPRET else (32, 8, 128)
    seq_len = 420 if INTERPRET else 9000
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    params = sd.SpanParams(segment_tokens=SEG)
    sink, recent, persist = 1, 2, 3
    q, k, v, key_cache, value_cache, table, span_keys, flags = run_prefill(
        seq_len, [], page, h, hkv, d, dtype, 21, params, persist, sink, recent)
    gen = torch.Generator().manual_seed(9)
    qd = (torch.randn(1, h, d, generator=gen) + q[-1:].float()).to(dtype).to(DEV)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=DEV)
    sel, counts = sd.select_span_pages(qd, span_keys, flags, table, seq_lens, page, sink_pages=sink,
                                       recent_pages=recent, persist_pages=persist, num_pages_budget=budget)
    check_selection(sel, counts, qd, span_keys, flags, table, seq_lens, page, sink_pages=sink, recent_pages=recent,
                    persist_pages=persist, num_pages_budget=budget)
    n_pages = cdiv(seq_len, page)
    phys = table[0, :n_pages].long()
    for g in range(hkv):
        chosen = set(sel[0, g, :int(counts[0, g])].tolist())
        forced = {0} | set(range(n_pages - recent, n_pages)) | {j for j in range(n_pages) if flags[phys[j], g]}
        assert forced <= chosen
    out = torch.full_like(qd, float("nan"))
    tk.topk_decode_attention(qd, key_cache, value_cache, table, seq_lens, sel, counts, d ** -0.5, out)
    mask = torch.zeros(h, 1, seq_len, dtype=torch.bool)
    for head in range(h):
        for lp in sel[0, head // (h // hkv), :int(counts[0, 0])].tolist():
            mask[head, 0, lp * page:min(seq_len, (lp + 1) * page)] = True
    want = masked_attention_f64(qd.cpu(), k.to(dtype), v.to(dtype), mask, d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double().cpu(), want, atol=tol, rtol=tol)
    if budget >= n_pages:  # everything selected: dense decode attention
        assert int(counts[0, 0]) == n_pages


def test_bad_params_are_refused():
    with pytest.raises(ValueError, match="min_index"):
        sd.SpanParams(min_index=30, max_index=24)
    with pytest.raises(ValueError, match="segment_tokens"):
        sd.SpanParams(segment_tokens=100)
    with pytest.raises(ValueError, match="index"):
        sd.SpanParams(index="token")
    assert sd.SpanParams().fallback_count == 6 and sd.SpanParams(index="page").fallback_count == 1
    assert sd.unsupported_page_size(16) is None and sd.unsupported_page_size(128) is not None


# ------------------------------------------------------------------------------------------
# The backend's step (vllm_sparse_backend.decode.spans): two sequences prefilled in chunks in
# shared steps (with a decode row of a third sequence and padding), then decoded together
# ------------------------------------------------------------------------------------------

def last_queries_page_mass(q_last, k, page, scale):
    """float64 [pages, Hkv]: the attention mass each page of k ``[n, Hkv, D]`` gets from the last
    queries q_last ``[m, H, D]`` (positions n - m .. n - 1, each its own causal softmax), summed
    over the queries and each KV head's query heads; a loop over queries and heads."""
    m, h, _ = q_last.shape
    n, hkv, _ = k.shape
    mass = torch.zeros(cdiv(n, page), hkv, dtype=torch.float64)
    for i in range(m):
        pos = n - m + i
        for head in range(h):
            g = head // (h // hkv)
            w = torch.softmax(k[:pos + 1, g] @ q_last[i, head] * scale, 0)
            padded = torch.nn.functional.pad(w, (0, cdiv(n, page) * page - pos - 1))
            mass[:, g] += padded.view(-1, page).sum(1)
    return mass


def check_flags(flagged, scores, n_pages, sink, recent, persist):
    """``flagged`` are ``persist`` best-scoring pages outside the sink and recent pages. Pages of
    one span share their key, so their scores tie: any of tied pages may be flagged."""
    cand = list(range(sink, n_pages - recent))
    assert len(flagged) == min(persist, len(cand)) and set(flagged) <= set(cand)
    rest = [j for j in cand if j not in flagged]
    if rest and flagged:
        worst = min(float(scores[j]) for j in flagged)
        assert worst >= max(float(scores[j]) for j in rest) - 1e-6 * max(1.0, abs(worst))


@pytest.mark.parametrize("index, persist, persist_next", [("span", "index", 0), ("page", "index", 0),
                                                          ("span", "attention", 0), ("span", "attention", 1)])
def test_backend_step_prefill_and_decode(index, persist, persist_next):
    """index="span": pages keyed by their span's index keys; "page" (issue 24): by their own
    most-voted key, decode-written pages by their mean key. persist="index": the persistent pages
    are those the last queries score highest by the span keys; "attention" (issue 24): those
    that get the most of the last queries' attention (float64 softmax over the prompt here);
    with persist_next=1 in runs of 2 pages from the persist // 2 most attended ones."""
    from vllm_sparse_backend.config import SparseSettings
    from vllm_sparse_backend.decode.spans import SpanIndex, plan_step_segments

    page, hkv, group, d = 16, 2, 2, 64
    h = hkv * group
    dtype = torch.float32  # exact maps, as in test_span_keys_through_chunks
    cfg = SparseSettings(decode_mode="spans", decode_sink_pages=1, decode_recent_pages=1, decode_persist_pages=2,
                         decode_budget_pages=3, last_q=16, decode_span_index=index, decode_span_persist=persist,
                         decode_persist_next=persist_next)
    gen = torch.Generator().manual_seed(4)
    prompt = [330, 290, 40]  # sequence 2 is short: already decoding when the others prefill
    chunks = [[0, 200, 330], [0, 170, 290]]
    steps = 3
    final = [n + steps + 2 for n in prompt]  # sequence 2 decodes in the two mixed steps too
    num_pages = sum(cdiv(n, page) for n in final) + 4
    seqs = [planted(n, h, hkv, d, gen, page) for n in final]
    kv = torch.full((num_pages, page, hkv, 2 * d), float("nan"), dtype=dtype, device=DEV)
    key_cache, value_cache = kv.split(d, -1)
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.full((3, cdiv(max(final), page) + 2), GARBAGE_PAGE, dtype=torch.int32)
    used = 0
    for i, n in enumerate(final):
        table[i, :cdiv(n, page)] = perm[used:used + cdiv(n, page)]
        used += cdiv(n, page)
    table = table.to(DEV)
    index = SpanIndex(key_cache, cfg)
    params = index.params.__class__(**{**index.params.__dict__, "segment_tokens": SEG})
    object.__setattr__(index, "params", params)

    def write(seq, positions):
        s = slots(table[seq:seq + 1], positions, page)
        q, k, v = seqs[seq]
        key_cache[(s // page).to(DEV), (s % page).to(DEV)] = k[positions].to(dtype).to(DEV)
        value_cache[(s // page).to(DEV), (s % page).to(DEV)] = v[positions].to(dtype).to(DEV)
        return s

    # sequence 2's prompt first (alone), then two mixed steps: its decode row + chunks of 0 and 1
    lens = [0, 0, 0]

    def step(rows):  # rows: [(seq, n_new)] -> runs update + prefill like the backend's forward
        qsl, seq_lens, qs, ks, sl = [0], [], [], [], []
        for seq, n_new in rows:
            pos = list(range(lens[seq], lens[seq] + n_new))
            sl.append(write(seq, pos))
            qs.append(seqs[seq][0][pos])
            ks.append(seqs[seq][1][pos])
            lens[seq] += n_new
            qsl.append(qsl[-1] + n_new)
            seq_lens.append(lens[seq])
        pad = 5
        query = torch.cat(qs + [torch.zeros(pad, h, d)]).to(dtype).to(DEV)
        key = torch.cat(ks + [torch.zeros(pad, hkv, d)]).to(dtype).to(DEV)
        index.update(key_cache, torch.cat(sl + [torch.full((pad,), -1, dtype=torch.int64)]).to(DEV))
        segs = plan_span_segments(qsl, seq_lens, page, SEG, cfg.last_q, DEV)  # the tests' segment size
        planned = plan_step_segments(qsl, seq_lens, page, cfg, DEV)  # the backend's (1024-token segments)
        assert planned.persist_row.tolist() == segs.persist_row.tolist()
        if segs is not None:
            step_table = table[[r for r, _ in rows]]
            index.prefill(query, key, key_cache, segs, step_table, d ** -0.5)
        return query

    step([(2, 40)])
    for c in range(2):
        step([(2, 1), (0, chunks[0][c + 1] - chunks[0][c]), (1, chunks[1][c + 1] - chunks[1][c])])
    # span keys of sequences 0 and 1 (chunk boundaries 200 and 170 are inside pages)
    for seq in (0, 1):
        q, k, _ = seqs[seq]
        phys = table[seq, :cdiv(prompt[seq], page)].long()
        got = index.keys[phys].double().cpu()
        want = torch.empty_like(got)
        bounds = chunks[seq]
        for c in range(2):
            start, end = bounds[c], bounds[c + 1]
            p0 = cdiv(start, page)
            ref, _ = span_ref.reference_span_keys(q[p0 * page:end].to(dtype), k[p0 * page:end].to(dtype), page,
                                            d ** -0.5, params)
            want[p0:p0 + ref.shape[0]] = ref
            if start % page:
                a = start // page
                want[a] = params.fallback_count * k[a * page:(a + 1) * page].to(dtype).double().mean(0)
        tol = 1e-4 if INTERPRET else 2e-2
        assert torch.allclose(got, want, rtol=tol, atol=tol), (seq, (got - want).abs().max())
        q_last = q[prompt[seq] - cfg.last_q:prompt[seq]].to(dtype).double()
        n_pages = cdiv(prompt[seq], page)
        mass = last_queries_page_mass(q_last, k[:prompt[seq]].to(dtype).double(), page, d ** -0.5)
        for g in range(hkv):
            flagged = [j for j in range(n_pages) if index.flags[phys[j], g]]
            by_index = got[:, g] @ q_last.sum(0)[g * group:(g + 1) * group].sum(0)
            score = mass[:, g] if persist == "attention" else by_index
            if persist_next:  # the one best page outside sink (page 0) and recent (the last) + the next
                best = 1 + int(mass[1:n_pages - 1, g].argmax())
                assert flagged == [j for j in (best, best + 1) if j < n_pages - 1]
            else:
                check_flags(flagged, score, n_pages, 1, 1, 2)
    # decode steps of all three sequences: equal to float64 attention over the reference selection
    for _ in range(steps):
        sl = torch.cat([write(s, [lens[s]]) for s in range(3)])
        lens = [n + 1 for n in lens]
        index.update(key_cache, sl.to(DEV))
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        qd = torch.stack([seqs[s][0][lens[s] - 1] for s in range(3)]).to(dtype).to(DEV)
        out = torch.full_like(qd, float("nan"))
        index.decode(qd, key_cache, value_cache, table, seq_lens, d ** -0.5, out)
        b = index.budget
        sel, counts = sd.select_span_pages(qd, index.keys, index.flags, table, seq_lens, page,
                                           sink_pages=b.sink_pages, recent_pages=b.recent_pages,
                                           persist_pages=b.persist_pages, num_pages_budget=b.budget_pages)
        check_selection(sel, counts, qd, index.keys, index.flags, table, seq_lens, page, sink_pages=1,
                        recent_pages=1, persist_pages=2, num_pages_budget=3)
        sel, counts = sel.cpu(), counts.cpu()
        for b, n in enumerate(lens):
            allowed = torch.zeros(h, 1, n, dtype=torch.bool)
            for g in range(hkv):
                pages = sel[b, g, :counts[b, g]].long()
                pos = (pages[:, None] * page + torch.arange(page)).flatten()
                allowed[g * group:(g + 1) * group, 0, pos[pos < n]] = True
            _, k, v = seqs[b]
            ref = masked_attention_f64(qd[b].cpu()[None], k[:n].to(dtype), v[:n].to(dtype), allowed, d ** -0.5)[0]
            tol = 1e-4 if INTERPRET else 2e-2
            assert (out[b].cpu().double() - ref).abs().max() < tol
        assert int(counts[0, 0]) == 1 + 1 + 2 + 3  # the 21-page sequence: the full width


@pytest.mark.parametrize("group,heads_per_program", [(3, 2), (4, 4), (2, 1)])
def test_maps_stacked_heads(group, heads_per_program):
    """Heads stacked per program (a group that does not divide into the stack included) give the
    same maps as one head per program and as the float64 reference."""
    page, hkv, d, n = 16, 2, 64, 200 if INTERPRET else 2000
    gen = torch.Generator().manual_seed(group)
    q, k, _ = planted(n, hkv * group, hkv, d, gen, page)
    segs = plan_span_segments([0, n], [n], page, SEG, 64, DEV)
    maps, votes = sd.local_attention_maps(q.to(DEV), k.to(DEV), segs, page, d ** -0.5, heads_per_program)
    one, one_votes = sd.local_attention_maps(q.to(DEV), k.to(DEV), segs, page, d ** -0.5, 1)
    assert torch.allclose(maps, one, rtol=1e-5, atol=1e-4) and torch.allclose(votes, one_votes, rtol=1e-5, atol=1e-4)
    rm, rv = span_ref.reference_local_map(q[:min(n, SEG)], k[:min(n, SEG)], page, d ** -0.5, SEG)
    assert torch.allclose(maps[0].double().cpu(), rm, rtol=1e-4, atol=1e-3)
    assert torch.allclose(votes[0].double().cpu(), rv, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_plugins_state_layouts_are_the_kernels_allocations(dtype):
    """The backend reserves and lays out the decode state from its own layouts
    (vllm_sparse_backend.decode.{topk,spans}); the kernels' allocation functions are the state the
    kernels were written for: the same tensors."""
    from vllm_sparse_backend.decode.spans import span_index_layout
    from vllm_sparse_backend.decode.topk import summaries_layout

    key_cache = torch.zeros(9, 16, 2, 64, dtype=dtype)
    num_pages, _, hkv, d = key_cache.shape
    for layout, tensors in ((summaries_layout(num_pages, hkv, d, dtype), tk.allocate_page_summaries(key_cache)),
                            (span_index_layout(num_pages, hkv, d), sd.allocate_span_index(key_cache))):
        assert [(tuple(t.shape), t.dtype) for t in tensors] == [(tuple(s), t) for s, t in layout]
