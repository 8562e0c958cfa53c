"""Accuracy of sparse prefill on real models: the same RULER-style prompts, dense vs sparse.

Builds the prompts (``vllm_sparse_backend.evaluation.tasks``: single needle, multi-key with
distractors, multi-value, multi-query, variable tracking, common words) from an offline text with
the model's own tokenizer, fixed seeds and needle depths spread over the prompt; then runs them
through one vLLM OpenAI server per variant (``dense`` = vLLM's own backend: FLASH_ATTN on CUDA,
the CPU backend on CPU; the others ``--attention-backend sparse-prefill``), greedy, and prints per
task and length: accuracy per variant, the attention density the sparse path actually computed
(from the worker's statistics file) and the prefill time (time to the first streamed token).

    python benchmarks/accuracy.py --model smollm2 --lengths 2048 4096 8000 --samples 2
    python benchmarks/accuracy.py --model qwen-coder --lengths 8192 16384 --tasks single_needle \\
        multi_key --variants dense vs flex0.9 flex0.95 'vs-small=vertical_size=250,slash_size=1000'

Models: ``smollm2`` (SmolLM2-135M-Instruct, 8K context), ``qwen-coder``
(Qwen2.5-Coder-0.5B-Instruct, 32K), or a Hugging Face folder. Variants: see
``vllm_sparse_backend.evaluation.variants``; without ``--variants``, ``searched`` is added to
the default list when ``head_configs/<model folder or name>.json`` exists. Writes
``<out>.json`` (every prompt's output, score, density, timing) and ``<out>.txt`` (the table).
Asserts nothing: CI runs a small subset (tests/test_accuracy_ci.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import signal
import sys
import tempfile
import time

# This folder's kernels.py would shadow the `kernels` package that transformers looks for.
_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]

from vllm_sparse_backend.demo import ServerError, cuda_available  # noqa: E402
from vllm_sparse_backend.evaluation import accuracy as acc  # noqa: E402
from vllm_sparse_backend.evaluation import inputs  # noqa: E402
from vllm_sparse_backend.evaluation.tasks import TASKS, HFTokenizer, make_samples  # noqa: E402
from vllm_sparse_backend.evaluation.variants import Variant  # noqa: E402

REPO = _HERE.parent


def main(argv: list[str] | None = None) -> int:
    # `timeout` and job control send SIGTERM: unwind, so that the running server is stopped (it
    # runs in its own session and would otherwise keep the accelerator's memory).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    inputs.add_arguments(p, ["dense", "vs", "flex0.9", "flex0.95"], REPO / "head_configs")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8000],
                   help="prompt lengths in tokens (at most the model's context minus the answer)")
    p.add_argument("--samples", type=int, default=2, help="prompts per task and length")
    p.add_argument("--seed", type=int, default=0, help="first sample's seed")
    p.add_argument("--min-sparse-query-len", type=int, default=1024,
                   help="VLLM_SPARSE_MIN_SPARSE_QUERY_LEN of the sparse servers")
    p.add_argument("--out", help="output path without extension (default: benchmarks/results/"
                   "accuracy_<device>_<model>_<date>)")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--resume", action="store_true",
                   help="keep the results already in <out>.json (same prompts) and run only the "
                        "variants missing there; its other variants stay in the table")
    args = p.parse_args(argv)

    run = inputs.from_arguments(p, args)
    model_dir, model_name, text, text_name = run.model_dir, run.model_name, run.text, run.text_name
    variants = run.variants
    labels = [v.label for v in variants]
    cfg = acc.model_config(model_dir)
    cuda = cuda_available()
    device = "cuda" if cuda else "cpu"

    t0 = time.monotonic()
    tok = HFTokenizer(str(model_dir))
    samples = make_samples(tok, text, args.tasks, args.lengths, args.samples, args.seed)
    longest = max(s.n_tokens + s.max_tokens for s in samples)
    max_len = min(cfg.get("max_position_embeddings", longest), -(-(longest + 16) // 256) * 256)
    if longest > max_len:
        p.error(f"prompts need {longest} tokens; the model's context is {max_len}")
    print(f"model {model_name} ({model_dir}), text {text_name}, device {device}: {len(samples)} "
          f"prompts built in {time.monotonic() - t0:.1f} s; max-model-len {max_len}", flush=True)

    date = datetime.date.today().isoformat()
    out = pathlib.Path(args.out or REPO / "benchmarks" / "results" /
                       f"accuracy_{device}_{run.short_name}_{date}")
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-sparse-accuracy-"))
    results: list[acc.Result] = []
    if args.resume and out.with_suffix(".json").exists():
        old = json.loads(out.with_suffix(".json").read_text())
        # Results of tasks or lengths not asked for now stay (a later run may cover a subset);
        # those of prompts asked for again must be of the same prompts: same model and text,
        # and per (task, length, seed) the same depth and token count.
        for field, now in (("model", model_name), ("text", text_name)):
            if old["meta"][field] != now:
                p.error(f"{out}.json was run with {field} {old['meta'][field]}, not {now}")
        prompts = {(s.task, s.target_tokens, s.seed): (s.depth, s.n_tokens) for s in samples}
        kept = [acc.Result(**r) for r in old["results"]]
        if any(prompts.get((r.task, r.target_tokens, r.seed), (r.depth, r.n_tokens))
               != (r.depth, r.n_tokens) for r in kept):
            p.error(f"{out}.json holds results of other prompts (other --samples or --seed?); "
                    "use another --out")
        if old["meta"]["min_sparse_query_len"] != args.min_sparse_query_len:
            p.error(f"{out}.json was run with --min-sparse-query-len "
                    f"{old['meta']['min_sparse_query_len']}")
        done = list(dict.fromkeys(r.variant for r in kept))
        results += kept
        # Earlier runs' variants stay in the table, first and in their order.
        earlier = [Variant(label, old["meta"]["variants"][label]) for label in done]
        variants = earlier + [v for v in variants if v.label not in done]
        labels = [v.label for v in variants]
        print(f"resuming {out}.json: {len(kept)} results of {', '.join(done)}", flush=True)
    meta = {"model": model_name, "model_dir": str(model_dir), "text": text_name, "device": device,
            "host": platform.node(), "date": date, "tasks": args.tasks, "lengths": args.lengths,
            "samples": args.samples, "seed": args.seed,
            "min_sparse_query_len": args.min_sparse_query_len, "max_model_len": max_len,
            "variants": {v.label: v.overrides for v in variants}, "base_settings": acc.SPARSE_BASE,
            "commands": [" ".join(sys.argv)]}
    if args.resume and results:
        meta["commands"] = old["meta"].get("commands", []) + meta["commands"]
        if old["meta"].get("errors"):
            meta["errors"] = old["meta"]["errors"]

    def save() -> None:
        rows = acc.summarize(results, labels)
        table = acc.format_table(rows, labels)
        summary = acc.overall(results, labels)
        out.with_suffix(".json").write_text(json.dumps(
            {"meta": meta, "rows": rows, "overall": summary,
             "results": acc.results_json(results)}, indent=1) + "\n")
        lines = [f"# {model_name} on {device}, {date}: {args.samples} prompt(s) per task and "
                 f"length, text {text_name}; needle depths spread over the prompt",
                 "# acc = mean score (share of expected values in the greedy answer); dens = "
                 "computed / causal attention pairs in sparse rows; ttft = time to first token",
                 table, "", f"overall ({next(iter(summary.values()))['n'] if summary else 0} "
                 "prompts run by every variant): " + ", ".join(
                     f"{k} acc {v['accuracy']:.3f}" + (f" dens {v['density']:.3f}"
                                                       if v["density"] is not None else "")
                     for k, v in summary.items())]
        # A variant listed in the meta but without results must not read as a blank success.
        missing = [label for label in labels if not any(r.variant == label for r in results)]
        if missing:
            lines.append("no results (not run yet, or failed: see meta.errors in the JSON): "
                         + ", ".join(missing))
        out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)

    for v in variants:
        if any(r.variant == v.label for r in results):
            continue
        t1 = time.monotonic()
        try:
            acc.run_variant(model_dir, v, samples, workdir=workdir, max_model_len=max_len,
                            min_sparse_query_len=args.min_sparse_query_len, cuda=cuda,
                            start_timeout=args.start_timeout, log=lambda m: print(m, flush=True),
                            into=results)
        except (ServerError, OSError) as e:  # a dead server: record it, go on with the rest
            print(f"[{v.label}] FAILED: {e}", flush=True)
            meta.setdefault("errors", {})[v.label] = str(e)[:2000]
        else:  # an earlier run's failure of this variant (on --resume) is no longer the story
            meta.get("errors", {}).pop(v.label, None)
        print(f"[{v.label}] done in {time.monotonic() - t1:.0f} s", flush=True)
        save()
    save()  # also when every variant was already there (--resume re-renders the table)
    print(f"wrote {out}.json and {out}.txt (server logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
