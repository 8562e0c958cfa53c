"""Host-memory KV placement: what a GPU machine can move, and what decode and prefill would ask of it.

Issue 54, step 4, a measured feasibility note before any host-KV code. The mode it prepares: vLLM's
GPU pages hold page summaries, the full K/V lives in a pinned host pool indexed by vLLM's block ids,
decode fetches its top-k pages into a GPU hot cache (LRU) and prefill chunks fetch only the blocks
their sparse selection reads. Three parts, each optional (``--parts``):

1. ``transfer`` (CUDA): pinned host -> GPU bandwidth of contiguous copies (1 MiB .. 1 GiB) and of
   gathers of scattered pages (64 tokens x KV heads x head dim x K and V x bf16, one layer; the
   Qwen2.5-1.5B and Llama-3-8B layouts) by three routes: (a) ``index_select`` of the pages into a
   pinned staging buffer on the CPU, then one copy; (b) zero-copy: a Triton kernel that loads the
   pinned pages itself through unified virtual addressing (a pinned allocation's host address is
   its device address, so the kernel reads PCIe directly, no staging); (c) one ``copy_`` per page
   with ``non_blocking=True`` on a side stream. Times are wall-clock from issue to the pages being
   on the GPU (synchronised), median of ``--reps``.
2. ``decode`` (the real model, transformers, bf16, SDPA): the prompt (an Austen needle task of
   ``vllm_sparse_tools.evaluation.tasks``) is prefilled, then ``--steps`` tokens are decoded
   greedily with the end-of-sequence tokens masked (every step attends from an ordinary token).
   A registered attention function sees each layer's post-RoPE query and key cache; at each step
   and layer it computes the Quest page summaries and page selection of the ``topk`` decode mode
   with the package's float64 references (``reference_page_summaries``, ``reference_select_pages``:
   one selection per KV head, its query heads' bounds summed; the settings' sink and recent pages
   forced) for each budget and page size, and keeps only the selected page ids. Sink and recent
   pages are counted as GPU-resident; the budget pages are what the host pool serves. A hot cache
   per layer of ``C = m x budget x KV heads`` page slices (m = ``--cache-multiples``) is fed the
   steps in order (:func:`hot_cache_stats`): whole pages (all KV heads of a block travel together,
   as vLLM's block layout stores them: ``m x budget`` pages) and per-KV-head slices (``m x budget``
   per head). Hit rate = hits / requested over steps 2..T (the first step starts cold). A step's
   pages are touched in ascending order (the references list them so, not by score): a step that
   asks for more than C keeps its later pages. At 1x the whole-page cache is smaller than one
   step's union of KV heads (the same memory as the per-head slices), so it cannot hit fully.
3. ``prefill`` (same run): the prefill's post-RoPE queries and keys of each layer are cut into the
   chunks of a chunked prefill (``--chunk``, vLLM's default 8192; the causal model's Q and K do not
   depend on how the prompt is chunked) and each chunk after the first is estimated by the
   package's torch estimator (``vllm_sparse_backend.prefill.estimate.estimate_index``) with the
   default settings (``load_settings({})``: vertical-slash, shared per KV group). The union over the
   chunk's query blocks of the earlier-context keys its index lists (:func:`earlier_key_cover`) is
   what that chunk must have on the GPU; its pages (:func:`page_share`) as a share of the earlier
   context's pages is the fetch; each query block's own share says what a chunk computed block by
   block would need at a time. Chunks the plugin would run dense (shorter than
   ``min_sparse_query_len``, or a budget density above ``max_density``) are flagged: they need it all.

Run on a GPU machine (a few minutes at most at 32K for the 1.5B), from the repository root::

    python -m benchmarks.studies.host_kv_feasibility --model /tmp/models/qwen2.5-coder-1.5b-instruct \\
        --text /tmp/austen.txt --tokens 32768 --out $OUT/host_kv_32k

Parts 2 and 3 read the package's settings, which need pydantic; the GPU image has none: carry its
four wheels (the recipe is in ``docs/decode-offload.md``, "Feasibility: what to measure and how").
Writes ``<out>.json`` (settings, versions, every table's numbers and the per-step fetch series) and
``<out>.txt`` (the printed tables). Asserts only that the gathers deliver the right bytes and that
the captured tensors reproduce the model's attention output.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Sequence

import torch

from benchmarks.common import SHAPES
from benchmarks.studies.decode_topk_trace import dump_json, lru_hits

REPO = pathlib.Path(__file__).resolve().parents[2]
_ATTENTION_NAME = "vllm_sparse_host_kv_feasibility"
# layers, KV heads, head dim of the layouts whose pages part 1 moves
LAYOUTS = {name: (layers, *SHAPES[name][1:]) for name, layers in (("qwen2.5-1.5b", 28), ("llama3-8b", 32))}
TRANSFER_PAGE_TOKENS = 64
GATHER_ROUTES = ("index_select", "copy_per_page", "zero_copy")


# ---------------------------------------------------------------------------------------------
# Pure functions (tests/tools/test_host_kv_feasibility.py)
# ---------------------------------------------------------------------------------------------

def page_bytes(page_tokens: int, kv_heads: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Bytes of one layer's page: K and V of ``page_tokens`` tokens for every KV head."""
    return page_tokens * kv_heads * head_dim * 2 * elem_bytes


def hot_cache_stats(steps: Sequence[Sequence[int]], capacity: int) -> dict:
    """An LRU hot cache of ``capacity`` entries fed the entries each step requests, in order
    (:func:`decode_topk_trace.lru_hits`: lookups first, then the step's entries touched and the
    least recently used evicted). ``hit_rate``: hits / requested summed over steps 2.. (the first
    step starts cold); ``fetched``: misses per step of steps 2.. (mean and max); ``cold``: the
    first step's misses (all of them)."""
    hits = lru_hits(steps, capacity)
    misses = [len(s) - h for s, h in zip(steps, hits)]
    asked = sum(len(s) for s in steps[1:])
    later = misses[1:]
    return {"hit_rate": sum(hits[1:]) / asked if asked else float("nan"),
            "fetched_mean": sum(later) / len(later) if later else float("nan"),
            "fetched_max": max(later) if later else 0,
            "cold": misses[0] if misses else 0,
            "misses": misses}


def slice_cache_stats(steps: Sequence[Sequence[Sequence[int]]], capacity: int) -> dict:
    """``steps[t][h]``: the pages KV head h requests at step t, each head with its own LRU of
    ``capacity`` slices (:func:`hot_cache_stats`). ``hit_rate``: pooled over the heads and steps
    2..; ``misses``: per step, summed over the heads; ``fetched_mean``: their mean over steps 2..."""
    per_head = [hot_cache_stats([s[h] for s in steps], capacity) for h in range(len(steps[0]))]
    misses = [sum(col) for col in zip(*(st["misses"] for st in per_head))]
    asked = sum(len(pages) for s in steps[1:] for pages in s)
    later = misses[1:]
    return {"hit_rate": 1 - sum(later) / asked if asked else float("nan"),
            "fetched_mean": sum(later) / len(later) if later else float("nan"),
            "misses": misses}


def union_steps(per_head_steps: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """``per_head_steps[t][h]``: the pages KV head h selected at step t -> per step the sorted
    pages any head selected (a whole page carries every KV head)."""
    return [sorted(set().union(*map(set, heads))) for heads in per_head_steps]


def earlier_key_cover(index, ctx_len: int, heads_per_kv: int, per_query_block: bool = False) -> torch.Tensor:
    """bool ``[Hkv, ctx_len]``: the earlier-context keys (positions < ``ctx_len``) that any query
    block of ``index`` (a :class:`SparseIndex` of one row, one list per query head, heads of a KV
    group consecutive) lists, as a whole key block, a column or a range, for any head of each KV
    group; ``per_query_block``: ``[Hkv, NQB, ctx_len]``, each query block's own. Every earlier key
    is causally visible to every query of the chunk, so listing it is needing it."""
    from vllm_sparse_backend.prefill.index import range_cover

    b = index.block_size
    h, nqb = index.block_count.shape
    device = index.block_count.device
    n_key_blocks = -(-ctx_len // b)
    blocks = index.block_index.to(torch.int64)
    listed = torch.arange(blocks.shape[-1], device=device) < index.block_count[..., None]
    # one slot past the context's blocks (and keys, below) collects what lies beyond it
    block_hit = torch.zeros(h, nqb, n_key_blocks + 1, dtype=torch.bool, device=device)
    block_hit.scatter_(2, torch.where(listed, blocks.clamp(max=n_key_blocks), n_key_blocks), True)
    cover = torch.zeros(h, nqb, ctx_len + 1, dtype=torch.bool, device=device)
    cover[..., :ctx_len] = block_hit[..., :n_key_blocks].repeat_interleave(b, -1)[..., :ctx_len]

    cols = index.column_index.to(torch.int64)
    listed = torch.arange(cols.shape[-1], device=device) < index.column_count[..., None]
    cover.scatter_(2, torch.where(listed, cols.clamp(max=ctx_len), ctx_len), True)

    if index.range_start is not None and index.range_start.shape[-1]:
        cover[..., :ctx_len] |= range_cover(index.range_start, b, ctx_len)
    cover = cover[..., :ctx_len].view(h // heads_per_kv, heads_per_kv, nqb, ctx_len).any(1)
    return cover if per_query_block else cover.any(1)


def page_share(cover: torch.Tensor, page_size: int) -> tuple[torch.Tensor, int]:
    """``cover`` bool [..., n]: per row the pages (of ``page_size`` tokens, aligned to position 0)
    holding at least one covered key, and the number of pages of the n positions."""
    n = cover.shape[-1]
    pages = -(-n // page_size)
    padded = torch.nn.functional.pad(cover, (0, pages * page_size - n))
    return padded.view(*cover.shape[:-1], pages, page_size).any(-1).sum(-1), pages


def fetch_ms_for(pages: float, measured: dict[int, float]) -> float:
    """Milliseconds to fetch ``pages`` pages, linear between the measured page counts (the
    smallest count's time below it: a fetch has a fixed cost; extrapolated above the largest)."""
    ks = sorted(measured)
    if pages <= ks[0]:
        return measured[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if pages <= hi:
            return measured[lo] + (measured[hi] - measured[lo]) * (pages - lo) / (hi - lo)
    return measured[ks[-1]] * pages / ks[-1]


# ---------------------------------------------------------------------------------------------
# Part 1: transfers
# ---------------------------------------------------------------------------------------------

def _gather_kernel():
    """A page gather reading its source through the pointer it is given (built on first use so
    that the module imports without triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_pages(src, page_ids, dst, page_words, BLOCK: tl.constexpr):
        p = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < page_words
        page = tl.load(page_ids + p).to(tl.int64)
        words = tl.load(src + page * page_words + offs, mask=keep)
        tl.store(dst + p.to(tl.int64) * page_words + offs, words, mask=keep)

    return gather_pages


def zero_copy_gather(kernel, pool: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = pool[page_ids[i]]`` (int32 ``[pages, words]``) by the kernel reading ``pool`` where
    it lies: on the GPU, a pinned host tensor read in place over PCIe (Triton 3.6 takes it as a
    pointer argument: the driver maps a pinned allocation at the same address)."""
    words = pool.shape[1]
    block = 2048
    kernel[(page_ids.numel(), -(-words // block))](pool, page_ids, out, words, BLOCK=block)


def _wall_ms(fn, reps: int) -> float:
    """Median wall milliseconds from issue to completion (the GPU synchronised before and after)."""
    times = []
    fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_transfers(sizes_mib: Sequence[int], page_counts: Sequence[int], pool_pages: int, reps: int,
                      log=print) -> dict:
    dev = torch.device("cuda")
    out: dict = {"contiguous": [], "gather": {}}
    big = torch.empty(max(sizes_mib) << 20, dtype=torch.uint8, pin_memory=True)
    big.fill_(1)
    dst = torch.empty_like(big, device=dev)
    pageable = torch.ones(max(sizes_mib) << 20, dtype=torch.uint8)
    for mib in sizes_mib:
        n = mib << 20
        ms = _wall_ms(lambda: dst[:n].copy_(big[:n], non_blocking=True), reps)
        ms_pageable = _wall_ms(lambda: dst[:n].copy_(pageable[:n], non_blocking=True), max(3, reps // 3))
        out["contiguous"].append({"mib": mib, "ms": ms, "gb_s": n / ms / 1e6, "pageable_gb_s": n / ms_pageable / 1e6})
        log(f"contiguous {mib:>5} MiB: pinned {n / ms / 1e6:6.1f} GB/s, pageable {n / ms_pageable / 1e6:6.1f} GB/s",
            flush=True)
    del big, dst, pageable

    kernel = _gather_kernel()
    gen = torch.Generator().manual_seed(0)
    side = torch.cuda.Stream()
    for name, (layers, kv_heads, head_dim) in LAYOUTS.items():
        pb = page_bytes(TRANSFER_PAGE_TOKENS, kv_heads, head_dim)
        words = pb // 4
        pool = torch.empty(pool_pages, words, dtype=torch.int32, pin_memory=True)
        pool.copy_(torch.arange(pool_pages * words, dtype=torch.int32).view(pool_pages, words))
        rows = []
        for k in page_counts:
            ids_cpu = torch.randperm(pool_pages, generator=gen)[:k]
            ids_dev = ids_cpu.to(dev)
            staging = torch.empty(k, words, dtype=torch.int32, pin_memory=True)
            gpu = torch.empty(k, words, dtype=torch.int32, device=dev)
            want = pool[ids_cpu].to(dev)

            def staged():
                torch.index_select(pool, 0, ids_cpu, out=staging)
                gpu.copy_(staging, non_blocking=True)

            ids_list = ids_cpu.tolist()

            def per_page():
                with torch.cuda.stream(side):
                    for i, p in enumerate(ids_list):
                        gpu[i].copy_(pool[p], non_blocking=True)
                torch.cuda.current_stream().wait_stream(side)

            row = {"pages": k, "mib": k * pb / 2**20}
            for label, fn in (("index_select", staged), ("copy_per_page", per_page)):
                gpu.zero_()
                ms = _wall_ms(fn, reps)
                if not torch.equal(gpu, want):
                    raise RuntimeError(f"{label}: the gathered pages differ from the pool's ({name}, {k} pages)")
                row[label] = {"ms": ms, "gb_s": k * pb / ms / 1e6}
            gpu.zero_()
            ms = _wall_ms(lambda: zero_copy_gather(kernel, pool, ids_dev, gpu), reps)
            if not torch.equal(gpu, want):
                raise RuntimeError(f"zero-copy: the gathered pages differ from the pool's ({name}, {k} pages)")
            row["zero_copy"] = {"ms": ms, "gb_s": k * pb / ms / 1e6}
            rows.append(row)
            log(f"{name} gather {k:>5} pages ({row['mib']:.1f} MiB): "
                + ", ".join(f"{m} {row[m]['ms']:.3f} ms" for m in GATHER_ROUTES), flush=True)
        out["gather"][name] = {"page_bytes": pb, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                               "rows": rows}
        del pool
    return out


def format_transfers(res: dict, decode_pages: int) -> str:
    lines = ["# pinned host -> GPU, contiguous copy_ (non_blocking); pageable for comparison",
             f"{'MiB':>6} {'ms':>8} {'GB/s':>7} {'pageable GB/s':>14}"]
    for r in res["contiguous"]:
        lines.append(f"{r['mib']:>6} {r['ms']:>8.3f} {r['gb_s']:>7.1f} {r['pageable_gb_s']:>14.1f}")
    methods = GATHER_ROUTES
    lines += ["", f"# gathers of random {TRANSFER_PAGE_TOKENS}-token pages of one layer (K+V, every KV head, bf16): "
                  "index_select = CPU gather into pinned staging + one copy; copy_per_page = one copy_ per page "
                  "on a side stream; zero_copy = a Triton kernel reading the pinned pool in place",
              f"{'layout':>13} {'page KiB':>8} {'pages':>6} {'MiB':>7} "
              + " ".join(f"{m + ' ms':>18} {'GB/s':>6}" for m in methods)]
    for name, g in res["gather"].items():
        for r in g["rows"]:
            lines.append(f"{name:>13} {g['page_bytes'] / 1024:>8.0f} {r['pages']:>6} {r['mib']:>7.1f} "
                         + " ".join(f"{r[m]['ms']:>18.3f} {r[m]['gb_s']:>6.1f}" for m in methods))
    lines += ["", f"# a decode step that fetches {decode_pages} pages in each layer, layer after layer (a layer's "
                  "fetch needs its query): fetch ms per step (no hits; the best route per layout)"]
    for name, g in res["gather"].items():
        best = {r["pages"]: min(r[m]["ms"] for m in methods) for r in g["rows"]}
        per_layer = fetch_ms_for(decode_pages, best)
        lines.append(f"{name:>13}: {per_layer:.3f} ms per layer x {g['layers']} layers = "
                     f"{per_layer * g['layers']:.2f} ms per step "
                     f"({decode_pages * g['page_bytes'] * g['layers'] / 2**20:.0f} MiB)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Parts 2 and 3: the model run
# ---------------------------------------------------------------------------------------------

class Capture:
    """Attention function for transformers: SDPA, plus the prefill-chunk estimates (part 3) during
    the prefill and the decode page selections (part 2) during decode, per layer. Keeps only
    page ids and per-chunk counts, so memory stays that of the model and its cache."""

    def __init__(self, settings, chunk: int, page_sizes, budgets, sink_pages: int, recent_pages: int,
                 prefill: bool, decode: bool):
        self.settings, self.chunk = settings, chunk
        self.page_sizes, self.budgets = list(page_sizes), list(budgets)
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        self.do_prefill, self.do_decode = prefill, decode
        self.reset()

    def reset(self) -> None:
        """Forget the last run's results (the model keeps this object as its attention function)."""
        # (page size, budget) -> layer -> per step: per KV head the budget pages it selected
        self.selected: dict[tuple[int, int], dict[int, list[list[list[int]]]]] = collections.defaultdict(
            lambda: collections.defaultdict(list))
        self.chunks: list[dict] = []
        self.max_diff = 0.0
        self.estimate_s = self.select_s = 0.0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        with torch.no_grad():
            if query.shape[2] > 1 and self.do_prefill:
                t0 = time.monotonic()
                self.prefill_chunks(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), scale)
                self.estimate_s += time.monotonic() - t0
            elif query.shape[2] == 1 and self.do_decode:
                t0 = time.monotonic()
                self.check_decode(query[0, :, 0], key[0], value[0], out[0, 0], scale)
                self.decode_pages(module.layer_idx, query[0, :, 0], key[0])
                self.select_s += time.monotonic() - t0
        return out, weights

    def prefill_chunks(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        """q [L, H, D], k [L, Hkv, D]: every chunk after the first, estimated as vLLM's chunked
        prefill would see it (its queries; the context's and its own keys)."""
        from vllm_sparse_backend.head_configs import layer_heads
        from vllm_sparse_backend.prefill.estimate import HeadGroups, estimate_index

        s = self.settings
        n, n_heads, _ = q.shape
        heads = layer_heads(None, s, layer, n_heads)
        group = n_heads // k.shape[1]
        for start in range(self.chunk, n, self.chunk):
            end = min(n, start + self.chunk)
            q_len = end - start
            est = estimate_index(q[start:end], k[:end], start, heads, s, scale)
            per_block = earlier_key_cover(est.index, start, group, per_query_block=True)
            cover = per_block.any(1)
            density = HeadGroups.from_heads(heads, q.device).budget_density(q_len, start, s)
            dense = ("chunk below min_sparse_query_len" if q_len < s.min_sparse_query_len else
                     "budget density above max_density" if density > s.max_density else "")
            row = {"layer": layer, "ctx": start, "q_len": q_len, "budget_density": density, "dense": dense,
                   "key_share": cover.float().mean(-1).tolist()}
            for ps in self.page_sizes:
                per_kv, pages = page_share(cover, ps)
                layer_pages, _ = page_share(cover.any(0), ps)
                block_pages, _ = page_share(per_block, ps)
                row[f"pages_{ps}"] = {"per_kv_head": per_kv.tolist(), "any_kv_head": int(layer_pages),
                                      "query_block_mean": block_pages.double().mean().item(),
                                      "context_pages": pages}
            self.chunks.append(row)

    def check_decode(self, q, k, v, theirs, scale: float) -> None:
        """The captured query and cache must reproduce the model's own output for this layer."""
        rep = q.shape[0] // k.shape[0]
        s = torch.einsum("hd,hld->hl", q.float(), k.float().repeat_interleave(rep, 0)) * scale
        mine = torch.einsum("hl,hld->hd", torch.softmax(s, -1), v.float().repeat_interleave(rep, 0))
        self.max_diff = max(self.max_diff, ((mine - theirs.float()).norm() / theirs.float().norm()).item())

    def decode_pages(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """q [H, D], k [Hkv, L, D]: the topk mode's budget pages per KV head, for every page size
        and budget (the references' float64 Quest bounds on the cache laid out in pages)."""
        from vllm_sparse_kernels.reference.topk_decode import reference_page_summaries, reference_select_pages

        hkv, length, d = k.shape
        for ps in self.page_sizes:
            n_pages = -(-length // ps)
            paged = torch.zeros(n_pages * ps, hkv, d, dtype=k.dtype, device=k.device)
            paged[:length] = k.transpose(0, 1)
            paged = paged.view(n_pages, ps, hkv, d)
            table = torch.arange(n_pages, dtype=torch.int32, device=k.device)[None]
            seq_lens = torch.tensor([length], device=k.device)
            smin, smax, _ = reference_page_summaries(paged, table, seq_lens)
            for budget in self.budgets:
                sel, counts = reference_select_pages(q[None], smin, smax, table, seq_lens, ps,
                                                     sink_pages=self.sink_pages, recent_pages=self.recent_pages,
                                                     num_pages_budget=budget)
                lo, hi = self.sink_pages, n_pages - self.recent_pages  # forced pages stay on the GPU
                heads = []
                for h in range(sel.shape[1]):
                    picked = sel[0, h, :int(counts[0, h])].tolist()
                    heads.append([p for p in picked if lo <= p < hi])
                self.selected[(ps, budget)][layer].append(heads)


def load_model(model_dir: str, dtype: torch.dtype, yarn_factor: float, device, cap: Capture):
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    AttentionInterface.register(_ATTENTION_NAME, cap)

    config = AutoConfig.from_pretrained(model_dir)
    if yarn_factor > 1:
        # Qwen2.5's model card recipe for long contexts: static YaRN over the trained 32K positions
        base = getattr(config, "rope_parameters", None)
        original = config.max_position_embeddings
        yarn = {"rope_type": "yarn", "factor": yarn_factor, "original_max_position_embeddings": original}
        if isinstance(base, dict):
            config.rope_parameters = {**base, **yarn}
        else:
            config.rope_scaling = {"type": "yarn", **yarn}
        config.max_position_embeddings = int(original * yarn_factor)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, attn_implementation=_ATTENTION_NAME,
                                                 dtype=dtype)
    return model.to(device).eval()


def run_model(model, prompt_ids: list[int], steps: int, eos_ids, device, log=print):
    timings = {}

    def pick(logits):
        logits = logits[0, -1].float()
        logits[list(eos_ids)] = float("-inf")
        return int(logits.argmax())

    generated = []
    with torch.no_grad():
        t0 = time.monotonic()
        res = model(torch.tensor([prompt_ids], device=device), use_cache=True, logits_to_keep=1)
        cache = res.past_key_values
        generated.append(pick(res.logits))
        timings["prefill_s"] = time.monotonic() - t0
        log(f"prefill of {len(prompt_ids)} tokens (with the chunk estimates): {timings['prefill_s']:.1f} s",
            flush=True)
        t0 = time.monotonic()
        for _ in range(steps):
            res = model(torch.tensor([[generated[-1]]], device=device), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            cache = res.past_key_values
            generated.append(pick(res.logits))
        timings["decode_s"] = time.monotonic() - t0
    log(f"{steps} decode steps (with the page selections): {timings['decode_s']:.1f} s", flush=True)
    del cache
    return generated, timings


def analyse_decode(cap: Capture, multiples: Sequence[int], kv_heads: int, head_dim: int, layers: int) -> list[dict]:
    """Per (page size, budget): the mean over layers of the hot-cache statistics."""
    rows = []
    for (ps, budget), per_layer in sorted(cap.selected.items()):
        whole_page = page_bytes(ps, kv_heads, head_dim)
        row = {"page": ps, "budget": budget, "steps": len(next(iter(per_layer.values())))}
        unions, per_head_pages = [], []
        stats: dict[str, list] = collections.defaultdict(list)
        series = {}
        for layer, steps in sorted(per_layer.items()):
            union = union_steps(steps)
            unions += [len(u) for u in union]
            per_head_pages += [len(h) for s in steps for h in s]
            for m in multiples:
                whole = hot_cache_stats(union, m * budget)
                sliced = slice_cache_stats(steps, m * budget)
                stats[f"hit_page_{m}x"].append(whole["hit_rate"])
                stats[f"fetch_page_{m}x"].append(whole["fetched_mean"])
                stats[f"fetch_page_max_{m}x"].append(whole["fetched_max"])
                stats[f"hit_slice_{m}x"].append(sliced["hit_rate"])
                stats[f"fetch_slice_{m}x"].append(sliced["fetched_mean"])
                stats[f"cold_page_{m}x"].append(whole["cold"])
                series.setdefault(f"fetch_page_{m}x", []).append(whole["misses"])
        row["pages_per_head"] = sum(per_head_pages) / len(per_head_pages)
        row["union_pages"] = sum(unions) / len(unions)
        for key, vals in stats.items():
            row[key] = max(vals) if "max" in key else sum(vals) / len(vals)
        # bytes over PCIe per decode step, every layer: whole pages, or each KV head's slice alone
        for m in multiples:
            row[f"mib_step_page_{m}x"] = row[f"fetch_page_{m}x"] * whole_page * layers / 2**20
            row[f"mib_step_slice_{m}x"] = row[f"fetch_slice_{m}x"] * whole_page / kv_heads * layers / 2**20
        row["page_bytes"] = whole_page
        row["series"] = series
        rows.append(row)
    return rows


def format_decode(rows: list[dict], multiples: Sequence[int]) -> str:
    head = (f"{'page':>4} {'budget':>6} {'pg/head':>7} {'union':>6} "
            + " ".join(f"{f'hit@{m}x':>7} {f'fet@{m}x':>7} {f'max@{m}x':>7}" for m in multiples)
            + " " + " ".join(f"{f'slice hit@{m}x':>13}" for m in multiples)
            + " " + " ".join(f"{f'MiB/step@{m}x':>13}" for m in multiples))
    lines = ["# decode: budget pages per KV head (sink and recent pages resident); union = pages of a layer any KV "
             "head selected; hit@Cx / fet@Cx / max@Cx = LRU of C x budget whole pages per layer: hit rate, pages "
             "fetched per step and layer (mean, worst step of any layer), steps 2..T; slice hit = per-KV-head "
             "caches of C x budget slices; MiB/step = whole pages fetched per step, all layers",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['page']:>4} {r['budget']:>6} {r['pages_per_head']:>7.1f} {r['union_pages']:>6.1f} "
                     + " ".join(f"{r[f'hit_page_{m}x']:>7.3f} {r[f'fetch_page_{m}x']:>7.1f} "
                                f"{r[f'fetch_page_max_{m}x']:>7}" for m in multiples)
                     + " " + " ".join(f"{r[f'hit_slice_{m}x']:>13.3f}" for m in multiples)
                     + " " + " ".join(f"{r[f'mib_step_page_{m}x']:>13.1f}" for m in multiples))
    return "\n".join(lines)


def decode_fetch_lines(rows: list[dict], transfer: dict | None, multiples, kv_heads: int, head_dim: int,
                       layers: int) -> list[str]:
    """The decode misses priced at the best measured gather of this model's 64-token pages (none
    when part 1 did not run or measured no layout of these KV heads and head dim)."""
    layout = next((g for g in (transfer or {}).get("gather", {}).values()
                   if (g["kv_heads"], g["head_dim"]) == (kv_heads, head_dim)), None)
    if layout is None:
        return []
    best = {r["pages"]: min(r[m]["ms"] for m in GATHER_ROUTES) for r in layout["rows"]}
    lines = [f"# the misses of {TRANSFER_PAGE_TOKENS}-token whole pages at the best measured gather, {layers} "
             "layers fetched one after another"]
    for r in rows:
        if r["page"] != TRANSFER_PAGE_TOKENS:
            continue
        for m in multiples:
            f, worst = r[f"fetch_page_{m}x"], r[f"fetch_page_max_{m}x"]
            lines.append(f"budget {r['budget']}, cache {m}x: {f:.1f} pages per layer -> "
                         f"{fetch_ms_for(f, best) * layers:.2f} ms per step (worst step of a layer: {worst} pages, "
                         f"{fetch_ms_for(worst, best):.3f} ms)")
    return lines


def analyse_prefill(chunks: list[dict], page_sizes) -> list[dict]:
    """Per chunk (context start): means over layers of the key and page shares, and the worst layer."""
    by_ctx = collections.defaultdict(list)
    for c in chunks:
        by_ctx[c["ctx"]].append(c)
    rows = []
    for ctx, cs in sorted(by_ctx.items()):
        row = {"ctx": ctx, "q_len": cs[0]["q_len"], "dense": cs[0]["dense"],
               "budget_density": cs[0]["budget_density"],
               "key_share": statistics.mean(statistics.mean(c["key_share"]) for c in cs)}
        for ps in page_sizes:
            shares = [statistics.mean(c[f"pages_{ps}"]["per_kv_head"]) / c[f"pages_{ps}"]["context_pages"]
                      for c in cs]
            anys = [c[f"pages_{ps}"]["any_kv_head"] / c[f"pages_{ps}"]["context_pages"] for c in cs]
            worst = max(range(len(cs)), key=lambda i: anys[i])
            row[f"page_share_{ps}"] = statistics.mean(shares)
            row[f"block_share_{ps}"] = statistics.mean(c[f"pages_{ps}"]["query_block_mean"] /
                                                       c[f"pages_{ps}"]["context_pages"] for c in cs)
            row[f"any_share_{ps}"] = statistics.mean(anys)
            row[f"worst_{ps}"] = [cs[worst]["layer"], anys[worst]]
        rows.append(row)
    return rows


def _worst(layer_share) -> str:
    return f"L{layer_share[0]} {layer_share[1]:.3f}"


def format_prefill(rows: list[dict], page_sizes, chunk: int) -> str:
    head = (f"{'ctx':>7} {'q_len':>6} {'keys':>6} "
            + " ".join(f"{f'pg{ps}/kv':>8} {f'pg{ps} any':>8} {f'worst{ps}':>11} {f'pg{ps} qb':>8}"
                       for ps in page_sizes)
            + "  dense?")
    lines = [f"# prefill chunks of {chunk}: earlier-context keys the default vertical-slash index lists (union over "
             "the chunk's query blocks and each KV group's heads), mean over layers; pgP/kv = pages of P tokens "
             "per KV head, pgP any = pages any KV head needs, as shares of the earlier context's pages; worst = "
             "the layer needing most (layer share); pgP qb = pages per KV head of one query block alone (what a "
             "chunk computed block by block needs at a time)", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['ctx']:>7} {r['q_len']:>6} {r['key_share']:>6.3f} "
                     + " ".join(f"{r[f'page_share_{ps}']:>8.3f} {r[f'any_share_{ps}']:>8.3f} "
                                f"{_worst(r[f'worst_{ps}']):>11} {r[f'block_share_{ps}']:>8.3f}" for ps in page_sizes)
                     + (f"  {r['dense']}" if r["dense"] else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["transfer", "decode", "prefill"],
                   choices=["transfer", "decode", "prefill"])
    p.add_argument("--model", default="/tmp/models/qwen2.5-coder-1.5b-instruct", help="a bf16 HF model folder")
    p.add_argument("--text", default="/tmp/austen.txt", help="the haystack text file")
    p.add_argument("--task", default="single_needle", help="a task of vllm_sparse_tools.evaluation.tasks")
    p.add_argument("--tokens", nargs="+", type=int, default=[32768], help="prompt lengths, one model run each")
    p.add_argument("--yarn", type=float, default=None,
                   help="YaRN factor (default: 4 when a prompt is longer than the model's trained positions)")
    p.add_argument("--steps", type=int, default=32, help="decode steps")
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 32, 64], help="budget pages per KV head")
    p.add_argument("--page-sizes", nargs="+", type=int, default=[16, 64], help="tokens per page")
    p.add_argument("--cache-multiples", nargs="+", type=int, default=[1, 2, 4],
                   help="hot-cache capacity as multiples of the budget")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (vLLM's default)")
    p.add_argument("--sizes-mib", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--transfer-pages", nargs="+", type=int, default=[16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--pool-pages", type=int, default=4096, help="pages in the pinned pool gathers pick from")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", help="output path without extension "
                                 "(default benchmarks/results/host_kv_feasibility_<date>)")
    args = p.parse_args(argv)
    for name in ("steps", "chunk", "reps", "pool_pages"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("budgets", "page_sizes", "cache_multiples", "tokens", "sizes_mib", "transfer_pages"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must all be at least 1")
    if max(args.transfer_pages) > args.pool_pages:
        p.error(f"--transfer-pages up to {max(args.transfer_pages)} need --pool-pages at least that")
    date = datetime.date.today().isoformat()
    out = pathlib.Path(args.out or REPO / "benchmarks" / "results" / f"host_kv_feasibility_{date}")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": date, "host": platform.node(), "torch": torch.__version__, "command": " ".join(sys.argv),
            "args": vars(args)}
    if args.device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name()
    result: dict = {"meta": meta}
    text: list[str] = []

    transfer = None
    if "transfer" in args.parts:
        if not args.device.startswith("cuda"):
            p.error("--parts transfer needs CUDA (pinned host -> GPU copies)")
        transfer = measure_transfers(args.sizes_mib, args.transfer_pages, args.pool_pages, args.reps)
        result["transfer"] = transfer
        text.append(format_transfers(transfer, 64))
        print(text[-1], flush=True)

    model_parts = [x for x in ("decode", "prefill") if x in args.parts]
    if model_parts:
        import transformers
        from vllm_sparse_backend.config import load_settings
        from vllm_sparse_tools.evaluation.tasks import TASKS, HFTokenizer, make_samples

        if args.task not in TASKS:
            p.error(f"--task {args.task!r}: known {', '.join(TASKS)}")
        settings = load_settings({})
        model_dir = pathlib.Path(args.model)
        if not (model_dir / "config.json").is_file():
            p.error(f"--model {args.model}: no config.json there")
        haystack = pathlib.Path(args.text).read_text(encoding="utf-8", errors="replace")
        tok = HFTokenizer(str(model_dir))
        cfg = json.loads((model_dir / "config.json").read_text())
        trained = cfg.get("max_position_embeddings", 32768)
        yarn = args.yarn if args.yarn is not None else (4.0 if max(args.tokens) > trained else 1.0)
        cap = Capture(settings, args.chunk, args.page_sizes, args.budgets, settings.decode_sink_pages,
                      settings.decode_recent_pages, "prefill" in model_parts, "decode" in model_parts)
        t0 = time.monotonic()
        model = load_model(str(model_dir), getattr(torch, args.dtype), yarn, args.device, cap)
        meta.update(model=model_dir.name, yarn_factor=yarn, transformers=transformers.__version__,
                    load_s=time.monotonic() - t0, settings=settings.model_dump(mode="json"))
        n_layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        eos = sorted({i for i in (tok.tok.eos_token_id, tok.tok.convert_tokens_to_ids("<|endoftext|>"),
                                  tok.tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int) and i >= 0})
        result["runs"] = []
        for n_target in args.tokens:
            sample, = make_samples(tok, haystack, [args.task], [n_target], 1)
            cap.reset()
            print(f"{args.task} prompt: {sample.n_tokens} tokens; {args.steps} decode steps, yarn x{yarn}",
                  flush=True)
            generated, timings = run_model(model, sample.prompt_ids, args.steps if "decode" in model_parts else 0,
                                           eos, args.device)
            timings.update(estimate_s=cap.estimate_s, select_s=cap.select_s)
            run = {"target_tokens": n_target, "prompt_tokens": sample.n_tokens, "expected": list(sample.expected),
                   "generated_text": tok.decode(generated), "timings_s": timings,
                   "capture_max_rel_diff": cap.max_diff}
            head = (f"## {model_dir.name}, {sample.n_tokens}-token {args.task} prompt, yarn x{yarn}; "
                    f"generated {run['generated_text']!r} (expected {list(sample.expected)})")
            text.append(head)
            print(head, flush=True)
            if "decode" in model_parts:
                if cap.max_diff > 2e-2:
                    raise RuntimeError(f"captured q/k/v do not reproduce the model's attention output "
                                       f"(relative difference {cap.max_diff:.2e})")
                rows = analyse_decode(cap, args.cache_multiples, kv_heads, head_dim, n_layers)
                run["decode"] = rows
                text.append(format_decode(rows, args.cache_multiples))
                lines = decode_fetch_lines(rows, transfer, args.cache_multiples, kv_heads, head_dim, n_layers)
                if lines:
                    text.append("\n".join(lines))
                    run["fetch_ms_note"] = lines
                print("\n".join(text[-2:] if lines else text[-1:]), flush=True)
            if "prefill" in model_parts:
                run["prefill_chunks"] = analyse_prefill(cap.chunks, args.page_sizes)
                run["prefill_per_layer"] = cap.chunks
                text.append(format_prefill(run["prefill_chunks"], args.page_sizes, args.chunk))
                print(text[-1], flush=True)
            tail = (f"# timings: prefill {timings['prefill_s']:.1f} s (chunk estimates {cap.estimate_s:.1f} s), "
                    f"decode {timings.get('decode_s', 0):.1f} s (page selections {cap.select_s:.1f} s)")
            text.append(tail)
            print(tail, flush=True)
            result["runs"].append(run)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()

    out.with_name(out.name + ".json").write_text(dump_json(result))
    out.with_name(out.name + ".txt").write_text("\n\n".join(text) + "\n")
    print(f"wrote {out}.json and {out}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
