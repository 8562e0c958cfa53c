"""``gating.exact_last_rows``: the last queries of each sparse chunk attend every key. CUDA: the
builder gives each sparse row FlashAttention metadata for its last N tokens over its whole
sequence, and the impl runs it after the sparse path (not for rows handed back dense); the
PyTorch path computes them exactly (against float64 attention)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm_sparse_backend import _compat  # noqa: E402
from vllm_sparse_backend.backends.common import SparseStepMetadata  # noqa: E402
from vllm_sparse_backend.head_configs import HeadPattern, resolve_head  # noqa: E402
from vllm_sparse_backend.prefill.plan import LayerOutcome, SparseRow  # noqa: E402
from vllm_sparse_backend.prefill.run import run_sparse_rows  # noqa: E402
from vllm_sparse_backend.runtime import WorkerRuntime  # noqa: E402
from vllm_sparse_backend.settings import SparseSettings  # noqa: E402
from vllm_sparse_backend.observability.record import run_recorded  # noqa: E402
from vllm_sparse_backend.observability.stats import SparseStats  # noqa: E402

cuda_backend = pytest.importorskip("vllm_sparse_backend.backends.cuda")


def test_the_last_tokens_of_a_row_are_one_request_over_its_whole_sequence():
    # a decode row (1 token, 40 keys), then a chunk of 300 tokens after 700 of context
    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 301], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 1, 301], dtype=torch.int32),
        seq_lens=torch.tensor([40, 1000], dtype=torch.int32), num_reqs=2, num_actual_tokens=301,
        max_query_len=300, max_seq_len=1000, block_table_tensor=torch.arange(2 * 70, dtype=torch.int32).view(2, 70),
        slot_mapping=torch.arange(301) + 5000, causal=True)
    tail = _compat.last_tokens(_compat.slice_rows(cm, 1, 2, [40, 1000]), 8)
    assert tail.query_start_loc_cpu.tolist() == [0, 8] and tail.query_start_loc.tolist() == [0, 8]
    assert tail.seq_lens.tolist() == [1000] and tail.max_seq_len == 1000 and tail.max_query_len == 8
    assert tail.num_reqs == 1 and tail.num_actual_tokens == 8
    assert torch.equal(tail.block_table_tensor, cm.block_table_tensor[1:2])
    assert tail.slot_mapping.tolist() == list(range(5000 + 293, 5000 + 301))


def test_the_impl_runs_each_sparse_rows_last_queries_on_flash_attention_after_the_sparse_path(monkeypatch):
    settings = SparseSettings(exact_last_rows=8)
    impl = object.__new__(cuda_backend.SparsePrefillImpl)
    impl.runtime, impl._flash_only, impl._decode = WorkerRuntime(settings), None, None
    impl._host_placement = lambda: None
    rows = [SparseRow(1, 1, 300, 700), SparseRow(2, 301, 200, 0)]
    calls = []

    def sparse(layer, query, kv_cache, step, output, timing):
        calls.append("sparse")
        return LayerOutcome(2, True, dense=[(rows[1], "estimated density")])  # row 2 handed back dense

    monkeypatch.setattr(impl, "_sparse", sparse, raising=False)
    monkeypatch.setattr(impl, "_dense", lambda layer, q, k, v, cache, md, tokens, out, *a: calls.append((md, tokens)),
                        raising=False)
    monkeypatch.setattr(cuda_backend, "guard_stats", lambda *a: None)
    monkeypatch.setattr(cuda_backend, "count_dense_tokens", lambda *a: None)
    step = SparseStepMetadata(501, 300, [], rows, fallback={1: "ROW1", 2: "ROW2"},
                              exact_tails={1: (8, "TAIL1"), 2: (8, "TAIL2")})
    x = torch.zeros(501, 2, 8)
    impl.forward(SimpleNamespace(layer_name="l0"), x, x, x, None, step, x)
    assert calls == ["sparse", ("TAIL1", slice(293, 301)), ("ROW2", slice(301, 501))]


def test_the_pytorch_path_computes_the_last_queries_over_every_key():
    gen = torch.Generator().manual_seed(0)
    h, hkv, d, q_len, ctx_len = 4, 2, 16, 300, 3700
    kv = q_len + ctx_len
    q = torch.randn(q_len, h, d, generator=gen, dtype=torch.float64)
    k, v = torch.randn(kv, hkv, d, generator=gen, dtype=torch.float64), torch.randn(kv, hkv, d, generator=gen,
                                                                                   dtype=torch.float64)
    row = [SparseRow(0, 0, q_len, ctx_len)]

    def run(settings):
        heads = [resolve_head(HeadPattern(pattern="vertical_slash", vertical_size=30, slash_size=64), settings)] * h
        out = torch.full_like(q, float("nan"))
        run_recorded(SparseStats(), run_sparse_rows, q, out, row, lambda r: (k, v), heads, settings, d ** -0.5,
                     0.0, None)
        return out

    sparse = run(SparseSettings(min_sparse_query_len=1))
    exact = run(SparseSettings(min_sparse_query_len=1, exact_last_rows=16))
    # float64 attention of the last 16 queries over every key
    kk, vv = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q[-16:], kk) * d ** -0.5
    s = s.masked_fill(torch.arange(kv)[None, None, :] > torch.arange(kv - 16, kv)[None, :, None], float("-inf"))
    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    torch.testing.assert_close(exact[-16:], want)
    assert not torch.allclose(sparse[-16:], want, atol=1e-3)  # the budgets leave keys out
    torch.testing.assert_close(exact[:-16], sparse[:-16], rtol=0, atol=0)
