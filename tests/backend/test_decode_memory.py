"""The decode modes' state claimed before vLLM sizes the KV cache (decode/memory.py,
backends/decode.py): the size arithmetic against sizes worked out by hand from the state's
definition, the claim against vLLM's own sizing of the cache (simulated: the cache gets what vLLM
may use less what it measured, the claim included), and the buffer the layers' state comes from."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_sparse_backend._compat import KVCacheRequest  # noqa: E402
from vllm_sparse_backend.settings import SparseSettings  # noqa: E402
from vllm_sparse_backend.decode import decode_mode  # noqa: E402
from vllm_sparse_backend.decode.memory import (ALIGNMENT, DecodeStateMemory, StateBuffer,  # noqa: E402
                                               StateCost)

decode = pytest.importorskip("vllm_sparse_backend.backends.decode")

GIB = 2 ** 30
# Qwen2.5-Coder-1.5B-Instruct: 28 layers, 2 KV heads of 128, bf16 cache, vLLM's 16-token pages
LAYERS, HKV, D, PAGE = 28, 2, 128, 16
KV_PER_PAGE = 2 * PAGE * HKV * D * 2  # K and V, bf16


def _mode(name):
    return decode_mode(SparseSettings(decode_mode=name))


def _cost(name, layers=LAYERS, hkv=HKV, d=D, page=PAGE, dtype=torch.bfloat16, without_state=0):
    mode = _mode(name)
    layouts = [lambda n: mode.state_layout(n, hkv, d, dtype)] * layers
    kv = [2 * page * hkv * d * dtype.itemsize] * (layers + without_state)
    return StateCost.of_layers(layouts, kv)


def _state_bytes_by_hand(name, pages, layers=LAYERS, hkv=HKV, d=D, kv_bytes=2):
    """top-k: a key min and a key max per page and KV head, in the cache's dtype; spans: an fp32
    key vector and a flag byte per page and KV head, plus one spare row."""
    if name == "topk":
        return layers * pages * 2 * hkv * d * kv_bytes
    return layers * (pages + 1) * hkv * (4 * d + 1)


@pytest.mark.parametrize("name", ["topk", "spans"])
def test_state_layout_is_the_state_worked_out_by_hand(name):
    mode = _mode(name)
    for pages in (0, 1, 7, 4096):
        layout = mode.state_layout(pages, HKV, D, torch.bfloat16)
        got = sum(torch.empty(shape, dtype=dtype, device="meta").nbytes for shape, dtype in layout)
        assert got == _state_bytes_by_hand(name, pages, layers=1)


def test_top_k_state_is_one_page_in_page_size_of_the_cache():
    cost = _cost("topk")
    assert cost.per_page * PAGE == LAYERS * KV_PER_PAGE
    assert cost.fraction == pytest.approx(1 / PAGE)
    spans = _cost("spans")
    assert spans.fraction == pytest.approx((4 * D + 1) / (4 * PAGE * D))  # fp32 keys beside a bf16 cache
    # layers of the cache without a state (dense decode) count in the cache, not in the state
    assert _cost("topk", without_state=LAYERS).fraction == pytest.approx(1 / (2 * PAGE))


@pytest.mark.parametrize("name", ["topk", "spans"])
@pytest.mark.parametrize("available", [100_000, 5 * 2 ** 20, 123_900_000_000, 131 * GIB + 12345])
def test_the_claim_holds_the_state_of_the_cache_vllm_then_sizes(name, available):
    """vLLM gives the cache ``available`` less the claim, in whole pages of every layer; the state
    of that cache, laid out tensor by tensor as the layers take it, must fit in the claim, with
    little to spare."""
    cost = _cost(name)
    claim = cost.reservation(available)
    pages = (available - claim) // (LAYERS * KV_PER_PAGE)
    buffer = StateBuffer(torch.empty(claim, dtype=torch.uint8, device="meta"))
    mode = _mode(name)
    for _ in range(LAYERS):
        for shape, dtype in mode.state_layout(pages, HKV, D, torch.bfloat16):
            assert buffer.take(shape, dtype) is not None
    state = _state_bytes_by_hand(name, pages)
    assert buffer.used >= state
    f = cost.per_page / (LAYERS * KV_PER_PAGE)
    # R = f (A - R) + (rows beyond the pages, alignment): within a page and the fixed part of it
    assert claim == pytest.approx(available * f / (1 + f), abs=cost.fixed + cost.per_page + 1)
    assert claim - state <= cost.fixed + cost.per_page + 1


def test_the_issue_41_numbers():
    """H200, Qwen2.5-Coder-1.5B, topk: vLLM had 123.9 GiB for the cache and the state took 1/16
    of it beside (7.7 GiB). With the claim the cache gets 16/17 of it and the state 1/17."""
    cost = _cost("topk")
    available = int(123.9 * GIB)
    claim = cost.reservation(available)
    assert claim / GIB == pytest.approx(123.9 / 17, abs=0.01)
    assert cost.state_for_cache(available - claim) <= claim


def _request(**kw):
    base = dict(gpu_memory_utilization=0.9, kv_cache_memory_bytes=None, page_size=PAGE, max_model_len=131072)
    return KVCacheRequest(**{**base, **kw})


def test_the_claim_follows_vllm_sizing():
    cost = _cost("topk")
    total, measured = 80 * GIB, 5 * GIB
    claim = decode.plan_decode_claim(cost, _request(), total, measured, "topk")
    available = _request().requested_memory(total) - measured
    assert _request().requested_memory(total) == -(-total * 9 // 10)
    assert claim.error is None and claim.nbytes == cost.reservation(available)
    assert claim.kv_cache_bytes == available - claim.nbytes
    # a measurement short of vLLM's (the rest of the profiling run) only makes the claim larger
    # than the state of the cache vLLM then sizes
    later = measured + 2 * GIB
    assert cost.state_for_cache(_request().requested_memory(total) - later - claim.nbytes) <= claim.nbytes
    # --kv-cache-memory-bytes: vLLM's cache is that size, whatever the GPU
    fixed = decode.plan_decode_claim(cost, _request(kv_cache_memory_bytes=40 * GIB), total, measured, "topk")
    assert fixed.nbytes == cost.state_for_cache(40 * GIB) and fixed.kv_cache_bytes == 40 * GIB
    # no layer with a state: nothing
    assert decode.plan_decode_claim(_cost("topk", layers=0, without_state=4), _request(), total, measured,
                                    "topk").nbytes == 0


def test_a_cache_the_claim_makes_too_small_for_one_sequence_is_a_start_up_error():
    cost = _cost("topk")
    one_sequence = 131072 // PAGE * LAYERS * KV_PER_PAGE  # 3.5 GiB
    total = 10 * GIB
    requested = _request().requested_memory(total)
    # fits without the state, not with it
    measured = requested - one_sequence - one_sequence // 40
    claim = decode.plan_decode_claim(cost, _request(), total, measured, "topk")
    assert claim.error is not None
    for words in ("VLLM_SPARSE_DECODE_MODE=topk", "--gpu-memory-utilization", "--max-model-len 131072",
                  "VLLM_SPARSE_DECODE_MODE=dense"):
        assert words in claim.error
    assert "\n" not in claim.error  # one line: the last line the plugin's command prints
    # room for both: no error; no room even without the state: vLLM's own error, not ours
    assert decode.plan_decode_claim(cost, _request(), total, requested - 2 * one_sequence, "topk").error is None
    assert decode.plan_decode_claim(cost, _request(), total, requested - one_sequence // 2, "topk").error is None
    # vLLM fits max_model_len to the memory (--max-model-len -1): never ours to stop
    assert decode.plan_decode_claim(cost, _request(max_model_len=None), total, measured, "topk").error is None


def test_the_buffer_hands_out_aligned_disjoint_views():
    buffer = StateBuffer(torch.zeros(4 * ALIGNMENT, dtype=torch.uint8))
    a = buffer.take((3, 5), torch.float32)
    b = buffer.take((7,), torch.uint8)
    c = buffer.take((2, 2, 2), torch.bfloat16)
    assert buffer.take((ALIGNMENT + 1,), torch.uint8) is None  # 3 of 4 used: no room
    base = buffer.buffer.data_ptr()
    assert [t.data_ptr() - base for t in (a, b, c)] == [0, ALIGNMENT, 2 * ALIGNMENT]
    assert (a.shape, a.dtype, b.shape, c.dtype) == ((3, 5), torch.float32, (7,), torch.bfloat16)
    a.fill_(-1.0)
    c.fill_(2.0)
    assert not b.any() and (a == -1).all() and (c == 2).all()
    assert buffer.left == ALIGNMENT


def test_layers_take_their_state_from_the_claim_then_beside_it():
    """A top-k layer's summaries come out of the claimed buffer; what does not fit is allocated
    beside it and counted."""
    key_cache = torch.zeros(10, PAGE, HKV, 2 * D, dtype=torch.bfloat16)[..., :D]
    memory = DecodeStateMemory()
    mode = _mode("topk")
    one_layer = sum(torch.empty(s, dtype=t, device="meta").nbytes for s, t in mode.state_layout(10, HKV, D,
                                                                                                   torch.bfloat16))
    memory.buffer = StateBuffer(torch.empty(one_layer + 2 * ALIGNMENT, dtype=torch.uint8))
    memory.layers_expected = 2
    first = mode.allocate(key_cache, memory.empty(key_cache.device))
    base = memory.buffer.buffer.data_ptr()
    assert base <= first.min.data_ptr() < base + memory.buffer.nbytes
    assert not first.min.any() and not first.max.any()  # zeroed, whatever the buffer held
    assert memory.beyond_bytes == 0
    assert not memory.record(first.nbytes, 2 * key_cache.nbytes)
    second = mode.allocate(key_cache, memory.empty(key_cache.device))
    assert memory.beyond_bytes == second.nbytes
    assert memory.record(second.nbytes, 2 * key_cache.nbytes)  # the last layer the claim counted


def test_the_model_cost_counts_every_layers_cache_and_the_states_that_will_run(monkeypatch):
    """decode_state_cost reads every attention layer vLLM built: all their caches count, and only
    the layers of this backend whose mode will run add a state (an fp8 layer decodes dense)."""
    from types import SimpleNamespace

    cuda_backend = pytest.importorskip("vllm_sparse_backend.backends.cuda")
    settings = SparseSettings(decode_mode="topk")

    def impl(kv_cache_dtype):
        layer_impl = object.__new__(cuda_backend.SparsePrefillImpl)  # no FlashAttention set-up on CPU
        layer_impl.num_heads, layer_impl.num_kv_heads, layer_impl.head_size = 8, HKV, D
        layer_impl.logits_soft_cap, layer_impl.kv_cache_dtype = 0.0, kv_cache_dtype
        layer_impl._use_decode(decode.LayerDecode(decode_mode(settings), layer_impl._decode_unsupported_reason(),
                                                  lambda *a, **k: None))
        return SimpleNamespace(impl=layer_impl, kv_cache_dtype=kv_cache_dtype, num_kv_heads=HKV, head_size=D)

    layers = {"l0": impl("auto"), "l1": impl("auto"), "l2": impl("fp8"),
              "other": SimpleNamespace(impl=object(), kv_cache_dtype="auto", num_kv_heads=4, head_size=64)}
    monkeypatch.setattr(cuda_backend, "attention_layers", lambda vllm_config, names: layers)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))
    cost = cuda_backend.decode_state_cost(vllm_config, PAGE)
    assert cost.layers == 2
    assert cost.kv_per_page == 2 * PAGE * (2 * HKV * D * 2 + HKV * D * 1 + 4 * 64 * 2)
    assert cost.per_page == 2 * (2 * HKV * D * 2)
