"""How much the top-k keys of consecutive decode steps overlap, at page granularity, on a real model.

Measured input for the design of decode-side top-k retrieval with KV pages offloaded to CPU
(issue 8, item 4): if the pages a decode step needs are mostly the pages the previous steps
needed, a small GPU-resident page cache serves them and only the misses cross PCIe.

Method. transformers runs the model on CPU (fp32 by default, SDPA, ``use_cache=True``): the prompt
(a needle task from ``evaluation.tasks``, text from the offline Austen asset) is prefilled, then T
tokens are decoded greedily with the end-of-sequence tokens masked (like vLLM's ``ignore_eos``,
so that every step attends from an ordinary generated token). A registered attention function
(``transformers.AttentionInterface``) keeps each decode step's query (post-RoPE, all 14 query
heads) and the layer's key cache (post-RoPE, both KV heads). Afterwards, per layer, KV head and
step, with the exact attention scores ``q.k * scale`` over the whole context:

* always resident: the first ``--sinks`` tokens and the last ``--window`` tokens of the current
  context (the window slides with the decode and holds the tokens generated so far);
* top-k: every query head of the KV head's group takes its ``k`` highest-scoring keys among the
  other (non-resident) positions, ``k = fraction x prompt tokens`` (a fixed budget); the KV
  head's selection is the union over its group;
* pages: selected positions ``// page_size`` (16 and 64 tokens; pages are aligned to position 0);
  utilisation = selected tokens / (pages x page_size);
* mass: the share of the exact softmax (over the whole context) that falls on resident + top-k
  tokens, and on resident + every token of the selected pages (mean over the group's query heads);
* cache: per (layer, KV head) an LRU cache of C pages, C = 1, 2, 4, 8 x that (layer, head)'s mean
  number of selected pages per step. Each step's selected pages are looked up (hit = already
  cached before the step), then touched in order of increasing attention mass (so when a step
  selects more than C pages the lightest ones are dropped first) and the least recently used
  pages are evicted down to C. Hit rate = hits / selected pages of the step, averaged over steps
  2..T (the first step starts cold). ``fetch`` = pages missed per step per (layer, head), i.e.
  pages that would cross from CPU. ``prev`` = share of a step's pages selected by the previous
  step; ``tok prev`` is the same at token granularity.

Numbers are means over layers, KV heads and steps; "worst" is the layer with the lowest mean.
The checked-in results used Qwen2.5-Coder-0.5B-Instruct from the project's asset cache (the GGUF
Q4_K_M checkpoint dequantized to bf16, run in fp32), the multi_key prompt (seed 0, needle at
depth 0.5) and T = 32 decode steps on 2 CPU threads: 8192 tokens (about 1.5 min wall: prefill
68 s, decode 9 s, analysis 10 s) and 31999 tokens (``--tokens 32000``, 11.5 min: prefill 503 s,
decode 72 s, analysis 103 s):

    python -m benchmarks.studies.decode_topk_trace --model qwen-coder --task multi_key --tokens 8192 \\
        --steps 32 --fractions 0.005 0.01 0.02 --page-sizes 16 64 --per-layer

Writes ``<out>.json`` (settings, versions, timings, generated text, per-layer and per-(layer,
head) means, and per (layer, head) the series of selected pages and of misses per step) and
``<out>.txt`` (the summary table; per-layer tables with --per-layer); default ``<out>`` is
``benchmarks/results/decode_topk_trace_cpu_<model>_<N>k_<date>``. Asserts nothing beyond a
check that the captured tensors reproduce the model's own attention output.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import platform
import re
import sys
import time
from typing import Sequence

import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
_ATTENTION_NAME = "vllm_sparse_decode_topk_trace"
CACHE_MULTIPLES = (1, 2, 4, 8)


# ---------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------

def resident_positions(length: int, sinks: int, window: int) -> torch.Tensor:
    """Sorted positions that are always resident in a context of ``length`` tokens: the first
    ``sinks`` and the last ``window`` (overlaps counted once)."""
    head = torch.arange(min(sinks, length))
    tail = torch.arange(max(min(sinks, length), length - window), length)
    return torch.cat([head, tail])


def topk_union(scores: torch.Tensor, n_kv_heads: int, k: int, lo: int, hi: int) -> list[torch.Tensor]:
    """``scores`` [H, L]: one decode query per query head. Query head ``h`` reads KV head
    ``h // (H // n_kv_heads)`` (transformers' repeat_kv layout). Returns, per KV head, the sorted
    positions in ``[lo, hi)`` that are among the ``k`` highest scores of at least one of its
    query heads (all of ``[lo, hi)`` when it holds no more than ``k``)."""
    n_heads = scores.shape[0]
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads do not split into {n_kv_heads} KV heads")
    group = n_heads // n_kv_heads
    k = min(k, hi - lo)
    if k <= 0:
        return [torch.empty(0, dtype=torch.long) for _ in range(n_kv_heads)]
    idx = scores[:, lo:hi].topk(k, dim=-1).indices + lo
    return [torch.unique(idx[j * group:(j + 1) * group]) for j in range(n_kv_heads)]


def pages_of(positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Sorted distinct page numbers (page p holds positions [p*page_size, (p+1)*page_size))."""
    return torch.unique(torch.div(positions, page_size, rounding_mode="floor"))


def page_positions(pages: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """Every position of ``pages`` that exists in a context of ``length`` tokens."""
    pos = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
    return pos[pos < length]


def candidate_pages(lo: int, hi: int, page_size: int) -> int:
    """Number of pages that hold at least one position of ``[lo, hi)``."""
    return (hi - 1) // page_size - lo // page_size + 1 if hi > lo else 0


def utilisation(n_tokens: int, n_pages: int, page_size: int) -> float:
    """Share of the fetched pages' token slots that were actually selected."""
    return n_tokens / (n_pages * page_size) if n_pages else float("nan")


def covered_mass(probs: torch.Tensor, *position_sets: torch.Tensor) -> torch.Tensor:
    """``probs`` [G, L] softmax rows; the mass of each row on the union of ``position_sets``
    (positions counted once however many sets hold them) -> [G]."""
    mask = torch.zeros(probs.shape[-1], dtype=torch.bool)
    for pos in position_sets:
        mask[pos] = True
    return probs[:, mask].sum(-1)


def lru_hits(steps: Sequence[Sequence[int]], capacity: int) -> list[int]:
    """Feed an LRU cache of ``capacity`` pages with each step's pages; return per step how many
    of its pages were cached before the step. After the lookups a step's pages are touched in
    the given order (the last becomes most recent), then least recently used pages are evicted
    down to ``capacity``, so a step with more pages than ``capacity`` keeps its last ones."""
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    out = []
    for pages in steps:
        out.append(sum(1 for p in pages if p in cache))
        for p in pages:
            cache[p] = None
            cache.move_to_end(p)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return out


def hit_rate(steps: Sequence[Sequence[int]], hits: Sequence[int]) -> float:
    """Mean over steps 2.. of hits / pages in the step (the first step starts cold)."""
    rates = [h / len(s) for s, h in zip(steps[1:], hits[1:]) if len(s)]
    return sum(rates) / len(rates) if rates else float("nan")


def prev_overlap(steps: Sequence[Sequence[int]]) -> float:
    """Mean over steps 2.. of the share of a step's items that the previous step also had."""
    rates = [len(set(cur) & set(prev)) / len(cur) for prev, cur in zip(steps, steps[1:]) if len(cur)]
    return sum(rates) / len(rates) if rates else float("nan")


# ---------------------------------------------------------------------------------------------
# The model run
# ---------------------------------------------------------------------------------------------

class DecodeCapture:
    """Attention function for transformers: runs SDPA; during decode keeps per layer the query
    [H, D] of every step, the key cache of the last step and the context length of every step,
    and checks a recomputation of the layer output from them."""

    def __init__(self):
        self.active = False
        self.queries: dict[int, list[torch.Tensor]] = collections.defaultdict(list)
        self.lengths: dict[int, list[int]] = collections.defaultdict(list)
        self.keys: dict[int, torch.Tensor] = {}
        self.first_keys: dict[int, torch.Tensor] = {}
        self.scale: float | None = None
        self.max_diff = 0.0

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask,
                                              scaling=scaling, **kwargs)
        if self.active:
            if query.shape[0] != 1 or query.shape[2] != 1:
                raise RuntimeError(f"decode capture expects one sequence, one query: {query.shape}")
            scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
            self.scale = scale
            li = module.layer_idx
            q = query[0, :, 0].detach().float().cpu()               # [H, D]
            k = key[0].detach().float().cpu()                       # [Hkv, L, D]
            v = value[0].detach().float().cpu()
            self.queries[li].append(q)
            self.lengths[li].append(k.shape[1])
            self.keys[li] = k
            if li not in self.first_keys:
                self.first_keys[li] = k.clone()
            rep = q.shape[0] // k.shape[0]
            kr, vr = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            p = torch.softmax(torch.einsum("hd,hld->hl", q, kr) * scale, -1)
            mine = torch.einsum("hl,hld->hd", p, vr)
            theirs = out[0, 0].detach().float().cpu()               # [H, D] (out is [B, q, H, D])
            diff = ((mine - theirs).norm() / theirs.norm()).item()
            self.max_diff = max(self.max_diff, diff)
        return out, weights


def run_model(model_dir: str, prompt_ids: list[int], steps: int, dtype: torch.dtype,
              eos_ids: Sequence[int], log=print) -> tuple[DecodeCapture, list[int], dict]:
    from transformers import AttentionInterface, AutoModelForCausalLM

    cap = DecodeCapture()
    AttentionInterface.register(_ATTENTION_NAME, cap)
    timings = {}
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=_ATTENTION_NAME, dtype=dtype)
    model.eval()
    timings["load_s"] = time.monotonic() - t0

    def pick(logits):
        logits = logits[0, -1].float()
        logits[list(eos_ids)] = float("-inf")
        return int(logits.argmax())

    generated = []
    with torch.no_grad():
        t0 = time.monotonic()
        res = model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
        cache = res.past_key_values
        generated.append(pick(res.logits))
        timings["prefill_s"] = time.monotonic() - t0
        log(f"prefill of {len(prompt_ids)} tokens: {timings['prefill_s']:.1f} s", flush=True)
        cap.active = True
        t0 = time.monotonic()
        for step in range(steps):
            res = model(torch.tensor([[generated[-1]]]), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
            cache = res.past_key_values
            generated.append(pick(res.logits))
        timings["decode_s"] = time.monotonic() - t0
        cap.active = False
    log(f"{steps} decode steps: {timings['decode_s']:.1f} s", flush=True)
    return cap, generated, timings


# ---------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------

def analyse_head(probs_steps, scores_steps, lengths, n_kv_heads, kv, k, page_sizes, sinks, window):
    """One (layer, KV head): per step selection and masses; per page size the LRU results.
    ``probs_steps`` / ``scores_steps``: per step [H, L_t] over all query heads."""
    n_heads = probs_steps[0].shape[0]
    group = n_heads // n_kv_heads
    rows = slice(kv * group, (kv + 1) * group)
    tok_steps, rec = [], {ps: collections.defaultdict(list) for ps in page_sizes}
    page_steps = {ps: [] for ps in page_sizes}
    for probs, scores, length in zip(probs_steps, scores_steps, lengths):
        resident = resident_positions(length, sinks, window)
        lo, hi = min(sinks, length), max(min(sinks, length), length - window)
        sel = topk_union(scores, n_kv_heads, k, lo, hi)[kv]
        tok_steps.append(sel.tolist())
        p = probs[rows]
        mass_tok = covered_mass(p, resident, sel).mean().item()
        mass_res = covered_mass(p, resident).mean().item()
        for ps in page_sizes:
            pages = pages_of(sel, ps)
            # pages ordered by the group's attention mass on their selected tokens, lightest first
            weight = torch.zeros(int(pages.max()) + 1 if len(pages) else 0, dtype=p.dtype)
            weight.index_add_(0, torch.div(sel, ps, rounding_mode="floor"), p[:, sel].sum(0))
            order = pages[torch.argsort(weight[pages], stable=True)]
            page_steps[ps].append(order.tolist())
            r = rec[ps]
            r["sel_tokens"].append(len(sel))
            r["pages"].append(len(pages))
            r["cand_pages"].append(candidate_pages(lo, hi, ps))
            r["util"].append(utilisation(len(sel), len(pages), ps))
            r["mass_tokens"].append(mass_tok)
            r["mass_pages"].append(covered_mass(p, resident, page_positions(pages, ps, length)).mean().item())
            r["mass_resident"].append(mass_res)
    out = {}
    series = {ps: {"pages": rec[ps]["pages"]} for ps in page_sizes}
    tok_prev = prev_overlap(tok_steps)
    for ps in page_sizes:
        r = rec[ps]
        m = {key: sum(vals) / len(vals) for key, vals in r.items()}
        m["tok_prev"] = tok_prev
        m["prev"] = prev_overlap(page_steps[ps])
        for mult in CACHE_MULTIPLES:
            cap = max(1, round(mult * m["pages"]))
            hits = lru_hits(page_steps[ps], cap)
            m[f"hit_{mult}x"] = hit_rate(page_steps[ps], hits)
            misses = [len(s) - h for s, h in zip(page_steps[ps][1:], hits[1:])]
            series[ps][f"misses_{mult}x"] = misses
            m[f"fetch_{mult}x"] = sum(misses) / len(misses) if misses else float("nan")
            m[f"capacity_{mult}x"] = cap
            m[f"capacity_share_{mult}x"] = cap / m["cand_pages"]
        out[ps] = m
    return out, series


def mean_of(dicts: list[dict]) -> dict:
    return {key: sum(d[key] for d in dicts) / len(dicts) for key in dicts[0]}


def analyse(cap: DecodeCapture, fractions, page_sizes, prompt_tokens, sinks, window, log=print):
    """Per fraction and page size: per-(layer, head) means, per-layer means and the overall mean."""
    layers = sorted(cap.queries)
    n_kv = cap.keys[layers[0]].shape[0]
    results = {}
    for frac in fractions:
        k = max(1, round(frac * prompt_tokens))
        per_head = {ps: [] for ps in page_sizes}
        for li in layers:
            keys = cap.keys[li]
            rep = cap.queries[li][0].shape[0] // n_kv
            scores_steps, probs_steps = [], []
            for q, length in zip(cap.queries[li], cap.lengths[li]):
                kr = keys[:, :length].repeat_interleave(rep, 0)
                s = torch.einsum("hd,hld->hl", q, kr) * cap.scale
                scores_steps.append(s)
                probs_steps.append(torch.softmax(s.double(), -1))
            for kv in range(n_kv):
                res, series = analyse_head(probs_steps, scores_steps, cap.lengths[li], n_kv, kv, k,
                                           page_sizes, sinks, window)
                for ps in page_sizes:
                    per_head[ps].append({"layer": li, "kv_head": kv, **res[ps], "series": series[ps]})
        results[frac] = {}
        for ps in page_sizes:
            rows = per_head[ps]
            metrics = [key for key in rows[0] if key not in ("layer", "kv_head", "series")]
            per_layer = []
            for li in layers:
                lr = [{m: r[m] for m in metrics} for r in rows if r["layer"] == li]
                per_layer.append({"layer": li, **mean_of(lr)})
            overall = mean_of([{m: r[m] for m in metrics} for r in rows])
            results[frac][ps] = {"k": k, "mean": overall, "per_layer": per_layer, "per_head": rows}
        log(f"k = {frac:.1%} ({k} per query head): analysed", flush=True)
    return results


def _rounded(x, digits: int = 5):
    if isinstance(x, float):
        return round(x, digits)
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, digits) for v in x]
    return x


_NUMBER_LIST = re.compile(r"\[(?:\s*-?[0-9][0-9.eE+-]*,?)+\s*\]")


def dump_json(obj) -> str:
    """Indented JSON with floats rounded and lists of numbers (the per-step series) on one line."""
    text = json.dumps(_rounded(obj), indent=1)
    return _NUMBER_LIST.sub(lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def worst(per_layer: list[dict], key: str) -> tuple[int, float]:
    r = min(per_layer, key=lambda d: d[key])
    return r["layer"], r[key]


def format_table(results: dict) -> str:
    hits = " ".join(f"{f'hit@{m}x':>7}" for m in CACHE_MULTIPLES)
    fetch = " ".join(f"{f'fet@{m}x':>6}" for m in (1, 2, 4))
    head = (f"{'k':>5} {'k/head':>6} {'page':>4} {'sel tok':>7} {'pages':>6} {'cand':>5} {'pg/cnd':>6} {'util':>5} "
            f"{'m tok':>6} {'m page':>6} {hits} {'prev':>5} {'tokprv':>6} {fetch} "
            f"{'worst hit@2x':>13} {'worst prev':>11} {'worst m page':>12}")
    lines = [head, "-" * len(head)]
    for frac, per_page in results.items():
        for ps, r in per_page.items():
            m, pl = r["mean"], r["per_layer"]
            wl, wv = worst(pl, "hit_2x")
            pl_, pv = worst(pl, "prev")
            ml, mv = worst(pl, "mass_pages")
            lines.append(
                f"{frac:>5.1%} {r['k']:>6} {ps:>4} {m['sel_tokens']:>7.1f} {m['pages']:>6.1f} {m['cand_pages']:>5.0f} "
                f"{m['pages'] / m['cand_pages']:>6.3f} "
                f"{m['util']:>5.3f} {m['mass_tokens']:>6.4f} {m['mass_pages']:>6.4f} "
                + " ".join(f"{m[f'hit_{x}x']:>7.3f}" for x in CACHE_MULTIPLES)
                + f" {m['prev']:>5.3f} {m['tok_prev']:>6.3f} "
                + " ".join(f"{m[f'fetch_{x}x']:>6.1f}" for x in (1, 2, 4))
                + f" {f'L{wl} {wv:.3f}':>13} {f'L{pl_} {pv:.3f}':>11} {f'L{ml} {mv:.4f}':>12}")
    return "\n".join(lines)


def format_layers(results: dict, frac: float, ps: int) -> str:
    r = results[frac][ps]
    head = (f"{'layer':>5} {'pages':>6} {'util':>5} {'m res':>6} {'m tok':>6} {'m page':>6} "
            f"{'hit@1x':>6} {'hit@2x':>6} {'hit@4x':>6} {'prev':>5} {'tokprv':>6}")
    lines = [f"# per layer, k = {frac:.1%} ({r['k']} per query head), page {ps}", head]
    for d in r["per_layer"]:
        lines.append(f"{d['layer']:>5} {d['pages']:>6.1f} {d['util']:>5.3f} {d['mass_resident']:>6.4f} "
                     f"{d['mass_tokens']:>6.4f} {d['mass_pages']:>6.4f} {d['hit_1x']:>6.3f} "
                     f"{d['hit_2x']:>6.3f} {d['hit_4x']:>6.3f} {d['prev']:>5.3f} {d['tok_prev']:>6.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vllm_sparse_tools.evaluation import inputs
    from vllm_sparse_tools.evaluation.tasks import TASKS, HFTokenizer, make_samples

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen-coder", help=f"{', '.join(inputs.MODELS)}, or a model folder")
    p.add_argument("--text", default="austen", help=f"{', '.join(inputs.TEXTS)}, or a text file")
    p.add_argument("--task", default="multi_key", choices=list(TASKS))
    p.add_argument("--tokens", type=int, default=8192, help="prompt length (approximate)")
    p.add_argument("--seed", type=int, default=0, help="task seed (the needle depth is 0.5)")
    p.add_argument("--steps", type=int, default=32, help="decode steps T")
    p.add_argument("--fractions", nargs="+", type=float, default=[0.005, 0.01, 0.02],
                   help="top-k per query head as a fraction of the prompt tokens")
    p.add_argument("--page-sizes", nargs="+", type=int, default=[16, 64])
    p.add_argument("--sinks", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--per-layer", action="store_true", help="also print per-layer tables")
    p.add_argument("--out", help="output path without extension")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.monotonic()

    try:
        model_dir, model_name = inputs.resolve_model(args.model)
        text, text_name = inputs.resolve_text(args.text)
    except ValueError as e:
        p.error(str(e))
    short = inputs.short_model_name(args.model, model_name)
    tok = HFTokenizer(str(model_dir))
    sample, = make_samples(tok, text, [args.task], [args.tokens], 1, base_seed=args.seed)
    n = sample.n_tokens
    eos = sorted({i for i in (tok.tok.eos_token_id, tok.tok.convert_tokens_to_ids("<|endoftext|>"),
                              tok.tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int) and i >= 0})
    print(f"{args.task} prompt: {n} tokens (target {args.tokens}); decoding {args.steps} steps, "
          f"{args.dtype}, {torch.get_num_threads()} threads", flush=True)

    date = datetime.date.today().isoformat()
    out = pathlib.Path(args.out or REPO / "benchmarks" / "results" /
                       f"decode_topk_trace_cpu_{short}_{round(args.tokens / 1000)}k_{date}")
    out.parent.mkdir(parents=True, exist_ok=True)

    cap, generated, timings = run_model(str(model_dir), sample.prompt_ids, args.steps,
                                        getattr(torch, args.dtype), eos)
    # the key cache only grows: the last step's keys hold every earlier step's keys as a prefix
    for li, first in cap.first_keys.items():
        if not torch.equal(cap.keys[li][:, :first.shape[1]], first):
            raise RuntimeError(f"layer {li}: key cache changed between decode steps")
    print(f"capture check: recomputed vs the model's attention output, max relative difference "
          f"{cap.max_diff:.2e}", flush=True)
    if cap.max_diff > (1e-4 if args.dtype == "float32" else 2e-2):
        raise RuntimeError("captured q/k/v do not reproduce the model's attention output")

    t0 = time.monotonic()
    results = analyse(cap, args.fractions, args.page_sizes, n, args.sinks, args.window)
    timings["analysis_s"] = time.monotonic() - t0
    timings["total_s"] = time.monotonic() - t_start
    lengths = cap.lengths[min(cap.lengths)]

    import transformers
    meta = {"model": model_name, "model_dir": model_dir.name, "text": text_name, "task": args.task,
            "seed": args.seed, "prompt_tokens": n, "target_tokens": args.tokens,
            "needle_depths": list(sample.needle_depths), "expected": list(sample.expected),
            "steps": args.steps, "context_first_last": [lengths[0], lengths[-1]],
            "fractions": args.fractions, "k_per_query_head": {str(f): max(1, round(f * n)) for f in args.fractions},
            "page_sizes": args.page_sizes, "sinks": args.sinks, "window": args.window,
            "cache_multiples": list(CACHE_MULTIPLES), "dtype": args.dtype, "device": "cpu",
            "threads": torch.get_num_threads(), "host": platform.node(), "date": date,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "capture_max_rel_diff": cap.max_diff, "timings_s": timings,
            "generated_text": tok.decode(generated), "eos_masked": eos,
            "scale": cap.scale, "command": " ".join(sys.argv)}
    out.with_name(out.name + ".json").write_text(dump_json(
        {"meta": meta,
         "results": {str(f): {str(ps): r for ps, r in per.items()} for f, per in results.items()}}))

    n_layers, (n_kv, _, _) = len(cap.keys), cap.keys[0].shape
    group = cap.queries[0][0].shape[0] // n_kv
    res_mass = results[args.fractions[0]][args.page_sizes[0]]["mean"]["mass_resident"]
    lines = [f"# {model_name}, cpu {args.dtype}, {date}: {args.task} prompt from {text_name}, {n} tokens; "
             f"{args.steps} greedy decode steps (EOS masked); context {lengths[0]}..{lengths[-1]}",
             f"# resident: first {args.sinks} + last {args.window} tokens (softmax mass "
             f"{res_mass:.4f}); top-k per query head over the rest, union over the {group}-head "
             "group of each KV head",
             f"# means over {n_layers} layers x {n_kv} KV heads x {args.steps} steps (hit/prev/fet: "
             "steps 2..T); sel tok / pages per (layer, KV head, step); "
             "util = sel tok / (pages x page)",
             "# cand = candidate pages (holding a non-resident position); pg/cnd = pages / cand, so a cache "
             "of C x pages holds C x pg/cnd of them (>= 1: the whole candidate region fits)",
             "# m tok / m page = softmax mass on resident + top-k tokens / + whole selected pages",
             "# hit@Cx = LRU hit rate, cache of C x mean pages per (layer, KV head); prev / tokprv = "
             "overlap with the previous step's pages / tokens; fet@Cx = pages missed per step "
             "per (layer, KV head)",
             "# worst = layer with the lowest mean (layer, value)",
             format_table(results),
             f"# timings: load {timings['load_s']:.0f} s, prefill {timings['prefill_s']:.0f} s, "
             f"decode {timings['decode_s']:.0f} s, analysis {timings['analysis_s']:.0f} s, "
             f"total {timings['total_s']:.0f} s; torch {torch.__version__}, transformers "
             f"{transformers.__version__}"]
    if args.per_layer:
        for f in args.fractions:
            lines += ["", format_layers(results, f, args.page_sizes[0])]
    out.with_name(out.name + ".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"generated: {meta['generated_text']!r}")
    print(f"wrote {out}.json and {out}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
