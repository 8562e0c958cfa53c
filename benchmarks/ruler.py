"""An external judge of answers: lm-eval's own RULER tasks against vLLM OpenAI servers, dense vs sparse.

One server per variant (``dense`` = vLLM's own backend, the others ``--attention-backend
sparse-prefill`` with their ``VLLM_SPARSE_*`` overrides; started by the accuracy harness's
``launch``, one after another), and against each the offline RULER tasks of lm-eval (synthetic
haystacks, no download: ``niah_single_1``, ``niah_multikey_2``, ``niah_multikey_3``, ``ruler_vt``,
``ruler_cwe``, ``ruler_fwe``) through lm-eval's ``local-completions`` model: the prompts are built
by lm-eval with the model's own tokenizer (``tokenizer_backend=huggingface``), sized to each
``--lengths`` value, and sent as token ids, greedy. lm-eval runs in an interpreter of its own
(``--lmeval-python``: lm-eval is no dependency of the plugin)::

    python -m venv .venv-lmeval && .venv-lmeval/bin/pip install lm-eval==0.4.13 wonderwords tenacity transformers

One lm-eval process per task and length (``--limit`` prompts each), ``--parallel-tasks`` of them
at once against the same server. lm-eval's RULER tasks generate 500 prompts per length whatever
the limit (minutes of one core per task at 128K), so lm-eval runs under
``benchmarks/infra/lmeval_launcher.py``, which has them generate only the ``--limit`` first
(``--all-samples``: lm-eval as it is). Then per task and length: each variant's score (RULER's
string match, the mean over the prompts, with its 95% t interval) and its paired difference to the first
variant on the same prompts (mean and 95% t interval over the per-prompt differences, read from
lm-eval's ``--log_samples`` files; prompts are matched by lm-eval's ``doc_id`` and must have the
same ``prompt_hash``). Writes ``<out>.json`` (meta, every prompt's score and answer, the table
rows) and ``<out>.txt`` (the table, the device, the versions and the command).

    # CPU: SmolLM2-135M at 4K
    python -m benchmarks.ruler --model smollm2 --lengths 4096 --tasks niah_single_1 ruler_vt \\
        --limit 3 --lmeval-python /work/lmeval-venv/bin/python \\
        --variants dense default 'forced=min_sparse_query_len=1024,max_density=1.0'
    # GPU: Qwen2.5-Coder-1.5B, YaRN x4 past its trained 32K (see docs/benchmarks.md)
    python -m benchmarks.ruler --model qwen-coder-1.5b --yarn 4 --lengths 32000 65536 130000 \\
        --limit 10 --variants dense default --out benchmarks/results/ruler_h100_qwen-coder-1.5b

A length whose prompt and answer fit the model's trained context runs on the model as it is;
longer ones, with ``--yarn``, on a YaRN copy (as in ``benchmarks/accuracy.py``). ``--resume``
keeps the (variant, task, length) cells already in ``<out>.json`` and runs the rest, so that a
long run can be split into several commands; ``--merge A.json B.json ... --out X`` writes one
table from runs made side by side (one per variant and length, ``--shared-gpu``). Asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.ruler ...")

from vllm_sparse_tools.demo import ServerError, cuda_available, wait_ready  # noqa: E402
from vllm_sparse_tools.evaluation import accuracy as acc  # noqa: E402
from vllm_sparse_tools.evaluation.inputs import (add_model_and_variants_arguments, model_and_variants,  # noqa: E402
                                                 result_paths, short_model_name)
from vllm_sparse_tools.evaluation.intervals import mean_interval, paired_difference  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# The RULER tasks of lm-eval 0.4.13 that build their haystacks offline (the others download essays
# or hub datasets).
OFFLINE_TASKS = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"]
# Tokens past a RULER length that a request may need: RULER sizes the prompt and its 128 answer
# tokens to the length, without the answer prefix (gen_prefix) and the chat template.
LENGTH_MARGIN = 256
SERVED_NAME = "eval-model"  # accuracy.server_args' default served name
# Run by path with the lm-eval interpreter (which need not see this repository).
LMEVAL_LAUNCHER = REPO / "benchmarks" / "infra" / "lmeval_launcher.py"
# meta["generated_prompts"]: which prompts lm-eval generated (the scored ones are the first
# --limit either way: the generators build them one after another from one random state).
GENERATED_LIMIT = "lm-eval generating only those (benchmarks/infra/lmeval_launcher.py)"
GENERATED_ALL = "lm-eval generating RULER's 500 (--all-samples)"


@dataclass
class SampleScore:
    """One prompt of one lm-eval sample file."""
    variant: str
    task: str
    length: int
    doc_id: int
    prompt_hash: str
    score: float
    response: str
    target: str


# ---------------------------------------------------------------------------------------------
# lm-eval's files
# ---------------------------------------------------------------------------------------------

def lmeval_command(python: str, *, task: str, length: int, base_url: str, tokenizer: str, max_length: int,
                   limit: int, output_path: pathlib.Path, num_concurrent: int = 1, timeout: float = 3600,
                   chat_template: bool = False, all_samples: bool = False) -> list[str]:
    """``lm_eval run`` for one RULER task at one length against a completions endpoint, through
    :data:`LMEVAL_LAUNCHER` generating ``limit`` prompts (``all_samples``: ``python -m lm_eval``,
    generating RULER's 500)."""
    model_args = ",".join(f"{k}={v}" for k, v in (
        ("model", SERVED_NAME), ("tokenizer", tokenizer), ("base_url", base_url),
        ("tokenizer_backend", "huggingface"), ("max_length", max_length),
        ("num_concurrent", num_concurrent), ("timeout", int(timeout))))
    entry = ["-m", "lm_eval"] if all_samples else [str(LMEVAL_LAUNCHER), "--samples", str(limit)]
    cmd = [python, *entry, "run", "--model", "local-completions", "--model_args", model_args,
           "--tasks", task, "--metadata", json.dumps({"max_seq_lengths": [length]}),
           "--limit", str(limit), "--output_path", str(output_path), "--log_samples", "--seed", "0"]
    return cmd + (["--apply_chat_template"] if chat_template else [])


def find_outputs(output_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    """lm-eval's results file and its sample file per task under ``output_path``
    (``<output_path>/<model>/results_<time>.json``, ``samples_<task>_<time>.jsonl``): the newest
    results file, and the sample files with its time stamp."""
    results = sorted(output_path.glob("*/results_*.json"), key=lambda p: p.stat().st_mtime)
    if not results:
        raise FileNotFoundError(f"no lm-eval results_*.json under {output_path}")
    newest = results[-1]
    stamp = newest.stem[len("results_"):]
    samples = {p.name[len("samples_"):-len(f"_{stamp}.jsonl")]: p
               for p in newest.parent.glob(f"samples_*_{stamp}.jsonl")}
    return newest, samples


def read_results(path: pathlib.Path, length: int) -> dict[str, dict[str, Any]]:
    """Per task of an lm-eval results file: its aggregated score at ``length`` (metric
    ``"<length>,none"``; None if absent) and how many prompts it was over."""
    data = json.loads(path.read_text())
    out = {}
    for task, metrics in data["results"].items():
        value = metrics.get(f"{length},none")
        out[task] = {"score": value if isinstance(value, (int, float)) else None,
                     "n": (data.get("n-samples", {}).get(task) or {}).get("effective"),
                     "lm_eval_version": data.get("lm_eval_version")}
    return out


def read_samples(path: pathlib.Path, *, variant: str, task: str, length: int) -> list[SampleScore]:
    """The per-prompt scores of an lm-eval ``--log_samples`` file (JSON lines). RULER's
    process_results gives each prompt a metric per length, -1 for the lengths it is not of; the
    prompt's score is the one named ``str(length)``."""
    scores = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        value = rec.get(str(length))
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{path}: doc {rec.get('doc_id')} has no score at length {length} "
                             f"(metrics {rec.get('metrics')})")
        resps = rec.get("filtered_resps") or [""]
        scores.append(SampleScore(variant, task, length, int(rec["doc_id"]), rec.get("prompt_hash", ""),
                                  float(value), str(resps[0]), _target_text(rec.get("target"))))
    return scores


def _target_text(target: Any) -> str:
    """lm-eval logs a list target as its Python repr (``"['4430567']"``): kept as ``a | b``."""
    if isinstance(target, str):
        try:
            target = ast.literal_eval(target)
        except (ValueError, SyntaxError):
            return target
    return " | ".join(map(str, target)) if isinstance(target, (list, tuple)) else str(target)


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------

def summarize(samples: Sequence[SampleScore], labels: Sequence[str],
              lmeval_scores: dict[tuple[str, str, int], float | None] | None = None) -> list[dict[str, Any]]:
    """One row per (task, length): each variant's mean score with its 95% interval, lm-eval's own
    aggregate (a check: the same mean), and the paired difference to ``labels[0]`` over the
    prompts both ran with the same prompt hash (prompts whose hashes differ are counted, not
    compared)."""
    lmeval_scores = lmeval_scores or {}
    keys = sorted({(s.task, s.length) for s in samples}, key=lambda k: (k[1], k[0]))
    rows = []
    for task, length in keys:
        by_variant = {label: {s.doc_id: s for s in samples if (s.variant, s.task, s.length) == (label, task, length)}
                      for label in labels}
        base = by_variant[labels[0]]
        cells = {}
        for label in labels:
            mine = by_variant[label]
            if not mine:
                continue
            cell: dict[str, Any] = {"score": mean_interval([s.score for s in mine.values()], bounds=(0, 1)).as_dict(),
                                    "lm_eval_score": lmeval_scores.get((label, task, length))}
            if label != labels[0] and base:
                shared = sorted(set(mine) & set(base))
                same = [d for d in shared if mine[d].prompt_hash == base[d].prompt_hash]
                cell["prompt_mismatches"] = len(shared) - len(same)
                if same:
                    cell["diff"] = paired_difference([mine[d].score for d in same], [base[d].score for d in same],
                                                     bounds=(-1, 1)).as_dict()
                    cell["changed_prompts"] = sum(mine[d].score != base[d].score for d in same)
            cells[label] = cell
        rows.append({"task": task, "length": length, "variants": cells})
    return rows


def _interval(c: dict | None, signed: bool = False) -> str:
    if not c:
        return "-"
    spec = "+.3f" if signed else ".3f"
    if c["low"] is None:
        return f"{c['mean']:{spec}} (n={c['n']})"
    return f"{c['mean']:{spec}} [{c['low']:{spec}}, {c['high']:{spec}}]"


def format_table(rows: Sequence[dict], labels: Sequence[str]) -> str:
    """Task, length, n, then per variant its score [95% interval] and, after the first, the paired
    difference to the first [95% interval] and how many prompts changed score."""
    head = ["task", "length", "n"]
    for i, label in enumerate(labels):
        head.append(f"{label} score [95%]")
        if i:
            head.append(f"{label} - {labels[0]} [95%] (changed)")
    lines = [head]
    for row in rows:
        cells = row["variants"]
        n = max((c["score"]["n"] for c in cells.values()), default=0)
        line = [row["task"], acc.length_label(row["length"]), str(n)]
        for i, label in enumerate(labels):
            c = cells.get(label)
            line.append(_interval(c["score"]) if c else "-")
            if i:
                extra = ""
                if c and c.get("prompt_mismatches"):
                    extra = f", {c['prompt_mismatches']} other prompts"
                line.append(_interval(c.get("diff"), signed=True) + (f" ({c['changed_prompts']}{extra})"
                                                                       if c and "diff" in c else extra)
                            if c else "-")
        lines.append(line)
    return acc.aligned(lines)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def lmeval_version(python: str) -> str:
    """The lm-eval version of the interpreter ``python``; exits with how to make one if it has none."""
    try:
        out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
                             capture_output=True, text=True, timeout=300)
        problem = None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["no output"])[-1]
    except OSError as e:
        problem = str(e)
    if problem is not None:
        raise SystemExit(f"--lmeval-python {python}: no lm-eval there ({problem}). Make one with\n"
                         "  python -m venv .venv-lmeval && .venv-lmeval/bin/pip install lm-eval==0.4.13 "
                         "wonderwords tenacity transformers")
    return out.stdout.strip()


def plan_lengths(lengths: Sequence[int], native: int, yarn: float | None) -> dict[str, tuple[list[int], int]]:
    """rope ("native" or "yarnF") -> (its lengths, the server's max-model-len): a length runs on
    the model as it is where it fits with :data:`LENGTH_MARGIN`, else on the YaRN copy; the
    max-model-len is the longest need in 256s, within the context. Raises ValueError where a
    length fits neither."""
    limits = {"native": native, **({f"yarn{yarn:g}": int(native * yarn)} if yarn else {})}
    groups: dict[str, list[int]] = {}
    for length in sorted(set(lengths)):
        need = length + LENGTH_MARGIN
        rope = next((r for r, limit in limits.items() if need <= limit), None)
        if rope is None:
            raise ValueError(f"length {length} needs a context of {need} tokens (RULER's prompt and answer "
                             f"+ {LENGTH_MARGIN} for the answer prefix and chat template); the model's is "
                             f"{native}" + (f", {max(limits.values())} with YaRN x{yarn:g}" if yarn else
                                             " (--yarn FACTOR serves longer)"))
        groups.setdefault(rope, []).append(length)
    return {rope: (ls, min(limits[rope], -(-(max(ls) + LENGTH_MARGIN) // 256) * 256)) for rope, ls in groups.items()}


def run_lmeval_jobs(jobs: list[tuple[str, list[str], pathlib.Path]], parallel: int, env: dict[str, str],
                    on_done: Callable[[str, int, float, pathlib.Path], None]) -> None:
    """Run the lm-eval commands ``(name, cmd, log file)``, ``parallel`` at a time, calling
    ``on_done(name, exit status, seconds, log file)`` as each ends (so that a run cut short keeps
    the tasks that finished). Those still running when this is left early (an exception, SIGTERM)
    are killed with their process group."""
    pending, running = list(jobs), {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name, cmd, log_path = pending.pop(0)
                with open(log_path, "wb") as f:
                    f.write(("$ " + shlex.join(cmd) + "\n").encode())
                    f.flush()
                    running[name] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                                      cwd=log_path.parent, stdin=subprocess.DEVNULL,
                                                      start_new_session=True), time.monotonic(), log_path)
            for name, (proc, t0, log_path) in list(running.items()):
                if proc.poll() is not None:
                    del running[name]
                    on_done(name, proc.returncode, time.monotonic() - t0, log_path)
            time.sleep(0.5)
    finally:
        for proc, _, _ in running.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def density_record(before: dict | None, after: dict | None, num_layers: int) -> dict[str, float | None]:
    """What the sparse server's statistics file counted between two reads (every prompt of one
    length, all tasks): computed / causal pairs of the rows that ran sparse (None: no row did, the
    library's gating kept them dense) and how many query tokens per layer ran sparse."""
    return {"density": acc.sparse_density(before, after),
            "sparse_tokens_per_layer": acc.stats_delta(after, before, "sparse_query_tokens") / num_layers}


def truncation_warnings(log_path: pathlib.Path) -> int:
    """Lines where lm-eval says it left-truncated prompts (max_length too small)."""
    try:
        return sum("left truncat" in line.lower() for line in log_path.read_text(errors="replace").splitlines())
    except OSError:
        return 0


def write_result(out_json: pathlib.Path, out_txt: pathlib.Path, meta: dict[str, Any],
                 samples: Sequence[SampleScore], labels: Sequence[str],
                 lmeval_scores: dict[tuple[str, str, int], float | None]) -> None:
    """``<out>.json`` (meta, the table's rows, lm-eval's own aggregates, every prompt) and
    ``<out>.txt`` (the table with the device, versions and commands), printed too."""
    rows = summarize(samples, labels, lmeval_scores)
    out_json.write_text(json.dumps({
        "meta": meta, "rows": rows,
        "lm_eval_scores": [{"variant": v, "task": t, "length": n, "score": s}
                           for (v, t, n), s in lmeval_scores.items()],
        "samples": [asdict(s) for s in samples]}, indent=1) + "\n")
    text = [f"# lm-eval {meta['lm_eval']} RULER on {meta['model']}, {meta['device']} ({meta['device_name']}), vLLM "
            f"{meta['vllm']}, torch {meta['torch']}, {meta['date']}: up to {meta['limit']} prompts per task and "
            f"length, {meta['generated_prompts']}"
            + (f", YaRN x{meta['yarn']:g} past the trained context" if meta.get("yarn") else "")
            + (", chat template" if meta.get("apply_chat_template") else ""),
            "# score = mean of RULER's per-prompt string match [95% t interval, cut to 0..1]; X - "
            f"{labels[0]} = paired difference on the same prompts [95% t interval] (prompts whose "
            "score changed)",
            format_table(rows, labels), "",
            acc.describe_variants(meta["variants"]),
            *([("sparse rows' computed density (query tokens per layer that ran sparse) per variant and "
                "length, all tasks: " + "; ".join(
                    f"{k} {acc.fmt(d['density'], '.3f')} ({d['sparse_tokens_per_layer']:.0f})"
                    for k, d in meta["density"].items()))] if meta.get("density") else []),
            *([f"note: {meta['merged']}"] if meta.get("merged") else []),
            *(f"$ {c}" for c in meta["commands"])]
    if meta.get("errors"):
        text.append("errors (see meta.errors in the JSON): " + ", ".join(meta["errors"]))
    out_txt.write_text("\n".join(text) + "\n")
    print("\n".join(text), flush=True)


# What must agree between result files for their prompts to be compared in one table.
MERGE_SAME = ("model", "limit", "yarn", "apply_chat_template", "kv_cache_dtype", "max_num_batched_tokens",
              "generated_prompts", "lm_eval", "vllm", "torch", "device_name")


def merge_results(paths: Sequence[pathlib.Path]) -> tuple[dict[str, Any], list[SampleScore], list[str],
                                                              dict[tuple[str, str, int], float | None]]:
    """One result out of several runs' files (e.g. one run per variant and length, side by side on
    one GPU with ``--shared-gpu``): their prompts, lm-eval aggregates, densities, errors and commands
    together. The files must agree on :data:`MERGE_SAME`, and no (variant, task, length) cell may
    come from two files. The variants keep the order in which the files name them, so the first
    file's first variant is the reference of the paired differences; ``max_model_len`` lists, per
    model copy, every server's limit."""
    meta: dict[str, Any] | None = None
    samples: list[SampleScore] = []
    lmeval_scores: dict[tuple[str, str, int], float | None] = {}
    owner: dict[tuple[str, str, int], pathlib.Path] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        m = data["meta"]
        m.setdefault("generated_prompts", GENERATED_ALL)  # files from before the launcher
        file_samples = [SampleScore(**s) for s in data["samples"]]
        for cell in {(s.variant, s.task, s.length) for s in file_samples}:
            if cell in owner:
                raise ValueError(f"{path}: {'/'.join(map(str, cell))} is in {owner[cell]} too")
            owner[cell] = path
        samples += file_samples
        lmeval_scores.update({(c["variant"], c["task"], c["length"]): c["score"] for c in data["lm_eval_scores"]})
        if meta is None:
            meta = {**m, "commands": list(m["commands"]), "merged_from": [pathlib.Path(path).name],
                    "max_model_len": {rope: [limit] for rope, limit in m["max_model_len"].items()}}
            continue
        for field in MERGE_SAME:
            if m.get(field) != meta.get(field):
                raise ValueError(f"{path} was run with {field} {m.get(field)!r}, {meta['merged_from'][0]} "
                                 f"with {meta.get(field)!r}")
        meta["merged_from"].append(pathlib.Path(path).name)
        meta["commands"] += m["commands"]
        meta["variants"] = {**meta["variants"], **m["variants"]}
        meta["tasks"] = list(dict.fromkeys(meta["tasks"] + m["tasks"]))
        meta["lengths"] = sorted(set(meta["lengths"]) | set(m["lengths"]))
        for rope, limit in m["max_model_len"].items():  # one server per run: every limit it had
            meta["max_model_len"][rope] = sorted(set(meta["max_model_len"].get(rope, [])) | {limit})
        meta["date"] = max(meta["date"], m["date"])
        for field in ("errors", "warnings", "density"):
            if m.get(field):
                meta[field] = {**meta.get(field, {}), **m[field]}
    if meta is None:
        raise ValueError("no files to merge")
    meta["merged"] = f"merged from {', '.join(meta['merged_from'])} (python -m benchmarks.ruler --merge)"
    return meta, samples, list(meta["variants"]), lmeval_scores


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the running server is stopped
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_variants_arguments(
        p, "presets or LABEL=FIELD=VALUE[,FIELD=VALUE...] as in benchmarks/accuracy.py; the first is the reference "
           "of the paired differences. Sparse servers keep the library's gating unless a variant sets "
           "min_sparse_query_len / max_density", REPO / "head_configs")
    p.add_argument("--tasks", nargs="+", default=OFFLINE_TASKS, help="lm-eval task names")
    p.add_argument("--lengths", nargs="+", type=int, default=[4096],
                   help="RULER lengths in tokens (lm-eval's max_seq_lengths), one lm-eval run each")
    p.add_argument("--limit", type=int, default=10, help="prompts per task and length")
    p.add_argument("--lmeval-python",
                   default=os.environ.get("LMEVAL_PYTHON", str(REPO / ".venv-lmeval" / "bin" / "python")),
                   help="interpreter with lm-eval (default $LMEVAL_PYTHON, else .venv-lmeval/bin/python)")
    p.add_argument("--parallel-tasks", type=int, default=None,
                   help="lm-eval processes at once against a server (default: every task on CUDA, where "
                        "building a task's prompts at 128K keeps one core busy; 1 on CPU)")
    p.add_argument("--all-samples", action="store_true",
                   help="run lm-eval as it is (python -m lm_eval), generating RULER's 500 prompts per task "
                        "and length, not through benchmarks/infra/lmeval_launcher.py generating --limit")
    p.add_argument("--num-concurrent", type=int, default=1, help="lm-eval's requests in flight per process")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="lm-eval renders each prompt with the model's chat template (the answer prefix "
                        "then starts the assistant's turn)")
    p.add_argument("--yarn", type=float, default=None, metavar="FACTOR",
                   help="lengths past the model's trained context run on a YaRN copy (factor over it)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill chunk (default: the whole prompt on CPU, 16384 on CUDA)")
    p.add_argument("--kv-cache-dtype", default=None, help="vLLM's --kv-cache-dtype for every server")
    p.add_argument("--shared-gpu", action="store_true",
                   help="CUDA: each server takes a fixed KV cache for two sequences instead of a share of the GPU's "
                        "memory, so that two runs (e.g. one per variant) can share one GPU")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=3600, help="lm-eval's timeout per request")
    p.add_argument("--out", help="output path without extension (default: benchmarks/results/"
                                 "ruler_<device>_<model>_<date>)")
    p.add_argument("--resume", action="store_true",
                   help="keep the (variant, task, length) cells already in <out>.json and run the rest")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="start nothing: write <out> from these result files (runs made side by side, e.g. one "
                        "per variant and length); the first file's first variant is the reference")
    args = p.parse_args(argv)
    if args.merge:
        if not args.out:
            p.error("--merge needs --out")
        try:
            meta, samples, labels, lmeval_scores = merge_results([pathlib.Path(f) for f in args.merge])
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--merge: {e}")
        write_result(*result_paths(args.out, args.out), meta, samples, labels, lmeval_scores)
        return 0

    model_dir, model_name, variants = model_and_variants(p, args)
    labels = [v.label for v in variants]
    cfg = acc.model_config(model_dir)
    try:
        groups = plan_lengths(args.lengths, cfg.get("max_position_embeddings") or max(args.lengths) + LENGTH_MARGIN,
                              args.yarn)
    except ValueError as e:
        p.error(str(e))
    version = lmeval_version(args.lmeval_python)
    cuda = cuda_available()
    device = "cuda" if cuda else "cpu"
    parallel = args.parallel_tasks or (len(args.tasks) if cuda else 1)
    date = datetime.date.today().isoformat()
    out_json, out_txt = result_paths(args.out, REPO / "benchmarks" / "results" /
                                     f"ruler_{device}_{short_model_name(args.model, model_name)}_{date}")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-sparse-ruler-"))

    meta: dict[str, Any] = {
        "model": model_name, "model_dir": str(model_dir), "device": device, **acc.serving_stack(cuda), "date": date,
        "lm_eval": version, "tasks": args.tasks, "lengths": sorted(set(args.lengths)), "limit": args.limit,
        "generated_prompts": GENERATED_ALL if args.all_samples else GENERATED_LIMIT,
        "yarn": args.yarn, "apply_chat_template": args.apply_chat_template,
        "max_model_len": {rope: m for rope, (_, m) in groups.items()},
        "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_dtype": args.kv_cache_dtype,
        "variants": {v.label: v.overrides for v in variants},
        "commands": ["python -m benchmarks.ruler " + shlex.join(sys.argv[1:] if argv is None else argv)]}
    samples: list[SampleScore] = []
    lmeval_scores: dict[tuple[str, str, int], float | None] = {}
    if args.resume and out_json.exists():
        old = json.loads(out_json.read_text())
        old["meta"].setdefault("generated_prompts", GENERATED_ALL)  # files from before the launcher
        acc.refuse_other_run(p, out_json, old["meta"], {f: meta[f] for f in (
            "model", "limit", "yarn", "apply_chat_template", "kv_cache_dtype", "max_num_batched_tokens",
            "generated_prompts")})
        samples = [SampleScore(**s) for s in old["samples"]]
        lmeval_scores = {(c["variant"], c["task"], c["length"]): c["score"] for c in old["lm_eval_scores"]}
        meta["commands"] = old["meta"]["commands"] + meta["commands"]
        for field in ("errors", "warnings", "density"):  # of the cells kept
            if old["meta"].get(field):
                meta[field] = old["meta"][field]
        # earlier variants stay in the table, first and in their order
        earlier = list(old["meta"]["variants"])
        labels = earlier + [label for label in labels if label not in earlier]
        meta["variants"] = {**old["meta"]["variants"], **meta["variants"]}
        meta["tasks"] = list(dict.fromkeys(old["meta"]["tasks"] + args.tasks))
        meta["lengths"] = sorted(set(old["meta"]["lengths"]) | set(args.lengths))
        meta["max_model_len"] = {**old["meta"]["max_model_len"], **meta["max_model_len"]}
        print(f"resuming {out_json}: {len(samples)} prompts of {', '.join(dict.fromkeys(s.variant for s in samples))}")
    done = {(s.variant, s.task, s.length) for s in samples}

    def save() -> None:
        write_result(out_json, out_txt, meta, samples, labels, lmeval_scores)

    def log(m: str) -> None:
        print(m, flush=True)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    model_dirs = {"native": model_dir}
    for v in variants:
        for rope, (lengths, max_model_len) in groups.items():
            todo = [(t, n) for n in lengths for t in args.tasks if (v.label, t, n) not in done]
            if not todo:
                continue
            if rope not in model_dirs:
                model_dirs[rope] = acc.yarn_model_dir(model_dir, args.yarn, workdir)
            t1 = time.monotonic()
            server = acc.launch(model_dirs[rope], v, workdir=workdir, max_model_len=max_model_len,
                                min_sparse_query_len=None, max_density=None, cuda=cuda, rope=rope,
                                max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
                                shared_gpu=args.shared_gpu)
            try:
                ready = wait_ready(server.handle, args.start_timeout)
                log(f"[{v.label}/{rope}] server ready in {ready:.0f} s ({server.handle.log_path}); "
                    f"max-model-len {max_model_len}")
                for length in lengths:
                    jobs = []
                    for task in [t for t, n in todo if n == length]:
                        folder = workdir / f"{v.label}-{task}-{length}".replace("/", "_")
                        folder.mkdir(parents=True, exist_ok=True)
                        cmd = lmeval_command(args.lmeval_python, task=task, length=length,
                                             base_url=f"{server.handle.url}/v1/completions",
                                             tokenizer=str(model_dir), max_length=max_model_len,
                                             limit=args.limit, output_path=folder / "out",
                                             num_concurrent=args.num_concurrent, timeout=args.request_timeout,
                                             chat_template=args.apply_chat_template,
                                             all_samples=args.all_samples)
                        jobs.append((task, cmd, folder / "lm-eval.log"))
                    log(f"[{v.label}/{rope}] {length} tokens: lm-eval on {len(jobs)} task(s), {parallel} at a time")
                    before = None if v.dense else acc.settled_stats(server.stats_path)

                    def collect(task: str, code: int, seconds: float, log_path: pathlib.Path) -> None:
                        key = f"{v.label}/{task}/{length}"
                        try:
                            if code != 0:
                                raise RuntimeError(f"lm-eval exited {code}; log {log_path}")
                            results_path, sample_paths = find_outputs(log_path.parent / "out")
                            scores = read_samples(sample_paths[task], variant=v.label, task=task, length=length)
                        except (RuntimeError, FileNotFoundError, KeyError, ValueError) as e:
                            meta.setdefault("errors", {})[key] = str(e)[:2000]
                            log(f"  {key} FAILED: {e}")
                            return
                        meta.get("errors", {}).pop(key, None)
                        samples.extend(scores)
                        aggregate = read_results(results_path, length).get(task, {})
                        lmeval_scores[v.label, task, length] = aggregate.get("score")
                        truncated = truncation_warnings(log_path)
                        if truncated:
                            meta.setdefault("warnings", {})[key] = \
                                f"lm-eval left-truncated prompts ({truncated} warnings)"
                        log(f"  {key}: {sum(s.score for s in scores) / max(1, len(scores)):.3f} over "
                            f"{len(scores)} prompts in {seconds:.0f} s ({log_path})")
                        save()

                    run_lmeval_jobs(jobs, parallel, env, collect)
                    if not v.dense:
                        meta.setdefault("density", {})[f"{v.label}/{length}"] = density_record(
                            before, acc.settled_stats(server.stats_path), cfg["num_hidden_layers"])
                    save()
                if not server.handle.alive():
                    raise ServerError(f"server exited with status {server.handle.proc.returncode}")
            except (ServerError, OSError) as e:
                acc.report_failure(server, log)
                meta.setdefault("errors", {})[f"{v.label}/{rope}"] = str(e)[:2000]
                log(f"[{v.label}/{rope}] FAILED: {e}")
            finally:
                server.handle.stop()
            log(f"[{v.label}/{rope}] done in {time.monotonic() - t1:.0f} s")
    save()
    print(f"wrote {out_json} and {out_txt} (server and lm-eval logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
