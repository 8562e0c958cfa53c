"""Block-sparse tiles from maintained libraries beside ours (issue 40 item 5): the same block-sparse
causal attention computed by our Triton kernel, FlashInfer 0.7's block-sparse prefill and
FlashAttention-4's (CuTe DSL) block sparsity as vLLM 0.33 ships it, timed side by side.

Workload: one prefill row of n tokens (no context), causal, bf16, GQA shapes Qwen2.5-1.5B (12 query
heads / 2 KV heads, head dim 128) and Llama-3-8B (32 / 8 / 128), n = 32K and 128K. The block mask
is drawn at FA4's granularity, 128 queries x 128 keys (its SM90 tile for head dim 128, and the only
key-block size its SM90 block sparsity takes is its n-tile): each query block keeps its diagonal
block and random earlier key blocks, about ``density`` of its causal blocks (0.05, 0.1, 0.2),
one mask per KV head, shared by the query heads of the group (the backend's default
``kv_group_shared``), seeded. Split into 64 x 64 blocks (our block, vllm_sparse_kernels BLOCK),
dropping the halves that hold only future keys, it is the same (query, key) set: every method
computes the same attention, exactly representable at both granularities.

Timed (median of CUDA events after a warm-up, ``benchmarks.kernels.bench``), per (shape, n, density):

* ours: ``sparse_prefill_attention`` with the block-only index (no columns or ranges; one list per
  KV head, the group's heads stacked per program) on vLLM's paged cache (``kernels.paged_cache``:
  NHD, K|V interleaved, pages in random order), pages of 64 keys (TMA loads on Hopper, what serving
  uses there) and of 16 (gathered loads); and on the contiguous K/V seen as 64-key pages in order
  (what FA4 reads below);
* FlashInfer ``BlockSparseAttentionWrapper`` (BSR with R x C blocks, backend ``auto``: FA3 on
  Hopper, CTA 128 queries x 96 keys per query head). Its mask is one for all heads, so one wrapper
  and one launch per KV head (the group's query heads and that head's cache slice, strided views).
  Its K/V are "pages" of C keys indexed by the BSR column list and its causal mask is aligned to
  the bottom right of each query block's key list, so it reads vLLM's paged cache directly:
  C = page size, column ids = physical page ids of the selected key blocks in key order (the
  diagonal block last); R = 64 (our blocks) and R = 128 (the 128-query mask as it is);
* FlashInfer ``VariableBlockSparseAttentionWrapper`` (one mask per KV head in one launch, 64 x 64
  blocks): contiguous HND K/V only ([Hkv, n, D]; its run() copies q, k, v into its own layout
  every call, which the time includes), token-level indices (page size 1); at n <= --variable-max;
* FA4 block sparsity: ``vllm.vllm_flash_attn.cute.interface._flash_attn_fwd`` (batch 1, causal)
  with tiles 128 x 128 (SM90 default for head dim 128; the sparse key block must equal the n-tile
  there) and ``tile_mn=(128, 64)``, and vLLM's public entry ``flash_attn_varlen_func(fa_version=4,
  block_sparse_tensors=...)`` (the varlen form of the same tensors), all on contiguous K/V: in
  this copy the SM90 block-sparse producer loads K/V tiles by logical block index with the TMA
  copy and never consults ``page_table`` (no cp.async path for pages other than the n-tile). With
  ``--fa4 paged`` (in a run of its own: a load that ignores the page table may read out of
  bounds and end the process's CUDA context) the paged calls are tried once (128 x 128 tiles on
  64-key pages; 128 x 64 tiles on the 64-key pages, TMA): expect an error or a large difference
  from ours, the pages being shuffled.
  The diagonal blocks go in FA4's "mask" list, the others in its "full" list; one list per query
  head (the lists' head dimension must be the query heads or 1, so GQA packing is off);
* dense causal FlashAttention for scale: vLLM's FA3 ``flash_attn_varlen_func`` on the 64-key
  paged cache, or torch SDPA (flash / cuDNN) where that is unavailable.

Each method's output is compared with ours (max abs difference over all outputs) and with float64
attention on 64 sampled rows (the first rows and rows of the last quarter; error = max |out -
ref| / max |ref| per row and head: bf16 rounding stays near 4e-3, a block missing from a late row
shows as a few percent; above 2e-2 the row says MISMATCH). Building a method's metadata from the mask (our index and
packing, FlashInfer's BSR lists and ``plan``, FA4's tensors) is outside the kernel time and timed
on its own (wall clock, median of 3), as is the host time of one call (enqueue only); in serving
the metadata would be built every step or layer. A method that cannot run prints "not available:
<exception>" in its row and the others go on.

From the repository root, on one CUDA GPU (torch, triton; FlashInfer and vLLM optional, imported
lazily):

    python -m benchmarks.studies.library_tiles [--sizes 32,128] [--densities 0.05,0.1,0.2]
        [--shapes qwen2.5-1.5b,llama3-8b] [--pages 64,16] [--skip flashinfer,fa4,dense]
        [--fa4 contiguous,tile64,varlen[,paged]] [--out FILE]

About two minutes on an H200 once everything is compiled; first calls add Triton compiles
(seconds), FA4's CuTe DSL compiles (one per shape and variant, in memory unless
FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1) and, without flashinfer's jit-cache package, FlashInfer's
JIT build of its prefill module (needs nvcc; minutes, cached under ~/.cache/flashinfer). The
first-call time of each method is printed at the end; --out is written line by line.

``--smoke`` runs tiny sizes on the CPU under Triton's interpreter (TRITON_INTERPRET=1), untimed:
our kernel on the refined mask against float64 attention and the mask conversions against the
token-level mask, libraries skipped; a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from benchmarks.common import SHAPES as MODEL_SHAPES  # noqa: E402 - torch only
from vllm_sparse_backend.prefill.index import build_index, compact  # noqa: E402 - torch only
from vllm_sparse_kernels.prefill.launch_config import shared_stack  # noqa: E402 - plain Python
from vllm_sparse_kernels.reference.dense import masked_attention_f64  # noqa: E402 - torch only

OUR_BLOCK = (64, 64)  # vllm_sparse_kernels.constants.BLOCK (that module imports triton)
FA4_BLOCK = (128, 128)  # FA4's SM90 m x n tile for head dim 128 (interface._tile_size_fwd_sm90)
# FlashInfer's FA3 (SM90) paged prefill for head dim 128: CTA_Q 128 x CTA_KV 96, one query head per
# CTA (hopper/prefill_sm90.cuh, BatchPrefillWithPagedKVCacheDispatched; the plan tiles each query
# block of R rows by 128, so R = 64 leaves half of each tile empty)
FI_TILE = "CTA 128x96 per q head"
SHAPES = {name: MODEL_SHAPES[name] for name in ("qwen2.5-1.5b", "llama3-8b")}  # head dim 128: the tiles above
SMOKE_SHAPES = {"tiny-gqa": (4, 2, 64)}
NAN = float("nan")
# Largest error a method may have on the sampled rows, relative to each row's largest output
# (bf16 output rounding and P cast to bf16 stay near 4e-3; one 64-key block missing from a late
# row of random q / k / v moves its output by a few percent)
MISMATCH = 2e-2
SAMPLED_ROWS = 64  # rows checked against float64 attention: half the first query tile, half the last quarter


# --------------------------------------------------------------------------------------------
# Block masks and their conversions (pure torch, any device)
# --------------------------------------------------------------------------------------------

def block_grid(m: int, nk: int, block: tuple[int, int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, partial), bool [m, nk], for a row with no context whose length is a multiple of
    the blocks: ``visible`` key blocks hold a key some query of the query block may see (causal);
    ``partial`` ones are visible but not to every query of the block (they need the causal mask:
    the blocks that touch the diagonal)."""
    bq, bk = block
    q0 = torch.arange(m, device=device)[:, None] * bq
    k0 = torch.arange(nk, device=device)[None, :] * bk
    visible = k0 <= q0 + bq - 1
    return visible, visible & (k0 + bk - 1 > q0)


def random_block_mask(lists: int, n: int, block: int, density: float, gen: torch.Generator,
                      device=None) -> torch.Tensor:
    """bool [lists, n / block, n / block] (square blocks, n a multiple of ``block``): query block
    qb keeps its diagonal block and random other causal key blocks, max(1, round(density * (qb +
    1))) of its qb + 1 causal blocks; nothing above the diagonal. ``gen`` lives on ``device``."""
    if n % block:
        raise ValueError(f"n = {n} is not a multiple of the block {block}")
    m = n // block
    device = gen.device if device is None else device
    qb = torch.arange(m, device=device)
    keep = (density * (qb + 1).double()).round().long().clamp(min=1)
    scores = torch.rand(lists, m, m, generator=gen, device=device)
    scores = scores.masked_fill(qb[None, :] > qb[:, None], -1.0).masked_fill(qb[None, :] == qb[:, None], 2.0)
    rank = scores.argsort(-1, descending=True).argsort(-1)  # 0 = the diagonal, then the random order
    return rank < keep[None, :, None]


def refine_block_mask(mask: torch.Tensor, coarse: tuple[int, int], fine: tuple[int, int]) -> torch.Tensor:
    """The same (query, key) set at a finer block size: each (bq x bk) block split into
    (bq / fq) x (bk / fk) blocks of (fq x fk), dropping those that hold only keys after all their
    queries (the causal mask removes them anyway; FlashInfer's bottom-right causal alignment needs
    them gone)."""
    fq, fk = coarse[0] // fine[0], coarse[1] // fine[1]
    if fq * fine[0] != coarse[0] or fk * fine[1] != coarse[1]:
        raise ValueError(f"{fine} does not divide {coarse}")
    out = mask.repeat_interleave(fq, -2).repeat_interleave(fk, -1)
    visible, _ = block_grid(out.shape[-2], out.shape[-1], fine, mask.device)
    return out & visible


def coarsen_block_mask(mask: torch.Tensor, fine: tuple[int, int], coarse: tuple[int, int]) -> torch.Tensor:
    """The smallest mask at the coarse block size that holds ``mask`` (a coarse block is kept when
    any of its fine blocks is)."""
    fq, fk = coarse[0] // fine[0], coarse[1] // fine[1]
    *lead, m, nk = mask.shape
    if m % fq or nk % fk:
        raise ValueError(f"{tuple(mask.shape)} blocks of {fine} do not tile blocks of {coarse}")
    return mask.reshape(*lead, m // fq, fq, nk // fk, fk).any(-1).any(-2)


def representable(mask: torch.Tensor, fine: tuple[int, int], coarse: tuple[int, int]) -> bool:
    """Whether a fine mask (causal blocks only) is exactly a coarse one split up."""
    return torch.equal(refine_block_mask(coarsen_block_mask(mask, fine, coarse), coarse, fine), mask)


def block_mask_to_bsr(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One list's bool [M, N] block mask -> BSR (indptr int32 [M + 1], indices int32 [nnz]): the
    kept key blocks of each query block, ascending."""
    if mask.dim() != 2:
        raise ValueError(f"one [M, N] mask expected, got shape {tuple(mask.shape)}")
    indptr = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    indptr[1:] = mask.sum(-1).cumsum(0)
    return indptr, mask.nonzero()[:, 1].to(torch.int32)  # row-major: ascending within each row


def bsr_to_pages(indptr: torch.Tensor, indices: torch.Tensor, block_k: int, page: int,
                 table_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BSR over key blocks of ``block_k`` -> BSR over the physical pages of a paged cache
    (C = ``page``, a divisor of ``block_k``): each key block becomes its block_k / page pages, in
    key order, looked up in the row's block table."""
    if block_k % page:
        raise ValueError(f"pages of {page} keys do not tile key blocks of {block_k}")
    f = block_k // page
    logical = (indices.long()[:, None] * f + torch.arange(f, device=indices.device)).reshape(-1)
    return (indptr * f).to(torch.int32), table_row.long()[logical].to(torch.int32)


def _lists(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [L, M, N] -> (count int32 [L, M], ascending block ids int32 [L, M, W >= 1], 0-padded)."""
    kb = torch.arange(sel.shape[-1], device=sel.device).expand(sel.shape)
    count, idx = compact(kb, sel)
    if idx.shape[-1] == 0:
        idx = torch.zeros(*idx.shape[:-1], 1, dtype=torch.int32, device=sel.device)
    return count, idx.clamp(min=0).contiguous()


def block_mask_to_fa4(mask: torch.Tensor, block: tuple[int, int], group: int):
    """Per-KV-head bool [Hkv, M, N] mask at FA4's (m, n) block -> FA4's block-sparse tensors
    (mask_block_cnt [1, H, M], mask_block_idx [1, H, M, W], full_block_cnt, full_block_idx),
    int32, H = Hkv * group: the list repeated for each query head of the group. The blocks that
    touch the diagonal (partial) are FA4's "mask" blocks, the others its "full" blocks; ascending."""
    visible, partial = block_grid(mask.shape[1], mask.shape[2], block, mask.device)
    kept = mask & visible
    out = []
    for sel in (kept & partial, kept & ~partial):
        count, idx = _lists(sel)
        out += [count.repeat_interleave(group, 0)[None].contiguous(),
                idx.repeat_interleave(group, 0)[None].contiguous()]
    return tuple(out)


def fa4_varlen(tensors, n_kblocks: int):
    """The varlen form of one row's FA4 tensors (what ``flash_attn_varlen_func`` with
    ``cu_seqlens_q`` reads): counts [H, M], indices [H, M * N] (each m block's list padded to the
    row's N key blocks), cu_total_m_blocks [0, M] and cu_block_idx_offsets [0, M * N]."""
    m_cnt, m_idx, f_cnt, f_idx = tensors
    h, m = m_cnt.shape[1:]

    def flat(idx):
        pad = torch.zeros(h, m, n_kblocks, dtype=torch.int32, device=idx.device)
        pad[..., :idx.shape[-1]] = idx[0]
        return pad.reshape(h, m * n_kblocks)

    dev = m_cnt.device
    cu_m = torch.tensor([0, m], dtype=torch.int32, device=dev)
    cu_idx = torch.tensor([0, m * n_kblocks], dtype=torch.int32, device=dev)
    return m_cnt[0].contiguous(), flat(m_idx), f_cnt[0].contiguous(), flat(f_idx), cu_m, cu_idx


def our_index(mask64: torch.Tensor, n: int):
    """The block-only SparseIndex (one list per KV head) of a 64 x 64 mask."""
    return build_index(mask64, OUR_BLOCK[0], n, 0)


def pack_ours(sa, index, heads: int, head_dim: int, n: int, device):
    """Our batched index as the launcher packs group-shared lists: shared_stack() heads of a group
    stacked per program, each KV head's list repeated for the group's other stacks."""
    group = heads // index.num_heads
    per = shared_stack(head_dim, group)
    return sa.pack_rows([(0, 0, n, 0)], [index.repeat_heads(group // per)], device=device, heads_per_list=per)


def visible_pairs(mask: torch.Tensor, block: tuple[int, int]) -> int:
    """(query, key) pairs a block mask computes with causality applied, summed over its lists."""
    bq, bk = block
    m, nk = mask.shape[-2:]
    d = torch.arange(m, device=mask.device)[:, None] * bq - torch.arange(nk, device=mask.device)[None, :] * bk
    per = torch.zeros(m, nk, dtype=torch.int64, device=mask.device)
    per[d >= bk - 1] = bq * bk
    part = (d < bk - 1) & (d + bq - 1 >= 0)
    r = torch.arange(bq, device=mask.device)
    per[part] = (d[part][:, None] + r + 1).clamp(0, bk).sum(-1)
    return int((mask.long() * per).sum())


# Token-level models of what each representation computes (the smoke run's self-check; the tests
# check the conversions against their own, independent references).

def tokens_from_blocks(mask: torch.Tensor, block: tuple[int, int], n: int) -> torch.Tensor:
    """bool [L, n, n]: the pairs of a block mask, causality applied."""
    t = mask.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :n, :n]
    return t & torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()


def tokens_from_bsr(indptr, indices, rows: int, page: int, table_row, n: int) -> torch.Tensor:
    """bool [n, n]: what FlashInfer's causal block-sparse prefill computes from a BSR list over
    pages: query block r (``rows`` queries) attends to the concatenation of its pages' keys, causal
    aligned to the bottom right (its query i sees the first kv_len - rows + i + 1 of them)."""
    inv = torch.empty_like(table_row, dtype=torch.long)
    inv[table_row.long()] = torch.arange(table_row.numel(), device=table_row.device)
    out = torch.zeros(n, n, dtype=torch.bool, device=table_row.device)
    i = torch.arange(rows, device=table_row.device)
    for r in range(indptr.numel() - 1):
        pages = indices[int(indptr[r]):int(indptr[r + 1])].long()
        keys = (inv[pages][:, None] * page + torch.arange(page, device=pages.device)).reshape(-1)
        kv_len = keys.numel()
        allowed = torch.arange(kv_len, device=keys.device)[None, :] <= (kv_len - rows + i)[:, None]
        out[(r * rows + i)[:, None], keys[None, :]] = allowed
    return out


def tokens_from_fa4(tensors, block: tuple[int, int], n: int) -> torch.Tensor:
    """bool [H, n, n]: what FA4 with causal=True computes from its tensors: the listed "mask" and
    "full" blocks of each query head, its causal mask applied to every block."""
    m_cnt, m_idx, f_cnt, f_idx = tensors
    h, m = m_cnt.shape[1:]
    blocks = torch.zeros(h, m, n // block[1] + 1, dtype=torch.bool, device=m_cnt.device)
    for cnt, idx in ((m_cnt, m_idx), (f_cnt, f_idx)):
        valid = torch.arange(idx.shape[-1], device=idx.device) < cnt[0][..., None]
        blocks.scatter_(2, torch.where(valid, idx[0].long(), n // block[1]), True)
    return tokens_from_blocks(blocks[..., :-1], block, n)


# --------------------------------------------------------------------------------------------
# Timing and comparison helpers
# --------------------------------------------------------------------------------------------

def sync(dev):
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def wall_ms(fn, dev, reps: int = 3) -> tuple[float, object]:
    """Median wall-clock ms of ``fn`` (synchronised before and after) and its last result: host
    work and syncs included, for metadata that is built with host round trips."""
    times, res = [], None
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        res = fn()
        sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), res


def host_ms(fn, dev, reps: int = 3) -> float:
    """Median host ms of one call (the time to enqueue it, the GPU idle before)."""
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    sync(dev)
    return statistics.median(times)


def free(dev):
    if torch.device(dev).type == "cuda":
        torch.cuda.empty_cache()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, chunk: int = 8192) -> float:
    """max |a - b| over all elements of two [n, ...] tensors, in float32 chunks along dim 0 (NaN if
    either holds one)."""
    worst = 0.0
    for i in range(0, a.shape[0], chunk):
        d = (a[i:i + chunk].float() - b[i:i + chunk].float()).abs().max().item()
        if d != d:
            return NAN
        worst = max(worst, d)
    return worst


def sampled_rows(n: int, count: int = SAMPLED_ROWS) -> torch.Tensor:
    """The query positions checked against float64: the first count // 2 rows (few keys: large
    outputs) and count - count // 2 spread over the last quarter (long rows: where a missing
    block shows least)."""
    first = torch.arange(min(count // 2, n))
    late = torch.linspace(n - n // 4, n - 1, count - count // 2).round().long()
    return torch.unique(torch.cat([first, late]))


def f64_rows_reference(q, k, v, mask: torch.Tensor, block: tuple[int, int], rows: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """float64 attention of the query positions ``rows`` over the keys the block ``mask``
    ([Hkv, n / block_q, n / block_k], one per KV head) and causality allow: [len(rows), H, D].
    Independent of every method timed here (the package's float64 reference on the token mask;
    at 128K on the 8B shape its float64 K / V copies take about 9 GB)."""
    group = q.shape[1] // k.shape[1]
    keys = torch.arange(k.shape[0], device=q.device)
    r = rows.to(q.device)
    allowed = mask[:, r // block[0]][:, :, keys // block[1]] & (keys[None, None, :] <= r[None, :, None])
    return masked_attention_f64(q[r], k, v, allowed.repeat_interleave(group, 0), scale)


def rows_rel_error(got: torch.Tensor, ref_rows: torch.Tensor, rows: torch.Tensor) -> float:
    """max over the sampled rows and heads of max |got - ref| / max |ref| (NaN if got holds one)."""
    g = got[rows.to(got.device)].double()
    err = (g - ref_rows).abs().amax(-1) / ref_rows.abs().amax(-1).clamp_min(1e-30)
    e = err.max().item()
    return NAN if e != e else e


def short(e: BaseException, width: int = 240) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:width]}"


def package_versions() -> str:
    from importlib import metadata
    parts = []
    for name in ("vllm", "flashinfer-python", "nvidia-cutlass-dsl", "quack-kernels", "triton"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


COLUMNS = ("shape", "n", "blocks / pairs", "method", "reads K/V", "tile (q x k)", "metadata ms", "kernel ms",
           "x vs ours", "host ms/call", "max abs diff vs ours / error vs float64")


class Table:
    """Markdown rows printed as they come and kept for --out."""

    def __init__(self, say):
        self.say = say

    def header(self):
        self.say("| " + " | ".join(COLUMNS) + " |")
        self.say("|" + "---|" * len(COLUMNS))

    def row(self, *cells):
        self.say("| " + " | ".join(str(c) for c in cells) + " |")


def fmt(x: float, digits: int = 3) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


# --------------------------------------------------------------------------------------------
# The methods (GPU)
# --------------------------------------------------------------------------------------------

def flashinfer_bsr(q, key_cache, value_cache, table, mask, block, page, heads, head_dim, n, scale, out, workspace):
    """FlashInfer's BlockSparseAttentionWrapper, one wrapper and launch per KV head, reading the
    paged cache (C = page, column ids = physical pages). Returns (run, metadata ms, backend)."""
    from flashinfer.sparse import BlockSparseAttentionWrapper

    hkv = mask.shape[0]
    group = heads // hkv
    rows = block[0]
    num_pages = key_cache.shape[0]
    conv_ms, lists = wall_ms(lambda: [bsr_to_pages(*block_mask_to_bsr(mask[h]), block[1], page, table[0])
                                      for h in range(hkv)], q.device)
    wrappers = [BlockSparseAttentionWrapper(workspace) for _ in range(hkv)]

    def plan():
        for w, (indptr, indices) in zip(wrappers, lists):
            w.plan(indptr, indices, n, num_pages * page, rows, page, group, 1, head_dim, causal=True, sm_scale=scale,
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16)

    plan_ms, _ = wall_ms(plan, q.device)

    def run():
        for h, w in enumerate(wrappers):
            sl = slice(h * group, (h + 1) * group)
            w.run(q[:, sl], key_cache[:, :, h:h + 1], value_cache[:, :, h:h + 1], out=out[:, sl])

    return run, conv_ms + plan_ms, getattr(wrappers[0], "_backend", "?")


def flashinfer_variable(q, k, v, mask64, heads, head_dim, scale, workspace):
    """FlashInfer's VariableBlockSparseAttentionWrapper: per-KV-head masks in one launch, 64 x 64
    blocks, contiguous HND K/V. Returns (run, metadata ms, result)."""
    from flashinfer.sparse import VariableBlockSparseAttentionWrapper

    hkv, m, _ = mask64.shape
    qh, kh, vh = (x.transpose(0, 1).contiguous() for x in (q, k, v))  # its [heads, n, D] inputs (untimed)
    sizes = torch.full((hkv, m), OUR_BLOCK[0], dtype=torch.int32, device=q.device)
    w = VariableBlockSparseAttentionWrapper(workspace)
    plan_ms, _ = wall_ms(lambda: w.plan(mask64, sizes, sizes, heads, hkv, head_dim, causal=True, sm_scale=scale,
                                        q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16), q.device)
    box = {}

    def run():
        box["out"] = w.run(qh, kh, vh)

    return run, plan_ms, lambda: box["out"].transpose(0, 1)


def fa4_batch(q, k, v, table, tensors, block, tile, scale, out):
    """FA4's _flash_attn_fwd, batch 1, causal, with block-sparse tensors: contiguous K/V [n, Hkv, D]
    (``table`` None) or a paged cache [pages, page, Hkv, D] with its block table."""
    from vllm.vllm_flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from vllm.vllm_flash_attn.cute.interface import _flash_attn_fwd

    m_cnt, m_idx, f_cnt, f_idx = tensors
    bst = BlockSparseTensorsTorch(mask_block_cnt=m_cnt, mask_block_idx=m_idx, full_block_cnt=f_cnt,
                                  full_block_idx=f_idx, block_size=block)
    q4, out4 = q.unsqueeze(0), out.unsqueeze(0)
    if table is None:
        k, v = k.unsqueeze(0), v.unsqueeze(0)

    def run():
        _flash_attn_fwd(q4, k, v, page_table=table, softmax_scale=scale, causal=True, block_sparse_tensors=bst,
                        out=out4, tile_mn=tile)

    return run


def fa4_vllm_varlen(q, k, v, tensors, block, n, scale, out):
    """FA4 through vLLM's public entry, flash_attn_varlen_func(fa_version=4), on contiguous K/V
    (cu_seqlens_k) with the varlen form of the tensors."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    from vllm.vllm_flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    m_cnt, m_idx, f_cnt, f_idx, cu_m, cu_idx = fa4_varlen(tensors, n // block[1])
    bst = BlockSparseTensorsTorch(mask_block_cnt=m_cnt, mask_block_idx=m_idx, full_block_cnt=f_cnt,
                                  full_block_idx=f_idx, cu_total_m_blocks=cu_m, cu_block_idx_offsets=cu_idx,
                                  block_size=block)
    cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)

    def run():
        flash_attn_varlen_func(q, k, v, max_seqlen_q=n, cu_seqlens_q=cu, max_seqlen_k=n, cu_seqlens_k=cu,
                               softmax_scale=scale, causal=True, out=out, fa_version=4, num_splits=1,
                               block_sparse_tensors=bst)

    return run


def dense_reference(q, k, v, cache, n, group, scale):
    """Dense causal attention for scale: (label, ms): vLLM's FA3 on the paged cache, else SDPA."""
    from benchmarks.kernels import bench, sdpa_times

    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        key_cache, value_cache, table = cache
        out = torch.empty_like(q)
        cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        used_k = torch.tensor([n], dtype=torch.int32, device=q.device)
        page = key_cache.shape[1]
        ms = bench(lambda: flash_attn_varlen_func(q, key_cache, value_cache, max_seqlen_q=n, cu_seqlens_q=cu_q,
                                                  max_seqlen_k=n, seqused_k=used_k, softmax_scale=scale, causal=True,
                                                  block_table=table, out=out, fa_version=3), max_reps=5)
        return f"dense causal FA3 (vLLM flash_attn_varlen_func), paged {page}", ms, ""
    except Exception as e:  # no vLLM / FA3 here: torch SDPA on contiguous K/V
        why = short(e, 120)
        times = sdpa_times(q, k, v, group)
        best = min((t for t in times.values() if t == t), default=NAN)
        return "dense causal torch SDPA (best of flash / cuDNN), contiguous", best, f"FA3 not available: {why}"


# --------------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------------

class Study:
    def __init__(self, args, say, dev="cuda"):
        self.args = args
        self.dev = torch.device(dev)
        self.table = Table(say)
        self.say = say
        self.first_calls: dict[str, float] = {}
        self.workspace = None
        self.fa4_paged_tried = False
        self.f64 = None  # (float64 outputs of the sampled rows, their positions) of the current mask

    def attempt(self, cells, label, build, ref, base_ms, first_key):
        """Run one method (``label``: name, how it reads K/V, its tile): ``build()`` -> (run,
        metadata ms, result getter, note); time it, compare with ``ref``; a row either way. Returns
        (kernel ms, output) or (NaN, None)."""
        from benchmarks.kernels import bench

        args = self.args
        try:
            run, meta_ms, result, note = build()
            t0 = time.perf_counter()
            run()
            sync(self.dev)
            self.first_calls.setdefault(first_key, time.perf_counter() - t0)
            ms = bench(run, budget_ms=args.budget_ms, max_reps=args.reps)
            hms = host_ms(run, self.dev)
            got = result()
            diff = max_abs_diff(got, ref) if ref is not None else NAN
            rel = rows_rel_error(got, *self.f64) if self.f64 is not None else NAN
            speed = base_ms / ms if base_ms == base_ms and ms else NAN
            bad = " MISMATCH" if self.f64 is not None and not rel <= MISMATCH else ""
            self.table.row(*cells, *label, fmt(meta_ms, 2), fmt(ms), fmt(speed, 2), fmt(hms, 3),
                           (f"{diff:.2e}" if diff == diff else "-") + f" / {rel:.1e}{bad}"
                           + (f" ({note})" if note else ""))
            return ms, got
        except Exception as e:
            self.table.row(*cells, *label, "-", f"not available: {short(e)}", "-", "-", "-")
            free(self.dev)
            return NAN, None

    def shape_size(self, shape: str, n: int, gen: torch.Generator):
        from benchmarks.kernels import paged_cache, random_qkv, sa

        args = self.args
        h, hkv, d = SHAPES[shape]
        group = h // hkv
        scale = 1.0 / math.sqrt(d)
        dev = self.dev
        size = f"{n // 1024}K"
        q, k, v = random_qkv(n, shape, gen, dev)
        caches = {p: paged_cache(k, v, p, dev) for p in args.pages}
        p_main = args.pages[0]

        if "dense" not in args.skip:
            try:
                label, ms, note = dense_reference(q, k, v, caches[p_main], n, group, scale)
                self.table.row(shape, size, "dense", label, "paged" if "FA3" in label else "contiguous", "-", "-",
                               fmt(ms), "-", "-", note or "-")
            except Exception as e:
                self.table.row(shape, size, "dense", "dense causal", "-", "-", "-", f"not available: {short(e)}",
                               "-", "-", "-")
            free(self.dev)

        for density in args.densities:
            mask = random_block_mask(hkv, n, FA4_BLOCK[0], density, gen)  # [Hkv, n/128, n/128]
            mask64 = refine_block_mask(mask, FA4_BLOCK, OUR_BLOCK)
            causal_blocks = (n // FA4_BLOCK[0]) * (n // FA4_BLOCK[0] + 1) // 2
            frac_blocks = mask.sum().item() / (hkv * causal_blocks)
            frac_pairs = visible_pairs(mask, FA4_BLOCK) / (hkv * n * (n + 1) / 2)
            cells = (shape, size, f"{frac_blocks:.3f} / {frac_pairs:.3f}")
            rows = sampled_rows(n)
            self.f64 = (f64_rows_reference(q, k, v, mask, FA4_BLOCK, rows, scale), rows)

            # ours: the index and its packing are the metadata
            meta_ms, bix = wall_ms(lambda: pack_ours(sa, our_index(mask64, n), h, d, n, dev), dev)
            ours_ms, ref = {}, None
            stack = shared_stack(d, group)
            ours_tile = f"{64 * stack}x64 ({stack} heads x 64 q)" if stack > 1 else "64x64"
            for p in args.pages:
                kc, vc, tbl = caches[p]
                out = torch.empty_like(q)

                def build(kc=kc, vc=vc, tbl=tbl, out=out):
                    run = lambda: sa.sparse_prefill_attention(q, kc, vc, tbl, [(0, 0, n, 0)], bix, scale, out)  # noqa
                    return run, meta_ms, lambda: out, "" if ref is not None else "the reference"

                tma = "TMA" if p % 64 == 0 and dev.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9 \
                    else "gathered"
                ms, got = self.attempt(cells, (f"ours (Triton), page {p}", f"paged ({tma})", ours_tile), build, ref,
                                       ours_ms.get(p_main, NAN), f"ours {shape} page {p}")
                ours_ms[p] = ms
                if ref is None and got is not None:
                    ref = got

            if n % 64 == 0:  # contiguous K/V seen as pages of 64 in order: what FA4 reads below
                out = torch.empty_like(q)
                lin = (k.view(n // 64, 64, hkv, d), v.view(n // 64, 64, hkv, d),
                       torch.arange(n // 64, dtype=torch.int32, device=dev)[None].contiguous())

                def build_lin(out=out, lin=lin):
                    run = lambda: sa.sparse_prefill_attention(q, *lin, [(0, 0, n, 0)], bix, scale, out)  # noqa
                    return run, meta_ms, lambda: out, ""

                ours_ms["contiguous"], _ = self.attempt(
                    cells, ("ours (Triton), contiguous K/V as pages of 64 in order", "contiguous (TMA)"
                            if dev.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9 else
                            "contiguous (gathered)", ours_tile),
                    build_lin, ref, ours_ms.get(p_main, NAN), f"ours {shape} contiguous")
                del out

            def base(kv):
                """Ours on the same K/V: the same page size, or contiguous; else the first page size."""
                got = ours_ms.get(kv, NAN)
                return got if got == got else ours_ms.get(p_main, NAN)

            if "flashinfer" not in args.skip:
                if self.workspace is None:
                    self.workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
                variants = [(OUR_BLOCK, p) for p in args.pages] + [((FA4_BLOCK[0], 64), 64)]
                for block, p in variants:
                    if p not in caches or block[1] % p:
                        continue
                    kc, vc, tbl = caches[p]
                    out = torch.empty_like(q)
                    fmask = mask64 if block == OUR_BLOCK else refine_block_mask(mask, FA4_BLOCK, block)

                    def build(kc=kc, vc=vc, tbl=tbl, out=out, fmask=fmask, block=block, p=p):
                        run, meta, backend = flashinfer_bsr(q, kc, vc, tbl, fmask, block, p, h, d, n, scale, out,
                                                            self.workspace)
                        return run, meta, lambda: out, f"backend {backend}, {hkv} launches"

                    self.attempt(cells, (f"FlashInfer BSR R={block[0]} C={p}, one wrapper per KV head",
                                         f"paged {p} (BSR pages)", FI_TILE),
                                 build, ref, base(p), f"flashinfer bsr {shape}")
                    del out
                    free(self.dev)
                if n <= args.variable_max * 1024:
                    def build_var():
                        run, meta, result = flashinfer_variable(q, k, v, mask64, h, d, scale, self.workspace)
                        return run, meta, result, "run() re-lays q/k/v every call"

                    self.attempt(cells, ("FlashInfer VariableBSR 64x64, per-KV-head masks",
                                         "contiguous HND (token indices)", FI_TILE),
                                 build_var, ref, base("contiguous"), f"flashinfer variable {shape}")
                    free(self.dev)

            if "fa4" not in args.skip:
                # (name, sparse block, tile_mn, K/V: "contiguous" / "varlen" / a page size)
                variants = []
                if "contiguous" in args.fa4:
                    variants += [("cute _flash_attn_fwd", FA4_BLOCK, None, "contiguous")]
                if "tile64" in args.fa4:
                    variants += [("cute _flash_attn_fwd, tile_mn=(128, 64)", (FA4_BLOCK[0], 64), (FA4_BLOCK[0], 64),
                                  "contiguous")]
                if "varlen" in args.fa4:
                    variants += [("vLLM flash_attn_varlen_func(fa_version=4)", FA4_BLOCK, None, "varlen")]
                if "paged" in args.fa4 and not self.fa4_paged_tried:  # once per run (its block-sparse loads
                    self.fa4_paged_tried = True                        # do not go through the page table)
                    variants += [("cute _flash_attn_fwd, page_table", FA4_BLOCK, None, p_main)]
                    if 64 in caches:
                        variants += [("cute _flash_attn_fwd, page_table, tile_mn=(128, 64)", (FA4_BLOCK[0], 64),
                                      (FA4_BLOCK[0], 64), 64)]
                for name, block, tile, kv in variants:
                    out = torch.empty_like(q)
                    fmask = mask if block == FA4_BLOCK else refine_block_mask(mask, FA4_BLOCK, block)

                    def build(out=out, fmask=fmask, block=block, tile=tile, kv=kv):
                        meta, tensors = wall_ms(lambda: block_mask_to_fa4(fmask, block, group), dev)
                        if kv == "varlen":
                            run = fa4_vllm_varlen(q, k, v, tensors, block, n, scale, out)
                        elif kv == "contiguous":
                            run = fa4_batch(q, k, v, None, tensors, block, tile, scale, out)
                        else:
                            run = fa4_batch(q, *caches[kv], tensors, block, tile, scale, out)
                        return run, meta, lambda: out, "per-query-head lists: no pack_gqa"

                    if isinstance(kv, int):
                        reads = f"paged {kv} ({'TMA' if kv == block[1] else 'cp.async'}), pages shuffled"
                    else:
                        reads = "contiguous (TMA)" + (", cu_seqlens_k" if kv == "varlen" else "")
                    self.attempt(cells, (f"FA4 {name}", reads, block_desc(tile or FA4_BLOCK)), build, ref,
                                 base(kv if isinstance(kv, int) else "contiguous"), f"fa4 {name} {kv} {shape}")
                    del out
                    free(self.dev)

            free(self.dev)
        free(self.dev)


def block_desc(block):
    return f"{block[0]}x{block[1]}"


def smoke(say) -> None:
    """Tiny sizes on the CPU (Triton interpreter): conversions against the token-level mask, our
    kernel on the refined mask against float64 attention, for pages of 64 and 16."""
    from benchmarks.kernels import paged_cache
    from vllm_sparse_kernels.prefill import attention as sa
    from vllm_sparse_kernels.reference.dense import masked_attention_f64
    from vllm_sparse_kernels.reference.index import index_to_dense_mask

    dev = torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    (shape, (h, hkv, d)), = SMOKE_SHAPES.items()
    group, n, density = h // hkv, 512, 0.5
    scale = 1.0 / math.sqrt(d)
    say(f"smoke: CPU, Triton interpreter, {shape} ({h} / {hkv} heads, d {d}), n {n}, fp16 (the interpreter's "
        "bf16 tl.dot is wrong), untimed; libraries skipped\n")
    mask = random_block_mask(hkv, n, FA4_BLOCK[0], density, gen)
    mask64 = refine_block_mask(mask, FA4_BLOCK, OUR_BLOCK)
    truth = tokens_from_blocks(mask, FA4_BLOCK, n)
    checks = {
        "refined 64x64 mask = 128x128 mask (tokens)": torch.equal(tokens_from_blocks(mask64, OUR_BLOCK, n), truth),
        "128x128 mask is representable at 64x64 and back": representable(mask64, OUR_BLOCK, FA4_BLOCK),
        "our index (tokens)": torch.equal(index_to_dense_mask(our_index(mask64, n), n, 0), truth),
    }
    for block in (FA4_BLOCK, (FA4_BLOCK[0], 64)):
        fmask = mask if block == FA4_BLOCK else refine_block_mask(mask, FA4_BLOCK, block)
        t = tokens_from_fa4(block_mask_to_fa4(fmask, block, group), block, n)
        checks[f"FA4 tensors {block_desc(block)} (tokens, per query head)"] = torch.equal(
            t, truth.repeat_interleave(group, 0))
    q, k, v = (torch.randn(n, x, d, generator=gen).to(torch.float16) for x in (h, hkv, hkv))
    ref = masked_attention_f64(q, k, v, truth.repeat_interleave(group, 0), scale)
    bix = pack_ours(sa, our_index(mask64, n), h, d, n, dev)
    errs = {}
    for p in (64, 16):
        kc, vc, tbl = paged_cache(k, v, p, dev)
        for rows, block in ((64, OUR_BLOCK), (128, (128, 64))):
            fmask = mask64 if block == OUR_BLOCK else refine_block_mask(mask, FA4_BLOCK, block)
            ok = all(torch.equal(tokens_from_bsr(*bsr_to_pages(*block_mask_to_bsr(fmask[i]), block[1], p, tbl[0]),
                                                 rows, p, tbl[0], n), truth[i]) for i in range(hkv))
            checks[f"FlashInfer BSR R={rows} C={p} on pages (tokens)"] = ok
        out = torch.full_like(q, float("nan"))
        sa.sparse_prefill_attention(q, kc, vc, tbl, [(0, 0, n, 0)], bix, scale, out)
        errs[p] = (out.double() - ref).abs().max().item()
    table = Table(say)
    table.header()
    cells = (shape, str(n), f"{mask.sum().item() / (hkv * (n // 128) * (n // 128 + 1) / 2):.3f} / "
                            f"{visible_pairs(mask, FA4_BLOCK) / (hkv * n * (n + 1) / 2):.3f}")
    for p, err in errs.items():
        table.row(*cells, f"ours (Triton), page {p}", "paged", "64x64", "-", "untimed", "-", "-",
                  f"{err:.2e} (vs float64)")
    for name in ("FlashInfer BSR", "FlashInfer VariableBSR", "FA4"):
        table.row(*cells, name, "-", "-", "-", "skipped (smoke)", "-", "-", "-")
    say("")
    for name, ok in checks.items():
        say(f"- {name}: {'ok' if ok else 'MISMATCH'}")
    bad = [name for name, ok in checks.items() if not ok] + [f"ours page {p}" for p, e in errs.items() if not e < 1e-2]
    if bad:
        raise SystemExit(f"smoke failed: {', '.join(bad)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32,128", help="n in K tokens (default 32,128)")
    ap.add_argument("--densities", default="0.05,0.1,0.2", help="block densities of the causal blocks")
    ap.add_argument("--shapes", default="qwen2.5-1.5b,llama3-8b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--pages", default="64,16", help="page sizes of the paged cache (the first is the reference)")
    ap.add_argument("--variable-max", type=int, default=32,
                    help="FlashInfer VariableBlockSparse up to this n in K tokens (token-level indices)")
    ap.add_argument("--skip", default="", help="comma list of: dense, flashinfer, fa4")
    ap.add_argument("--fa4", default="contiguous,tile64,varlen",
                    help="FA4 variants: contiguous (128x128 tiles), tile64 (128x64), varlen (vLLM's entry), paged "
                         "(page_table, once per run; in a process of its own: a block-sparse load that ignores the "
                         "page table may read out of bounds, which ends the process's CUDA context)")
    ap.add_argument("--budget-ms", type=float, default=300.0, help="timing budget per measurement")
    ap.add_argument("--reps", type=int, default=10, help="most timed repetitions per measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the output to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter), untimed")
    args = ap.parse_args()
    sink = open(args.out, "w") if args.out else None  # written line by line: a cut-off run keeps its rows

    def say(msg=""):
        print(msg, flush=True)
        if sink is not None:
            sink.write(msg + "\n")
            sink.flush()

    try:
        if args.smoke:
            smoke(say)
            return
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        import triton

        args.sizes = [int(s) * 1024 for s in args.sizes.split(",")]
        args.densities = [float(x) for x in args.densities.split(",")]
        args.pages = [int(p) for p in args.pages.split(",")]
        args.skip = {s for s in args.skip.split(",") if s}
        args.fa4 = {s for s in args.fa4.split(",") if s}
        cap = torch.cuda.get_device_capability()
        say(f"block-sparse causal attention, ours vs FlashInfer vs FA4, one prefill row, bf16; "
            f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}), triton {triton.__version__}; {package_versions()}")
        say(f"mask: drawn at {block_desc(FA4_BLOCK)} (FA4's SM90 tile, head dim 128), diagonal + random causal key "
            f"blocks, one mask per KV head shared by its query heads, seed {args.seed}; split into 64x64 for ours "
            f"and FlashInfer R=64 (the same pairs). 'blocks / pairs': kept share of the causal 128x128 blocks / "
            f"of the causal (query, key) pairs. 'x vs ours': ours' kernel ms on the same K/V (paged with the "
            f"same page size, or contiguous) / the method's (> 1: the method is faster). 'metadata ms': building "
            f"the method's lists from the mask (+ FlashInfer's plan), wall clock, outside the kernel time. "
            f"Last column: max abs difference from ours over all outputs / error against float64 attention on "
            f"{SAMPLED_ROWS} sampled rows (max |out - ref| / max |ref| per row and head); MISMATCH above "
            f"{MISMATCH}.\n")
        study = Study(args, say)
        study.table.header()
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        for shape in args.shapes.split(","):
            for n in args.sizes:
                try:
                    study.shape_size(shape, n, gen)
                except Exception as e:  # noqa: BLE001 - one (shape, n) failing must not end the study
                    study.table.row(shape, f"{n // 1024}K", "-", "all", "-", "-", "-", f"failed: {short(e, 160)}",
                                    "-", "-", "-")
                    free(study.dev)
        say("\nfirst call of each method (compile / JIT included), s: "
            + "; ".join(f"{k} {v:.1f}" for k, v in study.first_calls.items()))
    finally:
        if sink is not None:
            sink.close()


if __name__ == "__main__":
    main()
