"""The row cost model (vllm_sparse_backend.prefill.cost): its arithmetic against a hand
computation, and what a layer's density history learns and predicts."""

import pytest
import torch

from vllm_sparse_backend.prefill.cost import RowCost, LayerDensityHistory
from vllm_sparse_kernels.index_format import causal_pairs


def hand_costs(q_len, ctx_len, heads, head_size, density, last_q, cost):
    causal = sum(ctx_len + i + 1 for i in range(q_len)) * heads  # keys each query sees, summed
    estimate = cost.estimate_key * min(last_q, q_len) * (ctx_len + q_len) * heads
    return causal, estimate + cost.row_overhead * 128 / head_size + cost.sparse_pair * density * causal


@pytest.mark.parametrize("q_len,ctx_len,heads,head_size,density", [
    (16384, 114688, 12, 128, 0.2), (16384, 0, 12, 128, 0.5), (4096, 0, 32, 128, 0.0), (8192, 8192, 14, 64, 0.3)])
def test_costs_match_a_hand_computation(q_len, ctx_len, heads, head_size, density):
    cost = RowCost()
    causal, sparse = hand_costs(q_len, ctx_len, heads, head_size, density, 64, cost)
    assert causal_pairs(q_len, ctx_len, heads) == causal  # the count the model uses
    assert cost.sparse_cost(q_len, ctx_len, heads, head_size, density, 64) == pytest.approx(sparse)
    assert cost.sparse_pays(q_len, ctx_len, heads, head_size, density, 64) == (sparse < cost.margin * causal)


def test_long_sparse_rows_pay_short_or_dense_ones_do_not():
    cost = RowCost()
    # the last 16K chunk of a 128K prompt at the computed density of small budgets: sparse wins
    assert cost.sparse_pays(16384, 114688, 12, 128, 0.2, 64)
    # the same chunk at a density near 1 (scattered diagonals covering every key block): dense wins
    assert not cost.sparse_pays(16384, 114688, 12, 128, 0.9, 64)
    # a 4K chunk with no context: the fixed cost alone is more than its dense attention
    assert not cost.sparse_pays(4096, 0, 12, 128, 0.0, 64)
    # more density never makes sparse pay where less did not
    pays = [cost.sparse_pays(16384, 16384, 12, 128, d / 20, 64) for d in range(21)]
    assert pays == sorted(pays, reverse=True) and pays[0] and not pays[-1]


def test_history_learns_the_expansion_and_predicts_with_it():
    h = LayerDensityHistory()
    assert h.expansion is None and h.predicted_density(0.1) == pytest.approx(0.1)  # unknown: the budgets
    assert h.read_on_host()  # nothing known: read the flags
    # two rows: computed 0.3 and 0.6 of their pairs where the budgets allowed 0.1 and 0.2
    h.observed([0.3, 0.6], [0.1, 0.2], [1000, 3000], 0.5)
    assert h.expansion == pytest.approx((0.3 * 1000 + 0.6 * 3000) / (0.1 * 1000 + 0.2 * 3000))
    assert h.predicted_density(0.05) == pytest.approx(0.05 * h.expansion)
    assert h.predicted_density(0.5) == 1.0  # at most every pair
    assert h.read_on_host()  # 0.6 > 0.5: a row was flagged
    h.observed([0.2], [0.1], [1000], 0.5)
    assert h.expansion == pytest.approx(2.0) and not h.read_on_host()


def test_history_takes_watched_densities_in_on_a_later_call():
    h = LayerDensityHistory()
    h.watch(torch.tensor([0.4, 0.2]), [0.1, 0.1], [10, 30], 0.3)  # CPU: no event to wait for
    assert h.expansion is None  # not taken in until asked
    assert h.predicted_density(0.1) == pytest.approx(0.1 * (0.4 * 10 + 0.2 * 30) / (0.1 * 40))
    assert h.read_on_host()  # 0.4 > 0.3


def test_an_expansion_below_one_never_predicts_fewer_pairs_than_the_budgets():
    h = LayerDensityHistory()
    h.observed([0.05], [0.1], [100], 0.5)  # the estimate kept less than the budgets allowed
    assert h.predicted_density(0.2) == pytest.approx(0.2)


def test_one_row_in_probe_every_is_estimated_anyway():
    h = LayerDensityHistory()
    due = [h.probe_due() for _ in range(3 * LayerDensityHistory.PROBE_EVERY)]
    assert sum(due) == 3 and due[LayerDensityHistory.PROBE_EVERY - 1]
