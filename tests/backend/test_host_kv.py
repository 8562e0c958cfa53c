"""kv_placement=host wired into the CUDA backend (issue 54, backends/host_kv.py), driven on CPU:
the hot cache's device is the CPU here.

vLLM's page is the real shrunk one (its spec through the backend's customize_spec, its logical
view as vLLM computes it). The K/V write of ``do_kv_cache_update`` must leave in the host pool
the pages that plain paged writes of the same tokens make, and in vLLM's page each block's key
min / max over the tokens it holds, including a block vLLM handed to another sequence; a pure
decode step through the impl's forward must give the ``topk`` mode's output over a full cache of
the same tokens, bit for bit (Triton's interpreter)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes  # noqa: E402

from vllm_sparse_backend import _compat  # noqa: E402
from vllm_sparse_backend.backends.host_kv import (HostKV, check_host_kv_fits, check_vllm_cache_fits,  # noqa: E402
                                                 pinned_blocks, summary_views)
from vllm_sparse_backend.config import ConfigError  # noqa: E402
from vllm_sparse_backend.settings import SparseSettings  # noqa: E402
from vllm_sparse_backend.decode.topk import TopkDecodeBudget  # noqa: E402
from vllm_sparse_backend.kv_placement.base import KVLayout  # noqa: E402
from vllm_sparse_backend.kv_placement.host import HostPlacement, HotPages  # noqa: E402
from vllm_sparse_backend.runtime import WorkerRuntime  # noqa: E402

cuda_backend = pytest.importorskip("vllm_sparse_backend.backends.cuda")
FlashAttentionMetadata = pytest.importorskip("vllm.v1.attention.backends.flash_attn").FlashAttentionMetadata

H, HKV, D, PAGE, BLOCKS = 4, 2, 32, 16, 12
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
BLOCK_BYTES = len(LAYERS) * 2 * PAGE * HKV * D * 4  # one block of every layer's K and V, float32
SETTINGS = SparseSettings(kv_placement="host", decode_mode="topk", decode_sink_pages=1, decode_recent_pages=1,
                          decode_budget_pages=1, host_kv_hot_pages=6, host_kv_pool_bytes=BLOCKS * BLOCK_BYTES)


def vllm_page(gen: torch.Generator) -> torch.Tensor:
    """A layer's shrunk page as vLLM binds it, holding stale values (a cache is never cleared)."""
    shape = compute_layer_kv_cache_shape_bytes(_compat.summary_page_spec(SPEC), BLOCKS)
    raw = torch.empty(shape, dtype=torch.int8).view(torch.float32)
    return raw.copy_(torch.randn(raw.shape, generator=gen))


def impl_with(settings: SparseSettings):
    impl = object.__new__(cuda_backend.SparsePrefillImpl)  # no FlashAttention set-up on CPU
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = H, HKV, D, D ** -0.5
    impl.runtime = WorkerRuntime(settings)
    impl.runtime.host_kv = HostKV(settings, LAYERS, PAGE)  # what _host_placement makes from vLLM's config
    impl._flash_only = None  # as __init__ sets it with kv_placement=host
    return impl


class Writer:
    """vLLM's steps of some sequences through the impl's ``do_kv_cache_update`` and, beside it,
    plain paged writes of the same tokens (the reference K/V pages per layer)."""

    def __init__(self, impl, gen):
        self.impl, self.gen = impl, gen
        self.pages = {n: vllm_page(gen) for n in LAYERS}
        self.ref = {n: torch.zeros(2, BLOCKS, PAGE, HKV, D) for n in LAYERS}
        self.held: dict[int, int] = {}  # block -> tokens its current owner wrote

    def step(self, seqs: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """``seqs``: (block ids, tokens already written, new tokens) each. Returns the slot mapping."""
        slots = []
        for blocks, start, n in seqs:
            slots += [blocks[p // PAGE] * PAGE + p % PAGE for p in range(start, start + n)]
        slots.append(-1)  # a padding slot, as vLLM pads a batch
        slot_mapping = torch.tensor(slots)
        rows = len(slots) + 3  # key / value carry rows past the slot mapping too
        for name in LAYERS:
            key = torch.randn(rows, HKV, D, generator=self.gen)
            value = torch.randn(rows, HKV, D, generator=self.gen)
            self.impl.do_kv_cache_update(SimpleNamespace(layer_name=name), key, value, self.pages[name], slot_mapping)
            for i, s in enumerate(slots):
                if s < 0:
                    continue
                if s % PAGE == 0:  # a block's first token under its current owner: nothing before it is its
                    self.ref[name][:, s // PAGE] = 0
                self.ref[name][0, s // PAGE, s % PAGE] = key[i]
                self.ref[name][1, s // PAGE, s % PAGE] = value[i]
        for s in slots:
            if s >= 0:
                self.held[s // PAGE] = s % PAGE + 1
        return slot_mapping


def check_pool_and_summaries(writer: Writer):
    placement = writer.impl.runtime.host_kv.placement
    for layer, name in enumerate(LAYERS):
        summaries = summary_views(writer.pages[name])
        for b, n in writer.held.items():
            key, value = placement.pool.page(layer, placement.pool.entry(layer, b))
            assert torch.equal(key, writer.ref[name][0, b]) and torch.equal(value, writer.ref[name][1, b]), (name, b)
            written = writer.ref[name][0, b, :n]
            assert torch.equal(summaries.min[b], written.amin(0)) and torch.equal(summaries.max[b], written.amax(0))


def test_the_kv_write_fills_the_host_pool_and_the_summaries_in_vllms_page():
    gen = torch.Generator().manual_seed(0)
    writer = Writer(impl_with(SETTINGS), gen)
    a, b = [3, 7, 1], [5, 2]
    writer.step([(a, 0, 20), (b, 0, 17)])  # prefill chunks, ending mid-page
    writer.step([(a, 20, 18), (b, 17, 1)])  # a second chunk beside a decode token
    for t in range(3):
        writer.step([(a, 38 + t, 1), (b, 18 + t, 1)])
    check_pool_and_summaries(writer)
    # b finishes; vLLM gives its block 5 to a new sequence, whose first write starts the page over
    del writer.held[2]
    writer.step([([5, 9], 0, 3)])
    assert writer.held[5] == 3
    check_pool_and_summaries(writer)


def reference_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of the last ``len(q)`` positions over ``key`` / ``value`` [s, Hkv, D]."""
    q, key, value = q.double(), key.double(), value.double()
    group = q.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = key.shape[0]
    positions = torch.arange(s - q.shape[0], s)[:, None]
    scores = scores.masked_fill(torch.arange(s)[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_a_step_with_prefill_rows_is_dense_attention_over_the_tokens_written(monkeypatch):
    """A chunk with context beside a decode token: each row over its whole K/V from the pool,
    against float64 attention over the reference pages."""
    monkeypatch.setattr("vllm_sparse_backend.prefill.placed.QUERY_ROWS", 7)  # the chunk in three calls
    gen = torch.Generator().manual_seed(2)
    impl = impl_with(SETTINGS)
    writer = Writer(impl, gen)
    a, b = [3, 7, 1], [5, 2]
    writer.step([(a, 0, 20), (b, 0, 17)])
    writer.step([(a, 20, 18), (b, 17, 1)])  # the step attended below: 18 new tokens of a, 1 of b
    lens = [38, 18]
    table = torch.tensor([a + [0], b + [0, 0]], dtype=torch.int32)
    md = FlashAttentionMetadata(num_actual_tokens=19, max_query_len=18,
                                query_start_loc=torch.tensor([0, 18, 19], dtype=torch.int32), max_seq_len=38,
                                seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                                slot_mapping=torch.zeros(19, dtype=torch.long))
    q = torch.randn(21, H, D, generator=gen)  # rows past num_actual_tokens: padding
    for name in LAYERS:
        out = torch.full((21, H, D), float("nan"))
        impl.forward(SimpleNamespace(layer_name=name), q, None, None, writer.pages[name], md, out)
        for row, (start, end) in enumerate(((0, 18), (18, 19))):
            blocks = table[row].long()[torch.arange(lens[row]) // PAGE]
            offsets = torch.arange(lens[row]) % PAGE
            key, value = writer.ref[name][0, blocks, offsets], writer.ref[name][1, blocks, offsets]
            want = reference_attention(q[start:end], key, value, impl.scale)
            torch.testing.assert_close(out[start:end].double(), want, atol=1e-5, rtol=1e-5)
        assert torch.isnan(out[19:]).all()


def test_host_kv_prefill_pages_reads_the_sink_the_window_and_the_chosen_page():
    """With a page budget a chunk's rows attend the sink page, the pages from the window before
    the chunk on, and one of the pages between (chosen by the summaries in vLLM's page): float64
    attention over exactly those tokens, and not over all of them."""
    gen = torch.Generator().manual_seed(3)
    impl = impl_with(SETTINGS.replace(host_kv_prefill_pages=1))
    writer = Writer(impl, gen)
    blocks = [3, 7, 1, 5, 2, 9, 0, 11]
    writer.step([(blocks, 0, 100)])
    writer.step([(blocks, 100, 28)])  # the chunk attended below: pages 6-7, the window page 5
    table = torch.tensor([blocks], dtype=torch.int32)
    md = FlashAttentionMetadata(num_actual_tokens=28, max_query_len=28,
                                query_start_loc=torch.tensor([0, 28], dtype=torch.int32), max_seq_len=128,
                                seq_lens=torch.tensor([128], dtype=torch.int32), block_table=table,
                                slot_mapping=torch.zeros(28, dtype=torch.long))
    q = torch.randn(28, H, D, generator=gen)
    for name in LAYERS:
        out = torch.full((28, H, D), float("nan"))
        impl.forward(SimpleNamespace(layer_name=name), q, None, None, writer.pages[name], md, out)

        def attention_over(pages):
            positions = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])
            key = writer.ref[name][0, torch.tensor(blocks)[positions // PAGE], positions % PAGE]
            value = writer.ref[name][1, torch.tensor(blocks)[positions // PAGE], positions % PAGE]
            return reference_attention(q, key, value, impl.scale)

        matches = [p for p in (1, 2, 3, 4)
                   if torch.allclose(out.double(), attention_over([0, p, 5, 6, 7]), atol=1e-5, rtol=1e-5)]
        assert len(matches) == 1, name
        assert not torch.allclose(out.double(), attention_over(range(8)), atol=1e-3)


def test_gather_reads_the_blocks_pages_in_order_fp8_dequantised():
    settings = SETTINGS.replace(host_kv_dtype="fp8_e4m3")
    writer = Writer(impl_with(settings), torch.Generator().manual_seed(3))
    writer.step([([3, 7, 1], 0, 40)])
    placement = writer.impl.runtime.host_kv.placement
    key, value = placement.gather(1, [1, 3])
    for i, b in enumerate((1, 3)):
        page_key, page_value = placement.pool.page(1, placement.pool.entry(1, b))
        assert torch.equal(key[i * PAGE:(i + 1) * PAGE], page_key)
        assert torch.equal(value[i * PAGE:(i + 1) * PAGE], page_value)
    # fp8: within e4m3's rounding of the tokens written (3 mantissa bits), not equal to them
    ref = writer.ref[LAYERS[1]][0, 3]
    assert not torch.equal(key[PAGE:], ref)
    torch.testing.assert_close(key[PAGE:], ref, atol=0.0, rtol=2 ** -3)


def test_the_pool_must_hold_every_block_vllm_made():
    small = SETTINGS.replace(host_kv_pool_bytes=(BLOCKS - 2) * BLOCK_BYTES)
    impl = impl_with(small)
    with pytest.raises(ConfigError, match=f"vLLM made {BLOCKS} KV-cache blocks .* --num-gpu-blocks-override "
                                          f"{BLOCKS - 2}"):
        impl.do_kv_cache_update(SimpleNamespace(layer_name=LAYERS[0]), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D),
                                vllm_page(torch.Generator()), torch.tensor([0]))


LAYOUT = KVLayout(num_layers=len(LAYERS), num_blocks=BLOCKS, page_size=PAGE, num_kv_heads=HKV, head_size=D,
                  dtype=torch.float32)


# SETTINGS: 1 sink + 1 recent + 1 page for each of the 2 KV heads
@pytest.mark.parametrize("max_num_seqs, max_model_len, need", [
    (3, 64, 8),  # 4 pages of one sequence + 2 pinned for each of the 2 others
    (3, 32, 6),  # a sequence has 2 pages: 2 + 2 x 2
    (8, 64, 12),  # 4 + 7 x 2 = 18, but vLLM has 12 blocks
])
def test_the_hot_cache_must_hold_the_largest_decode_step(max_num_seqs, max_model_len, need):
    with pytest.raises(ConfigError, match=f"host_kv_hot_pages={need - 1} is below the {need} slots .* "
                                          f"--max-num-seqs {max_num_seqs} .* set host_kv_hot_pages={need},"):
        check_host_kv_fits(SETTINGS.replace(host_kv_hot_pages=need - 1), LAYOUT, max_num_seqs, max_model_len)
    check_host_kv_fits(SETTINGS.replace(host_kv_hot_pages=need), LAYOUT, max_num_seqs, max_model_len)


def test_the_pool_must_hold_vllms_blocks_at_start_up():
    with pytest.raises(ConfigError, match=f"vLLM made {BLOCKS} KV-cache blocks .* holds {BLOCKS - 1} .* "
                                          f"--num-gpu-blocks-override {BLOCKS - 1}"):
        check_host_kv_fits(SETTINGS.replace(host_kv_pool_bytes=BLOCKS * BLOCK_BYTES - 1), LAYOUT, 1, 64)
    check_host_kv_fits(SETTINGS.replace(host_kv_pool_bytes=BLOCKS * BLOCK_BYTES), LAYOUT, 1, 64)


def test_the_builder_checks_with_vllms_numbers_once_its_cache_is_sized():
    from vllm.model_executor.layers.attention import Attention

    def config(num_blocks):
        return SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=num_blocks),
                               scheduler_config=SimpleNamespace(max_num_seqs=3),
                               model_config=SimpleNamespace(max_model_len=64, dtype=torch.float32),
                               compilation_config=SimpleNamespace(
                                   static_forward_context={n: object.__new__(Attention) for n in LAYERS}))
    small = SETTINGS.replace(host_kv_hot_pages=7)  # 8 needed (above)
    with pytest.raises(ConfigError, match="host_kv_hot_pages=7 is below the 8 slots"):
        check_vllm_cache_fits(small, config(BLOCKS), SPEC)
    check_vllm_cache_fits(small.replace(host_kv_hot_pages=8), config(BLOCKS), SPEC)
    check_vllm_cache_fits(small, config(None), SPEC)  # vLLM's minimal profiling cache: the first write checks
    with pytest.raises(ConfigError, match="host_kv_pool_bytes=.* holds 12 .* --num-gpu-blocks-override 12"):
        check_vllm_cache_fits(SETTINGS, config(BLOCKS + 1), SPEC)


def test_the_first_write_checks_the_hot_cache_with_vllms_numbers():
    impl = impl_with(SETTINGS)
    impl.runtime.host_kv = HostKV(SETTINGS, LAYERS, PAGE, max_num_seqs=3, max_model_len=64)  # 8 slots needed
    with pytest.raises(ConfigError, match="host_kv_hot_pages=6 is below the 8 slots"):
        impl.do_kv_cache_update(SimpleNamespace(layer_name=LAYERS[0]), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D),
                                vllm_page(torch.Generator()), torch.tensor([0]))


def profiling_forward(impl, allocations: list) -> None:
    """vLLM's profiling run through the impl's forward (no metadata, no KV cache yet), every layer."""
    impl.vllm_flash_attn_version = 2  # FlashAttention's profiling branch asks for it
    for name in LAYERS:
        out = torch.full((5, H, D), float("nan"))
        impl.forward(SimpleNamespace(layer_name=name), torch.randn(5, H, D), torch.randn(5, HKV, D),
                     torch.randn(5, HKV, D), torch.empty(0), None, out)
    assert len(allocations) == 1


def count_hot_allocations(monkeypatch) -> list:
    allocations = []
    allocate = HotPages.allocate.__func__

    def counted(cls, *args):
        allocations.append(args)
        return allocate(cls, *args)
    monkeypatch.setattr(HotPages, "allocate", classmethod(counted))
    return allocations


def test_the_profiling_run_claims_the_hot_cache_once_and_the_placement_fills_it(monkeypatch):
    allocations = count_hot_allocations(monkeypatch)
    impl = impl_with(SETTINGS)
    profiling_forward(impl, allocations)
    profiling_forward(impl, allocations)  # (a second run, or CUDA-graph profiling, claims nothing more)
    hot = impl.runtime.host_kv.hot
    # 2 layers x 6 slots x (K, V) x 16 tokens x 2 KV heads x 32 dims x 4 bytes
    assert hot.nbytes == 2 * 6 * 2 * PAGE * HKV * D * 4 == 98304
    writer = Writer(impl, torch.Generator().manual_seed(3))
    a, b = [3, 7, 1], [5, 2]
    writer.step([(a, 0, 20), (b, 0, 17)])
    for t in range(3):
        writer.step([(a, 20 + t, 1), (b, 17 + t, 1)])
    placement = impl.runtime.host_kv.placement
    assert placement.hot is hot
    assert placement.hot_nbytes == 98304
    assert len(allocations) == 1


def test_a_page_that_vllm_did_not_shrink_is_refused():
    full_page = torch.zeros(compute_layer_kv_cache_shape_bytes(SPEC, BLOCKS), dtype=torch.int8).view(torch.float32)
    with pytest.raises(ValueError, match="not a page summary .* customize_spec"):
        impl_with(SETTINGS).do_kv_cache_update(SimpleNamespace(layer_name=LAYERS[0]), torch.zeros(1, HKV, D),
                                               torch.zeros(1, HKV, D), full_page, torch.tensor([0]))


def test_customize_spec_shrinks_vllms_page_to_the_summaries_with_kv_placement_host(monkeypatch):
    backend = cuda_backend.SparsePrefillBackend
    builder = cuda_backend.SparsePrefillMetadataBuilder
    assert backend.customize_spec(SPEC) == SPEC  # kv_placement=gpu: vLLM's page as it is
    assert builder.get_cudagraph_support(None, SPEC) is AttentionCGSupport.UNIFORM_BATCH
    monkeypatch.setattr(HostPlacement, "wired", True)  # the settings refuse host until it is wired
    for name, value in (("KV_PLACEMENT", "host"), ("DECODE_MODE", "topk"), ("HOST_KV_POOL_BYTES", str(1 << 20))):
        monkeypatch.setenv(f"VLLM_SPARSE_{name}", value)
    shrunk = backend.customize_spec(SPEC)
    # a key min and max per KV head: 1/PAGE of the K/V page
    assert shrunk.page_size_bytes == HKV * 2 * D * 4 == SPEC.page_size_bytes // PAGE
    assert compute_layer_kv_cache_shape_bytes(shrunk, BLOCKS) == (BLOCKS, HKV, 1, 2 * D * 4)
    assert builder.get_cudagraph_support(None, SPEC) is AttentionCGSupport.NEVER


def test_pinned_blocks_are_each_sequences_sink_and_recent_pages():
    table = torch.tensor([[3, 7, 1, 11], [5, 2, 8, 0]], dtype=torch.int32)
    # 40 tokens: pages 0-2 (blocks 3, 7, 1), sink page 0, recent pages 1-2; 16 tokens: page 0 alone (block 5)
    budget = TopkDecodeBudget(sink_pages=1, recent_pages=2, budget_pages=4)
    assert pinned_blocks(table, torch.tensor([40, 16]), PAGE, budget) == [1, 3, 5, 7]
    assert pinned_blocks(table, torch.tensor([49, 17]), PAGE, TopkDecodeBudget(2, 1, 4)) == [2, 3, 5, 7, 11]


def test_a_decode_step_reads_its_batch_back_and_pins_once_for_all_its_layers(monkeypatch):
    """The block table and the pinned set are the same for every layer of a step: its first layer
    reads them back, the others reuse them; the next step (a new metadata object, here after a
    request left and another joined) reads its own. The attention itself is recorded, not run
    (the kernel test below runs it)."""
    from vllm_sparse_backend.backends import host_kv as host_kv_module

    impl = impl_with(SETTINGS)
    writer = Writer(impl, torch.Generator().manual_seed(4))
    a, b, c = [3, 7, 1], [5, 2], [9, 4]
    writer.step([(a, 0, 40), (b, 0, 20), (c, 0, 17)])
    reads, attended = [], []
    real_pinned_blocks = host_kv_module.pinned_blocks

    def counted_pinned_blocks(*args):
        reads.append(args[0])
        return real_pinned_blocks(*args)

    def recorded_attention(*args, placement, layer, host_block_table):
        attended.append((layer, placement.pinned, host_block_table))

    monkeypatch.setattr(host_kv_module, "pinned_blocks", counted_pinned_blocks)
    monkeypatch.setattr(host_kv_module, "topk_decode_placed", recorded_attention)
    # (rows: block ids, tokens before the step), and the sink (page 0) and last page blocks of each
    steps = [([(a, 40), (b, 20)], {3, 1, 5, 2}),
             ([(a, 41), (b, 21)], {3, 1, 5, 2}),
             ([(a, 42), (c, 17)], {3, 1, 9, 4})]  # b left, c joined
    for rows, pinned in steps:
        writer.step([(blocks, n, 1) for blocks, n in rows])
        table = torch.tensor([blocks + [0] * (3 - len(blocks)) for blocks, _ in rows], dtype=torch.int32)
        lens = torch.tensor([n + 1 for _, n in rows], dtype=torch.int32)
        md = FlashAttentionMetadata(num_actual_tokens=2, max_query_len=1,
                                    query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                                    max_seq_len=int(lens.max()), seq_lens=lens, block_table=table,
                                    slot_mapping=torch.zeros(2, dtype=torch.long))
        attended.clear()
        for name in LAYERS:
            impl.forward(SimpleNamespace(layer_name=name), torch.zeros(2, H, D), None, None, writer.pages[name], md,
                         torch.zeros(2, H, D))
        assert [layer for layer, _, _ in attended] == [0, 1]
        for _, pinned_then, host_table in attended:
            assert pinned_then == pinned
            assert host_table is attended[0][2] and torch.equal(host_table, table.long())
    assert len(reads) == len(steps)  # once per step, not once per layer


def test_row_groups_fit_the_hot_slots_beside_the_pinned_blocks():
    from vllm_sparse_backend.decode.placed import row_groups

    rows = [{1, 2, 3}, {3, 4}, {5, 6, 7}, {8}]
    assert row_groups(rows, None) == [range(4)]  # no hot cache: one group
    assert row_groups(rows, 4) == [range(0, 2), range(2, 4)]  # {1, 2, 3, 4}, then {5, 6, 7, 8}
    assert row_groups(rows, 3) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    # pinned blocks outside a group hold slots too: 9 is pinned, so {1, 2, 3, 4} + 9 needs 5
    assert row_groups(rows, 4, frozenset({9})) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    # {1, 2, 3, 4} + 9 fits 5; {5, 6, 7, 8} + 3 + 9 does not
    assert row_groups(rows, 5, frozenset({3, 9})) == [range(0, 2), range(2, 3), range(3, 4)]


@pytest.mark.parametrize("changes, error", [
    ({"decode_mode": "dense"}, "kv_placement=host: needs decode_mode=topk"),
    ({"host_kv_pool_bytes": None}, "host_kv_pool_bytes: must be set"),
])
def test_kv_placement_host_settings(changes, error):
    with pytest.raises(ValueError, match=error):
        SETTINGS.replace(**changes)


@pytest.mark.kernels
@pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                    reason="needs triton's interpreter (CPU); run by make test with the kernel site")
def test_decode_through_the_impl_forward_is_the_topk_mode_over_the_same_tokens(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from vllm_sparse_backend.decode.topk import PageSummaries, TopkDecodeBudget, topk_decode
    from vllm_sparse_kernels.decode import topk_decode as topk_kernels

    gen = torch.Generator().manual_seed(1)
    settings = SETTINGS.replace(host_kv_hot_pages=8)  # a step's pages: sink + recent + one per KV head
    impl = impl_with(settings)
    allocations = count_hot_allocations(monkeypatch)
    profiling_forward(impl, allocations)  # the hot cache, claimed before any step
    writer = Writer(impl, gen)
    table = torch.tensor([[3, 7, 1, 11], [5, 2, 8, 0]], dtype=torch.int32)
    lens = [40, 45]
    writer.step([(table[0].tolist(), 0, lens[0]), (table[1].tolist(), 0, lens[1])])
    placement = impl.runtime.host_kv.placement
    pinned_sets = []  # what each set_pinned call pinned: one per step, whatever the layer count
    set_pinned = HostPlacement.set_pinned
    monkeypatch.setattr(HostPlacement, "set_pinned", lambda self, ids: pinned_sets.append(set(ids)) or
                        set_pinned(self, ids))
    for step in range(4):
        slot_mapping = writer.step([(table[0].tolist(), lens[0], 1), (table[1].tolist(), lens[1], 1)])
        lens = [n + 1 for n in lens]
        md = FlashAttentionMetadata(num_actual_tokens=2, max_query_len=1,
                                    query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                                    max_seq_len=max(lens), seq_lens=torch.tensor(lens, dtype=torch.int32),
                                    block_table=table, slot_mapping=slot_mapping[:2])
        q = torch.randn(3, H, D, generator=gen)  # a padded row after the two sequences
        for name in LAYERS:
            out = torch.full((3, H, D), float("nan"))
            assert impl.forward(SimpleNamespace(layer_name=name), q, None, None, writer.pages[name], md, out) is out
            key_cache, value_cache = writer.ref[name]
            ref = PageSummaries(key_cache, SETTINGS)  # each page's min / max over its sequence's tokens
            topk_kernels.build_page_summaries(key_cache, table, md.seq_lens, ref.min, ref.max)
            want = torch.empty(2, H, D)
            topk_decode(q[:2], key_cache, value_cache, ref, table, md.seq_lens,
                        TopkDecodeBudget.from_settings(SETTINGS), D ** -0.5, want)
            assert torch.equal(out[:2], want), (step, name)
            assert torch.isnan(out[2:]).all()
    assert placement.stats.misses > 0
    # sink page 0 and the last page of each sequence: 41-44 tokens end in page 2 (block 1); 46-48
    # in page 2 (block 8), 49 in page 3 (block 0)
    assert pinned_sets == [{3, 1, 5, 8}] * 3 + [{3, 1, 5, 0}]
    assert len(allocations) == 1 and placement.hot is impl.runtime.host_kv.hot  # no step allocated slots
