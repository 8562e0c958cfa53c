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
from decode_helpers import GARBAGE_PAGE, cdiv, check_flags, check_span_selection, planted, slots

from vllm_sparse_kernels.reference import span_decode as span_ref
from vllm_sparse_kernels.reference.dense import masked_attention_f64

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

sd = kernel_module("decode.span_decode")
tk = kernel_module("decode.topk_decode")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"
SEG = 256 if INTERPRET else 1024


def one_row_segments(q_len, seq_len, page, segment_tokens, last_q, device):
    """The segment plan (:class:`SpanSegments`) of a step of one row, batch row 0: queries
    0 .. q_len - 1 at positions seq_len - q_len .. seq_len - 1. Built here from the class's
    definition so that the kernel tests need nothing of the plugin (whose planner, for many rows,
    tests/plugin_triton/test_decode_steps.py checks): the pages the chunk writes from its first
    page boundary on (the last one possibly partial), cut into segments of ``segment_tokens``."""
    c0 = seq_len - q_len
    per_seg = segment_tokens // page
    first, end = cdiv(c0, page), cdiv(seq_len, page)
    table, n_tok, p_seg, p_idx, p_lp = [], [], [], [], []
    for s in range(first, end, per_seg):
        pages = min(per_seg, end - s)
        tokens = min((s + pages) * page, seq_len) - s * page
        p_seg += [len(table)] * pages
        table.append([0, s * page - c0, tokens, s, pages])
        n_tok.append(tokens)
        p_idx += list(range(pages))
        p_lp += list(range(s, s + pages))
    n_last = min(last_q, q_len)
    tok = [[q_len - n_last + min(i, n_last - 1) for i in range(last_q)]]
    weight = [[1.0 if i < n_last else 0.0 for i in range(last_q)]]

    def dev(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype, device=device)

    return sd.SpanSegments(dev(table, torch.int32).view(-1, sd.SEGMENT_COLUMNS), tuple(n_tok), dev(p_seg),
                           dev(p_idx), dev([0] * len(p_seg)), dev(p_lp), dev([0]), dev(tok),
                           dev(weight, torch.float32), dev([seq_len], torch.int32), segment_tokens,
                           ((0, 0, q_len, seq_len),))


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


# ------------------------------------------------------------------------------------------
# (a) + (b): maps and division
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page,n,h,hkv,d", [(16, 300, 4, 2, 64), (32, 200, 4, 1, 32)] if INTERPRET
                         else [(16, 3000, 32, 8, 128), (32, 2500, 14, 2, 64)])
def test_maps_and_division(page, n, h, hkv, d):
    gen = torch.Generator().manual_seed(n + page)
    q, k, _ = planted(n, h, hkv, d, gen, page)
    params = sd.SpanParams(segment_tokens=SEG)
    segs = one_row_segments(n, n, page, SEG, 64, DEV)
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
        segs = one_row_segments(end - start, end, page, params.segment_tokens, 64, DEV)
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
    check_span_selection(sel, counts, qd, span_keys, flags, table, seq_lens, page, sink_pages=sink, recent_pages=recent,
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


@pytest.mark.parametrize("group,heads_per_program", [(3, 2), (4, 4), (2, 1)])
def test_maps_stacked_heads(group, heads_per_program):
    """Heads stacked per program (a group that does not divide into the stack included) give the
    same maps as one head per program and as the float64 reference."""
    page, hkv, d, n = 16, 2, 64, 200 if INTERPRET else 2000
    gen = torch.Generator().manual_seed(group)
    q, k, _ = planted(n, hkv * group, hkv, d, gen, page)
    segs = one_row_segments(n, n, page, SEG, 64, DEV)
    maps, votes = sd.local_attention_maps(q.to(DEV), k.to(DEV), segs, page, d ** -0.5, heads_per_program)
    one, one_votes = sd.local_attention_maps(q.to(DEV), k.to(DEV), segs, page, d ** -0.5, 1)
    assert torch.allclose(maps, one, rtol=1e-5, atol=1e-4) and torch.allclose(votes, one_votes, rtol=1e-5, atol=1e-4)
    rm, rv = span_ref.reference_local_map(q[:min(n, SEG)], k[:min(n, SEG)], page, d ** -0.5, SEG)
    assert torch.allclose(maps[0].double().cpu(), rm, rtol=1e-4, atol=1e-3)
    assert torch.allclose(votes[0].double().cpu(), rv, rtol=1e-4, atol=1e-3)
