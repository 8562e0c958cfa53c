"""fp8 (e4m3) KV cache vs bf16 KV cache in the sparse path's kernels, one layer, and the fp8 error.

One attention shape per run (``--shape``: Llama-3-8B, 32 query / 8 KV heads, by default; the
Qwen2.5-1.5B layout, 12 / 2, stacks two heads per program where Llama's stacks four), head dim 128,
paged cache with pages of ``--page`` tokens (16 by default; 64 is what serving asks for on Hopper,
read with TMA there) in random order, one row of n tokens (no context), n = 32K and 128K. K/V are standard
normal bf16; the fp8 cache holds them as vLLM's fp8 cache does: stored = value / scale in
float8_e4m3fn, one scale for K and one for V (here amax / 448, passed as fp32 device tensors).

Timed (median of CUDA events, ``kernels.bench``), bf16 cache and fp8 cache side by side:

* sparse kernel alone on a planted vertical-slash index (``--budgets``: the serving default
  1000 / 1000; ``kernels.plant_vs``: sink columns and random columns, the nearest diagonals and
  log-spaced bands of diagonals), one list per KV head (the backend's default
  ``kv_group_shared``: ``shared_stack`` of the group's heads stacked per program, 4 on Llama's
  group of 4, 2 on the 1.5B's group of 6); ``--stacks`` times other stackings beside it;
* the kernel's dense mode (every causal key; what the density fallback runs);
* last-q estimation (``vs_index.last_q_scores``, the chunk's last 64 queries against all keys,
  summed per KV group): the estimation pass that reads the whole K cache;
* cuDNN SDPA on bf16 K/V for scale (dense causal).

Error, at n = 2048 with a planted 200 / 600 index: max |out - float64 reference| over all
outputs, for the bf16 cache (reference on the bf16 K/V), the fp8 cache (reference on the
dequantised K/V: the kernel's own error) and the fp8 cache against the reference on the
original bf16 K/V (the kernel's error plus fp8 storage).

Needs only torch and triton (no vLLM): from the repository root,

    python -m benchmarks.studies.fp8_kv

About a minute on an H200. ``--smoke`` runs tiny sizes on the CPU under Triton's interpreter
(TRITON_INTERPRET=1), untimed: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

import triton  # noqa: E402

from benchmarks.kernels import SHAPES, bench, paged_cache, plant_vs, sa, sdpa_times  # noqa: E402
from vllm_sparse_kernels.reference.dense import masked_attention_f64  # noqa: E402
from vllm_sparse_kernels.reference.index import index_to_dense_mask  # noqa: E402
from vllm_sparse_kernels.prefill import vs_index as vsi  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def planted_index(lists: int, n: int, nv: int, ns: int, dev, gen):
    """Vertical-slash index of ``lists`` lists over one row of n tokens from planted columns and
    diagonals, through the GPU conversion the backend runs (vs_topk + vertical_slash_index)."""
    v, s = plant_vs(lists, n, nv, ns, dev, gen)
    v_cnt, s_cnt = v.sum(-1).to(torch.int32), s.sum(-1).to(torch.int32)
    v_idx, v_cnt, s_idx, s_cnt = vsi.vs_topk(v.float(), s.float(), v_cnt, s_cnt, nv, ns, select="torch")
    return vsi.vertical_slash_index(v_idx, v_cnt, s_idx, s_cnt, n, 0)


def fp8_copy(key_cache: torch.Tensor, value_cache: torch.Tensor):
    """The paged K/V as an fp8 cache of the same layout (one [pages, page, Hkv, 2D] tensor, K|V
    interleaved), stored = value / scale with scale = amax / 448, and the scales (fp32 [1])."""
    pages, page, hkv, d = key_cache.shape
    kv8 = torch.empty(pages, page, hkv, 2 * d, dtype=FP8, device=key_cache.device)
    k8, v8 = kv8[..., :d], kv8[..., d:]
    scales = []
    for src, dst in ((key_cache, k8), (value_cache, v8)):
        scale = (src.abs().amax().float() / FP8_MAX).clamp(min=1e-12).reshape(1)
        dst.copy_((src.float() / scale).to(FP8))
        scales.append(scale)
    return k8, v8, scales[0], scales[1]


def timer(dev):
    if dev.type == "cuda":
        return bench

    def once(fn, **_):  # smoke: one untimed call through the interpreter
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return once


def random_qkv(n: int, shape, dev, gen, dtype):
    h, hkv, d = shape
    return tuple(torch.randn(n, heads, d, device=dev, generator=gen).to(dtype) for heads in (h, hkv, hkv))


def paged_caches(k: torch.Tensor, v: torch.Tensor, page: int, dev):
    """(caches, block table): the paged K/V as a cache of their dtype and as an fp8 one, each as
    (key cache, value cache, the launcher's scale arguments)."""
    key_cache, value_cache, table = paged_cache(k, v, page, dev)
    k8, v8, ks, vs = fp8_copy(key_cache, value_cache)
    return {"bf16": (key_cache, value_cache, {}), "fp8": (k8, v8, {"k_scale": ks, "v_scale": vs})}, table


def speed(n: int, shape, page: int, dev, gen, nv: int, ns: int, dtype) -> dict:
    H, HKV, D = shape
    timed = timer(dev)
    scale = 1.0 / math.sqrt(D)
    q, k, v = random_qkv(n, shape, dev, gen, dtype)
    rec = {"n": n}
    if dev.type == "cuda":
        rec["cudnn"] = sdpa_times(q, k, v, H // HKV).get("cudnn", float("nan"))
    caches, table = paged_caches(k, v, page, dev)
    del k, v
    out = torch.empty_like(q)
    rows = [(0, 0, n, 0)]
    # one list per KV head, shared_stack() of the group's heads stacked per program (as the launcher packs it)
    index = stacked_index(rows, HKV, H // HKV, sa.shared_stack(D, H // HKV), n, nv, ns, dev, gen)
    dense = sa.pack_rows(rows, None, device=dev)
    for name, (kc, vc, sc) in caches.items():
        rec[f"sparse_{name}"] = timed(lambda: sa.sparse_prefill_attention(q, kc, vc, table, rows, index, scale, out,
                                                                          **sc))
        rec[f"dense_{name}"] = timed(lambda: sa.sparse_prefill_attention(q, kc, vc, table, rows, dense, scale, out,
                                                                         **sc))
        rec[f"lastq_{name}"] = timed(lambda: vsi.last_q_scores(q[n - 64:], kc, table[0], n, scale, group_sum=True,
                                                               k_scale=sc.get("k_scale")))
    return rec


def stacked_index(rows, lists: int, group: int, stack: int, n: int, nv: int, ns: int, dev, gen):
    """The planted index (one list per KV head) packed for ``stack`` heads per program: each
    list repeated for the ceil(group / stack) programs of its KV head (a stack that does not
    divide the group leaves padding rows in the last program, masked by the kernel)."""
    ix = planted_index(lists, n, nv, ns, dev, gen)
    return sa.pack_rows(rows, [ix.repeat_heads(-(-group // stack))], device=dev, heads_per_list=stack)


def stack_speed(n: int, shape, page: int, dev, gen, nv: int, ns: int, dtype, stacks: list[int]) -> list[dict]:
    """Sparse kernel and dense mode, bf16 and fp8 cache, at each number of query heads stacked per
    program (the launch table picks one; the others for comparison), with each output's largest
    difference from the first stack's (the same attention, so bf16 rounding only)."""
    H, HKV, D = shape
    timed = timer(dev)
    scale = 1.0 / math.sqrt(D)
    q, k, v = random_qkv(n, shape, dev, gen, dtype)
    caches, table = paged_caches(k, v, page, dev)
    del k, v
    rows = [(0, 0, n, 0)]
    dense = sa.pack_rows(rows, None, device=dev)
    first: dict[str, torch.Tensor] = {}
    recs = []
    for stack in stacks:
        index = stacked_index(rows, HKV, H // HKV, stack, n, nv, ns, dev,
                              torch.Generator(device=dev).manual_seed(1))  # the same lists at every stack
        rec = {"n": n, "stack": stack}
        for name, (kc, vc, sc) in caches.items():
            for mode, ix, extra in (("sparse", index, {}), ("dense", dense, {"heads_per_program": stack})):
                out = torch.empty_like(q)
                run = (lambda ix=ix, extra=extra, out=out, kc=kc, vc=vc, sc=sc:
                       sa.sparse_prefill_attention(q, kc, vc, table, rows, ix, scale, out, **sc, **extra))
                rec[f"{mode}_{name}"] = timed(run)
                key = f"{mode}_{name}"
                if key not in first:
                    first[key] = out
                rec[f"{key}_diff"] = (out.float() - first[key].float()).abs().max().item()
        recs.append(rec)
    return recs


def accuracy(n: int, shape, page: int, dev, gen, nv: int, ns: int, dtype) -> dict:
    H, HKV, D = shape
    scale = 1.0 / math.sqrt(D)
    q, k, v = random_qkv(n, shape, dev, gen, dtype)
    key_cache, value_cache, table = paged_cache(k, v, page, dev)
    k8, v8, ks, vs = fp8_copy(key_cache, value_cache)
    ix = planted_index(HKV, n, nv, ns, dev, gen)
    allowed = index_to_dense_mask(ix.repeat_heads(H // HKV), n, 0)
    rows = [(0, 0, n, 0)]
    out16, out8 = torch.empty_like(q), torch.empty_like(q)
    sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, [ix], scale, out16)
    sa.sparse_prefill_attention(q, k8, v8, table, rows, [ix], scale, out8, k_scale=ks, v_scale=vs)
    ref16 = masked_attention_f64(q, k, v, allowed, scale)
    # the dequantised K/V in the rows' order (the paged copy is the same values, pages permuted)
    pages = table[0].long()  # (indexed as bytes: not every torch build indexes fp8 tensors)
    kd = k8.view(torch.uint8)[pages].view(FP8).reshape(-1, HKV, D)[:n].double() * ks.double()
    vd = v8.view(torch.uint8)[pages].view(FP8).reshape(-1, HKV, D)[:n].double() * vs.double()
    ref8 = masked_attention_f64(q, kd, vd, allowed, scale)
    return {"n": n, "bf16": (out16.double() - ref16).abs().max().item(),
            "fp8": (out8.double() - ref8).abs().max().item(),
            "fp8_vs_bf16_ref": (out8.double() - ref16).abs().max().item(),
            "out_absmax": ref16.abs().max().item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32,128", help="n in K tokens (default 32,128)")
    ap.add_argument("--shape", default="llama3-8b", choices=[k for k, v in SHAPES.items() if v[2] == 128],
                    help="attention shape (benchmarks.common.SHAPES)")
    ap.add_argument("--page", type=int, default=16, help="tokens per cache page (64: TMA loads on Hopper)")
    ap.add_argument("--budgets", type=int, nargs=2, default=(1000, 1000), metavar=("VERTICAL", "SLASH"),
                    help="planted vertical / slash budget (default: the backend's default 1000 / 1000; the "
                         "2026-11-24 results used 1000 / 6096)")
    ap.add_argument("--stacks", default="", help="also time these query heads per program, e.g. 1,2,4 (sparse "
                                                  "kernel and dense mode, bf16 and fp8)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreter), untimed")
    args = ap.parse_args()
    shape, page = SHAPES[args.shape], args.page
    H, HKV, D = shape
    if args.smoke:  # fp16: the interpreter's bf16 tl.dot is wrong (tests/kernels/test_triton_kernels.py)
        dev, sizes, budgets, acc, dtype = torch.device("cpu"), [256], (40, 100), (256, 40, 100), torch.float16
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        dev, budgets, acc, dtype = torch.device("cuda"), tuple(args.budgets), (2048, 200, 600), torch.bfloat16
        sizes = [int(s) * 1024 for s in args.sizes.split(",")]
    hi = str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")  # bf16 / fp16
    gen = torch.Generator(device=dev).manual_seed(0)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter, untimed smoke run)"
    print(f"fp8 (e4m3) vs {hi} KV cache, one layer, {args.shape} shape ({H} / {HKV} heads, d {D}, "
          f"{sa.shared_stack(D, H // HKV)} heads stacked per program), page {page}, {hi} queries")
    print(f"device {device}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}; "
          f"kernels from {Path(sa.__file__).parent}")
    print(f"vertical-slash {budgets[0]} / {budgets[1]} planted, one list per KV head; ms, fp8 / {hi} in brackets\n")
    print(f"| n | cuDNN dense ({hi}) | sparse kernel {hi} / fp8 | dense mode {hi} / fp8 | last-q estimation {hi} / fp8 |")
    print("|---|---|---|---|---|")
    for n in sizes:
        r = speed(n, shape, page, dev, gen, *budgets, dtype)
        cells = [f"{r[f'{p}_bf16']:.3f} / {r[f'{p}_fp8']:.3f} ({r[f'{p}_fp8'] / r[f'{p}_bf16']:.2f}x)"
                 for p in ("sparse", "dense", "lastq")]
        size = f"{n // 1024}K" if n >= 1024 else str(n)
        print(f"| {size} | {r.get('cudnn', float('nan')):.3f} | " + " | ".join(cells) + " |", flush=True)
        del r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    stacks = [int(x) for x in args.stacks.split(",") if x]
    if any(st < 1 or st & (st - 1) or st > 4 for st in stacks):
        ap.error(f"--stacks {args.stacks}: heads per program must be 1, 2 or 4")
    if stacks:
        print(f"\nquery heads stacked per program (the launch table's: {sa.shared_stack(D, H // HKV)} for shared "
              f"lists; padding rows where a stack does not divide the group of {H // HKV}); ms, fp8 / {hi}; "
              "max |difference| from the first stack's output")
        print(f"| n | heads per program | sparse kernel {hi} / fp8 | dense mode {hi} / fp8 | max diff sparse / dense |")
        print("|---|---|---|---|---|")
        for n in sizes:
            for r in stack_speed(n, shape, page, dev, gen, *budgets, dtype, stacks):
                cells = [f"{r[f'{p}_bf16']:.3f} / {r[f'{p}_fp8']:.3f} ({r[f'{p}_fp8'] / r[f'{p}_bf16']:.2f}x)"
                         for p in ("sparse", "dense")]
                diff = f"{max(r['sparse_bf16_diff'], r['sparse_fp8_diff']):.1e} / " \
                       f"{max(r['dense_bf16_diff'], r['dense_fp8_diff']):.1e}"
                size = f"{n // 1024}K" if n >= 1024 else str(n)
                print(f"| {size} | {r['stack']} | " + " | ".join(cells) + f" | {diff} |", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    a = accuracy(acc[0], shape, page, dev, gen, acc[1], acc[2], dtype)
    print(f"\nmax abs error at n={a['n']}, planted {acc[1]} / {acc[2]} (outputs up to {a['out_absmax']:.2f}): "
          f"{hi} cache vs float64 on the {hi} K/V {a['bf16']:.2e}; fp8 cache vs float64 on the dequantised K/V "
          f"{a['fp8']:.2e}; fp8 cache vs float64 on the {hi} K/V (with fp8 storage) {a['fp8_vs_bf16_ref']:.2e}")


if __name__ == "__main__":
    main()
