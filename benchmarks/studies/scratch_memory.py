"""GPU memory of the sparse path's scratch: what the profiling run claims vs what serving steps use.

vLLM sizes the KV cache from the peak memory of its profiling run, where the backend claims its
scratch (``prefill.claim.run_worst_case_steps``). A serving step can hold several sparse rows
(the last chunk of one prompt and the first of the next, each at least ``min_sparse_query_len``
queries), and their index lists all live until the one kernel launch of the layer. If such a
step needs more than the claim, the KV cache was sized too large; if it needs no more but the
caching allocator's pool still grows, the pool fragments. The load test at scale 6 saw a
density-1 server's GPU memory rise 2.9 GiB and stay
(``benchmarks/results/load_h100_qwen-coder-1.5b_scale6_2026-11-25.txt``); with the claim of one
row only (``--claim row``, as before 2026-11-26) this finds multi-row steps needing 1.8x its
scratch at those budgets.

This runs the claim, then a seeded sequence of steps through ``run_sparse_rows_paged`` exactly as
the backend calls it (estimation on the paged cache, then the Triton kernel; rows flagged too
dense go to a no-op standing in for FlashAttention, whose memory is not ours), and prints per
variant: the claim's peak scratch, the steps' peak scratch (allocated above what was live before),
and the allocator's reserved pool after the claim and over the steps. Scratch sizes depend on
the rows' lengths and the budgets only, so a one-page stand-in cache serves every row (as in the
claim)::

    python -m benchmarks.studies.scratch_memory                      # Qwen2.5-1.5B heads, 16K chunks, 131K context
    python -m benchmarks.studies.scratch_memory --steps 100 --variants default full=max_density=1,vertical_size=131072,slash_size=131072

torch + triton + this package; CUDA for the memory numbers (on CPU under TRITON_INTERPRET=1 it
only runs the steps, at small sizes, to check the script).
"""

from __future__ import annotations

import argparse
import random

import torch

from vllm_sparse_kernels.prefill import attention as sa

from vllm_sparse_backend.prefill.budgets import kv_group_share
from vllm_sparse_backend.head_configs import resolve_head
from vllm_sparse_backend.prefill.estimate import HeadGroups
from vllm_sparse_backend.prefill.plan import SparseRow
from vllm_sparse_backend.prefill.run import run_sparse_rows_paged
from vllm_sparse_backend.prefill.claim import run_worst_case_steps
from vllm_sparse_backend.observability.record import run_recorded
from vllm_sparse_backend.observability.stats import SparseStats
from vllm_sparse_tools.evaluation.variants import parse_variant

GIB = 2 ** 30


def step_rows(rng: random.Random, chunk: int, max_len: int, min_q: int, max_rows: int) -> list[SparseRow]:
    """One step's sparse rows: ``chunk`` query tokens split into 1..max_rows rows of at least
    ``min_q`` queries each, each at a random context (its queries included) up to ``max_len``."""
    n_rows = rng.randint(1, max(1, min(max_rows, chunk // min_q)))
    cuts = sorted(rng.sample(range(min_q, chunk - min_q + 1, 64), n_rows - 1)) if n_rows > 1 else []
    bounds = [0, *cuts, chunk]
    rows = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b - a < min_q:
            continue
        ctx = rng.randint(0, max_len - (b - a))
        rows.append(SparseRow(row=i, tok_start=a, q_len=b - a, ctx_len=ctx))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs=3, default=[12, 2, 128], metavar=("H", "HKV", "D"),
                    help="query heads, KV heads, head dim (default: Qwen2.5-1.5B)")
    ap.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens")
    ap.add_argument("--max-len", type=int, default=131200, help="max_model_len")
    ap.add_argument("--page", type=int, default=64, help="KV page size (64: the backend's on Hopper)")
    ap.add_argument("--min-q", type=int, default=4096, help="min_sparse_query_len")
    ap.add_argument("--max-rows", type=int, default=4, help="most sparse rows in one step")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--claim", choices=["steps", "row"], default="steps",
                    help="steps: the backend's claim; row: only its first step (one row of the whole chunk), "
                         "the claim before 2026-11-26")
    ap.add_argument("--variants", nargs="+",
                    default=["default", "full=max_density=1,vertical_size=131072,slash_size=131072"],
                    help="presets or LABEL=FIELD=VALUE[,...] with settings fields (tools.evaluation.variants)")
    args = ap.parse_args()

    h, hkv, d = args.heads
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    print(f"# {torch.cuda.get_device_name() if cuda else 'CPU (no memory numbers)'}, torch {torch.__version__}; "
          f"claim: {'the backend steps' if args.claim == 'steps' else 'one row of the whole chunk'}; "
          f"{h} / {hkv} heads of dim {d}, {dtype}, chunk {args.chunk}, max_model_len {args.max_len}, "
          f"{args.page}-key pages, sparse rows of >= {args.min_q} queries, 1-{args.max_rows} per step, "
          f"{args.steps} steps, seed {args.seed}")
    print("| variant | claim: peak scratch | steps: peak scratch | steps / claim | largest step (rows: q_len@context) "
          "| reserved after claim | reserved over steps (first / max / last) |")
    print("|---|---|---|---|---|---|---|")
    scale = d ** -0.5
    for spec in args.variants:
        variant = parse_variant(spec)
        label, cfg = variant.label, variant.settings(min_sparse_query_len=args.min_q)
        heads = [resolve_head(None, cfg)] * h
        groups = HeadGroups.from_heads(heads, dev, kv_group_share(heads, hkv, cfg))
        query = torch.randn(args.chunk, h, d, device=dev).to(dtype)
        output = torch.empty_like(query)
        key_cache = torch.randn(1, args.page, hkv, d, device=dev).to(dtype)
        value_cache = torch.randn(1, args.page, hkv, d, device=dev).to(dtype)
        table = torch.zeros(args.max_rows, -(-args.max_len // args.page), dtype=torch.int32, device=dev)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            live = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        claim_cfg = cfg if args.claim == "steps" else cfg.model_copy(update={"min_sparse_query_len": args.chunk})
        run_worst_case_steps(query, output, hkv, args.max_len, groups, claim_cfg, scale, 0.0,
                             sa.sparse_prefill_attention, page_size=args.page)
        if cuda:
            torch.cuda.synchronize()
            claim = torch.cuda.max_memory_allocated() - live
            reserved_claim = torch.cuda.memory_reserved()
        rng = random.Random(args.seed)
        peak, worst, reserved = 0, None, []
        for _ in range(args.steps):
            rows = step_rows(rng, args.chunk, args.max_len, args.min_q, args.max_rows)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            run_recorded(SparseStats(), run_sparse_rows_paged, query, output, rows, key_cache, value_cache, table,
                         groups, cfg, scale, 0.0, sa.sparse_prefill_attention, density_fallback=True)
            if cuda:
                torch.cuda.synchronize()
                used = torch.cuda.max_memory_allocated() - live
                if used > peak:
                    peak, worst = used, rows
                reserved.append(torch.cuda.memory_reserved())
        if not cuda:
            print(f"| {label} | - | - | - | - | - | - |")
            continue
        shape = ", ".join(f"{r.q_len}@{r.ctx_len + r.q_len}" for r in worst or [])
        print(f"| {label} | {claim / GIB:.2f} GiB | {peak / GIB:.2f} GiB | {peak / max(claim, 1):.2f}x | {shape} | "
              f"{reserved_claim / GIB:.2f} GiB | {reserved[0] / GIB:.2f} / {max(reserved) / GIB:.2f} / "
              f"{reserved[-1] / GIB:.2f} GiB |")
        del query, output, key_cache, value_cache, table, groups


if __name__ == "__main__":
    main()
