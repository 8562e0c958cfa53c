"""Tensor parallelism, simulated on the CPU: each rank of a TP group computes its slice of the
heads, and the ranks' outputs side by side must be the single-GPU output.

A rank is simulated the way vLLM lays out a column-parallel QKV projection (written out here,
independently of the backend, from vllm/model_executor/layers/linear.py: QKVParallelLinear):
rank r holds query heads r*H/tp .. (r+1)*H/tp - 1 and KV heads r*Hkv/tp .. (r+1)*Hkv/tp - 1, or,
when Hkv < tp, the one KV head r // (tp / Hkv). Its head patterns come from the backend's own
start-up glue (``backends.common.resolve_heads``, with vLLM's TP rank and world size
simulated), its rows from the planner, and its output from the CPU backend's sparse path
(``run_sparse_rows``: estimation + the PyTorch sparse attention), on its slice of Q/K/V.

The head-config files give every head of a layer a different pattern or budget, so a rank that
takes the wrong slice selects different keys and the comparison fails.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed import parallel_state  # noqa: E402

from vllm_sparse_backend.backends import common  # noqa: E402
from vllm_sparse_backend.config import ConfigError  # noqa: E402
from vllm_sparse_backend.settings import SparseSettings, load_settings  # noqa: E402
from vllm_sparse_backend.head_configs import load_head_config, resolve_head_config  # noqa: E402
from vllm_sparse_kernels.reference.index import index_to_dense_mask  # noqa: E402
from vllm_sparse_backend.prefill.estimate import estimate_index  # noqa: E402
from vllm_sparse_backend.prefill.budgets import kv_group_share  # noqa: E402
from vllm_sparse_backend.prefill.plan import rank_heads  # noqa: E402
from vllm_sparse_backend.prefill.route import plan_step  # noqa: E402
from vllm_sparse_kernels.index_format import causal_pairs  # noqa: E402
from vllm_sparse_backend.prefill.run import run_sparse_rows  # noqa: E402
from vllm_sparse_backend.runtime import WorkerRuntime  # noqa: E402
from vllm_sparse_backend.observability.record import run_recorded  # noqa: E402
from vllm_sparse_backend.observability.stats import SparseStats  # noqa: E402

from vllm_sparse_kernels.reference.dense import causal_mask, masked_attention_f64  # noqa: E402

H, HKV, D = 8, 2, 32
LAYER = 1  # the file's second layer: its first layer is different, so the layer index matters too
LAYER_NAME = f"model.layers.{LAYER}.self_attn.attn"
SCALE = D ** -0.5
QSL, SEQ_LENS = [0, 768, 1408], [768, 640]  # one step, two pure prefills (what the CPU twin runs sparse)


def vllm_layout(tp: int, rank: int, hkv: int = HKV) -> tuple[slice, slice]:
    """Query and KV heads of ``rank`` (vLLM's QKVParallelLinear; see the module doc)."""
    q = slice(rank * H // tp, (rank + 1) * H // tp)
    if hkv >= tp:
        return q, slice(rank * hkv // tp, (rank + 1) * hkv // tp)
    kv = rank // (tp // hkv)
    return q, slice(kv, kv + 1)


# One layer's heads (global numbers), every head different; KV groups 0-3 and 4-7.
PER_HEAD = [
    {"pattern": "vertical_slash", "vertical_size": 16, "slash_size": 2},
    {"pattern": "a_shape", "sink_tokens": 32, "local_window": 96},
    {"pattern": "block_sparse", "topk_blocks": 2},
    {"pattern": "flex_prefill", "gamma": 0.8},
    {"pattern": "vertical_slash", "vertical_size": 48, "slash_size": 1},
    {"pattern": "dense"},
    {"pattern": "a_shape", "sink_tokens": 0, "local_window": 160},
    {"pattern": "block_sparse", "topk_blocks": 3},
]
# KV group 0 uniform, group 1 mixed: at TP=1 the layer keeps one selection per head; at TP=2
# rank 0 holds group 0 alone, and deciding the sharing on its own heads would share it.
HALF_UNIFORM = [{"pattern": "vertical_slash", "vertical_size": 24, "slash_size": 3}] * 4 + [
    {"pattern": "a_shape", "sink_tokens": 16, "local_window": 96}] * 2 + [{"pattern": "block_sparse", "topk_blocks": 2}] * 2
# What the search writes per KV group (settings.selection per_kv_group): uniform groups, the two
# groups different.
PER_GROUP = [{"pattern": "vertical_slash", "vertical_size": 24, "slash_size": 3}] * 4 + [
    {"pattern": "block_sparse", "topk_blocks": 2}] * 4
ALL_DENSE = [{"pattern": "dense"}] * 8


def _write_file(path, heads: list[dict], per_kv_group: bool = False) -> str:
    first_layer = [{"pattern": "a_shape", "sink_tokens": 8, "local_window": 64}] * H  # never the one used
    data = {"format": "vllm-sparse-head-config", "version": 1, "model": "toy", "num_layers": 2, "num_heads": H,
            "num_kv_heads": HKV, "produced_by": "test_tensor_parallel.py",
            "settings": {"selection": "per_kv_group"} if per_kv_group else {},
            "layers": [{"heads": first_layer}, {"heads": heads}]}
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture
def backend(monkeypatch):
    """Settings from the environment as a worker reads them, and a simulated TP rank."""
    state = {"rank": 0, "initialized": False}
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: state["rank"])

    def configure(head_config: str | None, **env):
        env = {"MIN_SPARSE_QUERY_LEN": "128", "LAST_Q": "32", "MIN_BUDGET": "64", "KEEP_FIRST_COLUMNS": "4",
               "KEEP_LAST_DIAGONALS": "4", **env}
        if head_config:
            env["HEAD_CONFIG"] = head_config
        for k, v in env.items():
            monkeypatch.setenv(f"VLLM_SPARSE_{k}", v)
        return load_settings()  # what the worker's runtime reads (runtime.worker_runtime)

    @contextmanager
    def as_rank(rank: int):
        state.update(rank=rank, initialized=True)
        try:
            yield
        finally:
            state.update(rank=0, initialized=False)

    return SimpleNamespace(configure=configure, as_rank=as_rank)


def _vllm_config(tp: int, hkv: int = HKV):
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           model_config=SimpleNamespace(get_total_num_kv_heads=lambda: hkv))


def _qkv(seed: int = 0, hkv: int = HKV):
    gen = torch.Generator().manual_seed(seed)
    n = QSL[-1]
    return (torch.randn(n, H, D, generator=gen) * 2, torch.randn(n, hkv, D, generator=gen) * 2,
            torch.randn(n, hkv, D, generator=gen))


def _rows(settings):
    plan = plan_step(QSL, SEQ_LENS, settings, allow_context=False)
    assert [r.q_len for r in plan.sparse_rows] == [768, 640] and not plan.dense_runs
    return plan.sparse_rows


def _run(q, k, v, heads, settings, stats=None):
    """What the CPU twin's forward does with one layer's sparse rows (backends/cpu.py)."""
    out = torch.full_like(q, float("nan"))
    run_recorded(stats or SparseStats(), run_sparse_rows, q, out, _rows(settings),
                 lambda r: (k[r.tok_start:r.tok_start + r.q_len], v[r.tok_start:r.tok_start + r.q_len]),
                 heads.heads, settings, SCALE, 0.0, heads.share)
    return out


def _resolve(vllm_config, settings, local_heads, local_kv_heads):
    """A layer's heads on this rank through the start-up glue, with the file the settings name."""
    cfg = resolve_head_config(settings.head_config) if settings.head_config else None
    return common.resolve_heads(vllm_config, settings, LAYER_NAME, local_heads, local_kv_heads, cfg)


def _masks(q, k, heads, settings) -> list[torch.Tensor]:
    """Per row, the selected (query, key) pairs of every head [h, q_len, kv_len]."""
    out = []
    for r in _rows(settings):
        s = slice(r.tok_start, r.tok_start + r.q_len)
        est = estimate_index(q[s], k[s], 0, heads.heads, settings, SCALE, heads.share)
        out.append(index_to_dense_mask(est.index, r.q_len, 0))
    return out


def _rank_heads(backend, settings, tp, r, hkv):
    """(query-head slice, KV-head slice, resolved heads) of rank r, through the start-up glue."""
    qs, kvs = vllm_layout(tp, r, hkv)
    with backend.as_rank(r):
        heads = _resolve(_vllm_config(tp, hkv), settings, qs.stop - qs.start, kvs.stop - kvs.start)
    return qs, kvs, heads


def _single_and_ranks(backend, settings, tp, q, k, v, hkv=HKV):
    """(single-GPU heads and output, per rank (heads, output, masks)) through the start-up glue."""
    single = _resolve(_vllm_config(1, hkv), settings, H, hkv)
    ranks = []
    for r in range(tp):
        qs, kvs, heads = _rank_heads(backend, settings, tp, r, hkv)
        qr, kr, vr = q[:, qs].contiguous(), k[:, kvs].contiguous(), v[:, kvs].contiguous()
        ranks.append((heads, _run(qr, kr, vr, heads, settings), _masks(qr, kr, heads, settings)))
    return single, _run(q, k, v, single, settings), ranks


def _assert_ranks_equal_single(settings, q, k, single, single_out, ranks):
    """The ranks side by side select what the single GPU selects and compute its output."""
    for row, mask in enumerate(_masks(q, k, single, settings)):
        assert torch.equal(torch.cat([m[row] for _, _, m in ranks], dim=0), mask), f"row {row}: selections differ"
    joined = torch.cat([out for _, out, _ in ranks], dim=1)
    assert not torch.isnan(joined).any()
    torch.testing.assert_close(joined, single_out, rtol=1e-5, atol=1e-5)  # fp32 sums in another order


@pytest.mark.parametrize("tp", [2, 4, 8])  # 4 and 8: fewer KV heads than ranks (replicated KV heads)
def test_per_head_file_ranks_equal_single_gpu(tmp_path, backend, tp):
    settings = backend.configure(_write_file(tmp_path / "heads.json", PER_HEAD))
    q, k, v = _qkv()
    single, single_out, ranks = _single_and_ranks(backend, settings, tp, q, k, v)
    # each rank got its own heads of the file (global numbers), in vLLM's order
    got = [h for heads, _, _ in ranks for h in heads.heads]
    assert got == single.heads and len({h.pattern for h in single.heads}) == 5
    assert [h.param("vertical_size") for h in single.heads[0:5:4]] == [16, 48]
    _assert_ranks_equal_single(settings, q, k, single, single_out, ranks)
    # the single-GPU output is the sparse attention of its selection (float64, explicit mask),
    # and that selection skips keys: a wrong slice would select differently
    for row, mask in zip(_rows(settings), _masks(q, k, single, settings)):
        s = slice(row.tok_start, row.tok_start + row.q_len)
        ref = masked_attention_f64(q[s], k[s], v[s], mask, SCALE)
        torch.testing.assert_close(single_out[s].double(), ref, rtol=1e-5, atol=1e-5)
        assert int(mask.sum()) < 0.7 * causal_pairs(row.q_len, 0, H)


def test_sharing_is_decided_for_the_whole_layer(tmp_path, backend):
    """A layer with one mixed KV group keeps one selection per head on every rank, as at TP=1,
    also on the rank whose own group is uniform."""
    settings = backend.configure(_write_file(tmp_path / "half.json", HALF_UNIFORM))
    assert settings.kv_group_shared
    q, k, v = _qkv(1)
    single, single_out, ranks = _single_and_ranks(backend, settings, 2, q, k, v)
    assert single.share == 1
    rank0 = ranks[0][0]
    assert kv_group_share(rank0.heads, 1, settings) == 4  # its own heads alone would share...
    assert [heads.share for heads, _, _ in ranks] == [1, 1]  # ...but the layer does not
    _assert_ranks_equal_single(settings, q, k, single, single_out, ranks)


def test_kv_group_shared_selection_per_rank(tmp_path, backend):
    """A per-KV-group file served with kv_group_shared: at TP=2 each rank holds whole KV groups
    and shares exactly as the single GPU; at TP=4 (2 KV heads) a KV group is split over two ranks,
    and each rank shares one selection among the heads it holds: the single-GPU run of the same
    layer with its KV heads replicated as vLLM does (4 KV heads, groups of 2)."""
    settings = backend.configure(_write_file(tmp_path / "groups.json", PER_GROUP, per_kv_group=True))
    q, k, v = _qkv(2)
    single, single_out, ranks = _single_and_ranks(backend, settings, 2, q, k, v)
    assert single.share == 4 and [heads.share for heads, _, _ in ranks] == [4, 4]
    _assert_ranks_equal_single(settings, q, k, single, single_out, ranks)

    _, _, ranks4 = _single_and_ranks(backend, settings, 4, q, k, v)
    assert [heads.share for heads, _, _ in ranks4] == [2] * 4
    k_rep, v_rep = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    replicated = rank_heads(load_head_config(settings.head_config), settings, LAYER, H, 4)
    assert replicated.share == 2
    _assert_ranks_equal_single(settings, q, k_rep, replicated, _run(q, k_rep, v_rep, replicated, settings), ranks4)


@pytest.mark.parametrize("tp,hkv", [(1, 2), (2, 2), (4, 2), (4, 1), (8, 8)])
def test_density_one_ranks_equal_dense_attention(tmp_path, backend, tp, hkv):
    """Every head dense: the ranks side by side compute dense causal attention (float64
    reference), also with fewer KV heads than ranks (hkv 1 and 2 at tp 4)."""
    settings = backend.configure(_write_file(tmp_path / "dense.json", ALL_DENSE) if hkv == HKV else None,
                                 DEFAULT_PATTERN="dense")
    q, k, v = _qkv(3, hkv)
    outs = []
    for r in range(tp):
        qs, kvs, heads = _rank_heads(backend, settings, tp, r, hkv)
        outs.append(_run(q[:, qs].contiguous(), k[:, kvs].contiguous(), v[:, kvs].contiguous(), heads, settings))
    joined = torch.cat(outs, dim=1).double()
    for row in _rows(settings):
        s = slice(row.tok_start, row.tok_start + row.q_len)
        ref = masked_attention_f64(q[s], k[s], v[s], causal_mask(H, row.q_len, 0), SCALE)
        torch.testing.assert_close(joined[s], ref, rtol=1e-5, atol=1e-5)


def test_head_config_is_checked_against_the_global_model(tmp_path, backend):
    """The file names the model's heads: it fits a TP=2 worker whose layers hold 4 of the 8
    heads; a file written with one rank's 4 heads is refused, naming the file."""
    path = _write_file(tmp_path / "groups.json", PER_GROUP, per_kv_group=True)
    settings = backend.configure(path)
    hf = {"num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": HKV}
    vc = _vllm_config(2)
    with backend.as_rank(1):
        WorkerRuntime(settings).check_head_config_fits(hf, "toy")  # global counts: fits
        assert _resolve(vc, settings, 4, 1).heads[0].param("topk_blocks") == 2  # rank 1: group 1
    local = json.loads((tmp_path / "groups.json").read_text())
    local.update(num_heads=4, num_kv_heads=1)
    local["layers"] = [{"heads": layer["heads"][:4]} for layer in local["layers"]]
    (tmp_path / "local.json").write_text(json.dumps(local))
    settings = backend.configure(str(tmp_path / "local.json"))
    with backend.as_rank(1), pytest.raises(ConfigError) as e:
        WorkerRuntime(settings).check_head_config_fits(hf, "toy")
    assert "local.json" in str(e.value) and "field 'num_heads': 4" in str(e.value)
    with backend.as_rank(1), pytest.raises(ConfigError, match=r"local\.json: num_heads is 4 but layer .* has 8 query heads"):
        _resolve(vc, settings, 4, 1)


def test_layout_vllm_refuses_is_refused():
    with pytest.raises(ConfigError, match="tensor parallel size 3"):
        rank_heads(None, SparseSettings(), 0, 8, 2, tp_size=3)
    with pytest.raises(ConfigError, match="tensor parallel size 4"):
        rank_heads(None, SparseSettings(), 0, 12, 6, tp_size=4)  # 6 KV heads on 4 ranks
    with pytest.raises(ConfigError, match="rank 2 is not in 0..1"):
        rank_heads(None, SparseSettings(), 0, 8, 2, tp_size=2, tp_rank=2)


def test_stats_count_each_row_once_under_tp(tmp_path, backend, monkeypatch):
    """Only TP rank 0 records: with both ranks' samples summed (vLLM's multiprocess metrics), rows
    and query tokens are counted once, as at TP=1; pairs and head patterns are rank 0's heads;
    rank 1 writes no stats file and creates no metrics."""
    import prometheus_client
    from prometheus_client import CollectorRegistry

    from vllm_sparse_backend.observability.metrics import PrometheusMetrics

    settings = backend.configure(_write_file(tmp_path / "heads.json", PER_HEAD))
    q, k, v = _qkv()
    tp = 2
    single = _resolve(_vllm_config(1), settings, H, HKV)
    one = SparseStats()
    _run(q, k, v, single, settings, one)

    registries, stats = [], []
    for r in range(tp):
        st = SparseStats()
        registry = CollectorRegistry()
        if r == 0:
            st._prom = PrometheusMetrics(prometheus_client, registry=registry)
        with backend.as_rank(r):
            st.configure(settings.observability, export=common.tensor_parallel_rank() == 0)  # what WorkerRuntime decides
            qs, kvs = vllm_layout(tp, r)
            heads = _resolve(_vllm_config(tp), settings, 4, 1)
        _run(q[:, qs], k[:, kvs], v[:, kvs], heads, settings, st)
        st.dump(str(tmp_path / f"stats-rank{r}.json"))
        registries.append(registry)
        stats.append(st)

    rank0, rank1 = (s.as_dict() for s in stats)
    ref = one.as_dict()
    assert rank0["sparse_rows"] == ref["sparse_rows"] == 2  # two rows, one layer
    assert rank0["sparse_query_tokens"] == ref["sparse_query_tokens"] == 1408
    assert rank1["sparse_rows"] == rank1["sparse_query_tokens"] == rank1["causal_pairs"] == 0
    assert not stats[1].exporting and stats[1]._prom is None and stats[1].timer.every == 0
    assert not (tmp_path / "stats-rank1.json").exists() and (tmp_path / "stats-rank0.json").exists()
    merged = sum(registries[r].get_sample_value("sparse_prefill_rows_total") or 0.0 for r in range(tp))
    assert merged == 2
    # pairs and patterns: rank 0's 4 heads (vertical-slash, A-shape, block-sparse, FlexPrefill)
    assert rank0["causal_pairs"] == sum(causal_pairs(n, 0, 4) for n in (768, 640)) == ref["causal_pairs"] // 2
    assert 0 < rank0["computed_pairs"] < ref["computed_pairs"]
    patterns = rank0["head_patterns"]
    assert {p: patterns[p] for p in ("vertical_slash", "a_shape", "block_sparse")} == \
        {"vertical_slash": 2, "a_shape": 2, "block_sparse": 2}
    assert patterns.get("flex_prefill/query_aware", 0) + patterns.get("flex_prefill/vertical_slash", 0) == 2
    assert "dense" not in patterns  # head 5 (dense) is rank 1's
