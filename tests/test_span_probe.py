"""The spans probe's helpers (vllm_sparse_backend/tools/evaluation/span_probe.py) and the
diagnostics ``span_decode.reference_divide`` hands it (issue 24)."""

from __future__ import annotations

import pytest
import torch

from vllm_sparse_backend.tools.evaluation import span_probe


def test_find_subsequence():
    assert span_probe.find_subsequence([1, 2, 3, 1, 2], [1, 2]) == [0, 3]
    assert span_probe.find_subsequence([1, 2, 3], [4]) == []


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
    sd = pytest.importorskip("sparse_prefill_kernels.span_decode")  # imports triton
    gen = torch.Generator().manual_seed(1)
    n_tok, h, hkv, d, page = 256, 4, 2, 16, 16
    q, k = torch.randn(n_tok, h, d, generator=gen), torch.randn(n_tok, hkv, d, generator=gen)
    for start in range(0, n_tok, 64):  # planted triangles: runs sharing a direction
        base = torch.randn(d, generator=gen) * 2
        q[start:start + 64] += base
        k[start:start + 64] += base[None]
    params = sd.SpanParams(segment_tokens=256)
    maps, votes = sd.reference_local_map(q, k, page, d ** -0.5, 256)
    info: dict = {}
    span, chosen = sd.reference_divide(maps, votes, n_tok, page, h, params, info=info)
    assert (span, chosen) == sd.reference_divide(maps, votes, n_tok, page, h, params)  # info changes nothing
    assert len(info["in_kept"]) == len(span) and any(info["in_kept"])
    for x, y in info["kept"]:
        assert all(info["in_kept"][a] for a in range(x, y + 1))
    assert set(info["count"]) == set(span)
    for sid, count in info["count"].items():
        assert sum(1 for t in chosen if span[t // page] == sid) == count
