"""Kernel benchmark: dense SDPA (flash / cuDNN) vs our Triton kernel, dense and sparse.

One table per model shape on the current device: n = 16K..256K, batch 1, bf16, paged KV
(page 16, random page order), one layer's attention. Sparse indices are built (untimed) with the
package's own torch code (``vertical_slash_to_selection`` + ``build_index``) from planted
structure:

* VS v/s: verticals = the first 30 columns + (v - 30) uniform random columns; slashes = the
  30 diagonals nearest the main one + (s - 30) diagonals in contiguous bands of 256 (128 for
  s < 2000) whose offsets are log-uniform in [64, n) — bands, not isolated lines, because that
  is what top-k over diagonal sums picks on real attention (random Q/K would pick scattered
  lines and make every method dense). Each head draws its own pattern.
* BS top-k: the diagonal block + (k - 1) random causal key blocks per query block and head.

Times: median of CUDA-event timings after a warm-up. TFLOP/s counts 4 * D * (query, key) pairs
actually computed (causal pairs of the selection). Speedup: best dense SDPA time / ours.

Run from the repo root: ``python -m benchmarks.kernels`` (``--sweep`` times launch variants,
``--sizes 16,32`` picks n in K tokens, ``--json FILE`` writes all numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import SHAPES, capture_graph, event_median

from vllm_sparse_kernels.prefill import attention as sa  # noqa: E402 - the checkout's (ROOT is on sys.path)
from vllm_sparse_backend.prefill.index import build_index, causal_block_mask, diagonal_block_mask, num_blocks  # noqa: E402

PAGE = 16


def bench(fn, budget_ms: float = 1500.0, max_reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    return event_median(fn, int(max(3, min(max_reps, budget_ms / max(est, 1e-3)))))


def random_qkv(n, shape, gen, device="cuda"):
    """Standard normal bf16 q [n, H, D], k and v [n, Hkv, D] of a model shape (drawn in that order)."""
    h, hkv, d = SHAPES[shape]
    return tuple(torch.randn(n, heads, d, device=device, dtype=torch.bfloat16, generator=gen) for heads in (h, hkv, hkv))


def line_printer():
    """(lines, say): say(msg) prints msg at once and keeps it in lines."""
    lines = []

    def say(msg):
        print(msg, flush=True)
        lines.append(msg)

    return lines, say


def paged_cache(k, v, page, gen_device):
    """[n, Hkv, D] K/V -> NHD-physical paged cache views [pages, page, Hkv, D] + block table."""
    n, hkv, d = k.shape
    pages = num_blocks(n, page)
    kv = torch.empty(pages, page, hkv, 2 * d, dtype=k.dtype, device=k.device).transpose(1, 2)
    key_cache, value_cache = kv.transpose(1, 2).split(d, -1)
    perm = torch.randperm(pages, device=k.device)
    pad = pages * page - n
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(pages, page, hkv, d)
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(pages, page, hkv, d)
    key_cache[perm] = kp
    value_cache[perm] = vp
    return key_cache, value_cache, perm.to(torch.int32)[None].contiguous()


def plant_vs(h, n, nv, ns, device, gen, band=None):
    """bool [h, n] vertical and slash keeps (see module doc). ``band=1``: scattered single
    diagonals, as the real models' estimated indices have them."""
    v = torch.zeros(h, n, dtype=torch.bool, device=device)
    v[:, :30] = True
    extra = torch.rand(h, n - 30, device=device, generator=gen).topk(min(nv - 30, n - 30), dim=-1).indices + 30
    v.scatter_(1, extra, True)
    s = torch.zeros(h, n, dtype=torch.bool, device=device)
    s[:, :30] = True
    band = band or (256 if ns >= 2000 else 128)
    nb = math.ceil((ns - 30) / band)
    starts = torch.exp(torch.empty(h, nb, device=device).uniform_(math.log(64), math.log(n), generator=gen)).long()
    pos = (starts[:, :, None] + torch.arange(band, device=device)).clamp(max=n - 1).view(h, -1)
    s.scatter_(1, pos, True)
    return v, s


def vs_index(h, n, nv, ns, device, gen, band=None):
    from vllm_sparse_backend.prefill.patterns.vertical_slash import vertical_slash_to_selection
    v, s = plant_vs(h, n, nv, ns, device, gen, band)
    sel = vertical_slash_to_selection(v, s, n, 0, 64)
    del v, s
    return sel.to_index(64, n, 0)


def bs_index(h, n, topk, device, gen):
    nqb = num_blocks(n, 64)
    causal = causal_block_mask(n, 0, 64, device)
    diag = diagonal_block_mask(n, 0, 64, device)
    scores = torch.rand(h, nqb, nqb, device=device, generator=gen)
    scores = scores.masked_fill(~causal, -1.0).masked_fill(diag, 2.0)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(2, scores.topk(min(topk, nqb), dim=-1).indices, True)
    del scores
    return build_index(keep & causal, 64, n, 0)


def index_pairs(ix, n) -> int:
    """(query, key) pairs the index computes (causal), summed over heads; single row, ctx 0."""
    h, nqb, maxb = ix.block_index.shape
    q0 = torch.arange(nqb, device=ix.block_index.device) * 64
    nq = (n - q0).clamp(max=64)
    total = 0
    for j0 in range(0, maxb, 64):
        kb = ix.block_index[:, :, j0:j0 + 64].to(torch.int64)
        a = q0[None, :, None] - kb * 64 + 1  # keys visible to the first query of the block
        acc = torch.zeros_like(a)
        for r in range(64):
            acc += ((a + r).clamp(0, 64)) * (r < nq)[None, :, None]
        total += int((acc * (kb >= 0)).sum())
    for j0 in range(0, ix.column_index.shape[-1], 256):
        c = ix.column_index[:, :, j0:j0 + 256].to(torch.int64)
        last = (q0 + nq - 1)[None, :, None]
        total += int((((last - c + 1).clamp(min=0)).minimum(nq[None, :, None]) * (c >= 0)).sum())
    return total


def vtag(var: dict) -> str:
    short = {"heads_per_program": "gh", "num_warps": "w", "num_stages": "s", "block_n": "n", "kv_major": "kv",
             "prefetch": "pf", "split": "sp", "stack": "st", "tma": "tma"}
    return "[" + ",".join(f"{short[k]}{int(v)}" for k, v in var.items()) + "]" if var else ""


def sdpa_times(q, k, v, group):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qd = q.transpose(0, 1).unsqueeze(0)
    kd = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    vd = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    res = {}
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)  # noqa
                res[name] = bench(fn)
        except Exception as e:  # backend not available for this shape
            res[name] = float("nan")
            print(f"  sdpa {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    del kd, vd
    return res


def run_shape(shape, sizes, args, gen, results):
    h, hkv, d = SHAPES[shape]
    group = h // hkv
    scale = 1.0 / math.sqrt(d)
    dev = "cuda"
    for nk in sizes:
        n = nk * 1024
        rec = {"shape": shape, "n": n}
        try:
            q, k, v = random_qkv(n, shape, gen, dev)
            rec.update({f"sdpa_{kk}": vv for kk, vv in sdpa_times(q, k, v, group).items()})
            key_cache, value_cache, table = paged_cache(k, v, PAGE, dev)
            del k, v
            out = torch.empty_like(q)
            rows = [(0, 0, n, 0)]
            dense_pairs = h * n * (n + 1) // 2
            rec["dense_pairs"] = dense_pairs

            dense = sa.pack_rows(rows, None, device=dev)
            variants = [dict()]
            if args.sweep:
                variants += [dict(heads_per_program=1, num_warps=4, num_stages=2, prefetch=False),
                             dict(heads_per_program=1, num_warps=4, num_stages=2, prefetch=True),
                             dict(heads_per_program=2, num_warps=8, num_stages=2, prefetch=False),
                             dict(heads_per_program=4, num_warps=16, num_stages=2, prefetch=True)]
            for var in variants:
                tag = "ours_dense" + vtag(var)
                try:
                    rec[tag] = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, dense,
                                                                        scale, out, **var))
                except Exception as e:
                    rec[tag] = float("nan")
                    print(f"  {tag}: {type(e).__name__}: {str(e)[:200]}", flush=True)

            for name, make in (("vs1000_6096", lambda: vs_index(h, n, 1000, 6096, dev, gen)),
                               ("vs100_800", lambda: vs_index(h, n, 100, 800, dev, gen)),
                               ("bs100", lambda: bs_index(h, n, 100, dev, gen))):
                try:
                    ix = make()
                    torch.cuda.empty_cache()
                    bix = sa.pack_rows(rows, [ix], device=dev)
                    rec[name + "_pairs"] = index_pairs(ix, n)
                    rec[name + "_maxb"] = ix.block_index.shape[-1]
                    rec[name + "_maxc"] = ix.column_index.shape[-1]
                    del ix
                    rec[name] = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, bix,
                                                                         scale, out))
                    if args.sweep and name != "vs100_800":
                        for var in (dict(num_warps=4, num_stages=2, block_n=64, prefetch=True),
                                    dict(num_warps=4, num_stages=2, block_n=128, prefetch=True),
                                    dict(num_warps=4, num_stages=2, block_n=128, prefetch=False),
                                    dict(num_warps=4, num_stages=1, block_n=64, prefetch=False),
                                    dict(num_warps=4, num_stages=3, block_n=64, prefetch=True)):
                            tag = name + vtag(var)
                            rec[tag] = bench(lambda: sa.sparse_prefill_attention(
                                q, key_cache, value_cache, table, rows, bix, scale, out, **var))
                        for gm in ((4,) if args.merged else ()):
                            if group % gm == 0:
                                mix = sa.merge_group_heads(bix, gm)
                                rec[f"{name}[merged{gm}]"] = bench(lambda: sa.sparse_prefill_attention(
                                    q, key_cache, value_cache, table, rows, mix, scale, out))
                                del mix
                        if name == "vs1000_6096":  # where does the time go: blocks vs columns
                            import dataclasses
                            only_b = dataclasses.replace(bix, column_count=torch.zeros_like(bix.column_count))
                            only_c = dataclasses.replace(bix, block_count=torch.zeros_like(bix.block_count))
                            rec[name + "[blocks only]"] = bench(lambda: sa.sparse_prefill_attention(
                                q, key_cache, value_cache, table, rows, only_b, scale, out))
                            rec[name + "[columns only]"] = bench(lambda: sa.sparse_prefill_attention(
                                q, key_cache, value_cache, table, rows, only_c, scale, out))
                    del bix
                except torch.cuda.OutOfMemoryError:
                    rec[name] = float("nan")
                    print(f"  {name} at n={n}: OOM building the index", flush=True)
                torch.cuda.empty_cache()
            del q, out, key_cache, value_cache
        except torch.cuda.OutOfMemoryError:
            print(f"  n={n}: OOM", flush=True)
        torch.cuda.empty_cache()
        results.append(rec)
        print(json.dumps(rec), flush=True)


def index_bench(n: int, gen) -> str:
    """Vertical-slash index building at n (Llama shape), last 64 queries, VS 1000/6096:
    the package's torch path vs vllm_sparse_kernels/prefill/vs_index.py (estimation + top-k + conversion)."""
    from vllm_sparse_backend.prefill.patterns.base import keep_top, last_queries_probs, vertical_and_slash_sums
    from vllm_sparse_backend.prefill.patterns.vertical_slash import vertical_slash_to_selection
    from vllm_sparse_kernels.reference.attention import kv_head_map
    from vllm_sparse_kernels.prefill import vs_index as vsi
    h, hkv, d = SHAPES["llama3-8b"]
    scale = 1.0 / math.sqrt(d)
    q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    key_cache, value_cache, table = paged_cache(k, k, PAGE, "cuda")
    kvh = kv_head_map(h, hkv, "cuda")
    nv = torch.full((h,), 1000, device="cuda")
    ns = torch.full((h,), 6096, device="cuda")

    def torch_scores():
        probs, qpos = last_queries_probs(q, k, kvh, 0, 64, scale)
        vert, slash = vertical_and_slash_sums(probs, qpos)
        vert[:, :30] = float("inf")
        slash[:, :30] = float("inf")
        return vert, slash

    def torch_path():
        vert, slash = torch_scores()
        sel = vertical_slash_to_selection(keep_top(vert, nv), keep_top(slash, ns), n, 0, 64)
        return sel.to_index(64, n, 0)

    def convert(vert, slash):
        return vsi.vertical_slash_index(*vsi.vs_topk(vert, slash, nv, ns, 1000, 6096), n, 0)

    def ours():
        vert, slash = vsi.last_q_scores(q[n - 64:], key_cache, table[0], n, scale)
        vert[:, :30] = float("inf")
        slash[:, :30] = float("inf")
        return convert(vert, slash)

    t_est = bench(lambda: vsi.last_q_scores(q[n - 64:], key_cache, table[0], n, scale))
    t_est_atomic = bench(lambda: vsi.last_q_scores(q[n - 64:], key_cache, table[0], n, scale, diagonals="atomic"))
    t_ours = bench(ours)
    t_torch = bench(torch_path, budget_ms=500)
    a, b = convert(*torch_scores()), torch_path()  # same scores: conversion must agree exactly
    same = torch.equal(a.block_count, b.block_count) and torch.equal(a.column_count, b.column_count)
    tv, ts = torch_scores()
    ov, os_ = vsi.last_q_scores(q[n - 64:], key_cache, table[0], n, scale)
    err = max(((ov - tv)[:, 30:].norm() / tv[:, 30:].norm()).item(), ((os_ - ts)[:, 30:].norm() / ts[:, 30:].norm()).item())
    return (f"index building, VS 1000/6096, n={n // 1024}K, Llama shape: torch path {t_torch:.1f} ms, "
            f"vs_index.py {t_ours:.1f} ms (of which last-q estimation {t_est:.1f} ms; {t_est_atomic:.1f} ms with one atomic "
            f"per element instead of per tile diagonal); conversion identical to torch on the same scores: "
            f"{same}; scores rel. err vs torch fp32: {err:.1e}")


def timed_line(label: str, fn, out, ref, best: float, pairs: int, d: int) -> str:
    """Time ``fn`` (which writes ``out``): ``label: ms (speedup vs best, TFLOP/s of the computed
    pairs), max |diff|`` against ``ref`` (none when ``ref`` is None), or the error it raised."""
    try:
        out.zero_()
        t = bench(fn)
        line = f"{label}: {t:.2f} ms ({best / t:.2f}x, {4 * d * pairs / (t * 1e-3) / 1e12:.0f} TFLOP/s)"
        if ref is not None:
            line += f", max |diff| {(out.float() - ref.float()).abs().max().item():.1e}"
        return line
    except Exception as e:
        return f"{label}: {type(e).__name__}: {str(e)[:160]}"


def shared_sweep(sizes, gen, shape="llama3-8b") -> list[str]:
    """Group-shared lists (one list per KV head, the group's query heads stacked in one program)
    vs the same lists run per head (expanded); plus estimation with per-group top-k.
    Prints one line per (n, index, variant); returns the lines."""
    from vllm_sparse_kernels.prefill import vs_index as vsi
    h, hkv, d = SHAPES[shape]
    group = h // hkv
    scale = 1.0 / math.sqrt(d)
    dev = "cuda"
    lines, say = line_printer()

    for nk in sizes:
        n = nk * 1024
        q, k, v = random_qkv(n, shape, gen, dev)
        best = min(sdpa_times(q, k, v, group).values())
        key_cache, value_cache, table = paged_cache(k, v, PAGE, dev)
        rows = [(0, 0, n, 0)]
        out = torch.empty_like(q)
        ref = torch.empty_like(q)
        say(f"{shape} n={nk}K best dense SDPA {best:.2f} ms")
        for name, make in (("vs1000_6096", lambda: vs_index(hkv, n, 1000, 6096, dev, gen)),
                           ("bs100", lambda: bs_index(hkv, n, 100, dev, gen))):
            ix_kv = make()
            ix_h = ix_kv.repeat_heads(group)
            pairs = index_pairs(ix_h, n)
            per_head = sa.pack_rows(rows, [ix_h], device=dev)
            t_h = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, per_head, scale, ref))
            tf = 4 * d * pairs / (t_h * 1e-3) / 1e12
            say(f"  {name} density {pairs / (h * n * (n + 1) / 2):.3f}: per head (gh1 default) {t_h:.2f} ms "
                f"({best / t_h:.1f}x, {tf:.0f} TFLOP/s)")
            for var in ((dict(num_stages=2), dict(num_stages=4)) if d >= 128 else (dict(block_n=64),)):
                t = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, per_head, scale,
                                                              out, **var))
                say(f"    per head {vtag(var)}: {t:.2f} ms ({best / t:.1f}x)")
            for gh in (2, 4):
                lists = ix_kv.repeat_heads(group // gh)
                shared = sa.pack_rows(rows, [lists], device=dev, heads_per_list=gh)
                if d >= 128:
                    variants = (dict(), dict(num_warps=8, num_stages=3), dict(num_warps=4 * gh, num_stages=4))
                else:
                    variants = (dict(num_warps=4 * gh, num_stages=3), dict(num_warps=4 * gh, num_stages=2),
                                dict(num_warps=4 * gh, num_stages=2, block_n=128))
                for var in variants:
                    say(timed_line(f"    shared gh{gh} {vtag(var)}", lambda: sa.sparse_prefill_attention(
                        q, key_cache, value_cache, table, rows, shared, scale, out, **var), out, ref, best, pairs, d))
                del shared, lists
            del per_head, ix_h, ix_kv
            torch.cuda.empty_cache()
        # estimation: per-head top-k + conversion vs per-group (scores summed over the group)
        nv, ns = 1000, 6096

        def est(shared: bool):
            vert, slash = vsi.last_q_scores(q[n - 64:], key_cache, table[0], n, scale)
            if shared:
                vert, slash = vert.view(hkv, group, n).sum(1), slash.view(hkv, group, n).sum(1)
            vert[:, :30] = float("inf")
            slash[:, :30] = float("inf")
            return vsi.vertical_slash_index(*vsi.vs_topk(vert, slash, nv, ns, nv, ns), n, 0)

        t_scores = bench(lambda: vsi.last_q_scores(q[n - 64:], key_cache, table[0], n, scale))
        say(f"  estimation VS 1000/6096: scores {t_scores:.2f} ms, + top-k + conversion per head "
            f"{bench(lambda: est(False)):.2f} ms, per KV group {bench(lambda: est(True)):.2f} ms")
        del q, k, v, key_cache, value_cache, out, ref
        torch.cuda.empty_cache()
    return lines


def config_sweep(sizes, gen, shape="qwen2.5-1.5b") -> list[str]:
    """Launch variants for one shape, dense and with group-shared lists of scattered single
    diagonals (the real models' structure), including padded head stacks (groups of 6 stacked
    4 at a time). Prints one line per (n, index, variant) with ms, speedup vs the best SDPA and
    TFLOP/s of the computed pairs; returns the lines."""
    h, hkv, d = SHAPES[shape]
    group = h // hkv
    scale = 1.0 / math.sqrt(d)
    dev = "cuda"
    lines, say = line_printer()
    stacks = [g for g in (1, 2, 4) if g <= group]
    for nk in sizes:
        n = nk * 1024
        q, k, v = random_qkv(n, shape, gen, dev)
        best = min(sdpa_times(q, k, v, group).values())
        rows = [(0, 0, n, 0)]
        out = torch.empty_like(q)
        ref = torch.empty_like(q)
        say(f"{shape} n={nk}K best dense SDPA {best:.2f} ms")
        dense = sa.pack_rows(rows, None, device=dev)
        dense_pairs = h * n * (n + 1) // 2
        # one index for every page size and variant: lists of scattered single diagonals
        ix_kv = vs_index(hkv, n, 250, 1000, dev, gen, band=1)
        pairs = index_pairs(ix_kv.repeat_heads(group), n)
        say(f"  index: scattered vs250_1000 shared per KV head, density {pairs / dense_pairs:.3f}")
        for page in (16, 64):
            key_cache, value_cache, table = paged_cache(k, v, page, dev)
            # page 16: gathered loads; page 64: gathered vs TMA with 2-4 stages
            variants = [dict(num_stages=3)] + ([dict(num_stages=st, tma=True) for st in (2, 3, 4)] if page % 64 == 0
                                               else [])
            for gh in stacks:
                for var in variants:
                    var = dict(heads_per_program=gh, num_warps=4 * gh, **var)
                    try:
                        t = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, dense,
                                                                      scale, out, **var))
                        say(f"  page {page} dense {vtag(var)}: {t:.2f} ms ({best / t:.2f}x, "
                            f"{4 * d * dense_pairs / (t * 1e-3) / 1e12:.0f} TFLOP/s)")
                    except Exception as e:
                        say(f"  page {page} dense {vtag(var)}: {type(e).__name__}: {str(e)[:160]}")
            for gh in stacks:
                lists = ix_kv.repeat_heads(-(-group // gh))
                shared = sa.pack_rows(rows, [lists], device=dev, heads_per_list=gh)
                for var in variants:
                    var = dict(num_warps=4 * gh, **var)
                    first = page == 16 and gh == stacks[0]  # the reference: gathered loads, the first stack
                    say(timed_line(f"  page {page} sparse gh{gh} {vtag(var)}", lambda: sa.sparse_prefill_attention(
                        q, key_cache, value_cache, table, rows, shared, scale, out, **var), out,
                        None if first else ref, best, pairs, d))
                    if first:
                        ref.copy_(out)
                del shared, lists
            del key_cache, value_cache, table
            torch.cuda.empty_cache()
        del ix_kv
        del q, k, v, out, ref
        torch.cuda.empty_cache()
    return lines


def estimate_bench(sizes, gen, shape="llama3-8b") -> list[str]:
    """Where vertical-slash estimation time goes, and our dense path's launch variants.

    Per n: cuDNN and our dense kernel (default and a few stage/warp variants); last-q scores per
    query head then summed per KV group (the old shared path) vs summed in the kernel with the
    group's heads stacked (``group_sum``, several stacks); top-k with per-head tensor budgets vs
    one host budget; the conversion; ``estimate_index_paged`` as the backend calls it (shared and
    per head); the sparse kernel on planted group-shared VS 1000/6096 lists for the share.
    Prints one line per measurement; returns the lines."""
    from vllm_sparse_backend.config import SparseSettings
    from vllm_sparse_backend.head_configs import resolve_head
    from vllm_sparse_backend.prefill.estimate import HeadGroups, estimate_index_paged
    from vllm_sparse_backend.prefill.budgets import kv_group_share
    from vllm_sparse_kernels.prefill import vs_index as vsi
    h, hkv, d = SHAPES[shape]
    group = h // hkv
    scale = 1.0 / math.sqrt(d)
    dev = "cuda"
    lines, say = line_printer()

    for nk in sizes:
        n = nk * 1024
        q, k, v = random_qkv(n, shape, gen, dev)
        sd = sdpa_times(q, k, v, group)
        best = min(sd.values())
        key_cache, value_cache, table = paged_cache(k, v, PAGE, dev)
        del k, v
        rows = [(0, 0, n, 0)]
        out = torch.empty_like(q)
        say(f"{shape} n={nk}K: SDPA flash {sd['flash']:.2f} ms, cuDNN {sd['cudnn']:.2f} ms")
        if nk <= 256:
            dense = sa.pack_rows(rows, None, device=dev)
            variants = (dict(), dict(num_stages=2, prefetch=False), dict(num_stages=4, prefetch=True),
                        dict(num_warps=8, num_stages=3, prefetch=True)) if d >= 128 else (dict(),)
            for var in variants:
                try:
                    t = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, dense, scale,
                                                                  out, **var))
                    say(f"  ours dense {vtag(var) or '[default]'}: {t:.2f} ms ({t / best:.3f}x best dense)")
                except Exception as e:
                    say(f"  ours dense {vtag(var)}: {type(e).__name__}: {str(e)[:160]}")
            del dense
        # sparse kernel on planted shared lists: the denominator of the estimation share
        ix_kv = vs_index(hkv, n, 1000, 6096, dev, gen)
        # one list per KV head, handed over unpacked as the backend does (the launcher stacks)
        t_kernel = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, [ix_kv], scale,
                                                             out))
        say(f"  sparse kernel, planted VS 1000/6096 shared lists: {t_kernel:.2f} ms ({best / t_kernel:.1f}x)")
        del ix_kv
        ql = q[n - 64:]
        t_old = bench(lambda: [t.view(hkv, group, n).sum(1)
                               for t in vsi.last_q_scores(ql, key_cache, table[0], n, scale)])
        ref_v, ref_s = [t.view(hkv, group, n).sum(1) for t in vsi.last_q_scores(ql, key_cache, table[0], n, scale)]
        say(f"  last-q scores per head + group sum: {t_old:.3f} ms")
        for st, w, split in ((None, None, None), (4, 8, 4096), (4, 8, 2048), (4, 8, 1024), (2, 4, 4096), (2, 4, 2048),
                             (2, 4, 1024), (1, 4, 2048)):
            if group % (st or 1):
                continue
            fn = lambda: vsi.last_q_scores(ql, key_cache, table[0], n, scale, group_sum=True, stack=st,  # noqa: E731
                                           num_warps=w, split=split)
            gv, gs = fn()
            err = max(((gv - ref_v).norm() / ref_v.norm()).item(), ((gs - ref_s).norm() / ref_s.norm()).item())
            tag = "default" if st is None else f"stack {st} w{w} split {split}"
            say(f"  last-q scores group_sum {tag}: {bench(fn):.3f} ms (rel diff {err:.1e})")
        ref_v[:, :30] = float("inf")
        ref_s[:, :30] = float("inf")
        nv_t = torch.full((hkv,), 1000, device=dev)
        ns_t = torch.full((hkv,), 6096, device=dev)
        t_topk_t = bench(lambda: vsi.vs_topk(ref_v, ref_s, nv_t, ns_t, 1000, 6096))
        t_topk_i = bench(lambda: vsi.vs_topk(ref_v, ref_s, 1000, 6096, 1000, 6096))
        a, b = vsi.vs_topk(ref_v, ref_s, nv_t, ns_t, 1000, 6096), vsi.vs_topk(ref_v, ref_s, 1000, 6096, 1000, 6096)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        t_conv = bench(lambda: vsi.vertical_slash_index(*b, n, 0))
        say(f"  top-k tensor budgets {t_topk_t:.3f} ms, host budgets {t_topk_i:.3f} ms (same lists: {same}); "
            f"conversion {t_conv:.3f} ms")
        for shared_sel in (True, False):
            cfg = SparseSettings(kv_group_shared=shared_sel)
            heads = [resolve_head(None, cfg)] * h
            groups = HeadGroups.from_heads(heads, dev, kv_group_share(heads, hkv, cfg))
            t_est = bench(lambda: estimate_index_paged(q, key_cache, table[0], 0, groups, cfg, scale))
            say(f"  estimate_index_paged {'shared' if shared_sel else 'per head'} (default settings): {t_est:.3f} ms"
                + (f" = {t_est / (t_est + t_kernel):.1%} of estimate + planted kernel" if shared_sel else ""))
        del q, key_cache, value_cache, out
        torch.cuda.empty_cache()
    return lines


def graph_ms(fn, reps: int = 20) -> float:
    """GPU time of ``fn`` (mean of ``reps`` replays of a CUDA graph of it): what it costs when the
    host is ahead, as in the engine's eager forward with no sync in the layer."""
    fn()
    torch.cuda.synchronize()
    graph = capture_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        graph.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def lastq_bench(sizes, gen, chunk: int = 16384, shape="llama3-8b") -> list[str]:
    """Vertical-slash estimation of one chunk at the end of n tokens of context, stage by stage:
    ``last_q_scores`` (group-summed, as the default shared path) for each way of getting the
    diagonal sums and a few launch variants, ``vs_topk`` torch vs radix select, and the whole
    ``estimate_index_paged`` of a ``chunk``-query row. Each: eager median (host launch included)
    and GPU time (CUDA-graph replay); scores compared with the gather mode's. (Runs 28-29 also
    timed the scratch mode that skew replaced, removed since.)"""
    from vllm_sparse_backend.config import SparseSettings
    from vllm_sparse_backend.head_configs import resolve_head
    from vllm_sparse_backend.prefill.estimate import HeadGroups, estimate_index_paged
    from vllm_sparse_backend.prefill.budgets import kv_group_share
    from vllm_sparse_kernels.prefill import vs_index as vsi
    h, hkv, d = SHAPES[shape]
    scale = 1.0 / math.sqrt(d)
    lines, say = line_printer()
    for nk in sizes:
        n = nk * 1024
        q, k, v = random_qkv(n, shape, gen)
        key_cache, value_cache, table = paged_cache(k, v, PAGE, "cuda")
        del k, v
        ql = q[n - 64:]
        say(f"{shape} context {nk}K, 64 last queries, group-summed scores; eager ms / GPU ms (graph)")
        ref = vsi.last_q_scores(ql, key_cache, table[0], n, scale, group_sum=True, diagonals="gather")
        w4 = dict(num_warps=4)
        variants = [("gather", {}), ("skew", dict(num_warps=8)), ("skew", {}),
                    ("skew", dict(w4, num_stages=2)), ("skew", dict(w4, num_stages=4)), ("skew", dict(w4, block_n=32)),
                    ("skew", dict(w4, block_n=32, num_stages=4)), ("skew", dict(w4, block_n=128)),
                    ("skew", dict(num_warps=2)), ("skew", dict(stack=2, num_warps=2)), ("skew", dict(w4, split=1024)),
                    ("skew", dict(w4, split=4096)), ("skew", dict(num_warps=8, block_n=32))]
        for mode, var in variants:
            fn = lambda: vsi.last_q_scores(ql, key_cache, table[0], n, scale, group_sum=True,  # noqa: E731
                                           diagonals=mode, **var)
            try:
                got = fn()
                err = max(((g - r).norm() / r.norm()).item() for g, r in zip(got, ref))
                say(f"  last-q {mode} {vtag(var) or '[default]'}: {bench(fn):.3f} / {graph_ms(fn):.3f} ms "
                    f"(rel diff {err:.1e})")
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                say(f"  last-q {mode} {vtag(var)}: {type(e).__name__}: {str(e)[:160]}")
        vert, slash = ref
        vert[:, :30] = float("inf")
        slash[:, :30] = float("inf")
        picks = {}
        for sel in ("torch", "radix"):
            fn = lambda: vsi.vs_topk(vert, slash, 1000, 6096, 1000, 6096, select=sel)  # noqa: E731
            picks[sel] = fn()
            say(f"  vs_topk {sel}: {bench(fn):.3f} / {graph_ms(fn):.3f} ms")
        same = all(torch.equal(a, b) for a, b in zip(picks["torch"], picks["radix"]))
        say(f"  vs_topk torch and radix give the same lists: {same}")
        cfg = SparseSettings()
        heads = [resolve_head(None, cfg)] * h
        groups = HeadGroups.from_heads(heads, "cuda", kv_group_share(heads, hkv, cfg))
        ctx = n - chunk
        fn = lambda: estimate_index_paged(q[ctx:], key_cache, table[0], ctx, groups, cfg, scale)  # noqa: E731
        say(f"  estimate_index_paged, {chunk // 1024}K chunk at {ctx // 1024}K context (defaults): "
            f"{bench(fn):.3f} / {graph_ms(fn):.3f} ms")
        del q, key_cache, value_cache, ref, vert, slash, picks
        torch.cuda.empty_cache()
    return lines


def fmt_table(shape, recs, d):
    lines = [f"\n### {shape} (H/Hkv/D = {'/'.join(map(str, SHAPES[shape]))}), bf16, page {PAGE}, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {sa.triton.__version__}",
             "| n | SDPA flash ms | SDPA cuDNN ms | ours dense ms (vs best) | dense TFLOP/s best / ours | "
             "VS 1000/6096 ms (x, TFLOP/s, density) | VS 100/800 ms (x, TFLOP/s, density) | BS top-100 ms (x, TFLOP/s, density) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in recs:
        best = min(x for x in (r.get("sdpa_flash", float("nan")), r.get("sdpa_cudnn", float("nan"))) if x == x) \
            if any(r.get(k, float("nan")) == r.get(k, float("nan")) for k in ("sdpa_flash", "sdpa_cudnn")) else float("nan")
        ours = r.get("ours_dense", float("nan"))
        tf = lambda pairs, ms: 4 * d * pairs / (ms * 1e-3) / 1e12  # noqa: E731
        dp = r.get("dense_pairs", 0)
        cells = [f"{r['n'] // 1024}K", f"{r.get('sdpa_flash', float('nan')):.2f}",
                 f"{r.get('sdpa_cudnn', float('nan')):.2f}", f"{ours:.2f} ({ours / best:.2f}x)",
                 f"{tf(dp, best):.0f} / {tf(dp, ours):.0f}"]
        for name in ("vs1000_6096", "vs100_800", "bs100"):
            ms = r.get(name, float("nan"))
            pairs = r.get(name + "_pairs", 0)
            cells.append(f"{ms:.2f} ({best / ms:.1f}x, {tf(pairs, ms):.0f}, {pairs / max(dp, 1):.1%})"
                         if ms == ms else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,32,64,128,256")
    ap.add_argument("--shapes", default="llama3-8b,qwen2.5")
    ap.add_argument("--sweep", action="store_true", help="also time launch variants")
    ap.add_argument("--merged", action="store_true", help="with --sweep: also time merge_group_heads(4)")
    ap.add_argument("--index-bench", type=int, default=0, help="only time index building at this n (K tokens)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lastq-bench", action="store_true",
                    help="only time the vertical-slash estimation stages of a chunk (--sizes: context in K)")
    ap.add_argument("--estimate-bench", action="store_true",
                    help="only estimation split (scores / top-k / conversion) and dense launch variants")
    ap.add_argument("--shared-sweep", action="store_true",
                    help="only time group-shared lists (one per KV head, heads stacked) vs per head")
    ap.add_argument("--config-sweep", action="store_true",
                    help="only launch variants, dense and group-shared scattered lists (padded stacks too)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.config_sweep:
        for shape in args.shapes.split(","):
            config_sweep([int(s) for s in args.sizes.split(",")], gen, shape)
        return
    if args.lastq_bench:
        for shape in args.shapes.split(","):
            lastq_bench([int(s) for s in args.sizes.split(",")], gen, shape=shape)
        return
    if args.estimate_bench:
        for shape in args.shapes.split(","):
            estimate_bench([int(s) for s in args.sizes.split(",")], gen, shape)
        return
    if args.shared_sweep:
        for shape in args.shapes.split(","):
            shared_sweep([int(s) for s in args.sizes.split(",")], gen, shape)
        return
    if args.index_bench:
        print(index_bench(args.index_bench * 1024, gen))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    tables, results = [], []
    for shape in args.shapes.split(","):
        recs = []
        run_shape(shape, sizes, args, gen, recs)
        results += recs
        tables.append(fmt_table(shape, recs, SHAPES[shape][2]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n".join(tables))


if __name__ == "__main__":
    main()
