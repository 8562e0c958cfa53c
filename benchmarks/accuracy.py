"""Accuracy of sparse prefill on real models: the same RULER-style prompts, dense vs sparse.

Builds the prompts (``vllm_sparse_tools.evaluation.tasks``: single needle, multi-key with
distractors, multi-value, multi-query, variable tracking, common words) from an offline text with
the model's own tokenizer, fixed seeds and needle depths spread over the prompt; then runs them
through one vLLM OpenAI server per variant (``dense`` = vLLM's own backend: FLASH_ATTN on CUDA,
the CPU backend on CPU; the others ``--attention-backend sparse-prefill``), greedy, and prints per
task and length: accuracy per variant, the attention density the sparse path actually computed
(from the worker's statistics file) and the prefill time (time to the first streamed token).

    python -m benchmarks.accuracy --model smollm2 --lengths 2048 4096 8000 --samples 2
    python -m benchmarks.accuracy --model qwen-coder --lengths 8192 16384 --tasks single_needle \\
        multi_key --variants dense vs flex0.9 flex0.95 'vs-small=vertical_size=250,slash_size=1000'
    # GPU, as served: library gating, 16K chunks, YaRN x4 beyond the trained 32K, servers
    # started together and measured one after another
    python -m benchmarks.accuracy --model qwen-coder-1.5b --lengths 16384 32000 65536 130000 \\
        --samples 3 --library-gating --yarn 4 --parallel-servers --variants dense default flex0.9

Models: ``smollm2`` (SmolLM2-135M-Instruct, 8K context), ``qwen-coder``
(Qwen2.5-Coder-0.5B-Instruct, 32K), ``qwen-coder-1.5b`` (Qwen2.5-Coder-1.5B-Instruct, 32K), or a
Hugging Face folder. Variants: see
``vllm_sparse_tools.evaluation.variants``; without ``--variants``, ``searched`` is added to
the default list when ``head_configs/<model folder or name>.json`` exists. Writes
``<out>.json`` (every prompt's output, score, density, timing) and ``<out>.txt`` (the tables:
per task and length, and per length with each variant's TTFT speedup over the first variant).
``benchmarks/frontier.py`` draws score against TTFT speedup from the JSON.
Asserts nothing: CI runs a small subset (tests/tools/test_accuracy_ci.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import signal
import sys
import tempfile
import time

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.accuracy ...")

from vllm_sparse_tools.demo import ServerError, cuda_available, wait_ready  # noqa: E402
from vllm_sparse_tools.evaluation import accuracy as acc  # noqa: E402
from vllm_sparse_tools.evaluation import inputs  # noqa: E402
from vllm_sparse_tools.evaluation.tasks import TASKS, HFTokenizer, Sample, make_samples  # noqa: E402
from vllm_sparse_tools.evaluation.variants import Variant  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


def cached_samples(path: pathlib.Path | None, model_dir: pathlib.Path, text_name: str,
                   args: argparse.Namespace, build) -> list[Sample]:
    """``build()``, or the prompts a former run with the same inputs saved in ``path``."""
    key = {"model": pathlib.Path(model_dir).name, "text": text_name, "tasks": args.tasks,
           "lengths": args.lengths, "samples": args.samples, "seed": args.seed}
    if path is not None and path.exists():
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return [Sample(**{**s, "expected": tuple(s["expected"]),
                              "needle_depths": tuple(s["needle_depths"])}) for s in cached["samples"]]
    samples = build()
    if path is not None:
        path.write_text(json.dumps({"key": key, "samples": [dataclasses.asdict(s) for s in samples]}))
    return samples


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
                   help="VLLM_SPARSE_MIN_SPARSE_QUERY_LEN of the sparse servers (their "
                        "VLLM_SPARSE_MAX_DENSITY is 1.0: the sparse path forced on)")
    p.add_argument("--library-gating", action="store_true",
                   help="sparse servers keep the library's min_sparse_query_len and max_density "
                        "(what `vllm serve` does) instead of forcing the sparse path on")
    p.add_argument("--yarn", type=float, default=None, metavar="FACTOR",
                   help="prompts longer than the model's max_position_embeddings run on a YaRN "
                        "copy of the model (rope scaling FACTOR over the trained context)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill chunk (default: the whole prompt on CPU, 16384 on CUDA)")
    p.add_argument("--prompt-cache", type=pathlib.Path, default=None,
                   help="JSON file keeping the built prompts for later runs of the same model, "
                        "text, tasks, lengths, samples and seed (building 128K prompts takes a while)")
    p.add_argument("--parallel-servers", action="store_true",
                   help="CUDA: start every server of the run at once (fixed KV cache each), then "
                        "measure them one after another")
    p.add_argument("--out", help="output path without extension (default: benchmarks/results/"
                   "accuracy_<device>_<model>_<date>)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="vLLM's --kv-cache-dtype for every server (e.g. fp8; CUDA), default: the model's dtype")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--triton-cache-report", action="store_true",
                   help="give each server an empty Triton cache of its own and report the kernels it "
                        "compiled after it was ready (warm-up, measured prompts): a compile while "
                        "serving is a slow first request")
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
    samples = cached_samples(args.prompt_cache, model_dir, text_name, args, lambda: make_samples(
        HFTokenizer(str(model_dir)), text, args.tasks, args.lengths, args.samples, args.seed))
    native = cfg.get("max_position_embeddings") or max(s.n_tokens + s.max_tokens for s in samples)
    rope_of = {s.key: "native" if s.n_tokens + s.max_tokens <= native or not args.yarn
               else f"yarn{args.yarn:g}" for s in samples}
    limits = {"native": native}
    if args.yarn:
        limits[f"yarn{args.yarn:g}"] = int(native * args.yarn)
    max_lens = {}
    for rope, limit in limits.items():
        need = [s.n_tokens + s.max_tokens for s in samples if rope_of[s.key] == rope]
        if need:
            max_lens[rope] = min(limit, -(-(max(need) + 16) // 256) * 256)
            if max(need) > max_lens[rope]:
                p.error(f"prompts need {max(need)} tokens; the model's context is {limit}"
                        + ("" if args.yarn else " (--yarn FACTOR serves longer prompts with YaRN)"))
    print(f"model {model_name} ({model_dir}), text {text_name}, device {device}: {len(samples)} "
          f"prompts built in {time.monotonic() - t0:.1f} s; max-model-len "
          + ", ".join(f"{r} {n}" for r, n in max_lens.items()), flush=True)

    date = datetime.date.today().isoformat()
    out_json, out_txt = inputs.result_paths(args.out, REPO / "benchmarks" / "results" /
                                            f"accuracy_{device}_{run.short_name}_{date}")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-sparse-accuracy-"))
    model_dirs = {"native": model_dir}
    if args.yarn and any(r != "native" for r in rope_of.values()):
        model_dirs[f"yarn{args.yarn:g}"] = acc.yarn_model_dir(model_dir, args.yarn, workdir)
    results: list[acc.Result] = []
    gating = ({"min_sparse_query_len": None, "max_density": None} if args.library_gating else
              {"min_sparse_query_len": args.min_sparse_query_len, "max_density": 1.0})
    if args.resume and out_json.exists():
        old = json.loads(out_json.read_text())
        # Results of tasks or lengths not asked for now stay (a later run may cover a subset);
        # those of prompts asked for again must be of the same prompts: same model and text,
        # and per (task, length, seed) the same depth and token count; and the same servers.
        acc.refuse_other_run(p, out_json, old["meta"], {
            "model": model_name, "text": text_name, **gating, "yarn": args.yarn,
            "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_dtype": args.kv_cache_dtype})
        prompts = {(s.task, s.target_tokens, s.seed): (s.depth, s.n_tokens) for s in samples}
        kept = [acc.Result(**r) for r in old["results"]]
        if any(prompts.get((r.task, r.target_tokens, r.seed), (r.depth, r.n_tokens))
               != (r.depth, r.n_tokens) for r in kept):
            p.error(f"{out_json} holds results of other prompts (other --samples or --seed?); "
                    "use another --out")
        done = list(dict.fromkeys(r.variant for r in kept))
        results += kept
        # Earlier runs' variants stay in the table, first and in their order.
        earlier = [Variant(label, old["meta"]["variants"][label]) for label in done]
        variants = earlier + [v for v in variants if v.label not in done]
        labels = [v.label for v in variants]
        print(f"resuming {out_json}: {len(kept)} results of {', '.join(done)}", flush=True)
    meta = {"model": model_name, "model_dir": str(model_dir), "text": text_name, "device": device,
            "host": platform.node(), "date": date, "tasks": args.tasks, "lengths": args.lengths,
            "samples": args.samples, "seed": args.seed,
            **gating, "max_model_len": max_lens, "yarn": args.yarn,
            "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_dtype": args.kv_cache_dtype,
            "variants": {v.label: v.overrides for v in variants},
            "commands": [" ".join(sys.argv)]}
    if args.resume and results:
        meta["commands"] = old["meta"].get("commands", []) + meta["commands"]
        if old["meta"].get("errors"):
            meta["errors"] = old["meta"]["errors"]

    def save() -> None:
        rows = acc.summarize(results, labels)
        table = acc.format_table(rows, labels)
        lengths = acc.by_length(results, labels)
        summary = acc.overall(results, labels)
        out_json.write_text(json.dumps(
            {"meta": meta, "rows": rows, "by_length": lengths, "overall": summary,
             "results": acc.results_json(results)}, indent=1) + "\n")
        lines = [f"# {model_name} on {device}, {date}: {args.samples} prompt(s) per task and "
                 f"length, text {text_name}; needle depths spread over the prompt"
                 + (f"; KV cache {args.kv_cache_dtype} on every server" if args.kv_cache_dtype else ""),
                 "# acc = mean score (share of expected values in the greedy answer); dens = "
                 "computed share of all the prompt's causal attention pairs (rows that ran dense "
                 "count whole); ttft = mean time to first token; spd = first variant's TTFT / "
                 "this one's, same prompts",
                 table, "", "score (density, TTFT speedup) per length, every task:",
                 acc.format_length_table(lengths, labels), "", f"overall ({next(iter(summary.values()))['n'] if summary else 0} "
                 "prompts run by every variant): " + ", ".join(
                     f"{k} acc {v['accuracy']:.3f}" + (f" dens {v['density_all']:.3f}"
                                                       if v["density_all"] is not None else "")
                     for k, v in summary.items())]
        # A variant listed in the meta but without results must not read as a blank success.
        missing = [label for label in labels if not any(r.variant == label for r in results)]
        if missing:
            lines.append("no results (not run yet, or failed: see meta.errors in the JSON): "
                         + ", ".join(missing))
        out_txt.write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)

    def log(m: str) -> None:
        print(m, flush=True)

    # One server per variant and model folder (native, YaRN), each given its prompts.
    todo = [(v, rope, [s for s in samples if rope_of[s.key] == rope])
            for v in variants if not any(r.variant == v.label for r in results) for rope in max_lens]
    todo = [t for t in todo if t[2]]
    kw = dict(workdir=workdir, cuda=cuda, max_num_batched_tokens=args.max_num_batched_tokens,
              own_triton_cache=args.triton_cache_report, kv_cache_dtype=args.kv_cache_dtype, **gating)
    started: dict[tuple[str, str], acc.Launched] = {}
    if args.parallel_servers and cuda:
        t1 = time.monotonic()
        for v, rope, _ in todo:
            started[v.label, rope] = acc.launch(model_dirs[rope], v, max_model_len=max_lens[rope], rope=rope,
                                                shared_gpu=True, **kw)
        log(f"started {len(started)} servers")
    failed: set[str] = set()
    try:
        for v, rope, group in todo:
            if v.label in failed:
                continue
            t1 = time.monotonic()
            server = started.get((v.label, rope)) or acc.launch(
                model_dirs[rope], v, max_model_len=max_lens[rope], rope=rope, **kw)
            try:
                ready = wait_ready(server.handle, args.start_timeout)
                log(f"[{v.label}/{rope}] server ready ({ready:.0f} s more)")
                compiles = meta.setdefault("triton_compiles", {}).setdefault(f"{v.label}/{rope}", {}) \
                    if args.triton_cache_report else None
                acc.measure(server, group, log=log, into=results, compiles=compiles)
            except (ServerError, OSError) as e:  # a dead server: record it, go on with the rest
                acc.report_failure(server, log)
                log(f"[{v.label}/{rope}] FAILED: {e}")
                meta.setdefault("errors", {})[v.label] = str(e)[:2000]
                failed.add(v.label)
                results[:] = [r for r in results if r.variant != v.label]  # no half variants
            else:  # an earlier run's failure of this variant (on --resume) is no longer the story
                meta.get("errors", {}).pop(v.label, None)
            finally:
                server.handle.stop()  # frees its GPU memory for the servers still to measure
            log(f"[{v.label}/{rope}] done in {time.monotonic() - t1:.0f} s")
            save()
    finally:
        for server in started.values():
            server.handle.stop()
    save()  # also when every variant was already there (--resume re-renders the table)
    print(f"wrote {out_json} and {out_txt} (server logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
