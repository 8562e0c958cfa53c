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

Run from the repo root: ``python -m benchmarks.kernels`` (``--sizes 16,32`` picks n in K tokens,
``--config-sweep`` times the launch variants behind the launch table, ``--json FILE`` writes all numbers).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.common import SHAPES, event_median

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


def run_shape(shape, sizes, gen, results):
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
            try:
                rec["ours_dense"] = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows,
                                                                             dense, scale, out))
            except Exception as e:
                rec["ours_dense"] = float("nan")
                print(f"  ours_dense: {type(e).__name__}: {str(e)[:200]}", flush=True)

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


def config_sweep(sizes, gen, shape="qwen2.5-1.5b") -> None:
    """Launch variants for one shape, dense and with group-shared lists of scattered single
    diagonals (the real models' structure), including padded head stacks (groups of 6 stacked
    4 at a time). Prints one line per (n, index, variant) with ms, speedup vs the best SDPA and
    TFLOP/s of the computed pairs."""
    h, hkv, d = SHAPES[shape]
    group = h // hkv
    scale = 1.0 / math.sqrt(d)
    dev = "cuda"
    say = functools.partial(print, flush=True)
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
                    say(timed_line(f"  page {page} dense {vtag(var)}", lambda: sa.sparse_prefill_attention(
                        q, key_cache, value_cache, table, rows, dense, scale, out, **var), out, None, best,
                        dense_pairs, d))
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


def fmt_table(shape, recs, d):
    lines = [f"\n### {shape} (H/Hkv/D = {'/'.join(map(str, SHAPES[shape]))}), bf16, page {PAGE}, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {sa.triton.__version__}",
             "| n | SDPA flash ms | SDPA cuDNN ms | ours dense ms (vs best) | dense TFLOP/s best / ours | "
             "VS 1000/6096 ms (x, TFLOP/s, density) | VS 100/800 ms (x, TFLOP/s, density) | BS top-100 ms (x, TFLOP/s, density) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in recs:
        sdpa = [r[k] for k in ("sdpa_flash", "sdpa_cudnn") if k in r and r[k] == r[k]]  # x == x: not NaN
        best = min(sdpa, default=float("nan"))
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
    ap.add_argument("--json", default=None)
    ap.add_argument("--config-sweep", action="store_true",
                    help="only launch variants, dense and group-shared scattered lists (padded stacks too)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.config_sweep:
        for shape in args.shapes.split(","):
            config_sweep([int(s) for s in args.sizes.split(",")], gen, shape)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    tables, results = [], []
    for shape in args.shapes.split(","):
        recs = []
        run_shape(shape, sizes, gen, recs)
        results += recs
        tables.append(fmt_table(shape, recs, SHAPES[shape][2]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("\n".join(tables))


if __name__ == "__main__":
    main()
