"""Attention recall of the sparse patterns on a real model's Q/K/V: no generation needed.

transformers runs the model once per prompt length on a real long prompt (a multi-key needle
prompt cut from offline text, ``evaluation.tasks``; the model is loaded once, float32 on the CPU,
bfloat16 on CUDA, SDPA causal attention: flash / memory-efficient kernels, no n x n matrix); each
layer's post-RoPE Q/K/V goes, on the model's device and inside the capture callback (no layer is
kept), through every variant's estimator (the backend's own code, KV-group sharing decided as the
backend decides it) and is scored against exact dense attention on sampled query rows: the share
of the true softmax mass the selection keeps (recall), the relative output error, the exact
density and the kernel's tile density. See ``vllm_sparse_tools.evaluation.attention_check``.

    python -m benchmarks.attention_recall --model qwen-coder --lengths 8192 16384 \\
        --variants vs flex0.9 flex0.95 ashape block 'vs-small=vertical_size=250,slash_size=1000'
    # GPU, beyond the trained 32K: YaRN x4, estimated as vLLM serves it (16K chunks, library
    # gating); a searched file given by path
    python -m benchmarks.attention_recall --model /tmp/models/qwen2.5-coder-1.5b-instruct \\
        --text /tmp/austen.txt --lengths 65536 131072 --rows 512 --device cuda --yarn 4 \\
        --chunk 16384 --gating --variants vs flex0.9 flex0.95 \\
        searched=head_config=head_configs/qwen2.5-coder-1.5b-instruct.json

Writes ``<out>.json`` (per layer and variant) and ``<out>.txt`` (summary per length and
variant; per-layer table with --per-layer). Asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys
import time

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.attention_recall ...")

import torch  # noqa: E402

from vllm_sparse_tools.evaluation import attention_check as ac  # noqa: E402
from vllm_sparse_tools.evaluation import inputs  # noqa: E402
from vllm_sparse_tools.evaluation.tasks import TASKS, HFTokenizer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = ["vs", "flex0.9", "flex0.95", "ashape", "block"]


def format_summary(summary: dict[int, dict[str, dict]]) -> str:
    head = (f"{'tokens':>6} {'variant':<28} {'density':>7} {'tiles':>6} {'recall':>7} {'min lay':>7} "
            f"{'min head':>8} {'out err':>7} {'max lay':>7} {'shared':>6} {'dense':>5} {'q recall':>8} {'q min lay':>9}")
    lines = [head, "-" * len(head)]
    for n, per_variant in summary.items():
        for label, m in per_variant.items():
            lines.append(f"{n:>6} {label:<28} {m['density']:>7.3f} {m.get('tile_density', float('nan')):>6.3f} "
                         f"{m['recall']:>7.4f} {m['recall_min_layer']:>7.4f} {m['recall_min_head']:>8.4f} "
                         f"{m['error']:>7.4f} {m['error_max_layer']:>7.4f} {m.get('shared_layers', 0):>6} "
                         f"{m.get('dense_chunks', 0):>5} {m.get('tail_recall', float('nan')):>8.4f} "
                         f"{m.get('tail_recall_min_layer', float('nan')):>9.4f}")
    return "\n".join(lines)


def format_layers(results: list[dict], n: int) -> str:
    labels = list(dict.fromkeys(r["variant"] for r in results))
    head = f"{'layer':>5}" + "".join(f" | {lab[:20]:^20}" for lab in labels)
    sub = f"{'':>5}" + "".join(f" | {'dens':>6} {'recall':>6} {'err':>6}" for _ in labels)
    lines = [f"# per layer at {n} tokens", head, sub]
    for layer in sorted({r["layer"] for r in results}):
        line = f"{layer:>5}"
        for lab in labels:
            r = next(x for x in results if x["layer"] == layer and x["variant"] == lab)
            line += f" | {r['density']:>6.3f} {r['recall']:>6.4f} {r['error']:>6.4f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    inputs.add_arguments(p, DEFAULT_VARIANTS, REPO / "head_configs")
    p.add_argument("--task", default="multi_key", choices=list(TASKS),
                   help="which task's prompt to run (the text around the facts dominates)")
    p.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8000])
    p.add_argument("--rows", type=int, default=1024, help="sampled query rows per layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-budget", type=int, default=None,
                   help="FlexPrefill min_budget for every variant (library default 1024)")
    p.add_argument("--per-layer", action="store_true", help="also print per-layer tables")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (bfloat16 on CUDA, float32 on "
                   "CPU), float32, bfloat16")
    p.add_argument("--yarn", type=float, default=None, help="YaRN rope factor applied to the model "
                   "config before loading (e.g. 4: rope_type yarn, factor 4, "
                   "original_max_position_embeddings = the config's max_position_embeddings, 32768 "
                   "for Qwen2.5); needed for prompts beyond the trained context")
    p.add_argument("--yarn-original", type=int, default=None,
                   help="original_max_position_embeddings for --yarn (default: the config's)")
    p.add_argument("--chunk", type=int, default=0, help="estimate the prompt in chunks of this many "
                   "queries, each against the keys up to its end, as vLLM's chunked prefill runs it "
                   "(16384 on CUDA in benchmarks/accuracy.py); 0 (default): one row")
    p.add_argument("--gating", action="store_true", help="route chunks dense where the CUDA backend "
                   "would (min_sparse_query_len, max_density on the budgets and on the estimated index)")
    p.add_argument("--tail-rows", type=int, default=0, help="the prompt's last rows always among the "
                   "sampled rows, and scored alone too (q recall: a task's question; default 0: stratified only)")
    p.add_argument("--tile", type=int, default=64, help="query rows scored per step")
    p.add_argument("--oracle-densities", nargs="*", type=float, default=[],
                   help="also the per-row block oracle at these densities: each sampled row keeps its own "
                        "blocks of most true mass (an upper bound for any key-block selection)")
    p.add_argument("--oracle-groups", nargs="*", type=int, default=[],
                   help="also the block oracle at --oracle-densities with one key-block list per group of "
                        "this many consecutive positions x the query heads of a KV head (64: the kernel's "
                        "tiles; fewer: tiles that pack a KV group's heads at fewer positions); rows are "
                        "then sampled in aligned runs of the largest group (--tail-rows unused)")
    p.add_argument("--out", help="output path without extension")
    args = p.parse_args(argv)
    if args.oracle_groups and not args.oracle_densities:
        p.error("--oracle-groups needs --oracle-densities")
    if args.threads:
        torch.set_num_threads(args.threads)

    run = inputs.from_arguments(p, args)
    model_dir, model_name, text, text_name = run.model_dir, run.model_name, run.text, run.text_name
    variants = run.variants
    try:
        device = ac.resolve_device(args.device)
        ac.resolve_dtype(args.dtype, device)
    except ValueError as e:
        p.error(str(e))
    tok = HFTokenizer(str(model_dir))
    base = {} if args.min_budget is None else {"min_budget": args.min_budget}

    date = datetime.date.today().isoformat()
    out_json, out_txt = inputs.result_paths(args.out, REPO / "benchmarks" / "results" /
                                            f"attention_recall_{device.split(':')[0]}_{run.short_name}_{date}")
    t_load = time.monotonic()
    cap = ac.CaptureModel(str(model_dir), device, args.dtype, args.yarn, args.yarn_original)
    print(f"{model_name}: {cap.num_layers} layers, {cap.num_heads} / {cap.num_kv_heads} heads, "
          f"{cap.dtype} on {cap.device}, rope {ac.rope_description(cap.config)} "
          f"(loaded in {time.monotonic() - t_load:.1f} s)", flush=True)
    meta = {"model": model_name, "text": text_name, "task": args.task, "device": device,
            "dtype": str(cap.dtype).replace("torch.", ""), "yarn": args.yarn,
            "rope": ac.rope_description(cap.config), "chunk": args.chunk, "gating": args.gating,
            "host": platform.node(), "date": date, "rows": args.rows, "tail_rows": args.tail_rows,
            "seed": args.seed, "variants": {v.label: v.overrides for v in variants},
            "base_settings": base, "torch": torch.__version__, "command": " ".join(sys.argv)}
    per_length: dict[int, list[dict]] = {}
    summary: dict[int, dict] = {}
    t_all = time.monotonic()
    for n in args.lengths:
        sample = TASKS[args.task](tok, text, n, args.seed, 0.5)
        trained = int(getattr(cap.config, "max_position_embeddings", 0) or 0)
        if not args.yarn and trained and sample.n_tokens > trained:
            print(f"warning: {sample.n_tokens} tokens is beyond the model's {trained} positions; "
                  f"pass --yarn (e.g. 4) for the rope scaling it is served with", flush=True)
        checker = ac.LayerChecker(variants, rows=args.rows, seed=args.seed, base_settings=base,
                                  tile=args.tile, chunk=args.chunk, gating=args.gating,
                                  tail=args.tail_rows, oracle_densities=args.oracle_densities,
                                  oracle_groups=args.oracle_groups)
        t0 = time.monotonic()

        def on_layer(layer, q, k, v, scale, o):
            t = time.monotonic()
            res = checker(layer, q, k, v, scale, o)
            print(f"{sample.n_tokens} tok layer {layer:>2}: " + ", ".join(
                f"{r.variant} d={r.density:.3f} t={r.tile_density:.3f} r={r.recall:.4f} "
                f"e={r.error:.4f}" + (f" x{r.kv_share}" if r.kv_share > 1 else "")
                + (f" dense={sum(r.dense_chunks.values())}" if r.dense_chunks else "") for r in res)
                + f" ({time.monotonic() - t:.1f} s; {time.monotonic() - t_all:.0f} s in all)", flush=True)

        cap(sample.prompt_ids, on_layer)
        print(f"{sample.n_tokens} tokens: {time.monotonic() - t0:.0f} s; capture check: our dense "
              f"output vs the model's SDPA output, max relative difference "
              f"{checker.capture_diff:.2e} ({cap.dtype})", flush=True)
        per_length[sample.n_tokens] = ac.results_json(checker.results)
        summary[sample.n_tokens] = ac.summarize(checker.results)
        meta.setdefault("capture_diff", {})[sample.n_tokens] = checker.capture_diff
        meta.setdefault("seconds", {})[sample.n_tokens] = round(time.monotonic() - t0, 1)
        out_json.write_text(json.dumps(
            {"meta": meta, "summary": summary, "layers": per_length}, indent=1) + "\n")

    how = (f"{meta['dtype']}" + (f", YaRN x{args.yarn:g}" if args.yarn else "")
           + (f", estimated in {args.chunk}-token chunks" if args.chunk else "")
           + (", library gating" if args.gating else ""))
    lines = [f"# {model_name}, {device}, {date}: {args.task} prompt from {text_name}; "
             f"{args.rows} sampled query rows per layer; {how}",
             "# density = selected / causal pairs; recall = kept softmax mass (mean over heads, "
             "rows, layers; 'min lay' worst layer, 'min head' worst head);",
             "# out err = ||o_sparse - o_dense|| / ||o_dense|| (mean over layers; 'max lay' worst); "
             "tiles = kernel key tiles / causal tiles; shared = layers with one selection per KV group",
             format_summary(summary)]
    if args.per_layer:
        for n, res in per_length.items():
            lines += ["", format_layers(res, n)]
    out_txt.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out_json} and {out_txt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
