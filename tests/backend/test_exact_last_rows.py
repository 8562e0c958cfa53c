"""``gating.exact_last_rows`` / ``exact_prompt_end``: the last queries of each sparse chunk (of a
chunk that ends its prompt: a step under vLLM's token budget) attend every key. CUDA: the builder
gives each sparse row FlashAttention metadata for its last ``SparseRow.exact_rows`` tokens over its
whole sequence, and the impl runs it after the sparse path (not for rows handed back dense); the
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
from vllm_sparse_backend.prefill.route import plan_step  # noqa: E402
from vllm_sparse_backend.prefill.run import run_sparse_rows  # noqa: E402
from vllm_sparse_backend.runtime import WorkerRuntime  # noqa: E402
from vllm_sparse_backend.settings import SparseSettings  # noqa: E402
from vllm_sparse_backend.observability.record import run_recorded  # noqa: E402
from vllm_sparse_backend.observability.stats import SparseStats  # noqa: E402

cuda_backend = pytest.importorskip("vllm_sparse_backend.backends.cuda")


def _decode_and_chunk():
    """A decode row (1 token, 40 keys), then a chunk of 300 tokens after 700 of context."""
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 301], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 1, 301], dtype=torch.int32),
        seq_lens=torch.tensor([40, 1000], dtype=torch.int32), num_reqs=2, num_actual_tokens=301,
        max_query_len=300, max_seq_len=1000, block_table_tensor=torch.arange(2 * 70, dtype=torch.int32).view(2, 70),
        slot_mapping=torch.arange(301) + 5000, causal=True)


def test_the_last_tokens_of_a_row_are_one_request_over_its_whole_sequence():
    cm = _decode_and_chunk()
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


def _triton_builder(settings, budget):
    """The CUDA builder of a group that runs the Triton path, as __init__ leaves it with vLLM's
    token budget ``budget``."""
    b = object.__new__(cuda_backend.SparsePrefillMetadataBuilder)
    b.runtime, b.sparse_enabled, b._decode_mode = WorkerRuntime(settings), True, None
    b._head_sets, b._row_heads, b._uses_kernel_table = None, None, True
    b._plan_from, b._stats_file, b._step_token_budget = settings.gating.min_sparse_query_len, None, budget
    return b


@pytest.mark.parametrize("budget, exact_last_rows, want", [
    (302, 8, 64),  # under the budget: the chunk ends its prompt, exact_prompt_end's tail
    (301, 8, 8),  # the step fills the budget: the chunk may be cut, exact_last_rows' tail
    (301, 0, None),  # neither: no tail
    (None, 0, None),  # the budget unknown: never taken as a prompt's end
])
def test_the_builder_gives_a_prompt_ending_row_its_exact_prompt_end_tail(monkeypatch, budget, exact_last_rows, want):
    monkeypatch.setattr(cuda_backend.FlashAttentionMetadataBuilder, "build",
                        lambda self, common_prefix_len, cm, fast_build=False: cm)  # what FlashAttention was given
    monkeypatch.setattr(cuda_backend.kernels, "sparse_attention", None, raising=False)  # no row table: logged
    settings = SparseSettings(min_sparse_query_len=256, exact_last_rows=exact_last_rows, exact_prompt_end=64)
    md = _triton_builder(settings, budget).build(0, _decode_and_chunk())
    assert [(r.row, r.q_len, r.exact_rows) for r in md.sparse_rows] == [(1, 300, want or 0)]
    if want is None:
        assert md.exact_tails == {}
        return
    assert list(md.exact_tails) == [1] and md.exact_tails[1][0] == want
    tail = md.exact_tails[1][1]  # the chunk's last `want` queries over its 1000 keys
    assert tail.query_start_loc_cpu.tolist() == [0, want] and tail.seq_lens.tolist() == [1000]
    assert tail.slot_mapping.tolist() == list(range(5000 + 301 - want, 5000 + 301))


def test_a_prompt_ending_chunk_within_exact_prompt_end_is_flash_attention_s_whole(monkeypatch):
    monkeypatch.setattr(cuda_backend.FlashAttentionMetadataBuilder, "build",
                        lambda self, common_prefix_len, cm, fast_build=False: cm)
    settings = SparseSettings(min_sparse_query_len=256, exact_prompt_end=300)
    builder = _triton_builder(settings, 302)
    cm = _decode_and_chunk()
    assert builder.build(0, cm) is cm  # no sparse row: FlashAttention's own metadata for the step
    assert builder.runtime.stats.dense_reasons == {"chunk ending its prompt, within exact_prompt_end": 1}


@pytest.mark.parametrize("budget, want", [(301, 64), (300, 0)])
def test_the_cpu_builder_plans_with_vllm_s_token_budget(monkeypatch, budget, want):
    cpu_backend = pytest.importorskip("vllm_sparse_backend.backends.cpu")
    monkeypatch.setattr(cpu_backend.CPUAttentionMetadataBuilder, "build",
                        lambda self, common_prefix_len, cm, fast_build=False: cm)
    settings = SparseSettings(min_sparse_query_len=256, exact_prompt_end=64)
    b = object.__new__(cpu_backend.SparsePrefillCPUMetadataBuilder)
    b.runtime, b.sparse_enabled, b._step_token_budget = WorkerRuntime(settings), True, budget
    qsl = torch.tensor([0, 300], dtype=torch.int32)  # the CPU twin: a prompt of 300 without context
    md = b.build(0, CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([300], dtype=torch.int32), num_reqs=1,
        num_actual_tokens=300, max_query_len=300, max_seq_len=300,
        block_table_tensor=torch.arange(20, dtype=torch.int32).view(1, 20), slot_mapping=torch.arange(300), causal=True))
    assert [(r.q_len, r.exact_rows) for r in md.sparse_rows] == [(300, want)]


def test_the_pytorch_path_computes_the_last_queries_over_every_key():
    gen = torch.Generator().manual_seed(0)
    h, hkv, d, q_len, ctx_len = 4, 2, 16, 300, 3700
    kv = q_len + ctx_len
    q = torch.randn(q_len, h, d, generator=gen, dtype=torch.float64)
    k, v = torch.randn(kv, hkv, d, generator=gen, dtype=torch.float64), torch.randn(kv, hkv, d, generator=gen,
                                                                                   dtype=torch.float64)

    def run(settings, budget=None):
        heads = [resolve_head(HeadPattern(pattern="vertical_slash", vertical_size=30, slash_size=64), settings)] * h
        rows = plan_step([0, q_len], [kv], settings, step_token_budget=budget).sparse_rows  # the router's tails
        out = torch.full_like(q, float("nan"))
        run_recorded(SparseStats(), run_sparse_rows, q, out, rows, lambda r: (k, v), heads, settings, d ** -0.5,
                     0.0, None)
        return out

    def exact_attention(n):  # float64 attention of the last n queries over every key
        kk, vv = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q[-n:], kk) * d ** -0.5
        s = s.masked_fill(torch.arange(kv)[None, None, :] > torch.arange(kv - n, kv)[None, :, None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)

    sparse = run(SparseSettings(min_sparse_query_len=1))
    # exact_last_rows: every chunk; exact_prompt_end: a chunk of a step under vLLM's budget
    for settings, budget, n in [(SparseSettings(min_sparse_query_len=1, exact_last_rows=16), None, 16),
                                (SparseSettings(min_sparse_query_len=1, exact_prompt_end=48), q_len + 1, 48)]:
        exact = run(settings, budget)
        torch.testing.assert_close(exact[-n:], exact_attention(n))
        assert not torch.allclose(sparse[-n:], exact[-n:], atol=1e-3)  # the budgets leave keys out
        torch.testing.assert_close(exact[:-n], sparse[:-n], rtol=0, atol=0)
    # the step fills the budget: the chunk may have been cut, so no tail
    torch.testing.assert_close(run(SparseSettings(min_sparse_query_len=1, exact_prompt_end=48), q_len), sparse,
                               rtol=0, atol=0)
