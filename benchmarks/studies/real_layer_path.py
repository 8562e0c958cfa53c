"""The sparse path on a real model's layers: estimation + kernel, chunked as the backend runs it,
vs dense attention, on post-RoPE Q/K/V captured from the model (GPU only).

transformers runs the model once on a real long prompt (a task prompt of the accuracy harness
cut from an offline text, ``evaluation.tasks``), and the Q/K/V of the chosen layers are kept.
Each kept layer then goes through ``backend_path.run_layer``: dense causal attention (torch
SDPA flash and cuDNN, the faster one), our kernel's dense mode, and for every variant the
density of the computed (query, key) pairs, the GPU index estimation and the Triton kernel over
the prompt's chunks (``--chunk`` queries each, against the keys up to the chunk's end), summed.
The same layers also go through the attention check (``evaluation.attention_check``) for the
share of the true softmax mass each variant keeps (recall) and its output error on sampled
query rows, so each cost comes with what it keeps. No gating: every chunk runs sparse.

This measures what the planted-band benchmarks cannot: where a real model puts its heavy
diagonals (scattered, not side by side), and so what a slash line costs.

    python -m benchmarks.studies.real_layer_path --model /tmp/models/qwen2.5-coder-1.5b-instruct \\
        --text /tmp/austen.txt --lengths 65536 131072 --yarn 4 --layers 2 14 27 \\
        --variants vs 'vs-ranges=slash_tiles=ranges' 'vs-small=vertical_size=250,slash_size=1000'

Writes ``<out>.json`` and ``<out>.txt``; asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys
import time

import torch

from vllm_sparse_tools.evaluation import attention_check as ac
from vllm_sparse_tools.evaluation import inputs
from vllm_sparse_tools.evaluation.tasks import TASKS, HFTokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_VARIANTS = ["vs", "vs-ranges=slash_tiles=ranges", "vs-small=vertical_size=250,slash_size=1000",
                    "vs-small-ranges=vertical_size=250,slash_size=1000,slash_tiles=ranges"]


def timing_helpers():
    """backend_path.run_layer and the table's dense baseline (imported once the model is loaded, as
    before: backend_path imports triton)."""
    from benchmarks.studies import backend_path

    return backend_path.run_layer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    inputs.add_arguments(p, DEFAULT_VARIANTS, REPO / "head_configs")
    p.add_argument("--task", default="multi_key", choices=list(TASKS))
    p.add_argument("--lengths", nargs="+", type=int, default=[65536, 131072])
    p.add_argument("--layers", nargs="+", type=int, default=[2, 14, 27], help="layers to keep and measure")
    p.add_argument("--chunk", type=int, default=16384, help="queries per chunk, as vLLM's chunked prefill")
    p.add_argument("--rows", type=int, default=256, help="sampled query rows per layer for recall")
    p.add_argument("--yarn", type=float, default=None, help="YaRN rope factor (see attention_recall.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output path without extension")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA (the Triton kernels and the timed dense baselines run on the GPU)")
    run = inputs.from_arguments(p, args)
    tok = HFTokenizer(str(run.model_dir))
    cap = ac.CaptureModel(str(run.model_dir), "cuda", "bfloat16", args.yarn)
    run_layer = timing_helpers()
    date = datetime.date.today().isoformat()
    out = pathlib.Path(args.out or REPO / "benchmarks" / "results" / f"real_layer_path_{run.short_name}_{date}")
    out.parent.mkdir(parents=True, exist_ok=True)
    import triton
    meta = {"model": run.model_name, "text": run.text_name, "task": args.task, "yarn": args.yarn,
            "chunk": args.chunk, "layers": args.layers, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "host": platform.node(), "date": date,
            "variants": {v.label: v.overrides for v in run.variants}, "command": " ".join(sys.argv)}
    records = []
    for n in args.lengths:
        sample = TASKS[args.task](tok, run.text, n, args.seed, 0.5)
        kept: dict[int, tuple] = {}
        checker = ac.LayerChecker([v for v in run.variants if not v.dense], rows=args.rows, seed=args.seed,
                                  chunk=args.chunk)
        recall: dict[int, dict] = {}

        def on_layer(layer, q, k, v, scale, o):
            if layer in args.layers:
                kept[layer] = (q.clone(), k.clone(), v.clone(), scale)
                recall[layer] = {r.variant: {"recall": r.recall, "error": r.error, "density": r.density}
                                 for r in checker(layer, q, k, v, scale, o)}

        t0 = time.monotonic()
        cap(sample.prompt_ids, on_layer)
        print(f"{sample.n_tokens} tokens captured and checked in {time.monotonic() - t0:.0f} s", flush=True)
        for layer in sorted(kept):
            q, k, v, scale = kept.pop(layer)
            settings = [(var.label, var.settings()) for var in run.variants if not var.dense]
            rec = run_layer(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), args.chunk, settings,
                            scale)
            del q, k, v
            rec.update(layer=layer, tokens=sample.n_tokens, recall=recall[layer])
            records.append(rec)
            print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()
    labels = [v.label for v in run.variants if not v.dense]
    lines = [f"# {run.model_name}, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {date}: "
             f"{args.task} prompt from {run.text_name}" + (f", YaRN x{args.yarn:g}" if args.yarn else "")
             + f"; one layer at a time, {args.chunk}-query chunks summed, every chunk sparse (no gating)",
             "# cell: computed density / estimation + kernel = total ms (speedup vs the faster of SDPA flash "
             "and cuDNN), recall (kept softmax mass) on sampled rows",
             "| tokens | layer | dense SDPA ms | ours dense ms | " + " | ".join(labels) + " |",
             "|---" * (4 + len(labels)) + "|"]
    for r in records:
        best = min(x for x in (r["flash"], r["cudnn"]) if x == x)
        cells = [f"{r['tokens'] // 1024}K", str(r["layer"]), f"{best:.2f}", f"{r['ours_dense']:.2f}"]
        for name in labels:
            s, rc = r[name], r["recall"].get(name, {})
            cells.append(f"{s['density']:.2f} / {s['estimate_ms']:.2f} + {s['kernel_ms']:.2f} = {s['total_ms']:.2f} "
                         f"({best / s['total_ms']:.2f}x), r {rc.get('recall', float('nan')):.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    out.with_name(out.name + ".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}.json and {out}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
