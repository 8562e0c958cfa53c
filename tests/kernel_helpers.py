"""Helpers shared by the Triton tests (tests/kernels/ and the plugin's Triton path in
tests/plugin_triton/): a row's K in a paged cache, a batch's K/V cache and its fp8 copy, the
guard that the device path never reads a value back to the host, and the comparison of two
SparseIndex. Imports the kernel package only, as the kernel tests do."""

from __future__ import annotations

import contextlib

import torch

from vllm_sparse_kernels.index_format import num_blocks


def paged_row(k: torch.Tensor, page: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """k [kv_len, Hkv, D] -> (key_cache [pages, page, Hkv, D] strided view of a K|V cache, table row).

    Pages are drawn in random order from a larger pool; unused slots hold NaN and the table past
    the row holds an out-of-range page id: both must never be read."""
    kv_len, hkv, d = k.shape
    need = num_blocks(kv_len, page)
    pool = need + 5
    kv = torch.full((pool, page, hkv, 2 * d), float("nan"), dtype=k.dtype)
    key_cache = kv[..., :d]  # a view with the K|V interleaving strides, as vLLM hands it over
    pages = torch.randperm(pool, generator=gen)[:need]
    table = torch.full((need + 3,), 10**6, dtype=torch.int32)
    table[:need] = pages.to(torch.int32)
    for j in range(need):
        a, b = j * page, min(kv_len, (j + 1) * page)
        key_cache[int(pages[j]), : b - a] = k[a:b]
    kv = kv.to(device)
    return kv[..., :d], table.to(device)


def make_row(q_len, ctx_len, hkv, group, d, page, dtype, seed, device, structure=0.0):
    """Random q [q_len, H, D], k [kv_len, Hkv, D] and the paged copy of k. ``structure`` > 0 adds
    a shared direction to some key blocks so that pooled scores have a clear winner structure."""
    gen = torch.Generator().manual_seed(seed)
    kv_len = ctx_len + q_len
    h = hkv * group
    q = torch.randn(q_len, h, d, generator=gen)
    k = torch.randn(kv_len, hkv, d, generator=gen)
    if structure:
        u = torch.randn(d, generator=gen)
        hot = torch.rand(num_blocks(kv_len, 64), generator=gen) < 0.3
        k += structure * hot.repeat_interleave(64)[:kv_len, None, None] * u
        q += structure * 0.5 * u
    q, k = q.to(dtype), k.to(dtype)
    key_cache, table = paged_row(k, page, gen, device)
    return q, k, key_cache, table


_SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@contextlib.contextmanager
def no_host_sync(device):
    """The device path must queue its work without waiting for it. On CUDA, any synchronising
    call inside the block raises (torch's sync debug mode). On the CPU, the tensor methods that
    would read a device value back to the host raise instead."""
    if torch.device(device).type != "cuda":
        saved = {name: getattr(torch.Tensor, name) for name in _SYNCING}

        def refuse(name):
            def method(*args, **kwargs):
                raise AssertionError(f"host synchronisation: Tensor.{name}")
            return method

        for name in _SYNCING:
            setattr(torch.Tensor, name, refuse(name))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.Tensor, name, fn)
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _pad(t, w):
    return torch.nn.functional.pad(t.to(torch.int64).cpu(), (0, w - t.shape[-1]), value=-1)


def assert_same_index(got, ref, max_row_mismatch: float = 0.0):
    """Identical indices; with ``max_row_mismatch`` > 0 (GPU sizes, where float summation order
    can flip a selection at a cumulative-budget or top-k boundary), that fraction of (head, query
    block) lists may differ."""
    assert got.block_size == ref.block_size
    if max_row_mismatch:
        wb = max(got.block_index.shape[-1], ref.block_index.shape[-1])
        wc = max(got.column_index.shape[-1], ref.column_index.shape[-1], 1)
        same = (_pad(got.block_index, wb) == _pad(ref.block_index, wb)).all(-1)
        same &= (_pad(got.column_index, wc) == _pad(ref.column_index, wc)).all(-1)
        same &= got.block_count.cpu() == ref.block_count.cpu()
        same &= got.column_count.cpu() == ref.column_count.cpu()
        frac = 1.0 - same.double().mean().item()
        assert frac <= max_row_mismatch, f"{frac:.2%} of the lists differ"
        return
    assert torch.equal(got.block_count.cpu().to(torch.int32), ref.block_count.cpu())
    w = max(got.block_index.shape[-1], ref.block_index.shape[-1])
    assert torch.equal(_pad(got.block_index, w), _pad(ref.block_index, w))
    assert torch.equal(got.column_count.cpu().to(torch.int32), ref.column_count.cpu())
    w = max(got.column_index.shape[-1], ref.column_index.shape[-1], 1)
    assert torch.equal(_pad(got.column_index, w), _pad(ref.column_index, w))


def fp8_cache(key_cache: torch.Tensor, k_scale: float) -> torch.Tensor:
    """An fp8 (e4m3) copy of a paged K view as vLLM's fp8 cache holds it (stored = K / k_scale),
    with the same K|V interleaving strides (NHD); NaN slots stay NaN."""
    return quantize_cache(key_cache, key_cache, torch.float8_e4m3fn, k_scale, k_scale, "NHD")[0]


def make_cache(kv_lens, hkv, d, page, dtype, layout, gen, device):
    """Paged cache as vLLM lays it out ([num_pages, Hkv, page, 2D] logical, NHD or HND physical),
    pages of the rows drawn in random order; unused slots hold NaN."""
    need = [num_blocks(n, page) for n in kv_lens]
    num_pages = sum(need) + 3
    if layout == "HND":
        kv = torch.full((num_pages, hkv, page, 2 * d), float("nan"), dtype=dtype, device=device)
    else:
        kv = torch.full((num_pages, page, hkv, 2 * d), float("nan"), dtype=dtype, device=device).transpose(1, 2)
    key_cache, value_cache = kv.transpose(1, 2).split(d, -1)
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(need) + 2, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for i, n in enumerate(kv_lens):
        pages = perm[used:used + need[i]]
        used += need[i]
        table[i, :need[i]] = pages
        table[i, need[i]:] = 10**6  # garbage past the row's pages: must never be dereferenced
        k = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v = torch.randn(n, hkv, d, generator=gen).to(dtype)
        for j in range(need[i]):
            a, b = j * page, min(n, (j + 1) * page)
            key_cache[int(pages[j]), : b - a] = k[a:b].to(device)
            value_cache[int(pages[j]), : b - a] = v[a:b].to(device)
        ks.append(k)
        vs.append(v)
    return key_cache, value_cache, table.to(device), ks, vs


def quantize_cache(key_cache, value_cache, fp8, k_scale, v_scale, layout):
    """An fp8 copy of a K|V cache in vLLM's layout (one [pages, Hkv, page, 2D] tensor, NHD or HND
    physical) as vLLM's fp8 cache holds it: stored = value / scale; NaN slots stay NaN."""
    n, page, hkv, d = key_cache.shape
    if layout == "HND":
        kv = torch.empty((n, hkv, page, 2 * d), dtype=fp8, device=key_cache.device)
    else:
        kv = torch.empty((n, page, hkv, 2 * d), dtype=fp8, device=key_cache.device).transpose(1, 2)
    k8, v8 = kv.transpose(1, 2).split(d, -1)
    k8.copy_((key_cache.float() / k_scale).to(fp8))
    v8.copy_((value_cache.float() / v_scale).to(fp8))
    return k8, v8
