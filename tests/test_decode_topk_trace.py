"""benchmarks/decode_topk_trace.py: the pure functions against small hand-computed cases."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from conftest import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dt():
    return load_script("benchmarks/decode_topk_trace.py", "decode_topk_trace")


def test_resident_positions(dt):
    assert dt.resident_positions(20, 3, 4).tolist() == [0, 1, 2, 16, 17, 18, 19]
    # sinks and window overlap in a short context: each position once
    assert dt.resident_positions(5, 3, 4).tolist() == [0, 1, 2, 3, 4]
    assert dt.resident_positions(2, 3, 4).tolist() == [0, 1]


def test_topk_union_groups_and_range(dt):
    # 4 query heads, 2 KV heads: heads 0,1 -> KV 0; heads 2,3 -> KV 1 (repeat_kv layout)
    scores = torch.tensor([
        [9., 1., 5., 4., 0., 3., 8., 2.],
        [9., 2., 1., 7., 6., 0., 3., 5.],
        [0., 9., 8., 1., 2., 3., 4., 7.],
        [9., 9., 0., 1., 5., 2., 6., 3.],
    ])
    # candidates [1, 7): head 0 top-2 -> 6 (8), 2 (5); head 1 -> 3 (7), 4 (6)
    # head 2 -> 1 (9), 2 (8); head 3 -> 1 (9), 6 (6)
    kv0, kv1 = dt.topk_union(scores, 2, 2, 1, 7)
    assert kv0.tolist() == [2, 3, 4, 6]
    assert kv1.tolist() == [1, 2, 6]
    # position 0 and 7 are outside the candidate range even with the highest scores
    assert 0 not in kv0.tolist() and 7 not in kv1.tolist()


def test_topk_union_small_range_and_empty(dt):
    scores = torch.arange(12.).reshape(2, 6)
    one, = dt.topk_union(scores, 1, 10, 2, 4)  # k larger than the range: all of it
    assert one.tolist() == [2, 3]
    empty, = dt.topk_union(scores, 1, 3, 4, 4)
    assert empty.numel() == 0
    with pytest.raises(ValueError):
        dt.topk_union(torch.zeros(3, 5), 2, 1, 0, 5)


def test_pages_and_page_positions(dt):
    pos = torch.tensor([0, 15, 16, 17, 47, 48, 100])
    assert dt.pages_of(pos, 16).tolist() == [0, 1, 2, 3, 6]
    assert dt.pages_of(pos, 64).tolist() == [0, 1]
    # page 1 of size 4 -> 4..7; page 3 -> 12..15 clipped at length 14
    assert dt.page_positions(torch.tensor([1, 3]), 4, 14).tolist() == [4, 5, 6, 7, 12, 13]
    assert dt.utilisation(6, 2, 16) == pytest.approx(6 / 32)
    assert math.isnan(dt.utilisation(0, 0, 16))


def test_covered_mass_counts_positions_once(dt):
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4],
                          [0.4, 0.3, 0.2, 0.1]])
    m = dt.covered_mass(probs, torch.tensor([0, 1]), torch.tensor([1, 3]))
    assert m.tolist() == pytest.approx([0.1 + 0.2 + 0.4, 0.4 + 0.3 + 0.1])
    assert dt.covered_mass(probs, torch.tensor([], dtype=torch.long)).tolist() == [0.0, 0.0]


def test_lru_hits_hand_trace(dt):
    steps = [[1, 2], [2, 3], [1, 4], [3, 4]]
    # capacity 3: after step 0 cache (LRU->MRU) 1,2; step 1 hits {2}, cache 1,2,3;
    # step 2 hits {1}, touch 1,4 -> 2,3,1,4 -> evict 2 -> 3,1,4; step 3 hits {3,4}
    assert dt.lru_hits(steps, 3) == [0, 1, 1, 2]
    # capacity 2: after step 1 cache 2,3; step 2 hits none -> 1,4; step 3 hits {4}
    assert dt.lru_hits(steps, 2) == [0, 1, 0, 1]
    assert dt.hit_rate(steps, [0, 1, 1, 2]) == pytest.approx((1 / 2 + 1 / 2 + 2 / 2) / 3)


def test_lru_keeps_last_pages_of_an_oversized_step(dt):
    # a step with more pages than the capacity keeps its last (most recently touched) ones
    assert dt.lru_hits([[5, 6, 7], [5], [7]], 2) == [0, 0, 1]
    # the first step never counts towards the hit rate
    assert dt.hit_rate([[1], [1]], [1, 1]) == 1.0
    assert math.isnan(dt.hit_rate([[1]], [0]))


def test_prev_overlap(dt):
    steps = [[1, 2, 3], [2, 3, 4, 5], [9]]
    assert dt.prev_overlap(steps) == pytest.approx((2 / 4 + 0 / 1) / 2)
    assert dt.prev_overlap([[1, 2], [2, 1]]) == 1.0
    assert math.isnan(dt.prev_overlap([[1]]))


def test_analyse_head_on_a_tiny_trace(dt):
    # one KV head, two query heads, context of 12 tokens growing by one; sinks 1, window 2
    torch.manual_seed(0)
    lengths = [12, 13, 14]
    scores = [torch.randn(2, n) for n in lengths]
    probs = [torch.softmax(s.double(), -1) for s in scores]
    res, series = dt.analyse_head(probs, scores, lengths, 1, 0, 2, [4], 1, 2)
    m = res[4]
    sel = [dt.topk_union(s, 1, 2, 1, n - 2)[0] for s, n in zip(scores, lengths)]
    pages = [dt.pages_of(x, 4) for x in sel]
    assert series[4]["pages"] == [len(p) for p in pages]
    assert m["sel_tokens"] == pytest.approx(sum(len(x) for x in sel) / 3)
    assert m["tok_prev"] == pytest.approx(dt.prev_overlap([x.tolist() for x in sel]))
    assert m["prev"] == pytest.approx(dt.prev_overlap([p.tolist() for p in pages]))
    # whole pages cover at least the selected tokens
    assert m["mass_pages"] >= m["mass_tokens"] >= m["mass_resident"] > 0
    assert 0 <= m["hit_1x"] <= m["hit_8x"] <= 1


def test_candidate_pages(dt):
    # [64, 7680) with pages of 16: pages 4..479
    assert dt.candidate_pages(64, 7680, 16) == 476
    # [64, 7681): one position spills into page 480
    assert dt.candidate_pages(64, 7681, 16) == 477
    assert dt.candidate_pages(5, 6, 4) == 1
    assert dt.candidate_pages(3, 5, 4) == 2
    assert dt.candidate_pages(7, 7, 4) == 0
