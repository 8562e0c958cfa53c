"""The KV placements (issue 54): the host pool and its GPU hot cache against a plain LRU and the
values written, the gpu placement, the registry, the settings and the vLLM hooks they would use.
All on CPU: the hot cache's device is the CPU here."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from vllm_sparse_backend import _compat
from vllm_sparse_backend.config import ConfigError
from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_backend.kv_placement import KV_PLACEMENTS, KVLayout, kv_placement
from vllm_sparse_backend.kv_placement.gpu import GPUPlacement
from vllm_sparse_backend.kv_placement.host import (FP8, HostKVPoolFull, HostPlacement, HotCacheTooSmall, HotPages,
                                                   hot_slots_needed)
from vllm_sparse_backend.startup import load_checked_settings

LAYOUT = KVLayout(num_layers=2, num_blocks=64, page_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
BF16_BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # layers x (K, V) x page x heads x dim x 2 bytes
# the hot cache on the GPU: a pinned pool and asynchronous copies
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def host(hot_pages: int = 6, pool_blocks: int = 64, dtype: str = "auto", device: str = "cpu") -> HostPlacement:
    settings = SparseSettings(decode_sink_pages=1, decode_recent_pages=1, decode_budget_pages=2,
                              host_kv_hot_pages=hot_pages, host_kv_dtype=dtype,
                              host_kv_pool_bytes=pool_blocks * BF16_BLOCK_BYTES)
    return HostPlacement(settings, dataclasses.replace(LAYOUT, device=device))


def pages(n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn((n, *LAYOUT.page_shape), generator=gen) * scale).to(torch.bfloat16)


class ReferenceLRU:
    """A least-recently-used cache of ``size`` blocks, as a list (least recent first): a miss
    takes a free place or evicts the least recent block that is neither pinned nor asked for in
    the same call."""

    def __init__(self, size: int):
        self.size = size
        self.order: list[int] = []

    def access(self, blocks: list[int], pinned: set[int]):
        needed = set(blocks)
        pinned_held = [b for b in self.order if b in pinned and b not in needed]
        if len(needed) + len(pinned_held) > self.size:
            return None
        copied, evicted = [], []
        for b in blocks:
            if b in self.order:
                self.order.remove(b)
                self.order.append(b)
                continue
            if len(self.order) == self.size:
                victim = [v for v in self.order if v not in pinned and v not in needed][0]
                self.order.remove(victim)
                evicted.append(victim)
            self.order.append(b)
            copied.append(b)
        return copied, evicted

    def free(self, blocks: list[int]) -> None:
        self.order = [b for b in self.order if b not in blocks]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_hot_cache_follows_a_reference_lru_and_never_evicts_pinned_blocks(seed, device):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hot = 6
    placement = host(hot_pages=hot, device=device)
    refs = [ReferenceLRU(hot) for _ in range(LAYOUT.num_layers)]
    latest: dict[int, torch.Tensor] = {}  # block -> its key page as last written (every layer the same)
    hits = misses = 0
    for step in range(60):
        # a step writes a few pages (new blocks, and the recent page rewritten)
        written = rng.sample(range(24), 3)
        k = pages(len(written), gen)
        for layer in range(LAYOUT.num_layers):
            placement.write(layer, written, k, -k)
        latest.update(zip(written, k))
        if step % 7 == 6:  # vLLM reallocates some blocks: freed here, written again later
            gone = rng.sample(sorted(latest), 2)
            placement.free(gone)
            for ref in refs:
                ref.free(gone)
            for b in gone:
                del latest[b]
        pinned = set(rng.sample(sorted(latest), 2))  # sink and recent pages of the running request
        placement.set_pinned(sorted(pinned))
        asked = rng.sample(sorted(latest), rng.randint(1, min(7, len(latest))))
        for layer, ref in enumerate(refs):
            expected = ref.access(asked, pinned)
            if expected is None:
                with pytest.raises(HotCacheTooSmall, match="host_kv_hot_pages=6"):
                    placement.fetch(layer, asked)
                continue
            got = placement.fetch(layer, asked)
            assert (got.copied, got.evicted) == expected, (step, layer)
            assert not pinned & set(got.evicted)
            assert len(set(got.slots)) == len(set(asked))
            key, value = (t.cpu() for t in placement.dequantized(layer, got.slots))
            want = torch.stack([latest[b] for b in asked]).float()
            assert torch.equal(key, want) and torch.equal(value, -want)
            assert set(placement.caches[layer].slot_of) == set(ref.order)
            misses += len(expected[0])
            hits += len(asked) - len(expected[0])
    assert (placement.stats.hits, placement.stats.misses) == (hits, misses)
    assert hits and misses and placement.stats.evictions  # the trace exercised all three


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_pages_come_back_exactly_from_the_pool(device):
    gen = torch.Generator().manual_seed(1)
    placement = host(device=device)
    assert placement.pool.key.is_pinned() == (device == "cuda")
    k, v = pages(5, gen), pages(5, gen)
    blocks = [40, 3, 17, 0, 63]
    placement.write(1, blocks, k, v)
    res = placement.fetch(1, blocks)
    assert res.copied == blocks
    key, value = placement.resident_pages(1, None, None)
    assert key.dtype == torch.bfloat16 and key.device.type == device
    assert torch.equal(key[res.slots].cpu(), k) and torch.equal(value[res.slots].cpu(), v)
    with pytest.raises(ValueError, match="block 40 of layer 0 is not in the host KV pool"):
        placement.fetch(0, [40])  # layer 0 never wrote it


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_pages_dequantise_within_the_format_error_of_the_written_values(device):
    gen = torch.Generator().manual_seed(2)
    placement = host(dtype="fp8_e4m3", device=device)
    # pages and KV heads of very different magnitudes: one scale per page and KV head serves each
    heads = torch.tensor([1.0, 300.0])[None, None, :, None]
    k = (torch.cat([pages(2, gen, 1e-3), pages(2, gen, 30.0)]) * heads).to(torch.bfloat16)
    v = (torch.cat([pages(2, gen, 5.0), pages(2, gen, 1e-2)]) / heads).to(torch.bfloat16)
    blocks = [9, 1, 30, 22]
    placement.write(0, blocks, k, v)
    res = placement.fetch(0, blocks)
    assert placement.resident_pages(0)[0].dtype == torch.float8_e4m3fn
    key, value = (t.cpu() for t in placement.dequantized(0, res.slots))
    for got, written in ((key, k.float()), (value, v.float())):
        # e4m3 keeps 3 mantissa bits (error <= 2^-4 of the value) down to its subnormals, spaced
        # 2^-9 apart; the page's largest magnitude maps to 448
        scale = written.abs().amax(dim=(1, 3), keepdim=True) / 448
        bound = written.abs() * 2 ** -4 + scale * 2 ** -10
        assert torch.all((got - written).abs() <= bound * (1 + 1e-5))
        assert not torch.equal(got, written)  # it really went through fp8


def test_a_freed_block_id_reused_by_vllm_returns_its_new_content_as_a_miss():
    gen = torch.Generator().manual_seed(3)
    placement = host()
    old, new = pages(1, gen), pages(1, gen)
    for layer in range(LAYOUT.num_layers):
        placement.write(layer, [5], old, old)
    placement.fetch(0, [5])
    placement.free([5])
    with pytest.raises(ValueError, match="block 5 of layer 0"):
        placement.fetch(0, [5])  # freed and not written since: nothing to read
    placement.write(0, [6], new, new)  # block 6 takes 5's pool entry; its layer 1 is not written yet
    with pytest.raises(ValueError, match="block 6 of layer 1"):
        placement.fetch(1, [6])
    placement.free([6])
    placement.write(0, [5], new, new)
    res = placement.fetch(0, [5])
    assert res.copied == [5]
    assert torch.equal(placement.resident_pages(0)[0][res.slots[0]], new[0])
    assert (placement.stats.hits, placement.stats.misses) == (0, 2)


def test_a_rewritten_resident_page_is_refreshed_in_the_hot_cache():
    gen = torch.Generator().manual_seed(4)
    placement = host()
    first, second = pages(1, gen), pages(1, gen)
    placement.write(0, [7], first, first)
    slot = placement.fetch(0, [7]).slots[0]
    placement.write(0, [7], second, second)  # the decoding sequence's last page, one token longer
    res = placement.fetch(0, [7])
    assert res.copied == [] and res.slots == [slot]
    assert torch.equal(placement.resident_pages(0)[1][slot], second[0])


def test_a_full_pool_refuses_the_write_and_keeps_what_it_holds():
    gen = torch.Generator().manual_seed(5)
    placement = host(pool_blocks=3)
    assert placement.pool.capacity == 3
    held = pages(3, gen)
    placement.write(0, [0, 1, 2], held, held)
    with pytest.raises(HostKVPoolFull, match="1 new blocks, 0 of 3 entries free"):
        placement.write(0, [2, 3], pages(2, gen), pages(2, gen))
    res = placement.fetch(0, [0, 1, 2])  # the refused write changed nothing
    assert torch.equal(placement.resident_pages(0)[0][res.slots], held)
    placement.free([1])
    placement.write(0, [3], held[:1], held[:1])
    with pytest.raises(ValueError, match="host_kv_pool_bytes=10 holds no block"):
        HostPlacement(SparseSettings(host_kv_pool_bytes=10), LAYOUT)


def test_host_placement_checks_its_settings():
    with pytest.raises(ValueError, match="host_kv_pool_bytes: must be set"):
        HostPlacement(SparseSettings(), LAYOUT)


@pytest.mark.parametrize("dtype, nbytes", [
    # 2 layers x 6 slots x (K, V) x 4 tokens x 2 heads x 8 dims x 2 bytes
    ("auto", 2 * 6 * 2 * 4 * 2 * 8 * 2),
    # fp8: 1 byte a value, and a float32 scale per slot, KV head and K/V: 2 x 6 x (128 + 16)
    ("fp8_e4m3", 2 * 6 * (2 * 4 * 2 * 8 + 2 * 2 * 4)),
])
def test_the_hot_cache_takes_the_bytes_of_its_slots(dtype, nbytes):
    placement = host(hot_pages=6, dtype=dtype)
    assert placement.hot_nbytes == nbytes
    storage = FP8 if dtype == "fp8_e4m3" else torch.bfloat16
    assert HotPages.allocate(2, 6, LAYOUT.page_shape, storage, "cpu").nbytes == nbytes


def test_a_hot_cache_allocated_beforehand_is_the_one_the_placement_fills():
    hot = HotPages.allocate(2, 6, LAYOUT.page_shape, torch.bfloat16, "cpu")
    settings = SparseSettings(host_kv_hot_pages=6, host_kv_pool_bytes=64 * BF16_BLOCK_BYTES)
    placement = HostPlacement(settings, LAYOUT, hot)
    gen = torch.Generator().manual_seed(0)
    written = pages(2, gen)
    placement.write(1, [3, 9], written, written)
    slots = placement.fetch(1, [3, 9]).slots
    assert placement.hot is hot
    assert torch.equal(hot.key[1, slots], written) and torch.equal(hot.value[1, slots], written)
    with pytest.raises(ValueError, match=r"needs \(2, 7, 4, 2, 8\) torch.bfloat16 .* host_kv_hot_pages"):
        HostPlacement(settings.replace(host_kv_hot_pages=7), LAYOUT, hot)


@pytest.mark.parametrize("num_blocks, max_num_seqs, max_model_len, need", [
    (10_000, 1, 32768, 137),  # one sequence: 1 sink + 8 recent + 64 pages for each of 2 KV heads
    (10_000, 4, 32768, 164),  # + 9 pinned pages for each of the 3 others
    (10_000, 4, 4096, 91),  # a sequence has 64 pages: 64 + 3 x 9
    (10_000, 4, 256, 16),  # 4 pages: 4 + 3 x 4
    (100, 4, 32768, 100),  # no step names more than vLLM's blocks
])
def test_the_hot_slots_a_decode_step_can_need(num_blocks, max_num_seqs, max_model_len, need):
    assert hot_slots_needed(1, 8, 64, 2, 64, num_blocks, max_num_seqs, max_model_len) == need


def test_gpu_placement_reads_vllms_cache_by_block_id():
    key_cache, value_cache = torch.zeros(4, 2), torch.ones(4, 2)
    placement = kv_placement(SparseSettings(), LAYOUT)
    assert isinstance(placement, GPUPlacement)
    res = placement.fetch(0, [3, 1])
    assert (res.slots, res.copied) == ([3, 1], [])
    k, v = placement.resident_pages(0, key_cache, value_cache)
    assert k is key_cache and v is value_cache


def test_registry_names_the_placements_and_settings_refuse_the_unwired_one(monkeypatch):
    assert set(KV_PLACEMENTS) == {"gpu", "host"}
    assert SparseSettings().kv_placement == "gpu"
    with pytest.raises(ConfigError, match="VLLM_SPARSE_KV_PLACEMENT='host'.*not wired into serving yet, see "
                                          "docs/decode-offload.md"):
        load_checked_settings({"VLLM_SPARSE_KV_PLACEMENT": "host"})
    with pytest.raises(ConfigError, match="unknown KV placement 'disk' \\(known: gpu, host\\)"):
        load_checked_settings({"VLLM_SPARSE_KV_PLACEMENT": "disk"})

    class Mine(GPUPlacement):  # a new placement: a class and one registry line
        name = "mine"

    monkeypatch.setitem(KV_PLACEMENTS, "mine", Mine)
    settings = load_checked_settings({"VLLM_SPARSE_KV_PLACEMENT": "mine"})
    assert isinstance(kv_placement(settings, LAYOUT), Mine)


def test_the_installed_vllm_has_the_hooks_a_host_placement_needs(monkeypatch):
    assert _compat.kv_placement_hooks_missing() == []
    assert _compat.kv_placement_hooks_available()
    from vllm.v1.attention.backend import AttentionBackend

    monkeypatch.delattr(AttentionBackend, "customize_spec")
    assert _compat.kv_placement_hooks_missing() == ["vllm.v1.attention.backend:AttentionBackend.customize_spec"]
    assert not _compat.kv_placement_hooks_available()



def _write_steps(placement, layer, seqs, steps, gen):
    """vLLM's writes of the sequences ``seqs`` (their block ids): per step, ``n`` new tokens of each
    (a prefill chunk, then one per decode step) at slot = block x page + offset, a padding slot (-1)
    after each sequence's tokens, in one call; ``between(step)`` runs after each step. Returns the
    pages those tokens make, per block (zeros where nothing was written yet)."""
    page = LAYOUT.page_size
    want = {b: torch.zeros((2, *LAYOUT.page_shape), dtype=torch.bfloat16) for blocks in seqs for b in blocks}
    lengths = [0] * len(seqs)
    for step_tokens in steps:
        slots = []
        for i, (n, blocks) in enumerate(zip(step_tokens, seqs)):
            slots += [blocks[p // page] * page + p % page for p in range(lengths[i], lengths[i] + n)] + [-1]
            lengths[i] += n
        k, v = (torch.randn(len(slots), LAYOUT.num_kv_heads, LAYOUT.head_size, generator=gen).to(torch.bfloat16)
                for _ in range(2))
        placement.write_tokens(layer, k, v, torch.tensor(slots))
        for j, s in enumerate(slots):
            if s >= 0:
                want[s // page][0, s % page], want[s // page][1, s % page] = k[j], v[j]
        yield want


@pytest.mark.parametrize("device", DEVICES)
def test_token_writes_build_the_pages_vllms_cache_would_hold(device):
    gen = torch.Generator().manual_seed(5)
    placement = host(hot_pages=8, device=device)
    seqs = [[12, 3, 40, 7], [55, 21, 8]]  # page 4: room for 16 and 12 tokens
    steps = [(6, 5)] + [(1, 1)] * 5  # a prefill chunk each, then decode steps across page ends
    for n, want in enumerate(_write_steps(placement, 1, seqs, steps, gen)):
        blocks = [b for b in want if want[b].abs().sum() > 0]  # the pages written so far
        res = placement.fetch(1, blocks)  # from step 1 on, mostly hits whose pages have grown since
        key, value = placement.resident_pages(1)
        for b, slot in zip(blocks, res.slots):
            assert torch.equal(key[slot].cpu(), want[b][0]) and torch.equal(value[slot].cpu(), want[b][1]), \
                f"step {n}, block {b}"
    assert placement.stats.hits > 0


def test_token_writes_of_fp8_pages_stay_within_the_format_error():
    gen = torch.Generator().manual_seed(6)
    placement = host(dtype="fp8_e4m3")
    seqs = [[9, 30]]
    for want in _write_steps(placement, 0, seqs, [(3,)] + [(1,)] * 4, gen):
        pass
    res = placement.fetch(0, seqs[0])
    key, value = placement.dequantized(0, res.slots)
    for got, written in ((key, torch.stack([want[b][0] for b in seqs[0]]).float()),
                         (value, torch.stack([want[b][1] for b in seqs[0]]).float())):
        # a page is quantised again at each of its writes while it fills (up to 4 here, page 4):
        # one rounding of at most 2^-4 of the value (or a subnormal step) each
        scale = written.abs().amax(dim=(1, 3), keepdim=True) / 448
        bound = written.abs() * ((1 + 2 ** -4) ** 4 - 1) + 4 * scale * 2 ** -10
        assert torch.all((got - written).abs() <= bound * (1 + 1e-5))
