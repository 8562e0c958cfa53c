"""The spans probe's helpers (vllm_sparse_tools/evaluation/span_probe.py) and the
diagnostics ``reference.span_decode.reference_divide`` hands it (issue 24)."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse_tools.evaluation import span_probe

# The references below live in kernel modules that import triton: `make test` runs this module
# again with triton under its interpreter; in the main suite (no triton) those tests skip.
pytestmark = pytest.mark.kernels


def test_find_subsequence():
    assert span_probe.find_subsequence([1, 2, 3, 1, 2], [1, 2]) == [0, 3]
    assert span_probe.find_subsequence([1, 2, 3], [4]) == []


def test_needle_positions_every_value():
    """multi_value / multi_query: each expected value's positions; values found 0 or 2+ times listed apart."""
    enc = {"12": [1, 2], "34": [3, 4], "5": [5], "7": [7]}
    found, missing = span_probe.needle_positions([9, 3, 4, 9, 1, 2, 5, 0, 5], ["12", "34", "5", "7"], enc.__getitem__)
    assert found == [("12", [4, 5]), ("34", [1, 2])]
    assert missing == [("5", 2), ("7", 0)]


def test_best_rank_excludes_forced_and_breaks_ties_low():
    score = torch.tensor([9.0, 1.0, 5.0, 5.0, 7.0, 8.0])
    cand = span_probe.candidate_mask(6, 1, 1)  # pages 1..4
    assert cand.tolist() == [False, True, True, True, True, False]
    assert span_probe.best_rank(score, [4], cand) == 0
    assert span_probe.best_rank(score, [2], cand) == 1
    assert span_probe.best_rank(score, [3], cand) == 2  # tie with page 2 goes to page 2
    assert span_probe.best_rank(score, [1, 3], cand) == 2
    assert span_probe.best_rank(score, [5], cand) == 0  # forced (recent)


def test_exact_page_mass_matches_loop():
    gen = torch.Generator().manual_seed(0)
    h, hkv, d, length, page = 4, 2, 8, 37, 8
    q, k = torch.randn(h, d, generator=gen), torch.randn(hkv, length, d, generator=gen)
    scale = d ** -0.5
    mass = span_probe.exact_page_mass(q, k, scale, page)
    ref = torch.zeros(hkv, -(-length // page), dtype=torch.float64)
    for head in range(h):
        g = head // (h // hkv)
        p = torch.softmax(k[g].double() @ q[head].double() * scale, 0)
        for t in range(length):
            ref[g, t // page] += p[t]
    torch.testing.assert_close(mass, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mass.sum(1), torch.full((hkv,), 2.0, dtype=torch.float64))


def test_divide_info_is_consistent():
    sd = pytest.importorskip("vllm_sparse_kernels.decode.span_decode")  # imports triton (SpanParams)
    from vllm_sparse_kernels.reference import span_decode as span_ref
    gen = torch.Generator().manual_seed(1)
    n_tok, h, hkv, d, page = 256, 4, 2, 16, 16
    q, k = torch.randn(n_tok, h, d, generator=gen), torch.randn(n_tok, hkv, d, generator=gen)
    for start in range(0, n_tok, 64):  # planted triangles: runs sharing a direction
        base = torch.randn(d, generator=gen) * 2
        q[start:start + 64] += base
        k[start:start + 64] += base[None]
    params = sd.SpanParams(segment_tokens=256)
    maps, votes = span_ref.reference_local_map(q, k, page, d ** -0.5, 256)
    info: dict = {}
    span, chosen = span_ref.reference_divide(maps, votes, n_tok, page, h, params, info=info)
    assert (span, chosen) == span_ref.reference_divide(maps, votes, n_tok, page, h, params)  # info changes nothing
    assert len(info["in_kept"]) == len(span) and any(info["in_kept"])
    for x, y in info["kept"]:
        assert all(info["in_kept"][a] for a in range(x, y + 1))
    assert set(info["count"]) == set(span)
    for sid, count in info["count"].items():
        assert sum(1 for t in chosen if span[t // page] == sid) == count


def test_probe_layer_finds_a_planted_needle():
    """A key aligned with the query on page 5: exact, top-k bound, span max and page-index ranks 0;
    the span key (sum over a long span's index tokens, none on the needle) ranks it lower."""
    gen = torch.Generator().manual_seed(2)
    h, hkv, d, page, n_pages = 2, 1, 8, 4, 12
    length = n_pages * page
    q = torch.zeros(h, d)
    q[:, 0] = 1.0
    k = torch.randn(hkv, length, d, generator=gen) * 0.1
    needle = [21]  # page 5
    k[0, 21, 0] = 5.0
    span_ids = [0] * 2 + [2] * 8 + [10] * 2  # the needle's span: pages 2..9
    index_tokens = [8, 9, 40, 41, 0, 1]  # none on the needle
    k[0, 40, 0] = 1.0  # page 10's span indexes a mildly aligned token
    votes = torch.rand(length, generator=gen)
    votes[21] = 2.0  # the needle is its page's most-voted token, but not an index token
    flags = torch.zeros(n_pages, hkv, dtype=torch.uint8)
    span_keys = torch.zeros(n_pages, hkv, d, dtype=torch.float64)
    for p in range(n_pages):
        span_keys[p, 0] = k[0, [t for t in index_tokens if span_ids[t // page] == span_ids[p]]].double().sum(0)
    mn = k[0].view(n_pages, page, d).amin(1)[:, None].double()
    mx = k[0].view(n_pages, page, d).amax(1)[:, None].double()
    from vllm_sparse_kernels.reference import topk_decode

    bounds = topk_decode.reference_page_bounds(q, mn, mx, torch.arange(n_pages), h // hkv)
    r = span_probe.probe_layer(q, k, d ** -0.5, page, [5], needle, span_ids=span_ids, in_kept=[True] * n_pages,
                               index_tokens=index_tokens, span_count={0: 2, 2: 2, 10: 2}, span_keys=span_keys,
                               flags=flags, topk_bounds=bounds, spans_selected=torch.tensor([[0, 10, 11]]),
                               topk_selected=torch.tensor([[0, 5, 11]]), sink_pages=1, recent_pages=1,
                               votes=votes)
    head = r["heads"][0]
    assert head["exact_rank"] == 0 and head["topk_rank"] == 0 and head["page_idx1_rank"] == 0
    assert head["span_sum_rank"] > 0  # page 10 (index token aligned) beats the needle's span
    assert head["vote_rank"] == 0 and not r["needle_token_is_index"]
    assert head["needle_span_pages"] == 8 and head["needle_span_index"] == 2
    assert head["topk_selected"] and not head["spans_selected"]
    assert r["spans"] == 3


def test_span_bound_is_the_page_bound_of_one_page_spans():
    from vllm_sparse_kernels.reference import topk_decode

    gen = torch.Generator().manual_seed(3)
    h, hkv, d, page, n_pages = 4, 2, 8, 4, 6
    q, k = torch.randn(h, d, generator=gen), torch.randn(hkv, n_pages * page, d, generator=gen)
    mn = k.view(hkv, n_pages, page, d).amin(2).transpose(0, 1).double()
    mx = k.view(hkv, n_pages, page, d).amax(2).transpose(0, 1).double()
    bounds = topk_decode.reference_page_bounds(q, mn, mx, torch.arange(n_pages), h // hkv)
    kw = dict(index_tokens=list(range(0, n_pages * page, page)), span_count={p: 1 for p in range(n_pages)},
              span_keys=torch.zeros(n_pages, hkv, d, dtype=torch.float64),
              flags=torch.zeros(n_pages, hkv, dtype=torch.uint8), topk_bounds=bounds,
              spans_selected=torch.full((hkv, 1), -1), topk_selected=torch.full((hkv, 1), -1), sink_pages=0,
              recent_pages=0, summaries=(mn, mx))
    for needle_page in range(n_pages):
        r = span_probe.probe_layer(q, k, 0.3, page, [needle_page], [needle_page * page], span_ids=list(range(n_pages)),
                                   in_kept=[True] * n_pages, **kw)
        assert [x["span_bound_rank"] for x in r["heads"]] == [x["topk_rank"] for x in r["heads"]]
