"""One layer's sparse path as the CUDA backend runs it, on a chunked prefill, vs dense attention.

For a prompt of n tokens split into chunks of ``--chunk`` queries (vLLM's chunked prefill), each
chunk is one sparse row (q_len = chunk, ctx_len = tokens before it) run the way
``run_sparse_rows_paged`` runs it: GPU index estimation on the paged cache
(``prefill.estimate.estimate_index_paged``), then the Triton block+column kernel. Times are summed
over the chunks, estimation and kernel separately, and compared with dense causal attention over
the same n tokens (torch SDPA, flash and cuDNN, the faster one) and with our kernel's dense mode.

Q/K carry planted structure so that the estimators make realistic choices (random Q/K would make
vertical-slash pick scattered lines, i.e. nearly dense): a rotary-like component whose score
decays with distance (local attention: a band of diagonals), sink columns and ~500 strong
key columns per KV head that every query likes (verticals). Llama-3-8B shape (32/8 heads,
d=128), bf16, page 16 in random order.

    python -m benchmarks.studies.backend_path --sizes 16,32,64,128 --chunk 16384

Variants: vertical-slash 1000/6096 with one selection per query head and with ``kv_group_shared``
(the default: one selection per KV head, the group's heads stacked in the kernel), the latter
also with its slash lines as unaligned key ranges instead of the aligned key blocks they cross
(``slash_tiles=ranges``) and with diagonals kept in bands of 64 (``slash_band=64``), block-sparse
top-100 (shared), FlexPrefill gamma 0.9 and 0.95 (per head: FlexPrefill never shares) and A-shape.
``--chunk 0`` runs the whole prompt as one row (the kernel benchmark's setting, with estimation).
``--kernel-sweep`` prints, instead of the table, launch variants and splits of the default
vertical-slash path (see :func:`kernel_sweep`).

Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.kernels import PAGE, bench, graph_ms, paged_cache, sdpa_times

from vllm_sparse_backend.config import SparseSettings
from vllm_sparse_backend.head_configs import resolve_head
from vllm_sparse_backend.prefill.index import SparseIndex, count_pairs
from vllm_sparse_backend.prefill.estimate import HeadGroups, estimate_index_paged
from vllm_sparse_backend.prefill.budgets import kv_group_share
from vllm_sparse_backend.prefill.plan import SparseRow
from vllm_sparse_kernels.prefill import attention as sa


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
    return run_layer(*structured_qkv(n, h, hkv, d, gen, dev), chunk, settings_list)


def run_layer(q, k, v, chunk, settings_list, scale=None):
    """One layer's q [n, H, D], k / v [n, Hkv, D] (bf16, CUDA): dense SDPA times, our kernel's
    dense mode, and for each (name, settings): density of the computed pairs, estimation, kernel
    and estimation + kernel time over the chunks. ``k`` and ``v`` are consumed (moved into a
    paged cache and released)."""
    n, h, d = q.shape
    hkv = k.shape[1]
    dev = q.device
    scale = scale or 1.0 / math.sqrt(d)
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


def gpu_kernel_times(fn) -> dict[str, float]:
    """GPU microseconds per kernel name over one call of ``fn`` (torch profiler, CUDA activity),
    names in first-launch order; a name launched several times is summed (with its count)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            times.setdefault(ev.name[:60], []).append(ev.device_time)
    # a Triton kernel's launches one by one (the passes of one kernel differ), torch's summed
    return {f"{k} #{i}" if k.startswith("_") else f"{k} (x{len(v)})": t
            for k, v in times.items() for i, t in (enumerate(v) if k.startswith("_") else [(0, sum(v))])}


def register_report(*kernels) -> list[str]:
    """Registers per thread and spilled bytes of every compiled specialisation of the given
    Triton kernels (ptxas figures; a spill in the main loop costs local-memory traffic)."""
    lines = []
    for k in kernels:
        for cache in getattr(k, "device_caches", {}).values():
            for ck in cache[0].values():
                try:
                    ck._init_handles()
                    lines.append(f"    {k.fn.__name__}: {ck.metadata.num_warps} warps, {ck.metadata.num_stages} stages: "
                                 f"{ck.n_regs} registers, {ck.n_spills} spilled")
                except Exception as e:  # noqa: BLE001 - a report, not a check
                    lines.append(f"    {k.fn.__name__}: {type(e).__name__}")
    return lines


def kernel_sweep(n, chunk, gen, h=32, hkv=8, d=128, dev="cuda") -> list[str]:
    """The default vertical-slash (shared) selection of every chunk, then GPU times (CUDA-graph
    replays) of the kernel over all chunks for launch variants, with the block tiles and the
    column tiles also timed apart; the last chunk's estimation split by kernel (profiler) and
    ``last_q_scores`` launch variants; the kernel on the last chunk at 3 query lengths (the grid's
    last wave) and with 2 instead of 4 heads per program; registers and spills of the kernels."""
    scale = 1.0 / math.sqrt(d)
    q, k, v = structured_qkv(n, h, hkv, d, gen, dev)
    key_cache, value_cache, table = paged_cache(k, v, PAGE, dev)
    del k, v
    out = torch.empty_like(q)
    rows = [SparseRow(0, s, min(chunk, n - s), s) for s in range(0, n, chunk)][1:]  # the first chunk runs dense
    cfg = SparseSettings()
    heads = [resolve_head(None, cfg)] * h
    groups = HeadGroups.from_heads(heads, dev, kv_group_share(heads, hkv, cfg))
    indices = [estimate_index_paged(q[r.tok_start:r.tok_start + r.q_len], key_cache, table[0], r.ctx_len, groups,
                                    cfg, scale).index for r in rows]
    lines = [f"n={n // 1024}K, chunk {chunk // 1024}K: {len(rows)} sparse chunks (the first runs dense), "
             f"VS {cfg.vertical_size}/{cfg.slash_size} shared, {indices[0].num_heads} lists"]
    nb = sum(ix.block_count.float().sum().item() + ix.range_count.float().sum().item() for ix in indices)
    nc = sum(ix.column_count.float().sum().item() for ix in indices)
    lines.append(f"  list entries: {nb / nc:.2f} key blocks or ranges of 64 per column (tiles {nb:.0f}, columns {nc:.0f}; "
                 f"column tiles of 64 = {nc / 64 / (nb + nc / 64):.1%} of the tiles)")

    def zero(ix, blocks):
        bc = torch.zeros_like(ix.block_count) if blocks else ix.block_count
        cc = ix.column_count if blocks else torch.zeros_like(ix.column_count)
        rc = torch.zeros_like(ix.range_count) if blocks else ix.range_count
        return SparseIndex(ix.block_size, bc, ix.block_index, cc, ix.column_index, rc, ix.range_start)

    sets = {"all": indices, "blocks and ranges only": [zero(ix, False) for ix in indices],
            "columns only": [zero(ix, True) for ix in indices]}
    variants = [("all", {}), ("all", {"num_stages": 2}), ("all", {"num_stages": 4}), ("blocks and ranges only", {}),
                ("columns only", {})]
    ref = None
    for which, var in variants:
        ixs = sets[which]

        def kernel_only():
            for r, ix in zip(rows, ixs):
                sa.sparse_prefill_attention(q, key_cache, value_cache, table, [r], [ix], scale, out, **var)

        kernel_only()
        if which == "all":
            if ref is None:
                ref = out.clone()
            diff = (out.float() - ref.float()).abs().max().item()
        else:
            diff = float("nan")
        lines.append(f"  kernel, {which} {var or '[default]'}: {graph_ms(kernel_only, reps=5):.3f} ms "
                     f"(max |diff| vs default {diff:.1e})")
        print(lines[-1], flush=True)
    from vllm_sparse_kernels.prefill import vs_index as vsi
    r = rows[-1]
    lines.append(f"  estimation of the last chunk (ctx {r.ctx_len // 1024}K), GPU us per kernel:")
    for name, us in gpu_kernel_times(lambda: estimate_index_paged(q[r.tok_start:], key_cache, table[0], r.ctx_len,
                                                                  groups, cfg, scale)).items():
        lines.append(f"    {us:9.1f}  {name}")
    ql = q[r.tok_start + r.q_len - 64:r.tok_start + r.q_len]
    kv_len = r.ctx_len + r.q_len
    lines.append(f"  last_q_scores at {kv_len // 1024}K (GPU ms, graph replays):")
    scores = vsi.last_q_scores(ql, key_cache, table[0], kv_len, scale, group_sum=True)
    for var in ({}, {"num_warps": 8}, {"num_stages": 3}, {"block_n": 32}, {"diagonals": "gather"}):
        fn = lambda: vsi.last_q_scores(ql, key_cache, table[0], kv_len, scale, group_sum=True, **var)  # noqa: E731
        got = fn()
        err = max(((g - x).norm() / x.norm()).item() for g, x in zip(got, scores))
        lines.append(f"    {var or '[default]'}: {graph_ms(fn):.3f} ms (rel diff {err:.1e})")
        print(lines[-1], flush=True)
    vert, slash = scores
    vert[:, :cfg.keep_first_columns] = float("inf")
    slash[:, :max(1, cfg.keep_last_diagonals)] = float("inf")
    lists = vsi.vs_topk(vert, slash, cfg.vertical_size, cfg.slash_size, cfg.vertical_size, cfg.slash_size)
    lines.append("  vertical_slash_index of the last chunk (GPU ms), diagonals or verticals per program step")
    base = None
    for var in ({"chunk": 128}, {"chunk": 256}, {}, {"chunk": 1024}):
        fn = lambda: vsi.vertical_slash_index(*lists, r.q_len, r.ctx_len, 64, **var)  # noqa: E731
        got = fn()
        base = got if base is None else base
        same = all(torch.equal(a, b) for a, b in zip(got.tensors(), base.tensors()))
        lines.append(f"    {var or '[default]'}: {graph_ms(fn):.3f} ms (same lists: {same})")
        print(lines[-1], flush=True)
    # the grid's last wave: 16384 queries = 2048 programs (15.5 waves of 132), 16896 = 16 waves
    lines.append("  kernel on the last chunk: the grid's last wave, and 2 heads per program")
    for q_len in (16384, 16896, 15872):
        rr = SparseRow(0, n - q_len, q_len, n - q_len)
        ix = estimate_index_paged(q[rr.tok_start:], key_cache, table[0], rr.ctx_len, groups, cfg, scale).index
        pairs = count_pairs(ix, rr.q_len, rr.ctx_len)
        # 2 heads per program (each K/V tile read by two programs): 1.3x slower in run 36
        for tag, ixv in (("4 heads per program (default)", ix), ("2 heads per program", ix.repeat_heads(2))):
            ms = graph_ms(lambda: sa.sparse_prefill_attention(q, key_cache, value_cache, table, [rr], [ixv],  # noqa: B023
                                                              scale, out))
            lines.append(f"    q_len {q_len}, {tag}: {ms:.3f} ms, {ms / pairs * 1e9:.3f} ms per G pairs")
            print(lines[-1], flush=True)
    lines.append("  compiled kernels:")
    lines += register_report(sa._sparse_fwd_kernel, sa._sparse_fwd_variants_kernel, vsi._lastq_pass,
                             vsi._lastq_skew_pass)
    del q, key_cache, value_cache, out, indices, sets
    torch.cuda.empty_cache()
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,32,64,128")
    ap.add_argument("--chunk", type=int, default=16384, help="queries per chunk; 0: one row of n queries")
    ap.add_argument("--skip-flex", action="store_true", help="leave FlexPrefill out (its estimation is slow)")
    ap.add_argument("--variants", default="", help="comma-separated name prefixes to run (default: all)")
    ap.add_argument("--kernel-sweep", action="store_true",
                    help="only: kernel launch variants and block/column split on the default selection, "
                         "and the estimation split by kernel (GPU time)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.kernel_sweep:
        for nk in (int(s) for s in args.sizes.split(",")):
            print("\n".join(kernel_sweep(nk * 1024, args.chunk, gen)), flush=True)
        return
    base = SparseSettings(kv_group_shared=False)  # one selection per query head
    shared = {"kv_group_shared": True}  # the default
    settings_list = [("VS 1000/6096 per head", base),
                     ("VS 1000/6096 shared", base.model_copy(update=shared)),
                     ("VS 1000/6096 shared, slash as ranges", base.model_copy(update={"slash_tiles": "ranges",
                                                                                     **shared})),
                     # diagonals kept in bands of a key block: the tiles hold what was selected
                     # (0.10 computed vs 0.24 at 128K, 16K chunks: results/density_breakdown_cpu_planted_128k_2026-11-26.txt)
                     ("VS 1000/6096 shared, bands of 64", base.model_copy(update={"slash_band": 64, **shared})),
                     ("BS top-100 shared", base.model_copy(update={"default_pattern": "block_sparse",
                                                                    **shared})),
                     # the same lists' cost, scored by anti-diagonal block mass (a matmul at 1/16 of
                     # QK's work over K gathered out of the pages, instead of pooled keys)
                     ("BS top-100 shared, anti-diagonal", base.model_copy(update={
                         "default_pattern": "block_sparse", "block_scoring": "antidiagonal", **shared})),
                     ("FlexPrefill g0.9", base.model_copy(update={"default_pattern": "flex_prefill", "gamma": 0.9})),
                     ("FlexPrefill g0.95", base.model_copy(update={"default_pattern": "flex_prefill",
                                                                   "gamma": 0.95})),
                     ("A-shape 128+2048", base.model_copy(update={"default_pattern": "a_shape", **shared}))]
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
