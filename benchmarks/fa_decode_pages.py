"""Kernel alone: vLLM's FlashAttention 3 decode over a paged KV cache of 16-key vs 64-key pages.

The backend asks vLLM for 64-key pages on Hopper (its prefill kernel loads a whole 64-key tile
with TMA); decode stays on vLLM's FlashAttention, which then reads that cache with 64-key pages
instead of its usual 16. Does the page size change FlashAttention's decode time? This times
`vllm.vllm_flash_attn.flash_attn_varlen_func` alone (no engine) on the same K / V, once with
each page size, with and without the ahead-of-time scheduler metadata vLLM's FlashAttention
backend computes for each step, pages in order or shuffled (as a long-running server's free
list hands them out)::

    PYTHONPATH=/tmp/site python3 benchmarks/fa_decode_pages.py            # GPU machine, vLLM staged

Prints one table: median time per call (CUDA events over back-to-back calls), and each page
size's outputs against the 16-key run's (the same attention, so they must agree).
"""

from __future__ import annotations

import argparse
import statistics

import torch


def paged(k: torch.Tensor, v: torch.Tensor, page: int, shuffle: bool, gen: torch.Generator):
    """[batch, ctx, Hkv, D] keys / values -> ([pages, page, Hkv, D] caches, int32 block table)."""
    b, n, hkv, d = k.shape
    per_req = -(-n // page)
    order = torch.randperm(b * per_req, generator=gen) if shuffle else torch.arange(b * per_req)
    table = order.view(b, per_req).to(torch.int32)
    kc = torch.zeros(b * per_req, page, hkv, d, dtype=k.dtype, device=k.device)
    vc = torch.zeros_like(kc)
    pad = per_req * page - n
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(b * per_req, page, hkv, d)
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(b * per_req, page, hkv, d)
    idx = table.view(-1).long().to(k.device)
    kc[idx], vc[idx] = kp, vp
    return kc, vc, table.to(k.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8x32768", "1x131072", "32x8192"],
                    help="BATCHxCONTEXT decode shapes")
    ap.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("H", "HKV", "D"),
                    help="query heads, KV heads, head dim (default: Llama-3-8B)")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()

    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    h, hkv, d = args.heads
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; FlashAttention 3 (vllm.vllm_flash_attn) "
          f"decode, {h} / {hkv} heads of dim {d}, bf16, one query token per request; median of "
          f"{args.iters} back-to-back calls, 3 repeats")
    print("| batch x context | pages | layout | scheduler | us per call | vs 16-key, same layout and scheduler | "
          "max abs diff vs 16-key |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        b, n = (int(x) for x in shape.split("x"))
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(b, h, d, generator=gen).to(torch.bfloat16).to(dev)
        k = torch.randn(b, n, hkv, d, generator=gen).to(torch.bfloat16).to(dev)
        v = torch.randn(b, n, hkv, d, generator=gen).to(torch.bfloat16).to(dev)
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
        seqused = torch.full((b,), n, dtype=torch.int32, device=dev)
        base = {}
        for shuffle in (False, True):
            # vLLM's FlashAttention backend: an ahead-of-time schedule per step, at most
            # flash_attn_max_num_splits_for_cuda_graph (32) splits where the step is a CUDA graph
            for sched, splits in (("none", None), ("ahead of time", 0), ("ahead of time, <= 32 splits", 32)):
                for page in (16, 64):
                    kc, vc, table = paged(k, v, page, shuffle, gen)
                    meta = None
                    if splits is not None:
                        meta = get_scheduler_metadata(b, 1, n, h, hkv, d, seqused, qkv_dtype=torch.bfloat16,
                                                      cu_seqlens_q=cu_q, page_size=page, causal=True,
                                                      num_splits=splits)

                    def call():
                        return flash_attn_varlen_func(q, kc, vc, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=n,
                                                      seqused_k=seqused, softmax_scale=d ** -0.5, causal=True,
                                                      block_table=table, scheduler_metadata=meta,
                                                      num_splits=splits or 0, fa_version=3)
                    out = call()
                    for _ in range(10):
                        call()
                    times = []
                    for _ in range(3):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        torch.cuda.synchronize()
                        start.record()
                        for _ in range(args.iters):
                            call()
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end) * 1e3 / args.iters)
                    us = statistics.median(times)
                    key = (shuffle, sched)
                    if page == 16:
                        base[key] = (us, out)
                    ref_us, ref_out = base[key]
                    diff = (out.float() - ref_out.float()).abs().max().item()
                    print(f"| {shape} | {page} | {'shuffled' if shuffle else 'in order'} | "
                          f"{sched} | {us:.1f} | {ref_us / us:.2f}x | {diff:.1e} |")
                    del kc, vc
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
