"""benchmarks/decode_accuracy.py: the variant spec parser, the share -> pages conversion, the paged
layout and attended-key count, and the selectors against an independent float64 computation.

No model is loaded. The selector tests need ``vllm_sparse_kernels.decode.topk_decode``
(its module imports triton, though only its plain-torch references run): they skip where triton
is not importable, e.g. in the main suite (``make test`` runs the kernel tests with
``PYTHONPATH=.venv/kernel-site``).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_sparse_kernels.reference.dense import masked_attention_f64

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU


@pytest.fixture(scope="module")
def da():
    from benchmarks import decode_accuracy

    return decode_accuracy


@pytest.fixture(scope="module")
def with_references():
    """Skip unless the kernels' module (and so triton) imports."""
    pytest.importorskip("triton", reason="triton is not installed (the project venv has none on purpose)")
    pytest.importorskip("vllm_sparse_kernels.decode.topk_decode",
                        reason="vllm_sparse_kernels is not installed (pip install -e .)")


# ------------------------------------------------------------------------------------------
# Variant specs
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, kind, params", [
    ("dense", "dense", {}),
    ("topk", "topk", {}),
    ("topk:budget=16", "topk", {"budget": 16}),
    ("topk:budget=64,tokens=256", "topk", {"budget": 64, "tokens": 256}),
    ("topk:share=0.01", "topk", {"share": 0.01}),
    (" topk: sink=0, recent=2 ,page=32", "topk", {"sink": 0, "recent": 2, "page": 32}),
])
def test_parse_variant_good(da, spec, kind, params):
    v = da.parse_variant(spec)
    assert (v.label, v.kind, v.params) == (spec, kind, params)
    assert all(type(x) is da.SELECTORS[kind].PARAMS[k] for k, x in v.params.items())


@pytest.mark.parametrize("spec, message", [
    ("ltri", r"unknown selector 'ltri' \(known: dense, topk, spans\)"),
    ("topk:", r"nothing after ':'"),
    ("topk:budget", r"'budget' is not KEY=VALUE"),
    ("topk:budget=", r"'budget=' is not KEY=VALUE"),
    ("topk:budget=4,,tokens=2", r"'' is not KEY=VALUE"),
    ("topk:foo=1", r"topk has no parameter 'foo' \(known: sink, recent, budget, share, tokens, page\)"),
    ("dense:budget=1", r"dense has no parameter 'budget' \(known: none\)"),
    ("topk:budget=1.5", r"budget must be an integer, got '1.5'"),
    ("topk:share=one", r"share must be a number, got 'one'"),
    ("topk:budget=1,budget=2", r"budget given twice"),
    ("topk:recent=-1", r"recent must be >= 0, got -1"),
    ("topk:share=0", r"share must be in \(0, 1\], got 0.0"),
    ("topk:share=1.5", r"share must be in \(0, 1\]"),
    ("topk:budget=4,share=0.01", r"budget \(pages\) or share"),
    ("topk:page=12", r"page must be a power of two, got 12"),
    ("topk:page=0", r"page must be a power of two, got 0"),
    ("topk:sink=0,recent=0,budget=0", r"sink, recent and budget are all 0"),
])
def test_parse_variant_bad(da, spec, message):
    with pytest.raises(ValueError, match=rf"^variant '{spec}'.*{message}"):
        da.parse_variant(spec)


def test_registry_takes_a_new_selector(da):
    class Spans:
        PARAMS = {"width": int}

        @classmethod
        def check_params(cls, params):
            if params.get("width", 1) < 1:
                raise ValueError("width must be >= 1")

    selectors = {**da.SELECTORS, "spans": Spans}
    assert da.parse_variant("spans:width=8", selectors).params == {"width": 8}
    with pytest.raises(ValueError, match="width must be >= 1"):
        da.parse_variant("spans:width=0", selectors)


@pytest.mark.parametrize("share, tokens, page, pages", [
    (0.01, 8192, 16, 6),  # 5.12 pages
    (0.01, 1600, 16, 1),  # exactly 1 page (0.01 x 1600 is not 16.000...1 here)
    (0.005, 8179, 16, 3),  # 2.56
    (0.05, 8192, 16, 26),  # 25.6
    (0.02, 8192, 64, 3),  # 2.56
    (1.0, 33, 16, 3),
    (1e-6, 100, 16, 1),  # never 0 pages
])
def test_budget_pages_for_share(da, share, tokens, page, pages):
    assert da.budget_pages_for_share(share, tokens, page) == pages


# ------------------------------------------------------------------------------------------
# Paged layout and attended keys
# ------------------------------------------------------------------------------------------

def test_paged_cache_layout(da):
    x = torch.randn(2, 37, 3)
    paged = da.paged_cache(x, 16)
    assert paged.shape == (3, 16, 2, 3)
    pos = torch.arange(37)
    assert torch.equal(paged[pos // 16, pos % 16].permute(1, 0, 2), x)
    assert paged[2, 5:].isnan().all() and not paged[2, :5].isnan().any()


def test_attended_keys(da):
    # 100 keys in pages of 16: pages 0..6, the last holds 4; sink 1 page, recent 2 (pages 5, 6)
    pages = torch.tensor([0, 3, 5, 6])
    assert da.attended_keys(pages, 100, 16, 1, 2, 0) == 16 + 16 + 16 + 4
    assert da.attended_keys(pages, 100, 16, 1, 2, 5) == 16 + 16 + 4 + 5  # 5 of the budget page
    assert da.attended_keys(pages, 100, 16, 1, 2, 100) == 52  # more than the budget pages hold
    assert da.attended_keys(torch.tensor([0, 1]), 20, 16, 1, 0, 0) == 20


# ------------------------------------------------------------------------------------------
# Selectors vs an independent float64 computation
# ------------------------------------------------------------------------------------------

def expected_topk(q, k, v, scale, page, sink, recent, budget, topk_tokens):
    """float64 output [H, D] and keys attended per query head, from scratch: Quest bounds of the
    pages per KV head (summed over its query heads), sink / recent pages forced, the best
    ``budget`` others; with ``topk_tokens`` only that many best keys per query head of those."""
    h, d = q.shape
    hkv, length, _ = k.shape
    group = h // hkv
    n_pages = -(-length // page)
    qd, kd, vd = q.double(), k.double(), v.double()
    out = torch.zeros(h, d, dtype=torch.float64)
    counts = []
    for g in range(hkv):
        bounds = []
        for j in range(n_pages):
            keys = kd[g, j * page:min((j + 1) * page, length)]
            lo, hi = keys.min(0).values, keys.max(0).values
            bounds.append(sum(torch.maximum(qd[x] * lo, qd[x] * hi).sum().item()
                              for x in range(g * group, (g + 1) * group)))
        forced = [j for j in range(n_pages) if j < sink or j >= n_pages - recent]
        others = sorted((j for j in range(n_pages) if j not in forced), key=lambda j: -bounds[j])
        chosen = others[:budget]
        forced_pos = [p for j in forced for p in range(j * page, min((j + 1) * page, length))]
        chosen_pos = [p for j in chosen for p in range(j * page, min((j + 1) * page, length))]
        for x in range(g * group, (g + 1) * group):
            scores = kd[g] @ qd[x]
            keep = chosen_pos
            if topk_tokens and len(chosen_pos) > topk_tokens:
                keep = sorted(chosen_pos, key=lambda p: -scores[p].item())[:topk_tokens]
            pos = torch.tensor(sorted(forced_pos + keep))
            p = torch.softmax(scores[pos] * scale, 0)
            out[x] = p @ vd[g, pos]
            counts.append(len(pos))
    return out, sum(counts) / len(counts)


@pytest.mark.parametrize("topk_tokens", [0, 10])
def test_topk_selector_matches_independent_float64(da, with_references, topk_tokens):
    gen = torch.Generator().manual_seed(7)
    h, hkv, d, page, scale = 8, 2, 16, 16, 0.25
    prompt, steps = 141, 24  # the context grows from 142 to 165 keys: across a page boundary (144)
    k = torch.randn(hkv, prompt + steps, d, generator=gen)
    v = torch.randn(hkv, prompt + steps, d, generator=gen)
    sel = da.build_selector(da.parse_variant(f"topk:sink=1,recent=2,budget=3,tokens={topk_tokens}"), prompt)
    sel.prefill(0, torch.randn(h, prompt, d, generator=gen), k[:, :prompt], v[:, :prompt])
    shares = []
    for length in range(prompt + 1, prompt + steps + 1):
        q = torch.randn(h, d, generator=gen)
        got = sel.attend(0, q, k[:, :length], v[:, :length], scale)
        want, keys = expected_topk(q, k[:, :length], v[:, :length], scale, page, 1, 2, 3, topk_tokens)
        assert got.dtype == torch.float32 and got.shape == (h, d)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        shares.append(keys / length)
    assert sel.attended.calls == steps
    assert sel.attended.mean == pytest.approx(sum(shares) / steps)
    # summaries kept across steps equal those of the final cache computed from scratch
    smin, smax = sel.summaries(0, da.paged_cache(k, page), k.shape[1])
    pos = torch.arange(k.shape[1])
    for j in range(smin.shape[0]):
        keys = k.double()[:, pos[j * page:(j + 1) * page]]
        torch.testing.assert_close(smin[j], keys.min(1).values, rtol=0, atol=0)
        torch.testing.assert_close(smax[j], keys.max(1).values, rtol=0, atol=0)


def test_budget_covering_every_page_is_dense(da, with_references):
    gen = torch.Generator().manual_seed(3)
    h, hkv, d, length, scale = 14, 2, 32, 203, 0.125
    q, k, v = torch.randn(h, d, generator=gen), torch.randn(hkv, length, d, generator=gen), \
        torch.randn(hkv, length, d, generator=gen)
    want = masked_attention_f64(q[None], k.transpose(0, 1), v.transpose(0, 1),
                                torch.ones(h, 1, length, dtype=torch.bool), scale)[0]
    dense = da.build_selector(da.parse_variant("dense"), length)
    topk = da.build_selector(da.parse_variant("topk:budget=13"), length)  # 1 + 8 + 13 >= 13 pages
    for sel in (dense, topk):
        torch.testing.assert_close(sel.attend(0, q, k, v, scale).double(), want, rtol=1e-5, atol=1e-6)
        assert sel.attended.mean == 1.0


def test_share_builds_pages_per_prompt(da, with_references):
    sel = da.build_selector(da.parse_variant("topk:share=0.01"), 8192)
    assert (sel.sink_pages, sel.recent_pages, sel.budget_pages, sel.topk_tokens, sel.page_size) == (1, 8, 6, 0, 16)
    sel = da.build_selector(da.parse_variant("topk:share=0.01,page=64"), 8192)
    assert (sel.budget_pages, sel.page_size) == (2, 64)
    assert da.build_selector(da.parse_variant("topk"), 100).budget_pages == 64


def test_spans_selector(da, with_references):
    """spans: its torch local maps equal the kernels' float64 definition, the persistent flags are
    the best pages for the last prompt queries, a budget covering every page is dense attention,
    and a small budget attends to sink + recent + flagged + budget pages only."""
    from vllm_sparse_kernels.reference import span_decode as span_ref

    gen = torch.Generator().manual_seed(5)
    h, hkv, d, n, page = 4, 2, 32, 1100, 16
    q = torch.randn(h, n, d, generator=gen) * 0.3
    k = torch.randn(hkv, n, d, generator=gen) * 0.3
    v = torch.randn(hkv, n, d, generator=gen)
    for t in range(0, n, 48):  # runs of 3 pages sharing a direction: triangles in the local maps
        base = torch.randn(d, generator=gen) * 1.5
        q[:, t:t + 48] += base
        k[:, t:t + 48] += base
    sel = da.build_selector(da.parse_variant("spans:persist=3,budget=2,persist_by=index"), n)
    maps, votes, lens = sel.local_maps(q, k, d ** -0.5)
    assert lens.tolist() == [1024, 76]
    for s, (s0, t) in enumerate(((0, 1024), (1024, 76))):
        rm, rv = span_ref.reference_local_map(q[:, s0:s0 + t].transpose(0, 1), k[:, s0:s0 + t].transpose(0, 1), page,
                                        d ** -0.5, 1024)
        torch.testing.assert_close(maps[s].double(), rm, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(votes[s].double(), rv, rtol=1e-4, atol=1e-4)
    sel.prefill(0, q, k, v)
    n_pages = -(-n // page)
    flags, keys = sel._flags[0], sel._keys[0]
    assert flags.sum(0).tolist() == [3, 3] and not flags[0].any() and not flags[-8:].any()
    # decode one more token: attention only over the selected pages
    k2 = torch.cat([k, torch.randn(hkv, 1, d, generator=gen)], 1)
    v2 = torch.cat([v, torch.randn(hkv, 1, d, generator=gen)], 1)
    qd = torch.randn(h, d, generator=gen) + q[:, -1]
    out = sel.attend(0, qd, k2, v2, d ** -0.5)
    scores = torch.einsum("phd,hd->ph", sel._keys[0], qd.double().view(hkv, 2, d).sum(1))
    for g in range(hkv):
        forced = {0} | set(range(n_pages - 8 + 1, n_pages + 1)) | set(flags[:, g].nonzero().flatten().tolist())
        rest = sorted((j for j in range(n_pages + 1) if j not in forced), key=lambda j: -float(scores[j, g]))[:2]
        allowed = torch.zeros(2, 1, n + 1, dtype=torch.bool)
        for j in forced | set(rest):
            allowed[:, 0, j * page:(j + 1) * page] = True
        want = masked_attention_f64(qd[None, 2 * g:2 * g + 2], k2[g:g + 1].transpose(0, 1),
                                    v2[g:g + 1].transpose(0, 1), allowed[:, :, :n + 1], d ** -0.5)[0]
        torch.testing.assert_close(out[2 * g:2 * g + 2].double(), want, rtol=1e-4, atol=1e-5)
    # every page selected: dense
    full = da.build_selector(da.parse_variant("spans:budget=100"), n)
    full.prefill(0, q, k, v)
    dense = masked_attention_f64(qd[None], k2.transpose(0, 1), v2.transpose(0, 1),
                                 torch.ones(h, 1, n + 1, dtype=torch.bool), d ** -0.5)[0]
    torch.testing.assert_close(full.attend(0, qd, k2, v2, d ** -0.5).double(), dense, rtol=1e-5, atol=1e-6)
    assert full.attended.mean == 1.0


def segment_votes_f64(q: torch.Tensor, k: torch.Tensor, segment: int = 1024) -> torch.Tensor:
    """Per token, the column sums of each ``segment``-token block's causal softmax over every query
    head (float64): the votes the spans index tokens are chosen by, computed independently."""
    h, n, d = q.shape
    group = h // k.shape[0]
    votes = torch.zeros(n, dtype=torch.float64)
    for s0 in range(0, n, segment):
        t = min(segment, n - s0)
        causal_mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        for head in range(h):
            sc = q[head, s0:s0 + t].double() @ k[head // group, s0:s0 + t].double().T * d ** -0.5
            votes[s0:s0 + t] += torch.softmax(sc.masked_fill(causal_mask, float("-inf")), -1).sum(0)
    return votes


def test_select_with_next(da):
    # 12 pages, 2 KV heads; forced: sink page 0, recent page 11, head 1's flagged page 5
    score = torch.tensor([[0.0, 0.0]] * 12, dtype=torch.float64)
    score[3, 0], score[7, 0], score[8, 0] = 9.0, 8.0, 7.0  # head 0: 3 brings 4, then 7 brings 8 (8 once)
    score[4, 1], score[10, 1] = 9.0, 8.0  # head 1: 4 brings 5 (forced already: not twice), 10 brings 11 (forced)
    forced = torch.zeros(12, 2, dtype=torch.bool)
    forced[0], forced[11] = True, True
    forced[5, 1] = True
    sel, n = da.select_with_next(score, forced, budget=4, next_pages=1)
    assert n.tolist() == [[6, 7]]  # equal forced counts would give equal counts; here head 1 has one more
    assert sel[0, 0, :6].tolist() == [0, 3, 4, 7, 8, 11] and sel[0, 0, 6] == -1
    # head 1: 4, then 10 (11 forced), then the best remaining by score with ties to the lower page: 1, 2
    assert sel[0, 1, :7].tolist() == [0, 1, 2, 4, 5, 10, 11]
    # the budget cuts a group short
    sel, n = da.select_with_next(score, forced, budget=1, next_pages=3)
    assert sel[0, 0, :int(n[0, 0])].tolist() == [0, 3, 11]


def _prefilled_spans(da, spec: str, seed: int, h: int = 4, hkv: int = 2, d: int = 16, n: int = 1100):
    """A spans selector of ``spec`` after the prefill of random q / k / v (layer 0); returns the
    selector, the generator (for the decode step's tensors) and q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(h, n, d, generator=gen)
    k = torch.randn(hkv, n, d, generator=gen)
    v = torch.randn(hkv, n, d, generator=gen)
    sel = da.build_selector(da.parse_variant(spec), n)
    sel.prefill(0, q, k, v)
    return sel, gen, q, k, v


def test_spans_selector_next_pages(da, with_references):
    """spans:next=1 at decode: every KV head attends to the same number of pages (the attention
    reference takes one count per sequence), and the output is float64 attention over them."""
    h, hkv, d, n, page = 4, 2, 16, 1100, 16
    sel, gen, q, k, v = _prefilled_spans(
        da, "spans:sink=1,recent=8,persist=2,budget=6,index=page,next=1,persist_by=index", 8)
    k2 = torch.cat([k, torch.randn(hkv, 1, d, generator=gen)], 1)
    v2 = torch.cat([v, torch.randn(hkv, 1, d, generator=gen)], 1)
    qd = torch.randn(h, d, generator=gen)
    out = sel.attend(0, qd, k2, v2, d ** -0.5)
    assert torch.isfinite(out).all()
    n_pages = -(-(n + 1) // page)
    qg = qd.double().view(hkv, -1, d).sum(1)
    score = torch.einsum("phd,hd->ph", sel._keys[0][:n_pages], qg)
    ids = torch.arange(n_pages)[:, None]
    forced = (ids < 1) | (ids >= n_pages - 8) | (sel._flags[0][:n_pages] != 0)
    chosen, counts = da.select_with_next(score, forced, 6, 1)
    assert counts[0, 0] == counts[0, 1] == 1 + 8 + 2 + 6
    for hq in range(h):
        g = hq // (h // hkv)
        keys = torch.cat([torch.arange(p * page, min((p + 1) * page, n + 1)) for p in chosen[0, g].tolist()])
        w = torch.softmax((k2[g, keys].double() @ qd[hq].double()) * d ** -0.5, 0)
        torch.testing.assert_close(out[hq].double(), w @ v2[g, keys].double(), rtol=1e-5, atol=1e-6)


def test_spans_selector_page_index(da, with_references):
    """spans:index=page (the backend's decode_span_index=page, issue 24): every prompt page holds the key
    of its own most-voted token (float64 votes of an independent softmax), the page decode writes
    its mean key."""
    h, hkv, d, n, page = 4, 2, 16, 1100, 16
    sel, gen, q, k, v = _prefilled_spans(da, "spans:persist=2,budget=3,index=page,persist_by=index", 6)
    votes = segment_votes_f64(q, k)
    n_pages = -(-n // page)
    for a in range(n_pages):
        best = a * page + int(votes[a * page:(a + 1) * page].argmax())
        torch.testing.assert_close(sel._keys[0][a], k[:, best].double(), rtol=0, atol=0)
    k2 = torch.cat([k, torch.randn(hkv, 1, d, generator=gen)], 1)
    v2 = torch.cat([v, torch.randn(hkv, 1, d, generator=gen)], 1)
    sel.attend(0, torch.randn(h, d, generator=gen), k2, v2, d ** -0.5)
    last = n // page
    torch.testing.assert_close(sel._keys[0][last], k2[:, last * page:].double().mean(1))
    with pytest.raises(ValueError, match="index must be span, page, page2, bounds, pagebounds or blocks"):
        da.parse_variant("spans:index=token")
    with pytest.raises(ValueError, match="vectors must be >= 1"):
        da.parse_variant("spans:index=blocks,vectors=0")
    with pytest.raises(ValueError, match="score=max scores the index vectors of index=blocks"):
        da.parse_variant("spans:score=max")


def test_spans_selector_persist_by_attention(da, with_references):
    """spans:persist_by=attention (issue 24): the persistent pages of each KV head are those that
    get the most attention mass from the last 64 prompt queries (each query's own causal softmax,
    float64, computed here query by query), sink and recent pages excluded; span keys unchanged."""
    h, hkv, d, n, page, persist = 4, 2, 16, 1100, 16, 5
    sel, _, q, k, _ = _prefilled_spans(da, f"spans:persist={persist},budget=3,persist_by=attention,persist_next=0", 11)
    base, *_ = _prefilled_spans(da, f"spans:persist={persist},budget=3,persist_by=index", 11)
    torch.testing.assert_close(sel._keys[0], base._keys[0], rtol=0, atol=0)
    n_pages = -(-n // page)
    mass = torch.zeros(n_pages, hkv, dtype=torch.float64)
    for head in range(h):
        kv = head // (h // hkv)
        for t in range(n - 64, n):
            w = torch.softmax(k[kv, :t + 1].double() @ q[head, t].double() * d ** -0.5, 0)
            for j in range(t + 1):
                mass[j // page, kv] += w[j]
    j = torch.arange(n_pages)
    mass[(j < sel.sink_pages) | (j >= n_pages - sel.recent_pages)] = float("-inf")
    for kv in range(hkv):
        want = set(mass[:, kv].topk(persist).indices.tolist())
        assert set(torch.nonzero(sel._flags[0][:, kv]).flatten().tolist()) == want
    assert not torch.equal(sel._flags[0], base._flags[0])  # the what-if changes which pages persist
    # persist_next=1: runs of 2 pages from the persist // 2 = 2 most attended pages on
    runs, *_ = _prefilled_spans(da, f"spans:persist={persist},budget=3,persist_next=1", 11)
    for kv in range(hkv):
        anchors = mass[:, kv].topk(persist // 2).indices.tolist()
        want = {p for a in anchors for p in (a, a + 1) if mass[p, kv] > float("-inf")}
        assert set(torch.nonzero(runs._flags[0][:, kv]).flatten().tolist()) == want
    with pytest.raises(ValueError, match="persist_by must be index or attention"):
        da.parse_variant("spans:persist_by=votes")
    with pytest.raises(ValueError, match="persist_next takes persist_by=attention"):
        da.parse_variant("spans:persist_by=index,persist_next=1")


def test_spans_selector_page2_index(da, with_references):
    """spans:index=page2 (harness-only what-if): every prompt page holds the keys of its own 2
    most-voted tokens (float64 votes of an independent softmax), pages are scored by the larger
    q . k (q summed over the KV head's query heads) for the persistent flags and at decode, the page
    decode writes holds its mean key; the output equals float64 attention over the pages so chosen."""
    h, hkv, d, n, page = 4, 2, 16, 1100, 16
    sink, recent, persist, budget = 1, 8, 2, 3
    sel, gen, q, k, v = _prefilled_spans(
        da, f"spans:sink={sink},recent={recent},persist={persist},budget={budget},index=page2,persist_by=index", 6)
    votes = segment_votes_f64(q, k)
    n_pages = -(-n // page)
    top2 = []
    for a in range(n_pages):
        toks = sorted(range(a * page, min((a + 1) * page, n)), key=lambda t: (-float(votes[t]), t))[:2]
        top2.append(toks)
        torch.testing.assert_close(sel._keys[0][a], k[:, toks[0]].double(), rtol=0, atol=0)
        torch.testing.assert_close(sel._keys2[0][a], k[:, toks[1]].double(), rtol=0, atol=0)
    # persistent flags: the last last_q prompt queries summed, the larger score of the 2 keys
    q_last = q[:, -sel.last_q:].double().sum(1).view(hkv, h // hkv, d).sum(1)  # [Hkv, D]
    n_new = n + 1
    k2 = torch.cat([k, torch.randn(hkv, 1, d, generator=gen)], 1)
    v2 = torch.cat([v, torch.randn(hkv, 1, d, generator=gen)], 1)
    qd = torch.randn(h, d, generator=gen)
    got = sel.attend(0, qd, k2, v2, d ** -0.5).double()
    last = n // page  # the prompt's partial last page, now written by decode: its mean key
    torch.testing.assert_close(sel._keys[0][last], k2[:, last * page:].double().mean(1))
    pages_new = -(-n_new // page)
    for g in range(hkv):
        def score(a, qv):
            if a == last:
                return float(k2[g, last * page:].double().mean(0) @ qv)
            return max(float(k[g, t].double() @ qv) for t in top2[a])
        middle = [a for a in range(n_pages) if sink <= a < n_pages - recent]
        flagged = sorted(middle, key=lambda a: (-max(float(k[g, t].double() @ q_last[g]) for t in top2[a]), a))[:persist]
        forced = [a for a in range(pages_new) if a < sink or a >= pages_new - recent or a in flagged]
        qg = qd[g * (h // hkv):(g + 1) * (h // hkv)].double().sum(0)
        rest = sorted((a for a in range(pages_new) if a not in forced), key=lambda a: (-score(a, qg), a))
        chosen = sorted(forced + rest[:budget])
        toks = [t for a in chosen for t in range(a * page, min((a + 1) * page, n_new))]
        for head in range(g * (h // hkv), (g + 1) * (h // hkv)):
            p = torch.softmax(k2[g, toks].double() @ qd[head].double() * d ** -0.5, 0)
            torch.testing.assert_close(got[head], p @ v2[g, toks].double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index", ["bounds", "pagebounds"])
def test_spans_selector_bounds_index(da, with_references, index):
    """spans:index=bounds (harness-only what-if): every prompt page holds its span's key min / max
    over all the span's tokens (the spans of the selector's own division; ``pagebounds``: its own
    keys'); pages are scored by
    Quest bounds summed over the KV head's query heads (persistent flags: the last last_q prompt
    queries summed; decode: the step's query), the page decode writes by its own keys; the output
    equals float64 attention over the pages so chosen, with the budget on top of the forced pages."""
    h, hkv, d, n, page = 4, 2, 16, 1100, 16
    sink, recent, persist, budget = 1, 8, 2, 5
    sel, gen, q, k, v = _prefilled_spans(
        da, f"spans:sink={sink},recent={recent},persist={persist},budget={budget},index={index},persist_by=index", 12)
    (_, (spans, _, _)), = sel._divided.values()
    seg = sel.params.segment_tokens
    owner = [(s, sid) for s, span in enumerate(spans) for sid in span]  # a span id per prompt page
    n_pages = -(-n // page)
    assert len(owner) == n_pages and len(set(owner)) < n_pages  # some span holds several pages
    if index == "pagebounds":
        owner = list(range(n_pages))
    smin, smax = sel._bounds[0]
    for a in range(n_pages):
        toks = [t for b in range(n_pages) if owner[b] == owner[a] for t in range(b * page, min((b + 1) * page, n))]
        assert toks[0] // seg == toks[-1] // seg  # a span lies in one segment
        torch.testing.assert_close(smin[a], k[:, toks].double().amin(1), rtol=0, atol=0)
        torch.testing.assert_close(smax[a], k[:, toks].double().amax(1), rtol=0, atol=0)

    def bound(lo, hi, qs):  # qs [group, D]
        return sum(float(torch.maximum(x * lo, x * hi).sum()) for x in qs.double())

    group = h // hkv
    q_sum = q[:, -sel.last_q:].double().sum(1)
    n_new = n + 1
    k2 = torch.cat([k, torch.randn(hkv, 1, d, generator=gen)], 1)
    v2 = torch.cat([v, torch.randn(hkv, 1, d, generator=gen)], 1)
    qd = torch.randn(h, d, generator=gen)
    got = sel.attend(0, qd, k2, v2, d ** -0.5).double()
    last = n // page  # the prompt's partial last page, now written by decode: bounds of its own keys
    pages_new = -(-n_new // page)
    for g in range(hkv):
        heads = slice(g * group, (g + 1) * group)
        middle = [a for a in range(n_pages) if sink <= a < n_pages - recent]
        flagged = sorted(middle, key=lambda a: (-bound(smin[a, g], smax[a, g], q_sum[heads]), a))[:persist]
        assert [a for a in range(n_pages) if sel._flags[0][a, g]] == sorted(flagged)

        def score(a):
            if a == last:
                own = k2[g, last * page:].double()
                return bound(own.amin(0), own.amax(0), qd[heads])
            return bound(smin[a, g], smax[a, g], qd[heads])
        forced = [a for a in range(pages_new) if a < sink or a >= pages_new - recent or a in flagged]
        rest = sorted((a for a in range(pages_new) if a not in forced), key=lambda a: (-score(a), a))
        toks = [t for a in sorted(forced + rest[:budget]) for t in range(a * page, min((a + 1) * page, n_new))]
        for head in range(g * group, (g + 1) * group):
            p = torch.softmax(k2[g, toks].double() @ qd[head].double() * d ** -0.5, 0)
            torch.testing.assert_close(got[head], p @ v2[g, toks].double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_spans_selector_blocks_index(da, with_references, reduce):
    """spans:index=blocks (harness-only what-if, the paper's Eq. 8-9): the prompt's pages in blocks
    of ``block`` pages; the pages of a block in one span of the selector's own division form a
    piece whose index vectors are the keys of its round(vectors x pages / block) most-voted tokens
    (float64 votes of an independent softmax), scored by the sum of their q . k (Eq. 8) or, with
    score=max, the best one; a page scores its block's best piece (q summed over the KV head's
    query heads; persistent flags: the last last_q prompt queries), whole blocks tie to the lower
    pages; the output equals float64 attention over the pages so chosen."""
    h, hkv, d, n, page, block, vectors = 4, 2, 16, 1100, 16, 4, 6
    sink, recent, persist, budget = 1, 8, 2, 8
    sel, gen, q, k, v = _prefilled_spans(
        da, f"spans:sink={sink},recent={recent},persist={persist},budget={budget},index=blocks,persist_by=index,"
            f"block={block},vectors={vectors},score={reduce}", 13)
    (_, (spans, _, _)), = sel._divided.values()
    owner = [(s, sid) for s, span in enumerate(spans) for sid in span]
    n_pages = -(-n // page)
    votes = segment_votes_f64(q, k)
    pieces = []  # per block: the pieces' summed keys [Hkv, D]
    for b0 in range(0, n_pages, block):
        members: dict = {}
        for a in range(b0, min(n_pages, b0 + block)):
            members.setdefault(owner[a], []).append(a)
        row = []
        for pages in members.values():
            toks = [t for a in pages for t in range(a * page, min((a + 1) * page, n))]
            count = max(1, round(vectors * len(pages) / block))
            best = sorted(toks, key=lambda t: (-float(votes[t]), t))[:count]
            row.append(k[:, best].double())  # [Hkv, count, D]
        pieces.append(row)
    assert any(len(row) > 1 for row in pieces) and any(len(row) == 1 for row in pieces)

    def score(a, g, qv):  # qv [D]: the KV head's query heads summed
        dots = [piece[g] @ qv for piece in pieces[a // block]]
        return max(float(x.sum() if reduce == "sum" else x.max()) for x in dots)

    group = h // hkv
    q_last = q[:, -sel.last_q:].double().sum(1).view(hkv, group, d).sum(1)
    n_new = n + 1
    k2 = torch.cat([k, torch.randn(hkv, 1, d, generator=gen)], 1)
    v2 = torch.cat([v, torch.randn(hkv, 1, d, generator=gen)], 1)
    qd = torch.randn(h, d, generator=gen)
    got = sel.attend(0, qd, k2, v2, d ** -0.5).double()
    pages_new = -(-n_new // page)
    assert pages_new == n_pages  # the decode step writes into the prompt's last page
    for g in range(hkv):
        middle = [a for a in range(n_pages) if sink <= a < n_pages - recent]
        flagged = sorted(middle, key=lambda a: (-score(a, g, q_last[g]), a))[:persist]
        assert [a for a in range(n_pages) if sel._flags[0][a, g]] == sorted(flagged)
        qg = qd[g * group:(g + 1) * group].double().sum(0)
        forced = [a for a in range(pages_new) if a < sink or a >= pages_new - recent or a in flagged]
        rest = sorted((a for a in range(pages_new) if a not in forced), key=lambda a: (-score(a, g, qg), a))
        toks = [t for a in sorted(forced + rest[:budget]) for t in range(a * page, min((a + 1) * page, n_new))]
        for head in range(g * group, (g + 1) * group):
            p = torch.softmax(k2[g, toks].double() @ qd[head].double() * d ** -0.5, 0)
            torch.testing.assert_close(got[head], p @ v2[g, toks].double(), rtol=1e-5, atol=1e-6)
