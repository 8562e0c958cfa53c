"""One layer's sparse path as the CUDA backend runs it, on a chunked prefill, vs dense attention.

For a prompt of n tokens split into chunks of ``--chunk`` queries (vLLM's chunked prefill), each
chunk is one sparse row (q_len = chunk, ctx_len = tokens before it) run the way
``run_sparse_rows_paged`` runs it: GPU index estimation on the paged cache
(``paged_estimate.estimate_index_paged``), then the Triton block+column kernel. Times are summed
over the chunks, estimation and kernel separately, and compared with dense causal attention over
the same n tokens (torch SDPA, flash and cuDNN, the faster one) and with our kernel's dense mode.

Q/K carry planted structure so that the estimators make realistic choices (random Q/K would make
vertical-slash pick scattered lines, i.e. nearly dense): a rotary-like component whose score
decays with distance (local attention: a band of diagonals), sink columns and ~500 strong
key columns per KV head that every query likes (verticals). Llama-3-8B shape (32/8 heads,
d=128), bf16, page 16 in random order.

    python benchmarks/backend_path.py --sizes 16,32,64,128 --chunk 16384

Variants: vertical-slash 1000/6096 with one selection per query head and with ``kv_group_shared``
(the default: one selection per KV head, the group's heads stacked in the kernel), block-sparse
top-100 (shared), FlexPrefill gamma 0.9 and 0.95 (per head: FlexPrefill never shares) and A-shape.
``--chunk 0`` runs the whole prompt as one row (the kernel benchmark's setting, with estimation).

Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels import PAGE, bench, paged_cache, sdpa_times  # noqa: E402

from vllm_sparse_backend.config import PatternName, SparseSettings  # noqa: E402
from vllm_sparse_backend.head_configs import resolve_head  # noqa: E402
from vllm_sparse_backend.index import count_pairs  # noqa: E402
from vllm_sparse_backend.paged_estimate import HeadGroups, estimate_index_paged  # noqa: E402
from vllm_sparse_backend.plan import SparseRow, kv_group_share  # noqa: E402
from vllm_sparse_backend.triton_kernels import sparse_attention as sa  # noqa: E402


def structured_qkv(n, h, hkv, d, gen, dev="cuda"):
    q = torch.randn(n, h, d, device=dev, generator=gen)
    k = torch.randn(n, hkv, d, device=dev, generator=gen)
    v = torch.randn(n, hkv, d, device=dev, dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(n, device=dev, dtype=torch.float32)
    # local band: sum over 6 frequency pairs of cos(theta_m (i - j)), theta_m = pi / (4096 * 2^m)
    for m in range(6):
        theta = math.pi / (4096 * 2 ** m)
        c, s = torch.cos(theta * pos), torch.sin(theta * pos)
        a = 2.0
        q[:, :, 2 * m], q[:, :, 2 * m + 1] = a * c[:, None], a * s[:, None]
        k[:, :, 2 * m], k[:, :, 2 * m + 1] = a * c[:, None], a * s[:, None]
    # verticals: sinks and strong columns along a direction every query shares
    u = torch.zeros(d, device=dev)
    u[12:] = torch.randn(d - 12, device=dev, generator=gen)
    u /= u.norm()
    q += 3.0 * u
    hot = torch.rand(hkv, n, device=dev, generator=gen) < 500 / n
    hot[:, :8] = True
    k += 8.0 * hot.T[:, :, None] * u
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v


def run(n, chunk, settings_list, gen, h=32, hkv=8, d=128, dev="cuda"):
    scale = 1.0 / math.sqrt(d)
    q, k, v = structured_qkv(n, h, hkv, d, gen, dev)
    rec = {"n": n}
    rec.update(sdpa_times(q, k, v, h // hkv))
    key_cache, value_cache, table = paged_cache(k, v, PAGE, dev)
    del k, v
    out = torch.empty_like(q)
    chunk = chunk or n  # 0: the whole prompt is one row
    rows = [SparseRow(0, s, min(chunk, n - s), s) for s in range(0, n, chunk)]
    dense = sa.pack_rows(rows, None, device=dev)  # all chunks in one launch (same area)
    rec["ours_dense"] = bench(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, rows, dense,
                                                                  scale, out))
    causal = h * n * (n + 1) // 2
    for name, cfg in settings_list:
        heads = [resolve_head(None, cfg)] * h
        groups = HeadGroups.from_heads(heads, dev, kv_group_share(heads, hkv, cfg))

        def est(r):
            return estimate_index_paged(q[r.tok_start:r.tok_start + r.q_len], key_cache, table[0], r.ctx_len,
                                        groups, cfg, scale).index

        indices = [est(r) for r in rows]
        pairs = sum(count_pairs(ix, r.q_len, r.ctx_len) for ix, r in zip(indices, rows)) * groups.share

        def kernel_only():
            for r, ix in zip(rows, indices):
                sa.sparse_prefill_attention(q, key_cache, value_cache, table, [r], [ix], scale, out)

        def estimate_only():
            for r in rows:
                est(r)

        def full():  # what the backend does per chunk: estimate, then the kernel
            for r in rows:
                sa.sparse_prefill_attention(q, key_cache, value_cache, table, [r], [est(r)], scale, out)

        rec[name] = {"density": pairs / causal, "estimate_ms": bench(estimate_only), "kernel_ms": bench(kernel_only),
                     "total_ms": bench(full)}
        indices.clear()
        torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,32,64,128")
    ap.add_argument("--chunk", type=int, default=16384, help="queries per chunk; 0: one row of n queries")
    ap.add_argument("--skip-flex", action="store_true", help="leave FlexPrefill out (its estimation is slow)")
    ap.add_argument("--variants", default="", help="comma-separated name prefixes to run (default: all)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = SparseSettings(kv_group_shared=False)  # one selection per query head
    shared = {"kv_group_shared": True}  # the default
    settings_list = [("VS 1000/6096 per head", base),
                     ("VS 1000/6096 shared", base.model_copy(update=shared)),
                     ("BS top-100 shared", base.model_copy(update={"default_pattern": PatternName.BLOCK_SPARSE,
                                                                    **shared})),
                     ("FlexPrefill g0.9", base.model_copy(update={"default_pattern": PatternName.FLEX_PREFILL, "gamma": 0.9})),
                     ("FlexPrefill g0.95", base.model_copy(update={"default_pattern": PatternName.FLEX_PREFILL,
                                                                   "gamma": 0.95})),
                     ("A-shape 128+2048", base.model_copy(update={"default_pattern": PatternName.A_SHAPE, **shared}))]
    if args.skip_flex:
        settings_list = [x for x in settings_list if not x[0].startswith("Flex")]
    if args.variants:
        settings_list = [x for x in settings_list if x[0].startswith(tuple(args.variants.split(",")))]
    recs = []
    for nk in (int(s) for s in args.sizes.split(",")):
        try:
            recs.append(run(nk * 1024, args.chunk, settings_list, gen))
        except torch.cuda.OutOfMemoryError:
            print(f"n={nk}K: OOM", flush=True)
        print(recs[-1] if recs else "", flush=True)
        torch.cuda.empty_cache()
    import triton
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; Llama-3-8B "
          f"shape (32/8/128), bf16, page {PAGE}, chunk {args.chunk or 'none (one row)'}; one layer, all chunks summed")
    head = "| n | best dense SDPA ms | ours dense ms |"
    for name, _ in settings_list:
        head += f" {name}: density / estimate + kernel = total ms (x vs dense) |"
    print(head)
    print("|---" * (3 + len(settings_list)) + "|")
    for r in recs:
        best = min(x for x in (r["flash"], r["cudnn"]) if x == x)
        cells = [f"{r['n'] // 1024}K", f"{best:.2f}", f"{r['ours_dense']:.2f}"]
        for name, _ in settings_list:
            s = r[name]
            cells.append(f"{s['density']:.1%} / {s['estimate_ms']:.2f} + {s['kernel_ms']:.2f} = "
                         f"{s['total_ms']:.2f} ({best / s['total_ms']:.1f}x)")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
