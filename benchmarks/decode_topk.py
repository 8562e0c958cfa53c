"""Decode-side top-k attention kernels (vllm_sparse_kernels/decode/topk_decode.py) vs dense decode, on one GPU.

What is measured: one decode step of one layer (one query token per sequence), bf16, paged KV cache
(page 16, every sequence's pages in random physical order), all sequences of a batch at the same
context length. Per model shape (``--shapes``: Llama-3-8B 32/8/128, Qwen2.5 14/2/64 query heads /
KV heads / head dim), context length (``--contexts``, K tokens) and batch size (``--batches``):

* baselines, side by side: (1) ``dense ours``: ``topk_decode_attention`` with every page of every
  sequence selected (the same Triton code path as top-k, page-granular; its selection is built
  untimed); (2) ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with the flash and
  the memory-efficient backends (the faster is reported), q_len 1, on contiguous ``[B, H, n, D]``
  K/V already expanded for GQA (the gather / expansion is not timed), as an external reference of
  a well-tuned dense decode;
* ``update``: ``update_page_summaries`` for one new token per sequence (its slot is the last one
  of the context: the per-step maintenance cost); ``build``: ``build_page_summaries`` over the
  whole context (the once-per-prefill cost);
* top-k at page budgets of 1%, 2%, 5% of the context's pages (at least 1), plus ``sink_pages=1``
  and ``recent_pages=4``, one selection per KV head (the default): ``select`` = ``select_pages``,
  ``attn`` = ``topk_decode_attention`` over those pages; ``tok attn`` = the same attention with
  ``topk_tokens`` = 1% of the context (token top-k inside the budget pages; its time includes the
  scores pass and the thresholds' ``torch.topk``). At the 1% page budget the budget pages hold
  fewer tokens than k, so the token top-k keeps all of them there (it costs, it cannot save);
* speedups ``x ours`` / ``x sdpa`` = that baseline's time / (select + attn), and in parentheses /
  (select + attn + update); ``tok x ...`` the same with ``tok attn``.

Untimed sanity numbers: ``err`` = max |dense ours - sdpa| / max |sdpa| over the batch (budget =
all pages must be dense decode); ``mass`` = the share of the exact attention (softmax over the
whole context, fp32, the first sequence, mean over query heads) that falls on the tokens of the
selected pages, with in parentheses the best possible share for the same number of pages (an
oracle that picks, per KV head, the pages of largest summed exact attention mass of its group);
``tok mass`` = the share on the tokens the token top-k keeps.

Inputs: K, V and q are standard normal (bf16), except planted "hot" pages so that the selection
is not meaningless: per sequence and KV head, 2% of the context's pages (at least 1, chosen
uniformly among the pages that are neither sink nor recent pages, independently per KV head) get
``c * u`` added to every key of the page, u = the unit vector of the sum of the group's decode
queries, c chosen so that the mean over the group's query heads of the added logit
``c * (q_h . u) / sqrt(D)`` equals a boost beta drawn per page uniformly from [2, 7] (random keys
give logits of standard deviation ~1). Values are not planted. Seed ``--seed`` (reset per case).

Timing: each measured call is captured in a CUDA graph (as vLLM runs decode; no Python launch
overhead) and replayed; median of CUDA-event timings of single replays, each preceded by a write
of 256 MiB that flushes the L2 cache, after a warm-up (Triton compiles there); about
``--budget-ms`` per measurement (at least 5, at most ``--max-reps`` replays). Where the capture
fails the call is timed eagerly instead (listed at the end). ``--eager`` times everything eagerly.
Combinations whose KV cache exceeds ``--max-cache-gb`` are skipped; SDPA is skipped when its
expanded K/V does not fit in 85% of free GPU memory; out-of-memory errors are caught per case.

Run (from any folder where the package is pip-installed; CUDA needed, otherwise it says so and
exits 0):

    python3 -m benchmarks.decode_topk                 # both shapes, 32K/64K/128K, batch 1/8/32
    python3 -m benchmarks.decode_topk --quick         # Llama-3-8B, 32K/128K, batch 1/32
    python3 -m benchmarks.decode_topk --shapes qwen2.5 --contexts 64 --batches 8 --json out.json

Prints the device, torch and triton versions, then one markdown table per shape (rows as they
come, flushed). Asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time

import torch

from benchmarks.common import SHAPES as MODEL_SHAPES, capture_graph, event_median

try:
    import triton

    from vllm_sparse_kernels.decode import topk_decode as tk
except ImportError as _e:  # checked in main(); lets the file be imported / linted without triton
    triton = tk = None
    _IMPORT_ERROR = _e
else:
    _IMPORT_ERROR = None

SHAPES = {name: MODEL_SHAPES[name] for name in ("llama3-8b", "qwen2.5")}
PAGE = 16
DTYPE = torch.bfloat16
SINK_PAGES = 1
RECENT_PAGES = 4
BUDGETS = (0.01, 0.02, 0.05)  # page budgets, fractions of the context's pages
TOKEN_TOPK_FRACTION = 0.01  # topk_tokens, fraction of the context
HOT_FRACTION = 0.02  # planted hot pages per (sequence, KV head), fraction of the context's pages
HOT_BOOST = (2.0, 7.0)  # added mean logit of a hot page's keys, uniform in this range
FLUSH_BYTES = 256 * 2**20  # > L2 of an H100 / H200

GRAPH_FAILURES: list[str] = []


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def bench(fn, device: torch.device, flush: torch.Tensor, budget_ms: float = 300.0, max_reps: int = 50,
          graphs: bool = True, label: str = "") -> float:
    """Median milliseconds of ``fn()`` on a CUDA ``device``, ``flush`` zeroed before each call (see
    the module doc)."""
    fn()  # compiles
    torch.cuda.synchronize(device)
    run = fn
    if graphs:
        try:
            run = capture_graph(fn).replay
        except Exception as e:  # not capturable: time it eagerly
            GRAPH_FAILURES.append(f"{label}: {type(e).__name__}: {str(e)[:120]}")
            torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize(device)
    est = (time.perf_counter() - t0) * 1e3 + 0.05  # + the flush
    return event_median(run, int(max(5, min(max_reps, budget_ms / est))), before=flush.zero_)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def make_inputs(h: int, hkv: int, d: int, n: int, batch: int, device: torch.device, gen: torch.Generator):
    """q ``[B, H, D]``; key / value cache ``[B * pages, PAGE, Hkv, D]`` (vLLM's flash-attn layout,
    K and V halves of one tensor); block table int32 ``[B, pages]`` (a random permutation of the
    physical pages); seq_lens int32 ``[B]`` = n. Hot pages planted (module doc)."""
    n_pages = triton.cdiv(n, PAGE)
    kv = torch.empty(2, batch * n_pages, PAGE, hkv, d, dtype=DTYPE, device=device)
    kv.normal_(generator=gen)
    key_cache, value_cache = kv[0], kv[1]
    perm = torch.randperm(batch * n_pages, generator=gen, device=device)
    block_table = perm.to(torch.int32).view(batch, n_pages)
    seq_lens = torch.full((batch,), n, dtype=torch.int32, device=device)
    q = torch.randn(batch, h, d, generator=gen, device=device, dtype=torch.float32)
    plant_hot_pages(q, key_cache, block_table, n_pages, gen)
    return q.to(DTYPE), key_cache, value_cache, block_table, seq_lens


def plant_hot_pages(q: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor, n_pages: int,
                    gen: torch.Generator) -> None:
    """In place: per sequence and KV head, HOT_FRACTION of the non-sink, non-recent pages get
    ``c * u`` added to all their keys (u: unit sum of the group's queries; c: mean added logit
    over the group = beta ~ U(HOT_BOOST))."""
    batch, h, d = q.shape
    hkv = key_cache.shape[2]
    group = h // hkv
    device = q.device
    lo, hi = SINK_PAGES, n_pages - RECENT_PAGES
    m = min(max(1, round(HOT_FRACTION * n_pages)), max(hi - lo, 0))
    if m == 0:
        return
    qg = q.float().view(batch, hkv, group, d)
    u = qg.sum(2)
    u = u / u.norm(dim=-1, keepdim=True)  # [B, Hkv, D]
    mean_dot = (qg * u[:, :, None]).sum(-1).mean(-1)  # [B, Hkv], > 0
    kv_heads = torch.arange(hkv, device=device)[:, None]
    for b in range(batch):
        logical = torch.rand(hkv, hi - lo, generator=gen, device=device).argsort(-1)[:, :m] + lo  # [Hkv, m]
        beta = torch.empty(hkv, m, device=device).uniform_(*HOT_BOOST, generator=gen)
        c = beta * math.sqrt(d) / mean_dot[b][:, None]
        shift = c[..., None] * u[b][:, None, :]  # [Hkv, m, D]
        phys = block_table[b].long()[logical]  # [Hkv, m]
        key_cache[phys, :, kv_heads] += shift[:, :, None, :].to(key_cache.dtype)  # [Hkv, m, PAGE, D]


def dense_kv(cache: torch.Tensor, block_table: torch.Tensor, n: int, group: int) -> torch.Tensor:
    """Contiguous ``[B, H, n, D]`` copy of every sequence's keys (or values), in logical order,
    each KV head repeated for its group's query heads."""
    batch, n_pages = block_table.shape
    _, page, hkv, d = cache.shape
    out = torch.empty(batch, hkv, group, n, d, dtype=cache.dtype, device=cache.device)
    for b in range(batch):
        seq = cache[block_table[b].long()].reshape(n_pages * page, hkv, d)[:n]
        out[b].copy_(seq.permute(1, 0, 2)[:, None].expand(hkv, group, n, d))
    return out.view(batch, hkv * group, n, d)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


# ---------------------------------------------------------------------------------------------
# Attention-mass sanity (first sequence, fp32, untimed)
# ---------------------------------------------------------------------------------------------

def exact_attention(q, key_cache, block_table, n, scale):
    """Raw scores and softmax probabilities ``[Hkv, group, n]`` (fp32) of sequence 0 over its
    whole context."""
    n_pages = triton.cdiv(n, PAGE)
    hkv, d = key_cache.shape[2:]
    k = key_cache[block_table[0, :n_pages].long()].reshape(n_pages * PAGE, hkv, d)[:n].float()
    qg = q[0].float().view(hkv, -1, d)
    s = torch.einsum("kgd,nkd->kgn", qg, k)
    return s, torch.softmax(s * scale, dim=-1)


def forced_pages(n_pages: int, device) -> torch.Tensor:
    j = torch.arange(n_pages, device=device)
    return (j < SINK_PAGES) | (j >= n_pages - RECENT_PAGES)


def page_mass(p: torch.Tensor, n_pages: int) -> torch.Tensor:
    """``[Hkv, group, pages]`` attention mass per page."""
    pad = n_pages * PAGE - p.shape[-1]
    return torch.nn.functional.pad(p, (0, pad)).view(*p.shape[:2], n_pages, PAGE).sum(-1)


def selection_mass(s, p, selected, counts, topk_tokens):
    """(mass on the selected pages' tokens, mass on the tokens the token top-k keeps), means over
    query heads; selected ``[Hkv, width]`` logical pages (-1 padded), counts ``[Hkv]``."""
    hkv, _, n = p.shape
    n_pages = triton.cdiv(n, PAGE)
    width = selected.shape[-1]
    ok = torch.arange(width, device=p.device)[None] < counts[:, None].to(p.device)
    idx = torch.where(ok, selected.long().to(p.device), n_pages)  # padding -> a spare column
    page_sel = torch.zeros(hkv, n_pages + 1, dtype=torch.bool, device=p.device)
    page_sel.scatter_(1, idx, torch.ones_like(idx, dtype=torch.bool))
    tok_sel = page_sel[:, :n_pages].repeat_interleave(PAGE, dim=-1)[:, :n]  # [Hkv, n]
    tok_forced = forced_pages(n_pages, p.device).repeat_interleave(PAGE)[:n]  # [n]
    mass = (p * tok_sel[:, None]).sum(-1).mean().item()
    budget_tok = tok_sel & ~tok_forced
    cand = s.masked_fill(~budget_tok[:, None], float("-inf"))
    k = min(topk_tokens, width * PAGE, n)
    kth = cand.topk(k, dim=-1).values[..., -1:]  # -inf where fewer candidates: all kept
    keep = (tok_sel & tok_forced)[:, None] | (budget_tok[:, None] & (s >= kth))
    return mass, (p * keep).sum(-1).mean().item()


def oracle_mass(pm: torch.Tensor, budget: int) -> float:
    """Best mass with the forced pages + ``budget`` others, one page set per KV head."""
    hkv, _, n_pages = pm.shape
    forced = forced_pages(n_pages, pm.device)
    group_mass = pm.sum(1).masked_fill(forced, float("-inf"))
    keep = forced.expand(hkv, n_pages).clone()
    b = min(budget, int((~forced).sum()))
    if b > 0:
        keep.scatter_(1, group_mass.topk(b, dim=-1).indices, True)
    return (pm * keep[:, None]).sum(-1).mean().item()


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------

def sdpa_case(q, key_cache, value_cache, block_table, n, group, scale, ref_out, time_it, device):
    """SDPA times (ms) per backend and the rel. error of ``ref_out`` against each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    batch, h, d = q.shape
    res = {}
    need = 2 * batch * h * n * d * q.element_size()
    free = torch.cuda.mem_get_info(device)[0]
    if need > 0.85 * free:
        res["sdpa_note"] = f"skipped: expanded K/V need {need / 2**30:.0f} GiB, {free / 2**30:.0f} free"
        return res
    kd = dense_kv(key_cache, block_table, n, group)
    vd = dense_kv(value_cache, block_table, n, group)
    qd = q[:, :, None, :]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale)
        try:
            res[f"err_{name}"] = rel_err(ref_out, call()[:, :, 0])
            res[f"sdpa_{name}"] = time_it(f"sdpa {name}", call)
        except Exception as e:  # backend refuses the shape, or out of memory
            res[f"sdpa_{name}_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    return res


def run_case(h: int, hkv: int, d: int, n: int, batch: int, device="cuda", *, seed: int = 0, budget_ms: float = 300.0,
             max_reps: int = 50, graphs: bool = True) -> dict:
    """All measurements of one (shape, context, batch); times in ms. See the module doc."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    group = h // hkv
    scale = 1.0 / math.sqrt(d)
    n_pages = triton.cdiv(n, PAGE)
    tag = f"H{h}/{hkv} D{d} n={n} B={batch}"
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)

    def time_it(label, fn):
        return bench(fn, device, flush, budget_ms, max_reps, graphs, f"{tag} {label}")

    rec = {"h": h, "hkv": hkv, "d": d, "n": n, "batch": batch, "pages": n_pages}
    t_start = time.perf_counter()
    q, key_cache, value_cache, block_table, seq_lens = make_inputs(h, hkv, d, n, batch, device, gen)
    smin, smax = tk.allocate_page_summaries(key_cache)

    rec["build"] = time_it("build", lambda: tk.build_page_summaries(key_cache, block_table, seq_lens, smin, smax,
                                                                      max_pages=n_pages))
    pos = seq_lens.long() - 1  # the decode token's slot: the last of the context
    slots = block_table.long().gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE
    rec["update"] = time_it("update", lambda: tk.update_page_summaries(key_cache, smin, smax, slots))

    # (1) dense through our kernel: every page selected
    sel_all = torch.arange(n_pages, dtype=torch.int32, device=device).expand(batch, hkv, n_pages).contiguous()
    cnt_all = torch.full((batch, hkv), n_pages, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    dense_out = tk.topk_decode_attention(q, key_cache, value_cache, block_table, seq_lens, sel_all, cnt_all, scale)
    rec["dense_ours"] = time_it("dense ours", lambda: tk.topk_decode_attention(
        q, key_cache, value_cache, block_table, seq_lens, sel_all, cnt_all, scale, out))

    # (2) torch SDPA on expanded contiguous K/V (freed when sdpa_case returns)
    rec.update(sdpa_case(q, key_cache, value_cache, block_table, n, group, scale, dense_out, time_it, device))
    sdpa = {k[5:]: v for k, v in rec.items() if k.startswith("sdpa_") and isinstance(v, float)}
    if sdpa:
        best = min(sdpa, key=sdpa.get)
        rec["sdpa"], rec["sdpa_backend"], rec["err"] = sdpa[best], best, rec[f"err_{best}"]

    s0, p0 = exact_attention(q, key_cache, block_table, n, scale)
    pm0 = page_mass(p0, n_pages)
    topk_tokens = max(1, round(TOKEN_TOPK_FRACTION * n))
    rec["topk_tokens"] = topk_tokens
    rec["budgets"] = []
    for frac in BUDGETS:
        budget = min(max(1, round(frac * n_pages)), max(n_pages - SINK_PAGES - RECENT_PAGES, 0))
        r = {"fraction": frac, "budget_pages": budget}

        def select():
            return tk.select_pages(q, smin, smax, block_table, seq_lens, PAGE, sink_pages=SINK_PAGES,
                                   recent_pages=RECENT_PAGES, num_pages_budget=budget, max_pages=n_pages)

        selected, counts = select()
        r["select"] = time_it(f"select {frac:.0%}", select)
        r["attn"] = time_it(f"attn {frac:.0%}", lambda: tk.topk_decode_attention(
            q, key_cache, value_cache, block_table, seq_lens, selected, counts, scale, out,
            sink_pages=SINK_PAGES, recent_pages=RECENT_PAGES))
        r["tok_attn"] = time_it(f"token top-k attn {frac:.0%}", lambda: tk.topk_decode_attention(
            q, key_cache, value_cache, block_table, seq_lens, selected, counts, scale, out,
            topk_tokens=topk_tokens, sink_pages=SINK_PAGES, recent_pages=RECENT_PAGES))
        r["mass"], r["tok_mass"] = selection_mass(s0, p0, selected[0], counts[0], topk_tokens)
        r["oracle_mass"] = oracle_mass(pm0, budget)
        rec["budgets"].append(r)
    rec["case_seconds"] = time.perf_counter() - t_start
    return rec


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

COLUMNS = ("ctx", "B", "dense ours", "sdpa", "err", "update", "build", "budget", "select", "attn", "x ours",
           "x sdpa", "tok attn", "tok x ours", "tok x sdpa", "mass (oracle)", "tok mass")


def table_header(shape: str) -> str:
    h, hkv, d = SHAPES[shape]
    return "\n".join([
        f"\n### {shape} (H/Hkv/D = {h}/{hkv}/{d}), bf16, page {PAGE}, sink {SINK_PAGES} + recent {RECENT_PAGES} "
        f"pages, selection per KV head, token top-k k = {TOKEN_TOPK_FRACTION:.0%} of the context",
        "Times in us (median). x = baseline / (select + attn), in parentheses / (select + attn + update); "
        "tok = with token top-k. err: dense ours vs sdpa (max abs / max abs). mass: exact attention share "
        "on the selection, sequence 0 (oracle: best pages at that budget).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ])


def ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _us(ms) -> str:
    if ms is None or ms != ms:
        return "n/a"
    us = ms * 1e3
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:.0f}"


def _x(base, t, t_upd) -> str:
    if base is None or base != base:
        return "n/a"
    return f"{base / t:.1f} ({base / t_upd:.1f})"


def table_rows(rec: dict) -> list[str]:
    ctx = ctx_label(rec["n"])
    dense, sdpa, upd = rec["dense_ours"], rec.get("sdpa"), rec["update"]
    sdpa_cell = f"{_us(sdpa)} {rec['sdpa_backend']}" if sdpa is not None else "n/a (see notes)"
    err = f"{rec['err']:.1e}" if "err" in rec else "n/a"
    rows = []
    for i, r in enumerate(rec["budgets"]):
        t, tt = r["select"] + r["attn"], r["select"] + r["tok_attn"]
        first = [ctx, str(rec["batch"]), _us(dense), sdpa_cell, err, _us(upd), _us(rec["build"])] if i == 0 \
            else [""] * 7
        cells = first + [f"{r['fraction']:.0%} ({r['budget_pages']}p)", _us(r["select"]), _us(r["attn"]),
                         _x(dense, t, t + upd), _x(sdpa, t, t + upd), _us(r["tok_attn"]),
                         _x(dense, tt, tt + upd), _x(sdpa, tt, tt + upd),
                         f"{r['mass']:.3f} ({r['oracle_mass']:.3f})", f"{r['tok_mass']:.3f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def case_notes(rec: dict) -> list[str]:
    """SDPA backends that failed or were skipped (printed under the shape's table)."""
    where = f"{ctx_label(rec['n'])} B={rec['batch']}"
    notes = [f"{where}: sdpa {k[5:-6]}: {v}" for k, v in rec.items() if k.startswith("sdpa_") and k.endswith("_error")]
    if "sdpa_note" in rec:
        notes.append(f"{where}: sdpa {rec['sdpa_note']}")
    return notes


def skip_row(n: int, batch: int, why: str) -> str:
    cells = [ctx_label(n), str(batch), why] + [""] * (len(COLUMNS) - 3)
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,qwen2.5", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--contexts", default="32,64,128", help="context lengths in K tokens (comma list)")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes (comma list)")
    ap.add_argument("--quick", action="store_true", help="only llama3-8b, contexts 32K/128K, batches 1/32")
    ap.add_argument("--budget-ms", type=float, default=300.0, help="time spent per measurement")
    ap.add_argument("--max-reps", type=int, default=50, help="most timed replays per measurement")
    ap.add_argument("--max-cache-gb", type=float, default=60.0, help="skip cases whose K+V cache is larger")
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every number to this file")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("decode_topk.py: CUDA is not available; this benchmark needs an NVIDIA GPU. Nothing measured.")
        return 0
    if tk is None:
        print(f"decode_topk.py: cannot import vllm_sparse_kernels.decode.topk_decode ({_IMPORT_ERROR}); "
              "pip install the package (with triton) first.")
        return 1
    if args.quick:
        args.shapes, args.contexts, args.batches = "llama3-8b", "32,128", "1,32"
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    contexts = [int(float(c) * 1024) for c in args.contexts.split(",") if c]
    batches = [int(b) for b in args.batches.split(",") if b]

    print(f"# decode top-k kernels: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, CUDA {torch.version.cuda}", flush=True)
    print(f"timing: {'eager calls' if args.eager else 'CUDA-graph replays'}, L2 flushed, median, "
          f"~{args.budget_ms:.0f} ms per measurement; inputs: N(0,1) + planted hot pages "
          f"({HOT_FRACTION:.0%} of pages per KV head, logit boost U{HOT_BOOST})", flush=True)
    t0 = time.perf_counter()
    results = []
    for shape in shapes:
        h, hkv, d = SHAPES[shape]
        print(table_header(shape), flush=True)
        notes = []
        for n in contexts:
            for batch in batches:
                cache_gb = 2 * batch * triton.cdiv(n, PAGE) * PAGE * hkv * d * DTYPE.itemsize / 1e9
                if cache_gb > args.max_cache_gb:
                    print(skip_row(n, batch, f"skipped: cache {cache_gb:.1f} GB"), flush=True)
                    continue
                row = None
                try:
                    rec = run_case(h, hkv, d, n, batch, "cuda", seed=args.seed, budget_ms=args.budget_ms,
                                   max_reps=args.max_reps, graphs=not args.eager)
                    rec["shape"] = shape
                    results.append(rec)
                    row = "\n".join(table_rows(rec))
                    notes += case_notes(rec)
                except torch.cuda.OutOfMemoryError:
                    row = skip_row(n, batch, "out of memory")
                except Exception as e:  # report and go on with the next case
                    msg = " ".join(str(e).split())[:150].replace("|", "/")
                    row = skip_row(n, batch, f"{type(e).__name__}: {msg}")
                finally:
                    gc.collect()
                    torch.cuda.empty_cache()
                print(row, flush=True)
        for line in notes:
            print(f"- {line}", flush=True)
    if GRAPH_FAILURES:
        print("\nTimed eagerly (CUDA-graph capture failed):", flush=True)
        for line in GRAPH_FAILURES:
            print(f"- {line}", flush=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "graph_failures": GRAPH_FAILURES, "cases": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
