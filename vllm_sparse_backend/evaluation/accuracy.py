"""The same prompts through vLLM OpenAI servers, dense and sparse, scored side by side.

One server per variant (settings are read when the engine starts): the dense baseline runs
vLLM's own backend (``FLASH_ATTN`` on CUDA, the CPU backend on CPU), every other variant
``--attention-backend sparse-prefill`` with its ``VLLM_SPARSE_*`` overrides. Prompts are sent as
token ids to ``/v1/completions`` (greedy, streamed), one at a time, so that

* every server sees exactly the same tokens (the chat template was applied once, locally);
* the time to the first streamed token is the prompt's prefill time (plus one decode step);
* the worker's statistics file (``VLLM_SPARSE_STATS_FILE``), read before and after each prompt,
  gives that prompt's computed attention density and how many of its layer passes ran sparse.
  Keeping that file exact costs the sparse servers a read-back of the counts (a GPU sync on
  CUDA) and a file rewrite per layer forward, so their time to first token is an upper bound on
  the prefill time; speed is measured by ``benchmarks/e2e.py``, without the file.

Server flags keep every prompt a single, uncached prefill (the CPU backend runs chunks with
cached context dense): ``--max-num-batched-tokens`` = ``--max-model-len`` and no prefix caching.
"""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from ..demo import ServerError, read_stats, start_server, wait_ready
from .tasks import Sample, score
from .variants import Variant

# The sparse path is forced on for prompts from this length (the library default, 4096, targets
# long prompts); CUDA rows denser than max_density would otherwise fall back to FlashAttention,
# which would hide the pattern's effect on accuracy.
SPARSE_BASE = {"max_density": 1.0}


@dataclass
class Result:
    variant: str
    task: str
    target_tokens: int
    n_tokens: int
    seed: int
    depth: float
    expected: list[str]
    output: str
    score: float
    ttft_s: float  # time to the first streamed token: prefill (+ one decode step)
    total_s: float
    density: float | None = None  # computed / causal (query, key) pairs of this prompt's sparse rows
    sparse_share: float | None = None  # share of the prompt's (token, layer) passes that ran sparse
    head_patterns: dict[str, int] = field(default_factory=dict)


def model_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((pathlib.Path(model_dir) / "config.json").read_text())


def kv_cache_bytes(cfg: dict, max_model_len: int, dtype_bytes: int = 4) -> int:
    """CPU KV-cache size for one sequence of ``max_model_len`` tokens, with headroom, rounded up
    to 64 MiB (vLLM's CPU backend refuses to start when it cannot hold one full sequence)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    need = int(per_token * max_model_len * 1.25) + (64 << 20)
    return -(-need // (64 << 20)) * (64 << 20)


def server_args(model_dir: str | os.PathLike, max_model_len: int, *, dense: bool, cuda: bool,
                served_name: str = "eval-model") -> list[str]:
    if dense:
        args = ["--attention-backend", "FLASH_ATTN"] if cuda else []
    else:
        args = ["--attention-backend", "sparse-prefill"]
    # fp32 on CPU: without avx512_bf16, bf16 compute is several times slower there.
    args += ["--served-model-name", served_name, "--dtype", "bfloat16" if cuda else "float32",
             "--enforce-eager", "--max-model-len", str(max_model_len),
             "--max-num-batched-tokens", str(max_model_len), "--no-enable-prefix-caching",
             "--max-num-seqs", "4", "--seed", "0"]
    if not cuda:
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes(model_config(model_dir), max_model_len))]
    return args


def stream_completion(host: str, port: int, body: dict, timeout: float = 7200
                      ) -> tuple[str, float, float, dict]:
    """POST a streamed /v1/completions; return (text, seconds to the first token, total
    seconds, usage)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True, "stream_options":
                                                           {"include_usage": True}}).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ServerError(f"/v1/completions: HTTP {resp.status}: {resp.read()[:1000]!r}")
        first, parts, usage = None, [], {}
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("error"):  # e.g. the engine died mid-request: the stream says so and ends
                raise ServerError(f"/v1/completions stream error: {json.dumps(obj)[:1000]}")
            if obj.get("choices"):
                if first is None:
                    first = time.perf_counter() - t0
                parts.append(obj["choices"][0].get("text") or "")
            if obj.get("usage"):
                usage = obj["usage"]
        total = time.perf_counter() - t0
    finally:
        conn.close()
    return "".join(parts), total if first is None else first, total, usage


def _delta(after: dict | None, before: dict | None, key: str) -> int:
    return int((after or {}).get(key, 0)) - int((before or {}).get(key, 0))


def run_variant(model_dir: str | os.PathLike, variant: Variant, samples: Sequence[Sample], *,
                workdir: str | os.PathLike, max_model_len: int, min_sparse_query_len: int,
                cuda: bool = False, start_timeout: float = 900,
                log: Callable[[str], None] = print, into: list[Result] | None = None
                ) -> list[Result]:
    """Start a server for ``variant``, run every sample through it (warm-up first), stop it.
    Results are appended to ``into`` (returned) as they come, so a caller keeps the prompts
    that finished when a later one fails."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    label = variant.label.replace("/", "_")
    stats_path = workdir / f"{label}-stats.json"
    server_tmp = workdir / f"{label}-tmp"  # vLLM leaves socket files in TMPDIR
    server_tmp.mkdir(exist_ok=True)
    # A long sparse prefill on CPU can take longer than vLLM's default limit on one model step
    # (300 s), after which the engine declares itself dead.
    env = {"TMPDIR": str(server_tmp),
           "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
                                                                 "7200")}
    if not variant.dense:
        env.update(variant.env(min_sparse_query_len=min_sparse_query_len,
                               stats_file=str(stats_path), **SPARSE_BASE))
    num_layers = model_config(model_dir)["num_hidden_layers"]
    handle = start_server(model_dir, server_args(model_dir, max_model_len, dense=variant.dense,
                                                 cuda=cuda), env, workdir / f"{label}.log")
    results = [] if into is None else into
    try:
        ready = wait_ready(handle, start_timeout)
        log(f"[{variant.label}] server ready in {ready:.0f} s ({handle.log_path})")
        model = handle.model()
        # Warm-up: the first long prompt pays one-time costs (allocations, first sparse call).
        warm = samples[0].prompt_ids[: max(64, min(len(samples[0].prompt_ids), min_sparse_query_len + 64))]
        stream_completion(handle.host, handle.port, {"model": model, "prompt": warm,
                                                     "max_tokens": 2, "temperature": 0})
        for s in samples:
            before = read_stats(stats_path)
            text, ttft, total, usage = stream_completion(handle.host, handle.port, {
                "model": model, "prompt": list(s.prompt_ids), "max_tokens": s.max_tokens,
                "temperature": 0})
            if usage.get("prompt_tokens") not in (None, s.n_tokens):
                raise ServerError(f"{s.key}: server counted {usage['prompt_tokens']} prompt "
                                  f"tokens, sent {s.n_tokens}")
            after = read_stats(stats_path)
            r = Result(variant.label, s.task, s.target_tokens, s.n_tokens, s.seed, s.depth,
                       list(s.expected), text, score(s, text), round(ttft, 3), round(total, 3))
            if not variant.dense:
                causal = _delta(after, before, "causal_pairs")
                r.density = _delta(after, before, "computed_pairs") / causal if causal else None
                r.sparse_share = _delta(after, before, "sparse_query_tokens") / (num_layers * s.n_tokens)
                pat_after = (after or {}).get("head_patterns", {})
                pat_before = (before or {}).get("head_patterns", {})
                r.head_patterns = {k: v - pat_before.get(k, 0) for k, v in pat_after.items()
                                   if v - pat_before.get(k, 0)}
            results.append(r)
            dens = "" if r.density is None else f" density {r.density:.3f}"
            log(f"[{variant.label}] {s.key} ({s.n_tokens} tok, depth {s.depth}): score "
                f"{r.score:.2f}, ttft {ttft:.1f} s{dens}; {text.strip()[:80]!r}")
    except Exception:
        first = handle.first_error()
        if first:
            log(f"[{variant.label}] first error in {handle.log_path}:\n{first}")
        raise
    finally:
        handle.stop()
    return results


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarize(results: Sequence[Result], variants: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (task, target length): per variant the mean score, density and TTFT, and the
    share of prompts whose output equals the first variant's (normally dense)."""
    cells: dict[tuple, dict[str, list[Result]]] = {}
    for r in results:
        cells.setdefault((r.task, r.target_tokens), {}).setdefault(r.variant, []).append(r)
    rows = []
    for (task, n), by_variant in sorted(cells.items()):
        row: dict[str, Any] = {"task": task, "tokens": n}
        base = {(r.seed, r.depth): r.output for r in by_variant.get(variants[0], [])}
        for v in variants:
            rs = by_variant.get(v, [])
            if not rs:
                continue
            same = [base.get((r.seed, r.depth)) == r.output for r in rs if (r.seed, r.depth) in base]
            row[v] = {"n": len(rs), "accuracy": _mean([r.score for r in rs]),
                      "density": _mean([r.density for r in rs]),
                      "ttft_s": _mean([r.ttft_s for r in rs]),
                      "same_output": sum(same) / len(same) if same else None}
        rows.append(row)
    return rows


def overall(results: Sequence[Result], variants: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per variant, over the prompts that every listed variant ran (so that the means compare
    like with like): mean score, density and TTFT."""
    def key(r: Result) -> tuple:
        return (r.task, r.target_tokens, r.seed)

    present = [v for v in variants if any(r.variant == v for r in results)]
    common = set.intersection(*[{key(r) for r in results if r.variant == v} for v in present]) \
        if present else set()
    out = {}
    for v in present:
        rs = [r for r in results if r.variant == v and key(r) in common]
        if rs:
            out[v] = {"n": len(rs), "accuracy": _mean([r.score for r in rs]),
                      "density": _mean([r.density for r in rs]),
                      "ttft_s": _mean([r.ttft_s for r in rs])}
    return out


def format_table(rows: Sequence[dict], variants: Sequence[str]) -> str:
    """Plain-text table: accuracy per variant, then density and prefill time (TTFT)."""
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = f"{'task':<18} {'tokens':>6} {'n':>2}"
    for v in variants:
        head += f" | {v[:20]:^20}"
    sub = f"{'':<18} {'':>6} {'':>2}" + "".join(f" | {'acc':>5} {'dens':>5} {'ttft':>8}" for _ in variants)
    lines = [head, sub, "-" * len(sub)]
    for row in rows:
        n = next((row[v]["n"] for v in variants if v in row), 0)
        line = f"{row['task']:<18} {row['tokens']:>6} {n:>2}"
        for v in variants:
            c = row.get(v)
            if c is None:
                line += f" | {'':>20}"
            else:
                dens = "1" if c["density"] is None else f(c["density"], ".3f")
                line += f" | {f(c['accuracy'], '.2f'):>5} {dens:>5} {f(c['ttft_s'], '.1f') + ' s':>8}"
        lines.append(line)
    return "\n".join(lines)


def results_json(results: Sequence[Result]) -> list[dict]:
    return [asdict(r) for r in results]
