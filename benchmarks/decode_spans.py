"""Span-retrieval decode mode (vllm_sparse_kernels/decode/span_decode.py): its GPU cost per layer, prefill and decode side.

bf16, page 16, one layer, shapes ``--shapes`` (Llama-3-8B 32/8/128, Qwen2.5 14/2/64). Timing, paged
decode inputs and the decode baselines are ``benchmarks.decode_topk``'s.

* **Prefill**: one prefill row, a chunk of ``--chunks`` K tokens ending at ``--contexts`` K (0: the
  first chunk); per layer, eager (as vLLM runs prefill), CUDA events, median after warm-up:
  ``update`` (``update_span_keys`` over the chunk's slots), ``maps`` (``local_attention_maps``),
  ``divide`` (``divide_segments`` on its output), ``gather`` (the rest of ``build_span_keys``: index
  keys summed per span, written per page), ``build`` (``build_span_keys`` whole; its parts alone do
  not hide each other's launch gaps), ``mark`` (``mark_persistent_pages``); ``plan`` (the package's
  ``plan_span_segments``: host wall clock incl. its copies, once per step for all layers). Baseline: flash SDPA of the
  chunk over context + chunk keys (K/V expanded for GQA), causal bottom-right
  (``causal_lower_right``), else without mask (the table says which). Inputs: N(0, 0.3^2) q/k plus
  one random direction (norm 1.5 sqrt(D)) per run of 1-5 pages, so the local maps show triangles;
  spans/seg, pages/seg, index/span: from the ``SpanDivision`` (sanity).
* **Decode**: one step, contexts ``--contexts-decode`` K x ``--batches``, CUDA graphs. Spans =
  ``update_span_keys`` (one new token per sequence) + ``select_span_pages`` + ``topk_decode_attention``
  over its pages; top-k = ``update_page_summaries`` + ``select_pages`` (budget = persist + budget:
  the same width) + the same attention; dense = ``dense ours`` (every page, same kernel) and
  ``sdpa``. Inputs: ``decode_topk.make_inputs`` (N(0,1), planted hot pages). Span keys
  (``--span-fill``): ``build`` runs update + build + mark per ``--fill-chunk`` K chunk (N(0,1)
  queries, untimed), ``random``: N(0,1) fp32 and random flags.

    python3 -m benchmarks.decode_spans                       # Llama-3-8B, both tables
    python3 -m benchmarks.decode_spans --shapes llama3-8b,qwen2.5 --json spans.json
    python3 -m benchmarks.decode_spans --only decode --contexts-decode 128 --batches 8

Needs CUDA (else it says so, exit 0). ``prefill_case`` / ``decode_case(..., device="cpu")`` run
under Triton's interpreter as a smoke test (tests/tools/test_decode_spans_bench.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from functools import partial

import torch

from benchmarks import decode_topk as dt

try:
    from vllm_sparse_kernels.decode import span_decode as sd
except ImportError as _e:  # checked in main()
    sd, _IMPORT_ERROR = None, _e
else:
    _IMPORT_ERROR = None
from vllm_sparse_backend.decode.spans import plan_span_segments  # noqa: E402  (the backend's host planning)

PAGE, DTYPE, cdiv = dt.PAGE, dt.DTYPE, dt.cdiv


def planted(n: int, q_from: int, h: int, hkv: int, d: int, device, gen, strength: float = 1.5, noise: float = 0.3):
    """k, v ``[n, Hkv, D]`` and q ``[n - q_from, H, D]`` (of tokens q_from..n), DTYPE: N(0, noise^2)
    plus one random direction (norm ~strength sqrt(D)) per run of 1-5 pages, added to q and k."""
    n_pages = cdiv(n, PAGE)
    runs = torch.randint(1, 6, (n_pages,), generator=gen, device=device)
    run_of_page = torch.repeat_interleave(torch.arange(n_pages, device=device), runs)[:n_pages]
    base = torch.randn(n_pages, d, generator=gen, device=device) * strength
    shift = base[run_of_page].repeat_interleave(PAGE, 0)[:n, None]  # [n, 1, D]
    k = torch.randn(n, hkv, d, generator=gen, device=device) * noise + shift
    v = torch.randn(n, hkv, d, generator=gen, device=device)
    q = torch.randn(n - q_from, h, d, generator=gen, device=device) * noise + shift[q_from:]
    return k.to(DTYPE), v.to(DTYPE), q.to(DTYPE)


def slots_of(block_table_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    pos = torch.arange(start, end, device=block_table_row.device)
    return block_table_row.long()[pos // PAGE] * PAGE + pos % PAGE


def host_ms(fn, device, reps: int = 5) -> float:
    """Median wall-clock ms of ``fn`` (a host function that also queues copies), synchronised."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[reps // 2]


def dense_prefill(q, k, v, group, context, scale, time_it, device):
    """(ms, mask used) of SDPA of the chunk's queries over all k/v (flash on CUDA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    qd = q.transpose(0, 1)[None].contiguous()
    kd = k.repeat_interleave(group, 1).transpose(0, 1)[None].contiguous()
    vd = v.repeat_interleave(group, 1).transpose(0, 1)[None].contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    variants = [("causal", dict(is_causal=True))] if context == 0 else [
        ("causal lower-right", dict(attn_mask=causal_lower_right(qd.shape[2], kd.shape[2]))), ("no mask", {})]
    errors = []
    for name, kw in variants:
        def call(kw=kw):
            if device.type != "cuda":
                return sdpa(qd, kd, vd, scale=scale, **kw)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return sdpa(qd, kd, vd, scale=scale, **kw)
        try:
            call()
            return time_it(f"dense {name}", call), name
        except Exception as e:  # variant not supported by the backend: the next one
            errors.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:100]}")
    raise RuntimeError("; ".join(errors))


def prefill_case(h: int, hkv: int, d: int, chunk: int, context: int, device="cuda", *, params=None, seed: int = 0,
                 last_q: int = 64, sink: int = 1, recent: int = 8, persist: int = 16, budget_ms: float = 200.0,
                 max_reps: int = 30) -> dict:
    """Per-layer span work of one prefill chunk (tokens context..context+chunk) vs dense attention; ms."""
    device = torch.device(device)
    params = params or sd.SpanParams()
    gen = torch.Generator(device=device).manual_seed(seed)
    n, group, scale = context + chunk, h // hkv, 1.0 / math.sqrt(d)
    rec = {"h": h, "hkv": hkv, "d": d, "chunk": chunk, "context": context,
           "segment_tokens": params.segment_tokens, "last_q": last_q}

    def time_it(label, fn):
        return dt.bench(fn, device, budget_ms, max_reps, graphs=False, label=f"prefill {label}")

    k, v, query = planted(n, context, h, hkv, d, device, gen)
    n_pages = cdiv(n, PAGE)
    block_table = torch.randperm(n_pages, generator=gen, device=device).to(torch.int32)[None]
    kv = torch.zeros(2, n_pages, PAGE, hkv, d, dtype=DTYPE, device=device)
    all_slots = slots_of(block_table[0], 0, n)
    kv[0].view(-1, hkv, d)[all_slots], kv[1].view(-1, hkv, d)[all_slots] = k, v
    key_cache, key, slots = kv[0], k[context:], all_slots[context:]
    span_keys, flags = sd.allocate_span_index(key_cache)

    plan = partial(plan_span_segments, [0, chunk], [n], PAGE, params.segment_tokens, last_q, device)
    segs = plan()
    rec["plan_host"] = host_ms(plan, device)
    rec["segments"] = segs.num_segments
    rec["update"] = time_it("update", lambda: sd.update_span_keys(key_cache, span_keys, flags, slots,
                                                                    params.min_index))
    maps, votes = sd.local_attention_maps(query, key, segs, PAGE, scale)
    rec["maps"] = time_it("maps", lambda: sd.local_attention_maps(query, key, segs, PAGE, scale))
    n_tok = segs.table[:, 2]
    rec["divide"] = time_it("divide", lambda: sd.divide_segments(maps, votes, n_tok, PAGE, h, params))

    build = partial(sd.build_span_keys, query, key, segs, span_keys, block_table, PAGE, scale, params)
    division = build()

    def gather():  # build_span_keys' last part: per span the sum of its index keys, written to its pages
        tok = (segs.table[:, 1].long()[:, None] + torch.arange(params.segment_tokens, device=device)).clamp(
            max=chunk - 1)
        page_keys = sd.span_page_keys(key[tok.view(-1)].view(*tok.shape, hkv, d), division, PAGE)
        span_keys[block_table[segs.page_row, segs.page_lp].long()] = page_keys[segs.page_seg, segs.page_idx]

    rec["gather"] = time_it("gather", gather)
    rec["build"] = time_it("build", build)
    rec["mark"] = time_it("mark", lambda: sd.mark_persistent_pages(
        query, span_keys, flags, block_table, segs, PAGE, sink_pages=sink, recent_pages=recent, persist_pages=persist))
    rec["spans_total"] = rec["update"] + rec["build"] + rec["mark"]
    ids = division.span_of_page
    spans = (ids == torch.arange(ids.shape[1], device=device)).sum(1).float()  # a span's id is its first page
    rec["spans_per_segment"] = spans.mean().item()
    rec["pages_per_segment"] = (ids >= 0).sum(1).float().mean().item()
    rec["index_per_span"] = (division.selected.sum() / spans.sum().clamp(min=1)).item()
    rec["persist_flags"] = int(flags[:-1].sum())
    del maps, votes, division
    rec["dense"], rec["dense_mask"] = dense_prefill(query, k, v, group, context, scale, time_it, device)
    rec["ratio"] = rec["spans_total"] / rec["dense"]
    return rec


def fill_span_index(key_cache, block_table, n, span_keys, flags, h, params, fill_chunk, last_q, sink, recent,
                    persist, gen):
    """The backend's prefill path over every sequence (n tokens each), chunk by chunk, queries N(0,1)."""
    hkv, d, device = key_cache.shape[2], key_cache.shape[3], key_cache.device
    for b in range(block_table.shape[0]):
        bt = block_table[b:b + 1]
        for c0 in range(0, n, fill_chunk):
            c1 = min(n, c0 + fill_chunk)
            slots = slots_of(bt[0], c0, c1)
            key = key_cache.reshape(-1, hkv, d)[slots]
            query = torch.randn(c1 - c0, h, d, generator=gen, device=device).to(key_cache.dtype)
            segs = plan_span_segments([0, c1 - c0], [c1], PAGE, params.segment_tokens, last_q, device)
            sd.update_span_keys(key_cache, span_keys, flags, slots, params.min_index)
            sd.build_span_keys(query, key, segs, span_keys, bt, PAGE, 1.0 / math.sqrt(d), params)
            sd.mark_persistent_pages(query, span_keys, flags, bt, segs, PAGE, sink_pages=sink, recent_pages=recent,
                                     persist_pages=persist)


def decode_case(h: int, hkv: int, d: int, n: int, batch: int, device="cuda", *, params=None, seed: int = 0,
                sink: int = 1, recent: int = 8, persist: int = 16, budget: int = 64, fill: str = "build",
                fill_chunk: int = 16384, last_q: int = 64, budget_ms: float = 200.0, max_reps: int = 50,
                graphs: bool = True) -> dict:
    """One decode step of one layer: spans vs top-k vs dense (times in ms)."""
    device = torch.device(device)
    params = params or sd.SpanParams()
    tk = dt.tk
    gen = torch.Generator(device=device).manual_seed(seed)
    group, scale, n_pages = h // hkv, 1.0 / math.sqrt(d), cdiv(n, PAGE)
    rec = {"h": h, "hkv": hkv, "d": d, "n": n, "batch": batch, "pages": n_pages, "fill": fill,
           "width": sink + recent + persist + budget}

    def time_it(label, fn):
        return dt.bench(fn, device, budget_ms, max_reps, graphs, f"n={n} B={batch} {label}")

    q, key_cache, value_cache, block_table, seq_lens = dt.make_inputs(h, hkv, d, n, batch, device, gen)
    span_keys, flags = sd.allocate_span_index(key_cache)
    t0 = time.perf_counter()
    if fill == "build":
        fill_span_index(key_cache, block_table, n, span_keys, flags, h, params, fill_chunk, last_q, sink,
                        recent, persist, gen)
    else:
        span_keys[:-1].normal_(generator=gen)  # flags: each page and KV head with probability persist / pages
        flags[:-1] = torch.rand(flags[:-1].shape, generator=gen, device=device) < persist / n_pages
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rec["fill_seconds"] = time.perf_counter() - t0

    out = torch.empty_like(q)
    pos = seq_lens.long() - 1  # the new token's slot: the last of the context
    slots = block_table.long().gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE

    span_select = partial(sd.select_span_pages, q, span_keys, flags, block_table, seq_lens, PAGE, sink_pages=sink,
                          recent_pages=recent, persist_pages=persist, num_pages_budget=budget)
    sel, cnt = span_select()
    rec["span_select"] = time_it("span select", span_select)
    rec["span_attn"] = time_it("span attn", lambda: tk.topk_decode_attention(
        q, key_cache, value_cache, block_table, seq_lens, sel, cnt, scale, out))
    rec["span_update"] = time_it("span upd", lambda: sd.update_span_keys(
        key_cache, span_keys, flags, slots, params.min_index))
    smin, smax = tk.allocate_page_summaries(key_cache)
    tk.build_page_summaries(key_cache, block_table, seq_lens, smin, smax)

    topk_select = partial(tk.select_pages, q, smin, smax, block_table, seq_lens, PAGE, sink_pages=sink,
                          recent_pages=recent, num_pages_budget=persist + budget)
    tsel, tcnt = topk_select()
    rec["topk_select"] = time_it("topk select", topk_select)
    rec["topk_attn"] = time_it("topk attn", lambda: tk.topk_decode_attention(
        q, key_cache, value_cache, block_table, seq_lens, tsel, tcnt, scale, out, sink_pages=sink,
        recent_pages=recent))
    rec["topk_update"] = time_it("topk update", lambda: tk.update_page_summaries(key_cache, smin, smax, slots))
    for mode in ("span", "topk"):
        rec[f"{mode}_total"] = rec[f"{mode}_update"] + rec[f"{mode}_select"] + rec[f"{mode}_attn"]

    sel_all = torch.arange(n_pages, dtype=torch.int32, device=device).expand(batch, hkv, n_pages).contiguous()
    cnt_all = torch.full((batch, hkv), n_pages, dtype=torch.int32, device=device)
    dense_out = tk.topk_decode_attention(q, key_cache, value_cache, block_table, seq_lens, sel_all, cnt_all, scale)
    rec["dense_ours"] = time_it("dense ours", lambda: tk.topk_decode_attention(
        q, key_cache, value_cache, block_table, seq_lens, sel_all, cnt_all, scale, out))
    del smin, smax, sel, tsel
    rec.update(dt.sdpa_case(q, key_cache, value_cache, block_table, n, group, scale, dense_out, time_it, device))
    sdpa = {k[5:]: v for k, v in rec.items() if k.startswith("sdpa_") and isinstance(v, float)}
    if sdpa:
        best = min(sdpa, key=sdpa.get)
        rec["sdpa"], rec["sdpa_backend"] = sdpa[best], best
    return rec


# --- output ---------------------------------------------------------------------------------

PREFILL_COLS = ("chunk", "tokens before", "plan (host)", "update", "maps", "divide", "gather", "build", "mark",
                "spans total", "dense", "dense mask", "spans / dense", "spans/seg", "pages/seg", "index/span")
DECODE_COLS = ("ctx", "B", "dense ours", "sdpa", "span upd", "span sel", "span attn", "span total", "topk upd",
               "topk sel", "topk attn", "topk total", "span x ours", "span x sdpa", "topk x sdpa")


def prefill_row(r: dict) -> str:
    cells = [dt.ctx_label(r["chunk"]), dt.ctx_label(r["context"])] + \
            [f"{r[k]:.3f}" for k in ("plan_host", "update", "maps", "divide", "gather", "build", "mark",
                                    "spans_total", "dense")] + \
            [r["dense_mask"], f"{r['ratio']:.3f}", f"{r['spans_per_segment']:.1f}", f"{r['pages_per_segment']:.0f}",
             f"{r['index_per_span']:.1f}"]
    return "| " + " | ".join(cells) + " |"


def decode_row(r: dict) -> str:
    us, sdpa = dt._us, r.get("sdpa")

    def x(base, t):
        return f"{base / t:.1f}" if base else "n/a"
    cells = [dt.ctx_label(r["n"]), str(r["batch"]), us(r["dense_ours"]), f"{us(sdpa)} {r['sdpa_backend']}" if sdpa
             else "n/a"] + [us(r[f"{m}_{k}"]) for m in ("span", "topk") for k in ("update", "select", "attn", "total")]
    cells += [x(r["dense_ours"], r["span_total"]), x(sdpa, r["span_total"]), x(sdpa, r["topk_total"])]
    return "| " + " | ".join(cells) + " |"


def run_table(title: str, cols, cases, row_fn, out: list, shape: str) -> None:
    """Print a markdown table, one row per (label, thunk) as it comes; a failing case is a row saying why."""
    print(f"\n{title}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)
    for label, thunk in cases:
        try:
            rec = thunk()
            out.append(dict(rec, shape=shape))
            row = row_fn(rec)
        except Exception as e:  # out of memory, a kernel refusing a shape: report and go on
            why = f"{type(e).__name__}: {' '.join(str(e).split())[:150]}".replace("|", "/")
            row = "| " + " | ".join(label + [why] + [""] * (len(cols) - len(label) - 1)) + " |"
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        print(row, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama3-8b", help=f"comma list of {', '.join(dt.SHAPES)}")
    ap.add_argument("--only", choices=("prefill", "decode"), default=None, help="one table only")
    ap.add_argument("--chunks", default="16", help="prefill chunk sizes, K tokens")
    ap.add_argument("--contexts", default="0,128", help="where the prefill chunk ends, K tokens (0: first chunk)")
    ap.add_argument("--contexts-decode", default="32,64,128", help="decode context lengths, K tokens")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    for name, default in (("sink", 1), ("recent", 8), ("persist", 16), ("budget-pages", 64), ("last-q", 64),
                          ("segment-tokens", 1024), ("max-reps", 50), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--span-fill", choices=("build", "random"), default="build", help="decode span keys (doc)")
    ap.add_argument("--fill-chunk", type=float, default=16, help="K tokens per chunk of --span-fill build")
    ap.add_argument("--budget-ms", type=float, default=200.0, help="time spent per measurement")
    ap.add_argument("--eager", action="store_true", help="decode: eager calls instead of CUDA-graph replays")
    ap.add_argument("--json", default=None, help="also write every number to this file")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("decode_spans.py: CUDA is not available; this benchmark needs an NVIDIA GPU. Nothing measured.")
        return 0
    if sd is None or dt.tk is None:
        print(f"decode_spans.py: cannot import the package's Triton kernels ({_IMPORT_ERROR or dt._IMPORT_ERROR}); "
              "pip install the package (with triton) first.")
        return 1
    shapes = [s for s in args.shapes.split(",") if s]
    if any(s not in dt.SHAPES for s in shapes):
        ap.error(f"unknown shapes in {shapes}; known: {', '.join(dt.SHAPES)}")

    def ks(s):
        return [int(float(x) * 1024) for x in s.split(",") if x]
    common = dict(params=sd.SpanParams(segment_tokens=args.segment_tokens), seed=args.seed, last_q=args.last_q,
                  sink=args.sink, recent=args.recent, persist=args.persist, budget_ms=args.budget_ms,
                  max_reps=args.max_reps)
    print(f"# span decode mode: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {dt.triton.__version__}, CUDA {torch.version.cuda}", flush=True)
    print(f"bf16, page {PAGE}, {common['params']}, last_q {args.last_q}; decode: sink {args.sink} + recent "
          f"{args.recent} + persist {args.persist} + budget {args.budget_pages} pages per KV head", flush=True)
    fill = (f"built by update + build + mark (N(0,1) queries) in {args.fill_chunk:g}K chunks"
            if args.span_fill == "build" else "random N(0,1) fp32 vectors, random persistent flags")
    t0 = time.perf_counter()
    out = {"prefill": [], "decode": []}
    for shape in shapes:
        h, hkv, d = dt.SHAPES[shape]
        geo = f"{shape} (H/Hkv/D = {h}/{hkv}/{d})"
        if args.only != "decode":
            cases = [([dt.ctx_label(c), dt.ctx_label(max(e, c) - c)],
                      partial(prefill_case, h, hkv, d, c, max(e, c) - c, "cuda", **common))
                     for c in ks(args.chunks) for e in ks(args.contexts)]
            run_table(f"### prefill, {geo}: span work per layer for one prefill row, ms (median, eager, CUDA "
                      "events); maps, divide, gather: the parts of build timed alone (launch gaps not hidden); "
                      "spans total = update + build + mark; plan: host, once per step for all layers",
                      PREFILL_COLS, cases, prefill_row, out["prefill"], shape)
        if args.only != "prefill":
            cases = [([dt.ctx_label(n), str(b)],
                      partial(decode_case, h, hkv, d, n, b, "cuda", budget=args.budget_pages, fill=args.span_fill,
                              fill_chunk=int(args.fill_chunk * 1024), graphs=not args.eager, **common))
                     for n in ks(args.contexts_decode) for b in [int(b) for b in args.batches.split(",") if b]]
            run_table(f"### decode, {geo}: one step per layer, us (median, {'eager' if args.eager else 'CUDA graphs'}"
                      f"); top-k budget = persist + budget pages (same width); total = update + select + attn; "
                      f"x = baseline / total; span keys {fill}",
                      DECODE_COLS, cases, decode_row, out["decode"], shape)
    if dt.GRAPH_FAILURES:
        print("\nTimed eagerly (CUDA-graph capture failed):\n" + "\n".join(f"- {x}" for x in dt.GRAPH_FAILURES))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": dt.triton.__version__, "args": vars(args), "graph_failures": dt.GRAPH_FAILURES,
                       **out}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
