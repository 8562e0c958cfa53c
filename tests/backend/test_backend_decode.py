"""The decode modes' one interface (backends/decode.py), driven on CPU: what the CUDA builder
attaches to a step and what the impl's forward hands the layer's decode state.

A recording mode checks the routing (which steps are planned, which calls reach the state, with
which rows); the top-k mode through the impl's forward, under Triton's
interpreter, must give exactly what its state's own calls give."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_sparse_backend.backends.common import DenseRun, SparseStepMetadata  # noqa: E402
from vllm_sparse_backend.settings import SparseSettings  # noqa: E402
from vllm_sparse_backend.decode import decode_mode  # noqa: E402
from vllm_sparse_backend.runtime import WorkerRuntime  # noqa: E402

cuda_backend = pytest.importorskip("vllm_sparse_backend.backends.cuda")
decode = pytest.importorskip("vllm_sparse_backend.backends.decode")
FlashAttentionMetadata = pytest.importorskip("vllm.v1.attention.backends.flash_attn").FlashAttentionMetadata

H, HKV, D, PAGE = 4, 2, 64, 16


def _fa_metadata(query_lens, seq_lens, table, slot_mapping):
    """FlashAttention's metadata as its builder fills the fields the decode modes read."""
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return FlashAttentionMetadata(num_actual_tokens=sum(query_lens), max_query_len=max(query_lens),
                                  query_start_loc=qsl, max_seq_len=max(seq_lens),
                                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
                                  slot_mapping=slot_mapping)


def _common(query_lens, seq_lens):
    """The CommonAttentionMetadata fields the step plan reads (host copies)."""
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(num_reqs=len(query_lens), max_query_len=max(query_lens), query_start_loc_cpu=qsl,
                           seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32))


class _Recorder:
    """A decode state that records what reached it."""

    nbytes = 0

    def __init__(self, key_cache):
        self.key_cache_ptr = key_cache.data_ptr()
        self.calls = []

    def update(self, key_cache, slot_mapping):
        self.calls.append(("update", slot_mapping))

    def prefill(self, query, key, key_cache, plan, block_table, scale):
        self.calls.append(("prefill", plan, query.shape[0], block_table, scale))

    def decode(self, query, key_cache, value_cache, block_table, seq_lens, scale, out):
        self.calls.append(("decode", query.shape[0], block_table, seq_lens, scale))
        out.fill_(7.0)
        return out


class _RecordingMode:
    name = "recording"
    plans_steps = True

    def __init__(self, page_limit=None):
        self.page_limit = page_limit
        self.planned = []

    def plan_step(self, query_start_loc, seq_lens, page_size, device):
        self.planned.append((query_start_loc, seq_lens, page_size))
        return "PLAN"

    def unsupported_page_size(self, page_size):
        return None if self.page_limit is None or page_size <= self.page_limit else f"page size {page_size}"

    def state_layout(self, num_pages, num_kv_heads, head_size, kv_dtype):
        return [((num_pages,), torch.uint8)]

    def allocate(self, key_cache, empty=None):
        return _Recorder(key_cache)


def _caches(num_pages=8):
    kv = torch.zeros(num_pages, PAGE, HKV, 2 * D)
    return kv[..., :D], kv[..., D:]


def _no_log(*args, **kwargs):
    pass


def _prefill_step(md, plan):
    """A step with prefill rows and the mode's plan, as the CUDA builder returns it: FlashAttention
    computes the whole step (one dense run), the plan rides beside it."""
    return SparseStepMetadata(md.num_actual_tokens, md.max_query_len, [DenseRun(0, md.num_actual_tokens, md)], [],
                              md.block_table, md.slot_mapping, decode_plan=plan)


def test_the_mode_plans_steps_with_prefill_rows_only():
    mode = _RecordingMode()
    assert decode.step_decode_plan(mode, _common([5, 1], [20, 9]), PAGE, "cpu") == "PLAN"
    assert mode.planned == [([0, 5, 6], [20, 9], PAGE)]
    assert decode.step_decode_plan(mode, _common([1, 1], [20, 9]), PAGE, "cpu") is None  # decodes only
    assert decode.step_decode_plan(None, _common([5, 1], [20, 9]), PAGE, "cpu") is None
    assert len(mode.planned) == 1  # decode steps and no mode plan nothing


def test_layer_decode_routes_each_step():
    key_cache, value_cache = _caches()
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    layer = decode.LayerDecode(_RecordingMode(), None, _no_log)
    q, k = torch.randn(6, H, D), torch.randn(6, HKV, D)
    out = torch.zeros(6, H, D)
    prefill = _prefill_step(_fa_metadata([5, 1], [20, 9], table, torch.arange(6)), "PLAN")
    assert layer.forward(q, k, key_cache, value_cache, prefill, 0.125, out) is False  # the impl computes it
    state = layer.state
    assert [c[0] for c in state.calls] == ["update", "prefill"]
    assert state.calls[1][1:] == ("PLAN", 6, table, 0.125)
    assert not out.any()
    state.calls.clear()
    pure = _fa_metadata([1, 1], [21, 10], table, torch.tensor([3, 4]))
    assert layer.forward(q, k, key_cache, value_cache, pure, 0.125, out) is True
    assert [c[0] for c in state.calls] == ["update", "decode"]
    _, n, bt, seq_lens, scale = state.calls[1]
    assert n == 2 and torch.equal(bt, table[:2]) and seq_lens.tolist() == [21, 10] and scale == 0.125
    assert (out[:2] == 7).all() and not out[2:].any()
    state.calls.clear()
    sparse_step = SparseStepMetadata(5, 5, [], [], table, slot_mapping=torch.arange(1))  # never decoded here
    assert layer.forward(q, k, key_cache, value_cache, sparse_step, 0.125, out) is False
    assert [c[0] for c in state.calls] == ["update"]
    assert layer.state is state and layer.active


def test_layer_decode_stays_dense_where_it_cannot_run():
    key_cache, value_cache = _caches()
    pure = _fa_metadata([1], [5], torch.zeros(1, 4, dtype=torch.int32), torch.tensor([4]))
    q, out = torch.randn(1, H, D), torch.zeros(1, H, D)
    for layer in (decode.LayerDecode(_RecordingMode(), "an fp8 KV cache", _no_log),
                  decode.LayerDecode(_RecordingMode(page_limit=8), None, _no_log)):  # pages of 16 are too large for it
        assert layer.forward(q, None, key_cache, value_cache, pure, 1.0, out) is False
        assert not layer.active and layer.state is None and not out.any()


def test_decode_mode_is_selected_once_from_the_settings():
    assert decode_mode(SparseSettings()) is None
    assert decode_mode(SparseSettings(decode_mode="topk")).name == "topk"
    spans = decode_mode(SparseSettings(decode_mode="spans"))
    assert spans.name == "spans" and spans.plans_steps


@pytest.mark.kernels
@pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                    reason="needs triton's interpreter (CPU); run by make test with the kernel site")
def test_topk_mode_through_the_impl_forward(monkeypatch):
    """decode_mode=topk through SparsePrefillImpl.forward: a mixed step goes to FlashAttention
    (stubbed) after the summaries followed its slots; a pure decode step is computed by the mode,
    equal to the summaries' own calls on the same cache."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from vllm_sparse_backend.decode.topk import PageSummaries, TopkDecodeBudget, topk_decode

    settings = SparseSettings(decode_mode="topk", decode_sink_pages=1, decode_recent_pages=1, decode_budget_pages=1)
    gen = torch.Generator().manual_seed(5)
    lens = [70, 45]
    num_pages = 12
    kv = torch.zeros(num_pages, PAGE, HKV, 2 * D)
    table = torch.tensor([[3, 7, 1, 9, 0], [5, 2, 11, 4, 6]], dtype=torch.int32)
    slots = [table[i, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE for i, n in enumerate(lens)]
    for i, n in enumerate(lens):
        kv[slots[i] // PAGE, slots[i] % PAGE] = torch.randn(n, HKV, 2 * D, generator=gen)
    kv_cache = kv.permute(0, 2, 1, 3)  # the logical view vLLM hands the impl
    key_cache, value_cache = kv.split(D, -1)

    impl = object.__new__(cuda_backend.SparsePrefillImpl)  # no FlashAttention set-up on CPU
    impl.num_heads, impl.head_size, impl.scale, impl.logits_soft_cap = H, D, D ** -0.5, 0.0
    impl.num_kv_heads, impl.kv_cache_dtype, impl.runtime = HKV, "auto", WorkerRuntime(settings)
    impl._use_decode(decode.LayerDecode(decode_mode(settings), impl._decode_unsupported_reason(), _no_log))
    dense_calls = []
    monkeypatch.setattr(cuda_backend.FlashAttentionImpl, "forward",
                        lambda self, layer, query, *a, **k: dense_calls.append(query.shape[0]))

    # a prefill step of both prompts (the cache already holds them, as after vLLM's update)
    prefill = _fa_metadata(lens, lens, table, torch.cat(slots))
    q = torch.randn(sum(lens), H, D, generator=gen)
    impl.forward(None, q, None, None, kv_cache, prefill, torch.zeros(sum(lens), H, D))
    assert dense_calls == [sum(lens)]
    ref = PageSummaries(key_cache, settings)
    ref.update(key_cache, torch.cat(slots))
    assert torch.equal(impl._decode.state.min, ref.min) and torch.equal(impl._decode.state.max, ref.max)

    # a pure decode step (one token per sequence, padding slots after them)
    q = torch.randn(3, H, D, generator=gen)
    out = torch.full((3, H, D), float("nan"))
    pure = _fa_metadata([1, 1], lens, table, torch.tensor([slots[0][-1], slots[1][-1]]))
    assert impl.forward(None, q, None, None, kv_cache, pure, out) is out
    assert dense_calls == [sum(lens)]  # not FlashAttention
    ref.update(key_cache, pure.slot_mapping)
    want = torch.full((2, H, D), float("nan"))
    topk_decode(q[:2], key_cache, value_cache, ref, table, pure.seq_lens, TopkDecodeBudget.from_settings(settings),
                D ** -0.5, want)
    assert torch.equal(out[:2], want) and torch.isnan(out[2:]).all()
