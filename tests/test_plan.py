from vllm_sparse_backend.config import SparseSettings
from vllm_sparse_backend.plan import SparseRow, plan_step


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
