import pytest

from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_backend.prefill.plan import SparseRow
from vllm_sparse_backend.prefill.route import DenseReason, cut_row, plan_step


def _qsl(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def test_rows_are_routed_by_length_and_dense_rows_form_maximal_runs():
    s = SparseSettings(min_sparse_query_len=100)
    q = [1, 1, 150, 20, 1, 300, 0]  # decodes, a long prefill, a short prefill, a long prefill, padding
    ctx = [50, 70, 0, 0, 9, 1000, 0]
    seq = [a + b for a, b in zip(q, ctx)]
    plan = plan_step(_qsl(q), seq, s)
    assert plan.sparse_rows == [SparseRow(2, 2, 150, 0), SparseRow(5, 173, 300, 1000)]
    assert plan.dense_runs == [(0, 2), (3, 5)]


def test_context_rows_stay_dense_when_the_cache_is_unreadable():
    s = SparseSettings(min_sparse_query_len=100)
    plan = plan_step(_qsl([150, 300]), [150, 1300], s, allow_context=False)
    assert [r.row for r in plan.sparse_rows] == [0]
    assert plan.dense_runs == [(1, 2)] and plan.dense_reasons["cached_context_on_cpu"] == 1


def test_kill_switch_and_sequence_gate():
    plan = plan_step(_qsl([5000]), [5000], SparseSettings(enabled=False))
    assert not plan.has_sparse and plan.dense_runs == [(0, 1)]
    plan = plan_step(_qsl([5000, 5000]), [5000, 9000], SparseSettings(min_sparse_seq_len=8000))
    assert [r.row for r in plan.sparse_rows] == [1] and plan.dense_runs == [(0, 1)]
    # a prompt's chunks past max_sparse_seq_len run dense, counted under their reason
    plan = plan_step(_qsl([5000, 5000, 5000]), [9000, 12000, 12001], SparseSettings(max_sparse_seq_len=12000))
    assert [r.row for r in plan.sparse_rows] == [0, 1] and plan.dense_runs == [(2, 3)]
    assert plan.dense_reasons == {"sequence longer than max_sparse_seq_len": 1}


def test_rows_no_layer_could_run_sparse_enough_stay_in_dense_runs():
    from collections import Counter

    from vllm_sparse_backend.head_configs import resolve_head

    # 100 + 100 keys per query: 0.8 of a 500-token prompt's causal pairs (above max_density 0.4),
    # 0.14 of an 800-token chunk after 1000 tokens of context
    s = SparseSettings(min_sparse_query_len=100, vertical_size=100, slash_size=100)
    head_sets = [Counter([resolve_head(None, s)] * 4)]
    plan = plan_step(_qsl([500, 800, 10]), [500, 1800, 1810], s, head_sets=head_sets)
    assert [r.row for r in plan.sparse_rows] == [1]
    assert plan.dense_runs == [(0, 1), (2, 3)]
    assert plan.dense_reasons == {"budgets denser than max_density": 1}
    # with max_density 1 (no fallback) the same row runs sparse
    assert plan_step(_qsl([500, 800, 10]), [500, 1800, 1810], s.replace(max_density=1.0),
                     head_sets=head_sets).has_sparse


def test_budget_density_by_hand():
    from collections import Counter

    from vllm_sparse_backend.prefill.patterns import PATTERNS
    from vllm_sparse_backend.head_configs import HeadPattern, resolve_head
    from vllm_sparse_backend.prefill.budgets import budget_density

    s = SparseSettings(block_size=64, min_budget=256)
    vs = resolve_head(HeadPattern(pattern="vertical_slash", vertical_size=100, slash_size=300), s)
    heads = [vs, vs, resolve_head(HeadPattern(pattern="dense"), s),
             resolve_head(HeadPattern(pattern="block_sparse", topk_blocks=4), s),
             resolve_head(HeadPattern(pattern="a_shape", sink_tokens=64, local_window=1000), s),
             resolve_head(HeadPattern(pattern="flex_prefill"), s)]
    assert {h.pattern for h in heads} == set(PATTERNS)
    visible = 2000 + 1001 / 2  # a query of a 1000-token chunk after 2000 cached tokens sees 2500.5 keys on average
    want = (2 * 400 / visible + 1 + 256 / visible + 1064 / visible + 256 / visible) / 6
    assert budget_density(heads, 1000, 2000, s) == pytest.approx(want)
    assert budget_density(Counter(heads), 1000, 2000, s) == pytest.approx(want)
    assert budget_density(heads, 100, 0, s) == pytest.approx(1.0)  # every budget covers a short row
    # the defaults (1000 + 6096 keys per query) cannot make a 32K prompt sparser than 0.4, 64K they can
    default = [resolve_head(None, SparseSettings())]
    assert budget_density(default, 32768, 0, SparseSettings()) > 0.4 > budget_density(default, 65536, 0,
                                                                                      SparseSettings())


def test_kv_group_share_needs_the_setting_and_uniform_groups():
    from vllm_sparse_backend.head_configs import HeadPattern, resolve_head
    from vllm_sparse_backend.prefill.budgets import kv_group_share

    on, off = SparseSettings(), SparseSettings(kv_group_shared=False)
    vs = resolve_head(None, on)
    small = resolve_head(HeadPattern(pattern="vertical_slash", vertical_size=10, slash_size=20), on)
    block = resolve_head(HeadPattern(pattern="block_sparse"), on)
    flex = resolve_head(HeadPattern(pattern="flex_prefill"), on)
    assert kv_group_share([vs] * 8, 2, on) == 4
    assert kv_group_share([vs] * 8, 2, off) == 1  # switched off
    assert kv_group_share([vs] * 4 + [block] * 4, 2, on) == 4  # one pattern per group is enough
    assert kv_group_share([vs] * 3 + [small] + [vs] * 4, 2, on) == 1  # budgets differ inside a group
    assert kv_group_share([vs] * 4 + [flex] * 4, 2, on) == 1  # FlexPrefill decides per head
    assert kv_group_share([vs] * 4, 4, on) == 1  # no GQA: nothing to share
    assert kv_group_share([vs] * 7, 1, on) == 7


def test_budgets_growing_with_the_row():
    """vertical_share / slash_share raise a row's budgets to a share of its keys, never lower
    them, never past the keys; budget_density sees the same budgets."""
    from vllm_sparse_backend.head_configs import resolve_head
    from vllm_sparse_backend.prefill.budgets import budget_density
    from vllm_sparse_backend.prefill.patterns.vertical_slash import vs_budget, vs_budgets

    assert vs_budget(1000, None, 500_000) == 1000
    assert vs_budget(1000, 0.02, 10_000) == 1000  # the fixed budget is larger
    assert vs_budget(1000, 0.02, 131_072) == 2622  # ceil(0.02 * 131072)
    assert vs_budget(1000, 0.5, 800) == 800  # never more keys than the row has
    s = SparseSettings(vertical_share=0.02, slash_share=0.1)
    assert vs_budgets(1000, 6096, 131_072, s) == (2622, 13108)
    head = [resolve_head(None, s)]
    visible = 114_688 + 16_385 / 2  # the last 16K chunk of a 128K prompt
    assert budget_density(head, 16_384, 114_688, s) == pytest.approx((2622 + 13108) / visible)
    fixed = SparseSettings(vertical_size=1000, slash_size=1000)
    assert budget_density([resolve_head(None, fixed)], 16_384, 114_688, fixed) == pytest.approx(2000 / visible)


def test_torch_estimator_with_shares_equals_explicit_budgets():
    """The CPU estimators with shares select exactly what explicit budgets of the same size do."""
    import torch

    from vllm_sparse_backend.head_configs import resolve_head
    from vllm_sparse_backend.prefill.estimate import estimate_index
    from vllm_sparse_backend.prefill.patterns.vertical_slash import vs_budgets

    g = torch.Generator().manual_seed(0)
    q_len, ctx, h, hkv, d = 300, 500, 4, 2, 32
    q = torch.randn(q_len, h, d, generator=g)
    k = torch.randn(ctx + q_len, hkv, d, generator=g)
    base = SparseSettings(last_q=32, keep_first_columns=2, keep_last_diagonals=2, vertical_size=5, slash_size=8)
    grown = base.model_copy(update={"vertical_share": 0.05, "slash_share": 0.1})
    v, sl = vs_budgets(5, 8, ctx + q_len, grown)
    assert (v, sl) == (40, 80)
    explicit = base.model_copy(update={"vertical_size": v, "slash_size": sl})
    a = estimate_index(q, k, ctx, [resolve_head(None, grown)] * h, grown, d ** -0.5).index
    b = estimate_index(q, k, ctx, [resolve_head(None, explicit)] * h, explicit, d ** -0.5).index
    for x, y in ((a.block_count, b.block_count), (a.block_index, b.block_index),
                 (a.column_count, b.column_count), (a.column_index, b.column_index)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("head,settings_kw,covers", [
    ({"pattern": "dense"}, {}, True),
    ({"pattern": "vertical_slash", "vertical_size": 500, "slash_size": 10}, {}, True),  # every column
    ({"pattern": "vertical_slash", "vertical_size": 10, "slash_size": 500}, {}, True),  # every diagonal
    ({"pattern": "vertical_slash", "vertical_size": 10, "slash_size": 10}, {"slash_share": 1.0}, True),
    ({"pattern": "vertical_slash", "vertical_size": 499, "slash_size": 499}, {}, False),
    ({"pattern": "a_shape", "sink_tokens": 100, "local_window": 400}, {}, True),
    ({"pattern": "a_shape", "sink_tokens": 100, "local_window": 399}, {}, False),
    ({"pattern": "block_sparse", "topk_blocks": 8}, {}, True),  # 500 keys = 8 blocks of 64
    ({"pattern": "block_sparse", "topk_blocks": 7}, {}, False),
    ({"pattern": "flex_prefill"}, {"min_budget": 500}, True),
    ({"pattern": "flex_prefill"}, {"min_budget": 499}, False),
])
def test_budgets_cover_every_key_only_where_every_key_is_selected(head, settings_kw, covers):
    """A 300-token chunk after 200 cached tokens (500 keys): where the budgets say every key,
    the estimator on random Q/K selects every causal pair; one key less and they do not say so."""
    import torch

    from vllm_sparse_backend.head_configs import HeadPattern, resolve_head
    from vllm_sparse_backend.prefill.index import count_pairs
    from vllm_sparse_backend.prefill.estimate import estimate_index
    from vllm_sparse_backend.prefill.budgets import budgets_cover_every_key
    from vllm_sparse_kernels.index_format import causal_pairs

    s = SparseSettings(last_q=32, **settings_kw)
    heads = [resolve_head(HeadPattern(**head), s)] * 2
    assert budgets_cover_every_key(heads, 300, 200, s) is covers
    if covers:
        gen = torch.Generator().manual_seed(3)
        q, k = torch.randn(300, 2, 64, generator=gen), torch.randn(500, 1, 64, generator=gen)
        est = estimate_index(q, k, 200, heads, s, 0.125)
        assert count_pairs(est.index, 300, 200) == causal_pairs(300, 200, 2)
    # one head short of its keys is enough to say no
    short = resolve_head(HeadPattern(pattern="a_shape", sink_tokens=10, local_window=10), s)
    assert not budgets_cover_every_key(heads + [short], 300, 200, s)


def test_rows_whose_selection_is_every_key_are_counted_dense():
    """The sparse path computes both rows; the one whose index selected every causal key (the
    default budgets on a short prompt) counts as a dense row, the other as a sparse row."""
    import prometheus_client
    import torch
    from prometheus_client import CollectorRegistry

    from vllm_sparse_backend.prefill import run as sparse_run
    from vllm_sparse_backend.head_configs import resolve_head
    from vllm_sparse_backend.observability.metrics import PrometheusMetrics
    from vllm_sparse_backend.observability.record import run_recorded
    from vllm_sparse_backend.observability.stats import SparseStats

    registry = CollectorRegistry()
    stats = SparseStats()
    stats._prom = PrometheusMetrics(prometheus_client, registry=registry)
    gen = torch.Generator().manual_seed(0)
    q_lens = [600, 2000]
    query = torch.randn(sum(q_lens), 2, 64, generator=gen)
    keys = [torch.randn(n, 1, 64, generator=gen) for n in q_lens]
    rows = [SparseRow(0, 0, 600, 0), SparseRow(1, 600, 2000, 0)]
    output = torch.empty_like(query)
    # row 0: 1000 + 1000 budgets cover its 600 keys; row 1: 30 columns + 30 diagonals do not
    settings = SparseSettings(vertical_size=30, slash_size=30)
    heads = [resolve_head(None, SparseSettings())] * 2
    run_recorded(stats, sparse_run.run_sparse_rows, query[:600], output[:600], rows[:1], lambda r: (keys[0], keys[0]),
                 heads, settings, 0.125, 0.0, None)
    run_recorded(stats, sparse_run.run_sparse_rows, query, output, rows[1:], lambda r: (keys[1], keys[1]),
                 [resolve_head(None, settings)] * 2, settings, 0.125, 0.0, None)
    d = stats.as_dict()
    assert d["dense_reasons"] == {DenseReason.EVERY_KEY: 1}
    assert (d["sparse_rows"], d["sparse_query_tokens"], d["dense_query_tokens"]) == (1, 2000, 600)
    assert 0 < d["computed_pairs"] < d["causal_pairs"] == 2 * 2000 * 2001 // 2
    assert registry.get_sample_value("sparse_prefill_query_tokens_total", {"route": "dense"}) == 600
    assert registry.get_sample_value("sparse_prefill_query_tokens_total", {"route": "sparse"}) == 2000
    assert registry.get_sample_value("sparse_prefill_dense_fallbacks_total",
                                     {"reason": "sparse_selection_covers_every_key"}) == 1
    assert registry.get_sample_value("sparse_prefill_density_count") == 1


def test_rows_sparse_cannot_pay_on_stay_in_dense_runs():
    """With the model's heads given, a row on which even an empty selection costs more than
    FlashAttention (the cost model's fixed per-row cost of 1e9 pairs and the estimation, against
    its causal pairs) stays in the dense runs; a long enough row is planned sparse as before."""

    s = SparseSettings()  # the defaults: cost model on, max_density 0.4, min_sparse_query_len 4096
    heads = (12, 128)  # Qwen2.5-1.5B's query heads, head size 128
    # causal pairs x 12 heads: 4K -> 1.0e8, 16K -> 1.6e9, 8K after 24K of context -> 2.8e9;
    # sparse at density 0 costs 1e9 + 7 x 64 x (ctx + q) x 12: pays (below 0.95 of dense) on the last two
    q = [4096, 16384, 8192, 1]
    ctx = [0, 0, 24576, 9000]
    plan = plan_step(_qsl(q), [a + b for a, b in zip(q, ctx)], s, row_heads=heads)
    assert [r.row for r in plan.sparse_rows] == [1, 2]
    assert plan.dense_runs == [(0, 1), (3, 4)]
    assert plan.dense_reasons == {DenseReason.CANNOT_PAY: 1}
    # without the heads, with the cost model off, or with max_density 1 (no fallback), the 4K row is sparse
    for settings, row_heads in ((s, None), (s.replace(cost_model=False), heads),
                                (s.replace(max_density=1.0), heads)):
        plan = plan_step(_qsl(q), [a + b for a, b in zip(q, ctx)], settings, row_heads=row_heads)
        assert [r.row for r in plan.sparse_rows] == [0, 1, 2]


@pytest.mark.parametrize("q_len,ctx,heads,pays", [
    (13000, 0, 12, False),  # 12 x 13000^2 / 2 = 1.01e9 pairs: below the fixed cost / 0.95 with the estimation
    (15000, 0, 12, True),  # 1.35e9 x 0.95 = 1.28e9 > 1e9 + 7 x 64 x 15000 x 12 = 1.08e9
    (4096, 0, 32, False),  # 2.7e8 pairs
    (2048, 126976, 32, True),  # a chunk after 124K of context: 8.4e9 pairs
])
def test_cannot_pay_boundary_by_hand(q_len, ctx, heads, pays):
    s = SparseSettings()
    plan = plan_step(_qsl([q_len]), [q_len + ctx], s.replace(min_sparse_query_len=1),
                     row_heads=(heads, 128))
    assert plan.has_sparse is pays


def test_cost_model_heads_takes_the_most_heads_of_a_group():
    from vllm_sparse_backend.backends.common import cost_model_heads
    from vllm_sparse_backend.prefill.plan import rank_heads

    s = SparseSettings()
    group = {"a": rank_heads(None, s, 0, 12, 2), "b": rank_heads(None, s, 1, 16, 2)}
    assert cost_model_heads(group, 128) == (16, 128)
    assert cost_model_heads({}, 128) is None


def test_a_step_under_vllm_s_token_budget_ends_its_prompts_and_their_last_queries_run_exact():
    # a decode, a 6000-query chunk after 20000 tokens of context, a 5000-query prompt: 11001 tokens
    q, seq = [1, 6000, 5000], [90, 26000, 5000]
    s = SparseSettings(exact_last_rows=64, exact_prompt_end=2048)
    # under the budget: no chunk was cut, each ends its prompt; the tail is the larger setting
    plan = plan_step(_qsl(q), seq, s, step_token_budget=11002)
    assert plan.sparse_rows == [SparseRow(1, 1, 6000, 20000, 2048), SparseRow(2, 6001, 5000, 0, 2048)]
    # a step that fills the budget: only the newest request can have been cut, the row with the
    # least cached context (here the new prompt); the 6000-query chunk after 20000 ends its prompt
    plan = plan_step(_qsl(q), seq, s, step_token_budget=11001)
    assert [r.exact_rows for r in plan.sparse_rows] == [2048, 64]
    # the same rows the other way round: still the one without context is taken as cut
    plan = plan_step(_qsl([1, 5000, 6000]), [90, 5000, 26000], s, step_token_budget=11001)
    assert [r.exact_rows for r in plan.sparse_rows] == [64, 2048]
    assert [r.exact_rows for r in plan_step(_qsl(q), seq, s).sparse_rows] == [64, 64]  # budget unknown
    # exact_last_rows above exact_prompt_end: it wins
    plan = plan_step(_qsl(q), seq, s.replace(exact_last_rows=1024, exact_prompt_end=512), step_token_budget=11002)
    assert [r.exact_rows for r in plan.sparse_rows] == [1024, 1024]
    # a prompt-ending chunk of at most exact_prompt_end queries runs dense whole, counted
    plan = plan_step(_qsl(q), seq, s.replace(exact_prompt_end=5000), step_token_budget=11002)
    assert plan.sparse_rows == [SparseRow(1, 1, 6000, 20000, 5000)]
    assert plan.dense_runs == [(0, 1), (2, 3)]
    assert plan.dense_reasons == {"chunk ending its prompt, within exact_prompt_end": 1}
    # a full step with one prefill chunk (and decodes): that chunk is taken as cut
    assert [r.exact_rows for r in plan_step(_qsl([1, 6000]), [90, 26000], s, step_token_budget=6001).sparse_rows] \
        == [64]
    # off by default: no tail, whatever the budget
    assert [r.exact_rows for r in plan_step(_qsl(q), seq, SparseSettings(), step_token_budget=11002).sparse_rows] \
        == [0, 0]


def test_in_a_full_step_only_the_newest_prefill_row_is_taken_as_cut():
    # vLLM schedules running requests before waiting ones and stops where the budget runs out:
    # a full step's cut chunk, if any, is its newest request's, the least cached context
    assert cut_row([0, 10, 20], [10, 10], None) is None  # budget unknown
    assert cut_row([0, 10, 20], [10, 10], 21) == -1  # under budget: none cut
    assert cut_row([0, 1, 2], [50, 70], 2) == -1  # decodes only
    assert cut_row([0, 1, 4000, 8192], [90, 12000, 4192], 8192) == 2  # a prompt's end, then a new one
    assert cut_row([0, 4000, 8192], [4192, 12000], 8192) == 0  # the new one first in the batch
    assert cut_row([0, 4000, 8192], [4000, 4192], 8192) == 1  # two new prompts: the later row
