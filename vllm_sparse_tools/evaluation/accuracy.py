"""The same prompts through vLLM OpenAI servers, dense and sparse, scored side by side.

One server per variant (settings are read when the engine starts): the dense baseline runs
vLLM's own backend (``FLASH_ATTN`` on CUDA, the CPU backend on CPU), every other variant
``--attention-backend sparse-prefill`` with its ``VLLM_SPARSE_*`` overrides. Prompts are sent as
token ids to ``/v1/completions`` (greedy, streamed), one at a time, so that

* every server sees exactly the same tokens (the chat template was applied once, locally);
* the time to the first streamed token is the prompt's prefill time (plus one decode step);
* the worker's statistics file (``VLLM_SPARSE_STATS_FILE``), read before and after each prompt,
  gives that prompt's computed attention density and how many of its layer passes ran sparse.
  On CUDA the worker never waits for the GPU to write it (the counts follow a forward or two
  later, at the latest at the prompt's first decode step, which runs eagerly here), so the time
  to first token is the server's own; on CPU it rewrites the file after every sparse layer.

No prefix caching, so every prompt is a whole prefill. On CPU one chunk per prompt
(``--max-num-batched-tokens`` = ``--max-model-len``: the CPU backend runs chunks with cached
context dense); on CUDA chunked prefill as served (16384-token chunks by default).

Prompts longer than the model's trained context can run with YaRN rope scaling
(:func:`yarn_model_dir`): a copy of the model folder whose ``config.json`` asks for it, served
for those prompts only, so shorter prompts keep the model's own positions. On CUDA, the servers
of a run can be started all at once (``shared_gpu``: a fixed KV cache each) and measured one
after another: an idle server does not touch the GPU.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..demo import ServerError, ServerHandle, read_stats, start_server, wait_ready
from .host_kv import host_kv_server
from .rope import scaled_max_positions, yarn_parameters
from .tasks import Sample, score
from .triton_cache import compiled_since, describe, snapshot
from .variants import Variant

if TYPE_CHECKING:
    from .peers import Peer


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
    # computed share of all the prompt's causal (query, key) pairs, every layer and head: sparse
    # rows' computed pairs plus every pair of the rows that ran dense (1 for the dense baseline)
    density_all: float | None = None
    rope: str = "native"  # "native", or "yarnF": the YaRN copy of the model (factor F)


def model_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((pathlib.Path(model_dir) / "config.json").read_text())


def kv_cache_bytes(cfg: dict, max_model_len: int, dtype_bytes: int = 4) -> int:
    """KV-cache size for one sequence of ``max_model_len`` tokens, with headroom, rounded up
    to 64 MiB (vLLM refuses to start when it cannot hold one full sequence). fp32 on CPU, bf16
    (``dtype_bytes`` 2) for the fixed caches of servers sharing a GPU."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    need = int(per_token * max_model_len * 1.25) + (64 << 20)
    return -(-need // (64 << 20)) * (64 << 20)


def serving_dtype(cuda: bool) -> str:
    """The servers' ``--dtype``: bf16 on CUDA; fp32 on CPU, where without avx512_bf16 bf16
    compute is several times slower."""
    return "bfloat16" if cuda else "float32"


GPU_CHUNK = 16384  # tokens per prefill step on CUDA: the chunk size the backend is tuned for


def server_args(model_dir: str | os.PathLike, max_model_len: int, *, dense: bool, cuda: bool,
                served_name: str = "eval-model", max_num_batched_tokens: int | None = None,
                shared_gpu: bool = False, kv_cache_dtype: str | None = None, as_served: bool = False,
                max_num_seqs: int = 4, enforce_eager: bool = False, worker_cls: str | None = None) -> list[str]:
    """``vllm serve`` flags. ``max_num_batched_tokens`` None: the whole prompt in one step on
    CPU, :data:`GPU_CHUNK` on CUDA, and with ``as_served`` on CUDA vLLM's own chunk (what
    ``vllm serve`` picks for the GPU: 8192 on an H100 / H200). ``shared_gpu`` (CUDA): a fixed KV cache (one sequence of
    ``max_model_len`` with headroom; ``as_served``: ``max_num_seqs`` of them, at least two) instead
    of a share of the GPU's memory, so that several servers can start side by side.
    ``kv_cache_dtype``: vLLM's ``--kv-cache-dtype`` (e.g. ``fp8``) for every server, dense and
    sparse alike; None leaves vLLM's default (the model's dtype).
    ``as_served``: CUDA graphs and prefix caching as ``vllm serve`` has them by default, instead
    of eager mode and every prompt a whole prefill; ``enforce_eager`` then turns CUDA graphs off alone.
    ``worker_cls``: a peer's vLLM worker (:mod:`.peers`) on FLASH_ATTN, eager (as the peer asks)."""
    if worker_cls and not cuda:
        raise ValueError(f"worker {worker_cls}: a peer runs on CUDA only (FLASH_ATTN)")
    if dense or worker_cls:
        args = ["--attention-backend", "FLASH_ATTN"] if cuda else []
    else:
        args = ["--attention-backend", "sparse-prefill"]
    if worker_cls:
        args += ["--worker-cls", worker_cls]
    # A user's server takes vLLM's chunk, and the selection's answers depend on it (each chunk
    # estimates its own columns): a judge of the served answers must not choose another.
    if max_num_batched_tokens is None and not (as_served and cuda):
        max_num_batched_tokens = min(GPU_CHUNK, max_model_len) if cuda else max_model_len
    args += ["--served-model-name", served_name, "--dtype", serving_dtype(cuda),
             *([] if as_served else ["--enforce-eager", "--no-enable-prefix-caching"]),
             "--max-model-len", str(max_model_len),
             *([] if max_num_batched_tokens is None else ["--max-num-batched-tokens", str(max_num_batched_tokens)]),
             "--max-num-seqs", str(max_num_seqs), "--seed", "0"]
    if as_served and (enforce_eager or worker_cls):
        args.append("--enforce-eager")
    if kv_cache_dtype is not None:
        args += ["--kv-cache-dtype", kv_cache_dtype]
    if not cuda:
        args += ["--kv-cache-memory-bytes", str(kv_cache_bytes(model_config(model_dir), max_model_len))]
    elif shared_gpu:
        # vLLM's start-up check wants gpu_memory_utilization x total free; the KV cache is fixed.
        sequences = max(2, max_num_seqs) if as_served else 1
        args += ["--kv-cache-memory-bytes",
                 str(kv_cache_bytes(model_config(model_dir), sequences * max_model_len, 2)),
                 "--gpu-memory-utilization", "0.05"]
    return args


def yarn_model_dir(model_dir: str | os.PathLike, factor: float, workdir: str | os.PathLike) -> pathlib.Path:
    """A folder in ``workdir`` that serves ``model_dir`` with YaRN rope scaling: links to its
    files and a ``config.json`` asking for YaRN with ``factor`` over the model's trained context
    (``original_max_position_embeddings`` = its ``max_position_embeddings``), and the scaled
    ``max_position_embeddings`` (transformers' convention for YaRN; vLLM 0.26 derives the long
    context from the factor, vLLM 0.32 from this field). Both spellings of the scaling are
    written (transformers 5 ``rope_parameters``, 4.x ``rope_scaling``), with the same values."""
    src = pathlib.Path(model_dir).resolve()
    cfg = model_config(src)
    rope = yarn_parameters(cfg.get("rope_parameters"), cfg.get("rope_theta"), cfg["max_position_embeddings"], factor)
    cfg["rope_parameters"] = dict(rope)
    cfg["rope_scaling"] = {**rope, "type": "yarn"}
    cfg["max_position_embeddings"] = scaled_max_positions(rope, cfg["max_position_embeddings"])
    return linked_copy(src, pathlib.Path(workdir) / f"{src.name}-yarn{factor:g}", cfg)


def linked_copy(model_dir: str | os.PathLike, out: pathlib.Path, cfg: dict) -> pathlib.Path:
    """``out``: links to ``model_dir``'s files (the weights are not copied) and ``cfg`` as its
    ``config.json``."""
    out.mkdir(parents=True, exist_ok=True)
    for f in pathlib.Path(model_dir).resolve().iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def causal_pairs_all(cfg: dict, n_tokens: int) -> int:
    """(query, key) pairs x query heads x layers of dense causal attention over a prompt."""
    return cfg["num_hidden_layers"] * cfg["num_attention_heads"] * n_tokens * (n_tokens + 1) // 2


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


def stats_delta(after: dict | None, before: dict | None, key: str) -> int:
    """How much the stats file's counter ``key`` grew from ``before`` to ``after`` (either may be
    None: the worker had not written the file yet)."""
    return int((after or {}).get(key, 0)) - int((before or {}).get(key, 0))


def sparse_density(before: dict | None, after: dict | None) -> float | None:
    """Computed / causal attention pairs of the rows that ran sparse between two reads of the
    stats file (None: no row did)."""
    causal = stats_delta(after, before, "causal_pairs")
    return stats_delta(after, before, "computed_pairs") / causal if causal else None


def serving_stack(cuda: bool) -> dict[str, str]:
    """The device's name, the host and the vLLM and torch versions, for a result's record."""
    import platform

    import torch  # vLLM's dependency
    import vllm

    return {"device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
            "host": platform.node(), "vllm": vllm.__version__, "torch": torch.__version__}


def refuse_other_run(parser: argparse.ArgumentParser, path: pathlib.Path, old_meta: dict, now: dict) -> None:
    """``--resume``: the parser's usage error naming the first field of ``now`` that the run in
    ``path`` (its ``old_meta``) had another value of."""
    for field_name, value in now.items():
        if old_meta.get(field_name) != value:
            parser.error(f"{path} was run with {field_name} {old_meta.get(field_name)}, not {value}")


@dataclass
class Launched:
    """A server started for one variant on one model folder (native or YaRN)."""
    variant: Variant
    rope: str
    handle: ServerHandle
    stats_path: pathlib.Path
    cfg: dict
    max_model_len: int
    max_num_batched_tokens: int | None
    triton_cache: pathlib.Path | None = None  # the server's own TRITON_CACHE_DIR (see measure)


def launch(model_dir: str | os.PathLike, variant: Variant, *, workdir: str | os.PathLike, max_model_len: int,
           min_sparse_query_len: int | None, max_density: float | None = 1.0, cuda: bool = False,
           rope: str = "native", max_num_batched_tokens: int | None = None,
           shared_gpu: bool = False, own_triton_cache: bool = False, kv_cache_dtype: str | None = None,
           as_served: bool = False, max_num_seqs: int = 4, env: dict[str, str] | None = None,
           stats_write_interval_s: float = 0, enforce_eager: bool = False,
           prometheus_multiproc: bool = False, peer: Peer | None = None, unverified_host_kv: bool = False
           ) -> Launched:
    """Start (do not wait for) the server of ``variant`` on ``model_dir``.

    ``min_sparse_query_len`` / ``max_density``: the sparse servers' gating; None keeps the
    library's default (what ``vllm serve`` does). The accuracy runs used to force the sparse
    path on (1024, 1.0) so that a pattern's effect on answers shows; a run that reports time to
    first token next to the answers keeps the defaults. ``own_triton_cache``: the server gets an
    empty Triton cache of its own, so that :func:`measure` can name the kernels it compiled
    while serving (each server then compiles everything it runs). ``as_served`` and
    ``max_num_seqs``: see :func:`server_args`; ``env``: more variables for the server (e.g.
    ``CUDA_VISIBLE_DEVICES``). ``stats_write_interval_s``: 0 rewrites the sparse servers' stats
    file after every sparse layer, for :func:`measure`'s per-prompt reads; a client that reads
    only totals leaves the timed prefills that work with the library's interval.
    ``prometheus_multiproc``: the server gets its own ``PROMETHEUS_MULTIPROC_DIR`` (as the
    deployment docs set it), so that its metric writes cost what they cost in production.
    ``peer``: how a peer variant is served (:mod:`.peers`): its worker, its copy of the model
    folder, its PYTHONPATH. ``unverified_host_kv``: serve a kv_placement=host variant
    (:mod:`.host_kv`: its refusal lifted for this server, its blocks, eager); ValueError without."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    label = f"{variant.label}-{rope}".replace("/", "_")
    stats_path = workdir / f"{label}-stats.json"
    stats_path.unlink(missing_ok=True)
    server_tmp = workdir / f"{label}-tmp"  # vLLM leaves socket files in TMPDIR
    server_tmp.mkdir(exist_ok=True)
    # A long sparse prefill on CPU can take longer than vLLM's default limit on one model step
    # (300 s), after which the engine declares itself dead.
    env = {"TMPDIR": str(server_tmp),
           "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
                                                                 "7200"), **(env or {})}
    if prometheus_multiproc:
        prometheus_dir = workdir / f"{label}-prometheus"
        prometheus_dir.mkdir(exist_ok=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(prometheus_dir)
    triton_cache = None
    if own_triton_cache:
        triton_cache = workdir / f"{label}-triton-cache"
        triton_cache.mkdir(exist_ok=True)
        env["TRITON_CACHE_DIR"] = str(triton_cache)
    if variant.peer:
        if peer is None:
            raise ValueError(f"variant {variant.label!r} is a peer: it needs the peer's worker (--peer-worker-cls)")
        model_dir = peer.model_dir(model_dir, workdir)
        env.update(peer.env())
    if variant.ours:
        gating = {k: v for k, v in (("min_sparse_query_len", min_sparse_query_len),
                                    ("max_density", max_density)) if v is not None}
        env.update(variant.env(stats_file=str(stats_path), stats_write_interval_s=stats_write_interval_s,
                               **gating))
    args = server_args(model_dir, max_model_len, dense=not variant.ours, cuda=cuda,
                       max_num_batched_tokens=max_num_batched_tokens, shared_gpu=shared_gpu,
                       kv_cache_dtype=kv_cache_dtype, as_served=as_served, max_num_seqs=max_num_seqs,
                       enforce_eager=enforce_eager, worker_cls=peer.worker_cls if variant.peer else None)
    cfg = model_config(model_dir)
    host = host_kv_server(variant, cfg, workdir, cuda=cuda, dtype=serving_dtype(cuda), unverified=unverified_host_kv)
    if host:
        env.update(host.env())
        args = host.server_args(args)
    handle = start_server(model_dir, args, env, workdir / f"{label}.log")
    return Launched(variant, rope, handle, stats_path, cfg, max_model_len, max_num_batched_tokens, triton_cache)


def settled_stats(path: pathlib.Path, timeout: float = 10.0) -> dict | None:
    """The stats file once no counts are on their way (CUDA forwards write it without waiting
    for the GPU; ``pending_readouts`` says how many are still to come)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = read_stats(path)
        if not (stats or {}).get("pending_readouts") or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def measure(server: Launched, samples: Sequence[Sample], *, log: Callable[[str], None] = print,
            into: list[Result] | None = None, compiles: dict | None = None) -> list[Result]:
    """Run every sample through a ready server, one at a time (warm-up first). Results are
    appended to ``into`` (returned) as they come, so a caller keeps the prompts that finished
    when a later one fails. With the server's own Triton cache (``launch(own_triton_cache=True)``)
    the kernels compiled by the warm-up and by the measured prompts are logged and put in
    ``compiles`` ({"warm-up": [...], "prompts": [...]}, see :func:`.triton_cache.compiled_since`)."""
    handle, variant, cfg = server.handle, server.variant, server.cfg
    seen = None if server.triton_cache is None else snapshot(server.triton_cache)
    results = [] if into is None else into
    num_layers = cfg["num_hidden_layers"]
    model = handle.model()
    # Warm-up: the first long prompt pays one-time costs (allocations, first sparse call). Two
    # chunks when chunked, so that a chunk with cached context has run too.
    longest = max(samples, key=lambda s: s.n_tokens).prompt_ids
    chunk = server.max_num_batched_tokens or len(longest)
    warm = longest[: max(64, min(len(longest), 2 * chunk + 64, server.max_model_len - 16))]
    stream_completion(handle.host, handle.port, {"model": model, "prompt": list(warm), "max_tokens": 2,
                                                 "temperature": 0})
    if seen is not None:
        seen = _log_compiles(server, seen, "warm-up", log, compiles)
    before = settled_stats(server.stats_path)
    for s in samples:
        text, ttft, total, usage = stream_completion(handle.host, handle.port, {
            "model": model, "prompt": list(s.prompt_ids), "max_tokens": s.max_tokens,
            "temperature": 0})
        if usage.get("prompt_tokens") not in (None, s.n_tokens):
            raise ServerError(f"{s.key}: server counted {usage['prompt_tokens']} prompt "
                              f"tokens, sent {s.n_tokens}")
        after = settled_stats(server.stats_path)
        r = Result(variant.label, s.task, s.target_tokens, s.n_tokens, s.seed, s.depth,
                   list(s.expected), text, score(s, text), round(ttft, 3), round(total, 3), rope=server.rope)
        if variant.dense:
            r.density_all = 1.0
        else:
            causal = stats_delta(after, before, "causal_pairs")
            computed = stats_delta(after, before, "computed_pairs")
            r.density = computed / causal if causal else None
            r.sparse_share = stats_delta(after, before, "sparse_query_tokens") / (num_layers * s.n_tokens)
            total_pairs = causal_pairs_all(cfg, s.n_tokens)
            r.density_all = (total_pairs - causal + computed) / total_pairs
            pat_after = (after or {}).get("head_patterns", {})
            pat_before = (before or {}).get("head_patterns", {})
            r.head_patterns = {k: v - pat_before.get(k, 0) for k, v in pat_after.items()
                               if v - pat_before.get(k, 0)}
        results.append(r)
        before = after  # nothing runs between two prompts
        dens = "" if r.density_all is None or variant.dense else f" density {r.density_all:.3f}"
        log(f"[{variant.label}/{server.rope}] {s.key} ({s.n_tokens} tok, depth {s.depth}): score "
            f"{r.score:.2f}, ttft {ttft:.2f} s{dens}; {text.strip()[:80]!r}")
    if seen is not None:
        _log_compiles(server, seen, "prompts", log, compiles)
    return results


def _log_compiles(server: Launched, seen: set[str], stage: str, log: Callable[[str], None],
                  compiles: dict | None) -> set[str]:
    new = compiled_since(server.triton_cache, seen)
    log(f"[{server.variant.label}/{server.rope}] Triton kernels compiled by the {stage}: "
        + describe(new).replace("\n", "; "))
    if compiles is not None:
        compiles[stage] = compiles.get(stage, []) + new
    return snapshot(server.triton_cache)


def run_variant(model_dir: str | os.PathLike, variant: Variant, samples: Sequence[Sample], *,
                workdir: str | os.PathLike, max_model_len: int, min_sparse_query_len: int | None,
                max_density: float | None = 1.0, cuda: bool = False, start_timeout: float = 900,
                log: Callable[[str], None] = print, into: list[Result] | None = None,
                rope: str = "native", max_num_batched_tokens: int | None = None) -> list[Result]:
    """Start a server for ``variant``, run every sample through it (:func:`measure`), stop it."""
    server = launch(model_dir, variant, workdir=workdir, max_model_len=max_model_len,
                    min_sparse_query_len=min_sparse_query_len, max_density=max_density, cuda=cuda, rope=rope,
                    max_num_batched_tokens=max_num_batched_tokens)
    try:
        ready = wait_ready(server.handle, start_timeout)
        log(f"[{variant.label}/{rope}] server ready in {ready:.0f} s ({server.handle.log_path})")
        return measure(server, samples, log=log, into=into)
    except Exception:
        report_failure(server, log)
        raise
    finally:
        server.handle.stop()


def report_failure(server: Launched, log: Callable[[str], None]) -> None:
    first = server.handle.first_error()
    if first:
        log(f"[{server.variant.label}/{server.rope}] first error in {server.handle.log_path}:\n{first}")


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _cell(rs: Sequence[Result], base: dict[tuple, Result]) -> dict[str, Any]:
    """Mean score, densities and TTFT of ``rs``; ``speedup``: the baseline's mean TTFT over the
    same prompts divided by theirs; ``same_output``: share of prompts answered as the baseline."""
    paired = [(base[(r.task, r.target_tokens, r.seed)], r) for r in rs if (r.task, r.target_tokens, r.seed) in base]
    b_ttft, v_ttft = _mean([b.ttft_s for b, _ in paired]), _mean([r.ttft_s for _, r in paired])
    return {"n": len(rs), "accuracy": _mean([r.score for r in rs]),
            "density": _mean([r.density for r in rs]), "density_all": _mean([r.density_all for r in rs]),
            "ttft_s": _mean([r.ttft_s for r in rs]),
            "speedup": b_ttft / v_ttft if paired and v_ttft else None,
            "same_output": sum(b.output == r.output for b, r in paired) / len(paired) if paired else None}


def _baseline(results: Sequence[Result], variants: Sequence[str]) -> dict[tuple, Result]:
    return {(r.task, r.target_tokens, r.seed): r for r in results if variants and r.variant == variants[0]}


def summarize(results: Sequence[Result], variants: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (task, target length): per variant the mean score, densities, TTFT and its
    speedup over the first variant (normally dense) on the same prompts, and the share of
    prompts whose output equals the first variant's."""
    base = _baseline(results, variants)
    cells: dict[tuple, dict[str, list[Result]]] = {}
    for r in results:
        cells.setdefault((r.task, r.target_tokens), {}).setdefault(r.variant, []).append(r)
    rows = []
    for (task, n), by_variant in sorted(cells.items()):
        row: dict[str, Any] = {"task": task, "tokens": n}
        for v in variants:
            if by_variant.get(v):
                row[v] = _cell(by_variant[v], base)
        rows.append(row)
    return rows


def by_length(results: Sequence[Result], variants: Sequence[str]) -> list[dict[str, Any]]:
    """One row per target length, every task together (the README's per-model tables)."""
    base = _baseline(results, variants)
    rows = []
    for n in sorted({r.target_tokens for r in results}):
        row: dict[str, Any] = {"tokens": n}
        for v in variants:
            rs = [r for r in results if r.variant == v and r.target_tokens == n]
            if rs:
                row[v] = _cell(rs, base)
        rows.append(row)
    return rows


def overall(results: Sequence[Result], variants: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per variant, over the prompts that every listed variant ran (so that the means compare
    like with like): mean score, densities and TTFT."""
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
                      "density_all": _mean([r.density_all for r in rs]),
                      "ttft_s": _mean([r.ttft_s for r in rs])}
    return out


def fmt(x: float | None, spec: str) -> str:
    """A table cell: ``x`` in ``spec``, "-" for None."""
    return "-" if x is None else format(x, spec)


def aligned(lines: Sequence[Sequence[str]]) -> str:
    """Rows of cells as left-aligned columns two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def describe_variants(variants: dict[str, dict | None]) -> str:
    """A result's ``meta["variants"]`` in one line."""
    return "variants: " + "; ".join(f"{k} = {'vLLM dense' if v is None else (v or 'library defaults')}"
                                    for k, v in variants.items())


def _dens(c: dict) -> str:
    d = c.get("density_all") if c.get("density_all") is not None else c.get("density")
    return "1" if d is None or d >= 0.9995 else fmt(d, ".3f")


def format_table(rows: Sequence[dict], variants: Sequence[str]) -> str:
    """Plain-text table per task and length: per variant the score, the computed density of
    all the prompt's attention, the mean TTFT and its speedup over the first variant."""
    head = f"{'task':<18} {'tokens':>6} {'n':>2}"
    for v in variants:
        head += f" | {v[:26]:^26}"
    sub = f"{'':<18} {'':>6} {'':>2}" + "".join(f" | {'acc':>5} {'dens':>5} {'ttft':>7} {'spd':>5}"
                                                for _ in variants)
    lines = [head, sub, "-" * len(sub)]
    for row in rows:
        n = next((row[v]["n"] for v in variants if v in row), 0)
        line = f"{row['task']:<18} {row['tokens']:>6} {n:>2}"
        for v in variants:
            c = row.get(v)
            if c is None:
                line += f" | {'':>26}"
            else:
                spd = fmt(c.get("speedup"), ".2f") + "x" if c.get("speedup") is not None else "-"
                line += f" | {fmt(c['accuracy'], '.2f'):>5} {_dens(c):>5} {fmt(c['ttft_s'], '.2f') + 's':>7} {spd:>5}"
        lines.append(line)
    return "\n".join(lines)


def length_label(n: int) -> str:
    """16384 -> '16K', 32000 -> '32K', 130000 -> '130K'."""
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n / 1000:.0f}K"


def format_length_table(rows: Sequence[dict], variants: Sequence[str]) -> str:
    """Markdown: one line per variant, one column per length; each cell 'score (density,
    TTFT speedup)', the baseline's cells 'score (TTFT)'."""
    lengths = [r["tokens"] for r in rows]
    lines = ["| variant | " + " | ".join(length_label(n) for n in lengths) + " |",
             "|---" * (len(lengths) + 1) + "|"]
    for i, v in enumerate(variants):
        cells = []
        for r in rows:
            c = r.get(v)
            if c is None:
                cells.append("")
            elif i == 0:
                cells.append(f"{fmt(c['accuracy'], '.2f')} ({fmt(c['ttft_s'], '.2f')} s)")
            else:
                cells.append(f"{fmt(c['accuracy'], '.2f')} ({_dens(c)}, {fmt(c.get('speedup'), '.2f')}x)")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_json(results: Sequence[Result]) -> list[dict]:
    return [asdict(r) for r in results]
