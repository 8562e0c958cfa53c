"""Top-k column positions of each row, in ascending column order (Triton radix select).

:func:`topk_ascending` computes ``scores.topk(k, sorted=False).indices.sort(-1).values`` on rows of
fp32 scores. Used by the decode page selection (``topk_decode.select_pages``: 8..256 rows of
2K..8K pages, k = 40..400), which runs in CUDA graphs where it is faster than torch. Also the
prefill estimation's (``vs_index.vs_topk`` with one host budget: 8..32 rows of up to 512K
columns, k = 1000 / 6096): eagerly a call is bound by the host's launch cost, but in the engine
the host runs ahead and the GPU time counts, which is less than torch's topk + sort.

Algorithm (no sort, no host synchronisation, shapes fixed by host ints: CUDA-graph capturable):

1. Keys: the fp32 bits as an int32 whose *signed* order is the float order (negative floats get
   their 31 low bits flipped); ``-0.0`` is mapped to the key of ``+0.0`` (the two compare equal,
   i.e. they tie). Denormals keep their place (bits only, no float arithmetic). ``-inf`` is a valid
   score (the smallest key). NaN is not supported (a positive NaN would rank above ``+inf``).
2. Radix select of the k-th largest key ``T`` per row: 4 passes of 8 bits, most significant digit
   first. Each pass reads the row once and builds the histogram (``tl.histogram``, 256 bins) of
   the digit among the keys whose higher digits equal the prefix found so far; every row is split
   over several programs (chunks of ``BLOCK``-multiples, about 2 programs per SM in total) that
   add their histograms atomically into a global ``[4, R, 256]`` buffer (zeroed once per call).
   Each program of the next pass re-derives the prefix and the remaining count from the previous
   histograms (a 256-bin scan per pass: no extra launch, no state written).
   The last pass also writes, per chunk, the count of keys of the chunk above every candidate
   threshold of its bucket (suffix sums, ``[R, chunks, 257]``).
3. Compaction, one pass over the row in column order: a column is kept when its key is ``> T``,
   or ``== T`` and fewer than ``k - count(> T)`` equal keys precede it in the row. The chunk's
   output offset and the equal keys before it come from the per-chunk counts of step 2; inside
   the chunk, ``tl.cumsum`` over each tile. Output is therefore already ascending.

Ties at the threshold: the **lowest columns** among the tied ones are kept, so exactly
``min(k, N)`` entries are returned, all entries strictly above the threshold included.

Launches per call: 1 memset (``torch.zeros``) + 4 histogram passes + 1 compaction = **6**
(``k >= N`` or ``k == 0`` without ``row_k``: a few small torch ops instead). The row is read 5
times, after the first read from L2 (16 MB at 8 x 512K fits).

Timings: docs/kernel-measurements.md (eager calls are bound by the host's launch cost; the
GPU work is what a CUDA graph runs).

``tl.histogram`` lowers to shared-memory atomics (one per element), so keys piling into
few bins serialise; a 12 + 12 + 8-bit variant (3 passes, 4096 bins) was slower on the GPU
(zeroing and reading 4096 shared bins per tile and per-program 4096-bin scans), hence 8-bit digits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BINS = 256
_PASSES = 4
_BLOCK = 4096          # elements per tile on a GPU
_WARPS = 8
_PROGRAMS_PER_SM = 2   # target number of programs (rows x chunks) per SM
_MAX_CHUNKS = 256      # chunks per row (the compaction loads one count per chunk; a power of two)
_sm_count: dict[int, int] = {}


@triton.jit
def _keys(x):
    """fp32 -> int32 with the float order as signed order; -0.0 gets the key of +0.0."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(key == -1, 0, key)


@triton.jit
def _row_state(hist_ptr, rowk_ptr, r, R, k_eff, NPASS: tl.constexpr, HAS_ROWK: tl.constexpr,
               BINS: tl.constexpr):
    """(prefix, rem) of row r after NPASS passes: prefix = the key's top 8*NPASS bits (arithmetic
    shift of the signed key), rem = entries still to take among the keys with that prefix."""
    if HAS_ROWK:
        rem = tl.minimum(tl.maximum(tl.load(rowk_ptr + r).to(tl.int32), 0), k_eff)
    else:
        rem = k_eff + tl.zeros([], tl.int32)
    prefix = tl.zeros([], tl.int32)
    bins = tl.arange(0, BINS)
    for q in tl.static_range(NPASS):
        h = tl.load(hist_ptr + (q * R + r) * BINS + bins)
        above = tl.sum(h) - tl.cumsum(h, 0)          # keys of the bucket in higher bins
        # the bin holding the rem-th largest: the highest one with above + h >= rem (255 if rem = 0)
        b = tl.max(tl.where(above + h >= rem, bins, -1))
        rem = rem - tl.sum(tl.where(bins == b, above, 0))
        if q == 0:
            prefix = b - 128
        else:
            prefix = prefix * 256 + b
    return prefix, rem


# One compile must serve every row length: the profiling run's (max_model_len) and every real
# request's. So the launch arguments that follow the length (N, chunk, ...) are unspecialised,
# no constexpr depends on it, and the rows' stride is always a multiple of 16 elements
# (:func:`aligned_rows`): specialised, it keeps the loads 16-byte aligned. A stride not divisible
# by 16 compiled new variants of both kernels in the first long request (~0.2 s each).
@triton.jit(do_not_specialize=["N", "chunk", "k_eff", "R", "n_chunks"])
def _hist_kernel(x_ptr, stride_x, hist_ptr, cnt_ptr, rowk_ptr, N, chunk, k_eff, R, n_chunks,
                 PASS: tl.constexpr, HAS_ROWK: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    prefix, rem = _row_state(hist_ptr, rowk_ptr, r, R, k_eff, PASS, HAS_ROWK, BINS)
    SHIFT: tl.constexpr = 24 - 8 * PASS
    lo = c * chunk
    hi = tl.minimum(lo + chunk, N)
    row = x_ptr + r.to(tl.int64) * stride_x
    h = tl.zeros([BINS], tl.int32)
    higher = tl.zeros([BLOCK], tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < hi
        key = _keys(tl.load(row + offs, mask=inb, other=0.0))
        if PASS == 0:
            h += tl.histogram((key >> 24) + 128, BINS, mask=inb)
        else:
            top = key >> (SHIFT + 8)
            h += tl.histogram((key >> SHIFT) & 0xFF, BINS, mask=inb & (top == prefix))
            if PASS == 3:
                higher += (inb & (top > prefix)).to(tl.int32)
    bins = tl.arange(0, BINS)
    tl.atomic_add(hist_ptr + (PASS * R + r) * BINS + bins, h, mask=h != 0, sem="relaxed")
    if PASS == 3:
        # keys of this chunk >= (prefix * 256 + b) for every b (column BINS: keys above the bucket)
        n_higher = tl.sum(higher)
        base = cnt_ptr + (r * n_chunks + c) * (BINS + 1)
        tl.store(base + bins, n_higher + tl.sum(h) - tl.cumsum(h, 0) + h)
        tl.store(base + BINS, n_higher)


@triton.jit(do_not_specialize=["N", "chunk", "k_eff", "R", "n_chunks", "width"])
def _compact_kernel(x_ptr, stride_x, hist_ptr, cnt_ptr, rowk_ptr, idx_ptr, val_ptr, count_ptr,
                    N, chunk, k_eff, R, n_chunks, width,
                    HAS_ROWK: tl.constexpr, VALUES: tl.constexpr, BINS: tl.constexpr,
                    CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    thr, rem = _row_state(hist_ptr, rowk_ptr, r, R, k_eff, 4, HAS_ROWK, BINS)
    # per chunk: keys >= thr and keys > thr (column b and b + 1 of the last pass's suffix counts)
    b = thr & 0xFF
    cs = tl.arange(0, CHUNKS_P2)
    before = cs < c
    base = cnt_ptr + (r * n_chunks + cs) * (BINS + 1)
    ge = tl.load(base + b, mask=before, other=0)
    gt = tl.load(base + b + 1, mask=before, other=0)
    eq_seen = tl.sum(ge - gt)                          # keys == thr in the chunks before
    out = tl.sum(gt) + tl.minimum(eq_seen, rem)        # entries kept by the chunks before
    lo = c * chunk
    hi = tl.minimum(lo + chunk, N)
    row = x_ptr + r.to(tl.int64) * stride_x
    out_row = r.to(tl.int64) * width
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < hi
        x = tl.load(row + offs, mask=inb, other=0.0)
        key = _keys(x)
        g = inb & (key > thr)
        e = (inb & (key == thr)).to(tl.int32)
        n_e = tl.sum(e)
        if tl.sum(g.to(tl.int32)) + n_e > 0:
            keep = g | ((eq_seen + tl.cumsum(e, 0) - e < rem) & (e != 0))
            k32 = keep.to(tl.int32)
            pos = out + tl.cumsum(k32, 0) - k32
            tl.store(idx_ptr + out_row + pos, offs, mask=keep)
            if VALUES:
                tl.store(val_ptr + out_row + pos, x, mask=keep)
            out += tl.sum(k32)
        eq_seen += n_e
    if c == 0:
        if HAS_ROWK:
            n_out = tl.minimum(tl.maximum(tl.load(rowk_ptr + r).to(tl.int32), 0), k_eff)
        else:
            n_out = k_eff + tl.zeros([], tl.int32)
        tl.store(count_ptr + r, n_out)
        for start in range(0, width, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            pad = (offs >= n_out) & (offs < width)
            tl.store(idx_ptr + out_row + offs, tl.full([BLOCK], -1, tl.int32), mask=pad)
            if VALUES:
                tl.store(val_ptr + out_row + offs, tl.full([BLOCK], float("-inf"), tl.float32), mask=pad)


def _programs_target(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _sm_count:
        _sm_count[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _PROGRAMS_PER_SM * _sm_count[i]


def aligned_rows(rows: int, n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """An empty ``[rows, n]`` tensor whose row stride is ``n`` rounded up to a multiple of 16
    elements: what :func:`topk_ascending` selects from without a copy (see the kernels' note)."""
    return torch.empty(rows, -(-n // 16) * 16, dtype=dtype, device=device)[:, :n]


def topk_ascending(scores: torch.Tensor, k: int, width: int | None = None, *, row_k: torch.Tensor | None = None,
                   return_values: bool = False, block: int | None = None, num_chunks: int | None = None):
    """Column indices of the k largest scores of each row, ascending.

    scores: fp32 ``[R, N]`` with unit column stride (other float dtypes are converted; may hold
    +inf and -inf, never NaN). Returns ``(idx, cnt)``: idx int32 ``[R, width]``, the columns of
    the ``min(k, N)`` largest scores of each row in ascending column order, -1 after ``cnt``;
    cnt int32 ``[R]`` = ``min(k, N)``. ``width`` (host int) defaults to k, must be >= k.
    Equivalent as a set per row (up to ties) to ``scores.topk(min(k, N), sorted=False).indices``.

    - Ties at the threshold: the lowest columns among the tied entries are kept (exactly
      ``min(k, N)`` entries). ``+0.0`` and ``-0.0`` tie. ``-inf`` entries are selected when fewer
      than k entries are larger: a caller that must drop them (page selection: pages past the
      sequence) asks for ``return_values=True`` and tests ``vals > -inf``, or gathers them itself
      with ``scores.gather(1, idx.clamp_min(0))``.
    - ``row_k`` (optional int tensor ``[R]``): per-row counts, clipped to ``[0, min(k, N)]``; row r
      keeps its ``row_k[r]`` largest (cnt = that), still in ascending order, -1 padded to width.
    - ``return_values=True``: returns ``(idx, cnt, vals)``, vals fp32 ``[R, width]`` the scores
      of the kept entries (-inf in the padding).
    - ``block`` / ``num_chunks``: tile size (power of two) and chunks per row; tuning and test
      knobs (defaults: 4096, about 2 programs per SM).

    No host synchronisation, output shapes fixed by host ints: capturable in a CUDA graph.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [R, N], got {tuple(scores.shape)}")
    width = k if width is None else width
    if width < k:
        raise ValueError(f"width {width} < k {k}")
    if scores.dtype != torch.float32:
        scores = scores.float()
    R, N = scores.shape
    if N > 1 and (scores.stride(1) != 1 or (R > 1 and scores.stride(0) % 16)):
        scores = aligned_rows(R, N, device=scores.device).copy_(scores)
    dev = scores.device
    k_eff = max(0, min(k, N))
    idx = torch.empty(R, width, dtype=torch.int32, device=dev)
    cnt = torch.empty(R, dtype=torch.int32, device=dev)
    vals = torch.empty(R, width, dtype=torch.float32, device=dev) if return_values else None
    if R == 0 or width == 0:
        return (idx, cnt.fill_(0), vals) if return_values else (idx, cnt.fill_(0))
    if N == 0 or (row_k is None and (k_eff == N or k_eff == 0)):
        # every column (or none): no selection needed
        idx.copy_(torch.arange(width, dtype=torch.int32, device=dev).expand(R, width))
        idx[:, k_eff:] = -1
        cnt.fill_(k_eff)
        if return_values:
            vals.fill_(float("-inf"))
            vals[:, :k_eff] = scores[:, :k_eff]
            return idx, cnt, vals
        return idx, cnt

    blk = block or _BLOCK
    if blk & (blk - 1) or blk < 16:
        raise ValueError(f"block {blk} must be a power of two >= 16")
    if num_chunks is None:
        want = max(1, triton.cdiv(_programs_target(dev), R))
        chunk = triton.cdiv(triton.cdiv(N, want), blk) * blk
    else:
        chunk = triton.cdiv(triton.cdiv(N, max(1, num_chunks)), blk) * blk
    chunk = max(chunk, triton.cdiv(N, _MAX_CHUNKS))
    chunk = triton.cdiv(chunk, blk) * blk
    n_chunks = triton.cdiv(N, chunk)
    hist = torch.zeros(_PASSES, R, _BINS, dtype=torch.int32, device=dev)
    counts = torch.empty(R, n_chunks, _BINS + 1, dtype=torch.int32, device=dev)
    has_rowk = row_k is not None
    rk = row_k.to(device=dev, dtype=torch.int32).contiguous() if has_rowk else cnt  # cnt: unused placeholder
    if has_rowk and rk.numel() != R:
        raise ValueError(f"row_k must have {R} entries, got {rk.numel()}")
    grid = (R, n_chunks)
    for p in range(_PASSES):
        _hist_kernel[grid](scores, scores.stride(0), hist, counts, rk, N, chunk, k_eff, R, n_chunks,
                           PASS=p, HAS_ROWK=has_rowk, BINS=_BINS, BLOCK=blk, num_warps=_WARPS)
    _compact_kernel[grid](scores, scores.stride(0), hist, counts, rk, idx, vals if return_values else idx, cnt,
                          N, chunk, k_eff, R, n_chunks, width,
                          HAS_ROWK=has_rowk, VALUES=return_values, BINS=_BINS,
                          CHUNKS_P2=_MAX_CHUNKS, BLOCK=blk, num_warps=_WARPS)
    return (idx, cnt, vals) if return_values else (idx, cnt)
