"""``topk_select.topk_ascending`` (Triton radix select) vs ``torch.topk``.

Every result is checked for its format (count, ascending in-range columns, -1 padding), the
threshold invariant (every kept score >= every dropped score: exactly min(k, N) entries, all those
strictly above the threshold included) and the documented tie rule (the lowest columns among the
tied ones); rows whose threshold value is unique must equal torch's top-k set.

CPU: Triton's interpreter at small sizes with small tiles and several chunks per row.
GPU: realistic sizes (R=8, N=128K+7, k=6096 / 1000; R=256, N=8192, k=170), the edge cases at the
default tile, and a CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from triton_setup import CUDA, INTERPRET, kernel_module

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU

ts = kernel_module("topk_select")
DEV = "cuda" if CUDA and not INTERPRET else "cpu"

cpu_only = pytest.mark.skipif(not INTERPRET, reason="interpreter tests run only with TRITON_INTERPRET=1 (no CUDA)")


def gpu(fn):
    skip = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA (and TRITON_INTERPRET unset)")
    return pytest.mark.gpu(skip(fn))


def check(scores, k, idx, cnt, width=None, row_k=None, vals=None):
    """Format, threshold invariant, lowest-columns tie rule, torch top-k set on tie-free rows."""
    R, N = scores.shape
    width = k if width is None else width
    dev = scores.device
    want = torch.full((R,), min(k, N), dtype=torch.int32, device=dev)
    if row_k is not None:
        want = row_k.to(dev).clamp(0, min(k, N)).to(torch.int32)
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert idx.shape == (R, width) and cnt.shape == (R,)
    assert torch.equal(cnt, want), (cnt, want)
    valid = torch.arange(width, device=dev)[None, :] < cnt[:, None].long()
    assert (idx[~valid] == -1).all(), "padding must be -1"
    assert ((idx >= 0) & (idx < N))[valid].all(), "column out of range"
    if width > 1:
        assert ((idx[:, 1:] > idx[:, :-1]) | ~valid[:, 1:]).all(), "columns must be strictly ascending"
    sel = torch.zeros(R, N + 1, dtype=torch.bool, device=dev)
    sel.scatter_(1, torch.where(valid, idx.long(), N), True)
    sel = sel[:, :N]
    assert torch.equal(sel.sum(1), cnt.long())
    if vals is not None:
        assert torch.equal(vals[valid], scores.gather(1, idx.clamp_min(0).long())[valid])
        assert (vals[~valid] == float("-inf")).all()
    if N == 0:
        return sel
    inf = torch.tensor(float("inf"), device=dev)
    lo = torch.where(sel, scores, inf).min(1).values          # threshold: the smallest kept score
    hi = torch.where(sel, -inf, scores).max(1).values         # the largest dropped score
    some = (cnt > 0) & (cnt < N)
    assert (lo >= hi)[some].all(), "a dropped score exceeds a kept one"
    # ties at the threshold: the kept ones are the lowest columns among the tied
    cols = torch.arange(N, device=dev)
    tied = scores == lo[:, None]
    first_dropped = torch.where(tied & ~sel, cols, N).min(1).values
    last_kept = torch.where(tied & sel, cols, -1).max(1).values
    assert (last_kept < first_dropped)[cnt > 0].all(), "ties must keep the lowest columns"
    # rows with a unique threshold value: exactly torch's top-k set
    unique = some & (tied.sum(1) == 1)
    if unique.any():
        for r in unique.nonzero().flatten().tolist():
            c = int(cnt[r])
            ref = scores[r].topk(c, sorted=False).indices
            assert torch.equal(ref.sort().values.to(torch.int32), idx[r, :c]), f"row {r}"
    return sel


def run(scores, k, width=None, **kw):
    out = ts.topk_ascending(scores, k, width, **kw)
    check(scores, k, *out[:2], width=width, row_k=kw.get("row_k"), vals=out[2] if len(out) > 2 else None)
    return out


def edge_rows(N, gen, device):
    """One row per edge case, N columns each."""
    rows = []
    rows.append(torch.randn(N, generator=gen))                                  # plain, +/- values
    rows.append(torch.full((N,), float("-inf")))                                # all -inf
    r = torch.randn(N, generator=gen)
    r[torch.randperm(N, generator=gen)[: N // 2]] = float("inf")                # many +inf
    rows.append(r)
    rows.append(torch.randint(0, 4, (N,), generator=gen).float())               # heavy exact ties
    z = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-45, -1e-45, 1.2e-38, -1.2e-38])
    rows.append(z[torch.randint(0, len(z), (N,), generator=gen)])               # zeros and denormals
    r = torch.randn(N, generator=gen)                                           # page selection shape
    r[:2] = float("inf")
    r[N // 2 - 3: N // 2] = float("inf")
    r[N // 2:] = float("-inf")
    rows.append(r)
    r = -torch.rand(N, generator=gen) * 1e30                                    # negatives only
    rows.append(r)
    r = torch.randn(N, generator=gen)                                           # ties around the k-th
    r[torch.randperm(N, generator=gen)[: N // 3]] = 0.25
    rows.append(r)
    return torch.stack(rows).to(device)


# ----------------------------------------------------------------------------------------------
# interpreter (small sizes, small tiles, several chunks per row)
# ----------------------------------------------------------------------------------------------

@cpu_only
@pytest.mark.parametrize("k", [1, 5, 37, 200, 299])
def test_interp_edges(k):
    gen = torch.Generator().manual_seed(k)
    scores = edge_rows(300, gen, DEV)        # 300: not a multiple of the tile, 3 chunks of 128
    run(scores, k, block=64, num_chunks=3)


@cpu_only
def test_interp_width_values_rowk():
    gen = torch.Generator().manual_seed(7)
    scores = edge_rows(333, gen, DEV)
    run(scores, 20, 50, block=64, num_chunks=4, return_values=True)
    row_k = torch.tensor([0, 3, 20, 50, 7, 1, 19, -2])                          # clipped to [0, k]
    run(scores, 20, 24, block=64, num_chunks=2, row_k=row_k, return_values=True)
    run(scores, 400, 400, block=64, row_k=row_k)                                # k > N with row_k


@cpu_only
def test_interp_shortcuts_and_strides():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 50, generator=gen)
    run(scores, 50)                                                             # k == N
    run(scores, 80, 90, return_values=True)                                     # k > N, wide
    run(scores, 0, 4)                                                           # k == 0
    run(scores[:, :0], 5)                                                       # N == 0
    big = torch.randn(4, 500, generator=gen)
    run(big[:, 7:407], 33, block=64)                                            # row stride > N
    run(big[:, :1], 1)                                                          # N == 1
    run(big.double()[:, :100], 10, block=32, num_chunks=2)                      # converted to fp32
    with pytest.raises(ValueError):
        ts.topk_ascending(big, 10, 5)


@cpu_only
def test_interp_single_tile_rows():
    # R larger, rows shorter than one tile (the decode shape, scaled down)
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(24, 100, generator=gen)
    scores[:, :3] = float("inf")
    scores[::3, 60:] = float("-inf")
    run(scores, 17)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------

@cpu_only
def test_interp_one_compile_serves_every_length(monkeypatch):
    """What Triton specialises a compile on must not follow the row length: the serving path's
    first request must reuse what the profiling run (max_model_len) compiled. So every
    constexpr of both kernels is the same for rows of any length, the lengths are left
    unspecialised, and the row stride the kernels get is a multiple of 16 whatever the length
    (rows that are not are copied to aligned ones, as the estimation allocates them)."""
    launches = {}

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                assert args[1] % 16 == 0  # stride_x
                launches.setdefault(self.name, set()).add(tuple(sorted(kwargs.items())))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_hist_kernel", "_compact_kernel"):
        monkeypatch.setattr(ts, name, Recorder(name, getattr(ts, name)))
    gen = torch.Generator().manual_seed(3)
    for n in (1000, 1007, 2900):  # strides 1000 / 1007 / 2900: 16 divides none, and 2 or 12 chunks
        scores = torch.randn(2, n, generator=gen)
        idx, cnt = ts.topk_ascending(scores, 40, block=256)
        check(scores, 40, idx, cnt)
    assert len(launches["_compact_kernel"]) == 1
    assert len(launches["_hist_kernel"]) == ts._PASSES  # one per radix pass, whatever the length
    for name in ("_hist_kernel", "_compact_kernel"):
        unspecialised = getattr(ts, name).kernel.kwargs["do_not_specialize"]
        assert {"N", "chunk", "n_chunks"} <= set(unspecialised)
    aligned = ts.aligned_rows(3, 1007)
    assert aligned.shape == (3, 1007) and aligned.stride() == (1008, 1)


@gpu
@pytest.mark.parametrize("R,N,k", [(8, 131072 + 7, 6096), (8, 131072 + 7, 1000), (256, 8192, 170),
                                   (32, 65536, 6096), (8, 524288, 6096)])
def test_gpu_realistic(R, N, k):
    gen = torch.Generator().manual_seed(R + k)
    scores = torch.rand(R, N, generator=gen).to("cuda") ** 4                   # skewed, positive
    scores[:, :64] = float("inf")                                              # forced entries
    run(scores, k)
    run(torch.randn(R, N, generator=gen).to("cuda"), k, k + 13, return_values=True)


@gpu
@pytest.mark.parametrize("N", [2048, 8192 + 5, 131072 + 7])
@pytest.mark.parametrize("k", [1, 170, 1000, 6096])
def test_gpu_edges(N, k):
    gen = torch.Generator().manual_seed(N + k)
    scores = edge_rows(N, gen, "cuda")
    run(scores, k)
    row_k = torch.randint(-1, k + 2, (scores.shape[0],), generator=gen).cuda()
    run(scores, k, k + 3, row_k=row_k, return_values=True)


@gpu
def test_gpu_cuda_graph():
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(64, 4096, generator=gen).cuda()
    ts.topk_ascending(scores, 100)                                              # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ts.topk_ascending(scores, 100)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, cnt = ts.topk_ascending(scores, 100)
    for seed in range(3):
        scores.copy_(torch.randn(64, 4096, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        torch.cuda.synchronize()
        check(scores, 100, idx, cnt)
