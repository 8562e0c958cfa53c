"""Why does ``decode_mode=spans`` miss the needles? Per-layer probe of the first decode step (issue 24).

For needle prompts of the accuracy harness (``evaluation.tasks``, same prompts as
``benchmarks/decode_accuracy.py``), transformers (fp32, CPU) prefills densely while the spans and
top-k selectors of ``decode_accuracy.py`` (the backend's float64 references: division, span keys,
persistent flags, page summaries) build their state from the prompt's q/k; then one decode step
runs with exact attention and, per layer, ``vllm_sparse_tools.evaluation.span_probe``
reports where the needle's pages (the pages holding the needle's value tokens) rank under the
exact attention of the decode query, the top-k bound, the span key score (sum, mean, best index
token), whether they lie in an NMS-kept span, are persistent, are selected; and how the spans
cover the prompt.

    PYTHONPATH=.venv/kernel-site python -m benchmarks.studies.decode_spans_probe --model qwen-coder \\
        --length 8192 --seeds 0 1 --threads 1

Writes ``<out>.json`` and ``<out>.txt`` (default
``benchmarks/results/decode_spans_probe_cpu_<model>_<k>k_<date>``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import torch

from benchmarks import decode_accuracy as da
from vllm_sparse_tools.evaluation import span_probe

REPO = pathlib.Path(__file__).resolve().parents[2]
# Qwen2.5-Coder-0.5B: layers 9-22 are where the decode query finds the needle (exact rank 0-1)
SUMMARY_GROUPS = {"0-8": list(range(0, 9)), "9-22": list(range(9, 23)), "23": [23]}


class InfoSpansSelector(da.SpansSelector):
    """The harness's spans selector, keeping the division's diagnostics per layer (global page
    ids): span id and kept flag per page, index tokens, index count per span."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.info: dict[int, dict] = {}
        self._layer = None
        self._divided.clear()

    def prefill(self, layer, q, k, v) -> None:
        self._layer = layer
        super().prefill(layer, q, k, v)

    def divide(self, q, k, scale):
        maps, votes, lens = self.local_maps(q, k, scale)
        seg_pages = self.params.segment_tokens // self.page_size
        spans, index, info = [], [], {"span_ids": [], "in_kept": [], "index_tokens": [], "count": {},
                                      "kept": [], "theta": [], "votes": []}
        for s in range(lens.shape[0]):
            d: dict = {}
            span, chosen = self._spans.reference_divide(maps[s].double(), votes[s].double(), int(lens[s]),
                                                         self.page_size, q.shape[0], self.params, info=d)
            spans.append(span)
            index.append(chosen)
            p0, t0 = s * seg_pages, s * self.params.segment_tokens
            info["span_ids"] += [p0 + sid for sid in span]
            info["in_kept"] += d["in_kept"]
            info["index_tokens"] += [t0 + t for t in chosen]
            info["count"].update({p0 + sid: c for sid, c in d["count"].items()})
            info["kept"] += [(p0 + x, p0 + y) for x, y in d["kept"]]
            info["theta"].append(d["theta"])
            info["votes"].append(votes[s, :int(lens[s])].double())
        self.info[self._layer] = info
        return spans, index, torch.cat([votes[s, :int(lens[s])] for s in range(len(lens))])


class ProbeSelector:
    """Prefill: the spans and top-k selectors' state. First decode call per layer: the probe;
    the output is exact attention."""

    label = "probe"

    def __init__(self, n_tokens: int, needles: list[list[int]], spans_spec: dict, topk_spec: dict, page: int):
        """``needles``: the token positions of each needle value (one list per value; multi_value /
        multi_query have several); each is probed at the same first decode step."""
        self.spans = InfoSpansSelector.build("spans", {**spans_spec, "page": page}, n_tokens)
        self.topk = da.TopkSelector.build("topk", {**topk_spec, "page": page}, n_tokens)
        self.page = page
        self.needles = needles
        self.needle_pages = [sorted({t // page for t in tokens}) for tokens in needles]
        self.attended = da.AttendedShare()
        self.layers: list[dict[int, dict]] = [{} for _ in needles]  # per needle, per layer

    def prefill(self, layer, q, k, v) -> None:
        self.spans.prefill(layer, q, k, v)
        self.topk.prefill(layer, q, k, v)

    def attend(self, layer, q, k, v, scale) -> torch.Tensor:
        from vllm_sparse_kernels.reference import span_decode, topk_decode

        length = k.shape[1]
        self.attended.add(length, length)
        if layer in self.layers[0]:
            return da.exact_attention(q, k, v, scale).to(q.dtype)
        sp = self.spans
        sp.attend(layer, q, k, v, scale)  # the step's fallback key, as the harness does it
        key_cache = da.paged_cache(k, self.page)
        n_pages = key_cache.shape[0]
        table = da.identity_block_table(n_pages)
        lens = torch.tensor([length], dtype=torch.int32)
        s_sel, _ = span_decode.reference_select_span_pages(
            q[None], sp._keys[layer], sp._flags[layer], table, lens, self.page, sink_pages=sp.sink_pages,
            recent_pages=sp.recent_pages, persist_pages=sp.persist_pages, num_pages_budget=sp.budget_pages)
        t_sel, _ = self.topk.select(layer, q, key_cache, length)
        smin, smax = self.topk.summaries(layer, key_cache, length)
        bounds = topk_decode.reference_page_bounds(q, smin, smax, torch.arange(n_pages), q.shape[0] // k.shape[0])
        info = sp.info[layer]
        for pages, tokens, layers in zip(self.needle_pages, self.needles, self.layers):
            layers[layer] = span_probe.probe_layer(
                q, k, scale, self.page, pages, tokens, span_ids=info["span_ids"],
                in_kept=info["in_kept"], index_tokens=info["index_tokens"], span_count=info["count"],
                span_keys=sp._keys[layer], flags=sp._flags[layer], topk_bounds=bounds, spans_selected=s_sel[0],
                topk_selected=t_sel[0], sink_pages=sp.sink_pages, recent_pages=sp.recent_pages,
                votes=torch.cat(info["votes"]), summaries=(smin, smax))
            layers[layer]["kept_intervals"] = info["kept"]
            layers[layer]["theta"] = info["theta"]
        return da.exact_attention(q, k, v, scale).to(q.dtype)


def main(argv=None) -> int:
    from vllm_sparse_tools.evaluation import inputs
    from vllm_sparse_tools.evaluation.tasks import TASKS, HFTokenizer, depths_for

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen-coder")
    p.add_argument("--text", default="austen")
    p.add_argument("--task", default="single_needle", choices=["single_needle", "multi_key", "multi_value", "multi_query"],
                   help="multi_value / multi_query: every expected value is probed (one block per value)")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--samples", type=int, default=2, help="depths as the harness spreads them for this many")
    p.add_argument("--spans", default="persist=16,budget=48", help="spans selector params (decode_accuracy spec)")
    p.add_argument("--topk", default="budget=64", help="topk selector params")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--summarise", metavar="JSON", help="only print the per-layer-group summary of a result file")
    args = p.parse_args(argv)
    if args.summarise:
        report = json.loads(pathlib.Path(args.summarise).read_text())
        budget = report["meta"]["spans"].get("budget", 48)
        print(f"# {' '.join(sys.argv)}")
        print("\n".join(span_probe.summarise(report["prompts"], SUMMARY_GROUPS, budget)))
        return 0
    torch.set_num_threads(args.threads)
    spans_spec = da.parse_variant("spans:" + args.spans).params
    topk_spec = da.parse_variant("topk:" + args.topk).params
    model_dir, model_name = inputs.resolve_model(args.model)
    text, text_name = inputs.resolve_text(args.text)
    short = inputs.short_model_name(args.model, model_name)
    tok = HFTokenizer(str(model_dir))
    depths = depths_for(args.samples)
    date = datetime.date.today().isoformat()
    out = pathlib.Path(args.out or REPO / "benchmarks" / "results" /
                       f"decode_spans_probe_cpu_{short}_{round(args.length / 1000)}k_{date}")

    from transformers import AttentionInterface, AutoModelForCausalLM

    attention = da.SelectorAttention()
    AttentionInterface.register(da._ATTENTION_NAME, attention)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=da._ATTENTION_NAME,
                                                 dtype=torch.float32).eval()
    stop_ids = da.stop_token_ids(model_dir, tok.tok)
    command = " ".join(sys.argv)
    header = [f"# {command}",
              f"# {model_name}, {args.task}, {args.length} tokens, text {text_name}, CPU fp32, {date}; spans "
              f"{args.spans}, topk {args.topk}, page {args.page}; first decode step, per layer, per KV head (a/b)",
              "# exact/topk/span_sum/span_mean/span_max: 0-based rank of the best needle page (pages holding the "
              "value's tokens) among the non-sink non-recent pages, by exact attention mass of the decode query / "
              "topk Quest bound / q.span_key (sum of index keys) / q.mean index key / max over the span's index "
              "tokens of q.k (query heads of the KV head summed); mass: needle pages' share of the exact attention "
              "(summed over 7 query heads, so max 7); kept: needle page inside an NMS-kept interval (not a gap "
              "run); idx: a needle value token is an index token; spanpg/nidx: pages and index tokens of the "
              "needle's span; pers: needle page flagged persistent; selS/selT: selected by spans / topk; "
              "spans, keptpg (share of pages in kept intervals), pg/span over the prompt; vote: rank of the best "
              "needle token among its span's tokens by the division's votes (index tokens are the top 6..24); "
              "spanbnd: what-if rank under a per-span Quest bound (min/max over all the span's keys); pidx1/pidx2: what-if rank if every page were indexed by its own 1 / 2 most-voted tokens, scored by "
              "the best of them"]
    report = {"meta": {"command": command, "model": model_name, "task": args.task, "length": args.length,
                       "spans": spans_spec, "topk": topk_spec, "page": args.page, "date": date,
                       "torch": torch.__version__, "threads": torch.get_num_threads()}, "prompts": []}
    lines = list(header)
    for seed in args.seeds:
        depth = depths[seed % len(depths)]
        sample = TASKS[args.task](tok, text, args.length, seed, depth)
        found, missing = span_probe.needle_positions(
            sample.prompt_ids, sample.expected, lambda v: tok.tok.encode(v, add_special_tokens=False))
        for value, count in missing:
            print(f"seed {seed}: value {value} found {count} times in the prompt; skipped", flush=True)
        if not found:
            continue
        probe = ProbeSelector(sample.n_tokens, [needle for _, needle in found], spans_spec, topk_spec, args.page)
        attention.prefill_selectors = [probe]
        t0 = time.monotonic()
        with torch.no_grad():
            res = model(torch.tensor([sample.prompt_ids]), use_cache=True, logits_to_keep=1)
            attention.prefill_selectors = []
            first = int(res.logits[0, -1].argmax())
            prefill_s = time.monotonic() - t0
            attention.selector = probe
            tokens = da.greedy_decode(model, res.past_key_values, first, 2, stop_ids)
            attention.selector = None
        n_pages = -(-sample.n_tokens // args.page)
        for j, ((value, needle), pages, layers) in enumerate(zip(found, probe.needle_pages, probe.layers)):
            which = f" needle {j + 1}/{len(sample.expected)}," if len(sample.expected) > 1 else ""
            title = (f"## seed {seed}, depth {depth},{which} {sample.n_tokens} tokens ({n_pages} pages), value {value} "
                     f"at tokens {needle[0]}..{needle[-1]} (pages {pages}); dense first tokens "
                     f"{tok.tok.decode(tokens)!r}; prefill+division {prefill_s:.0f} s")
            print(title, flush=True)
            rows = span_probe.format_rows(layers)
            print("\n".join(rows), flush=True)
            lines += ["", title] + rows
            report["prompts"].append({"seed": seed, "depth": depth, "n_tokens": sample.n_tokens, "value": value,
                                      "needle": j, "expected": list(sample.expected),
                                      "needle_tokens": needle, "needle_pages": pages,
                                      "first_tokens": tokens, "layers": layers})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_name(out.name + ".json").write_text(json.dumps(report, indent=1) + "\n")
        out.with_name(out.name + ".txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json and {out}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
