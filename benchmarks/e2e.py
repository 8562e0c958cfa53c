"""End-to-end through vLLM's engine: FLASH_ATTN vs sparse-prefill variants, side by side.

Writes a dummy-weight model folder (Llama-3-8B shape, ``--layers`` of them, ``--load-format
dummy``), then runs each variant in its own subprocess (a fresh engine each):

* warm-up (``--warmup-len``, default 48K): one untimed prefill, so that no timed one includes the
  Triton kernels' JIT compilation;
* prefill: random token ids of each length, one ``generate`` with max_tokens=1 (prefill + first
  token = TTFT of a lone request), best of ``--repeats``;
* tokens: 8 greedy tokens per length, compared with the first variant's (a density-1 variant,
  ``dense``, must give FLASH_ATTN's tokens);
* decode (``--decode-batch B``): B requests of ``--decode-len`` tokens, generate 1 and then
  1 + ``--decode-tokens`` tokens (best of ``--repeats`` each); several ``--decode-len`` (with one
  ``--decode-batch`` each, or one for all) run one after the other in the same engine; tokens/s =
  B * decode_tokens / (difference in time), and the decode step time from vLLM's per-request
  token timestamps (mean inter-token time of the request whose first token came last);
* decode from the prefix cache (``--decode-cached``, prefix caching on): per context, the largest
  batch's prompts are prefilled once (untimed, one ``cache_salt``), then each batch decodes from
  those cached pages: its prefill is vLLM's recompute of the last token, so the timed ``generate``
  is the decode steps of B requests together (with the difference method above, the first
  requests of a large batch at a long context can finish decoding while the last one still
  prefills). tokens/s = B * decode_tokens / wall time; step time = the median request's mean
  inter-token time; vLLM's count of cached tokens shows the cache held (``cached``).
* mixed (``--mixed``): one long request (the largest length) with 7 short ones (1K) in one
  batch; time and whether the short requests' tokens equal the first variant's.
* prefix cache (``--prefix-cache``): vLLM's prefix caching on; every measurement above gets its own
  ``cache_salt`` (so none hits the cache), and per length (up to ``--tokens-max-len``) a prompt A
  is computed, then B = the first half of A + new tokens, 8 greedy tokens: B's rows run with half
  of their context read from cached blocks. Reports vLLM's count of cached tokens and whether the
  tokens equal the first variant's.
* ``--server``: the same prompts through the OpenAI-compatible HTTP server
  (``python -m vllm.entrypoints.cli.main serve``), streaming, time to the first token, and the 4
  greedy tokens of each length's first request compared with the first variant's (with
  ``--structure band`` the server runs with ``VLLM_SERVER_DEV_MODE=1``, which it needs to serve
  ``/collective_rpc``: a benchmark setting, never one for production).
* ``--profile-lengths N ...`` (with ``--profile-variants``): one more prefill of each such length
  under vLLM's torch profiler; the trace is reduced on the spot to GPU time per kernel category
  (GEMMs, FlashAttention, our sparse kernel, last-q scores, top-k/sort, conversion, the rest),
  GPU busy time (union of kernel intervals) vs the profiled span, and the largest kernels.

Structure (``--structure band``, the default): dummy weights make every
attention row nearly uniform, where no sparse pattern finds anything to skip (every row then falls
back to dense). ``band`` rewrites the dummy weights on the workers
(``benchmarks/infra/worker_extensions/planted_band.py``, a vLLM worker extension called by name:
``LLM.collective_rpc``, or the server's ``/collective_rpc``) so that
attention has the local band real long-context heads show: each layer's K projection is scaled per
rotary frequency (energy ∝ θ^-0.5, most of it in the slow dimensions), every query head's Q
projection is its KV head's K projection, the input norms are 1 and every token embedding is one
shared vector plus 17% token noise. Logits then depend mostly on distance: at 128K the top 6096
diagonals lie within ~9K of the main one and cover about half of a row's attention mass. The
same weights serve every variant. ``none`` keeps vLLM's dummy weights.

Real weights (``--model-dir DIR``, with ``--structure none``): the model folder is loaded as it
is (weights and config; prompts are random token ids, or with ``--prompt-text FILE`` consecutive
token ids of that text, tokenized once before any engine starts so that no timed request includes
tokenization; with ``--server`` too, whose server then loads the weights and gets the same token
ids), ``--yarn FACTOR`` serving
it through a YaRN copy of its config (``vllm_sparse_tools.evaluation.accuracy.yarn_model_dir``) for contexts
past its trained length.

Variants: ``LABEL=BACKEND[:VAR=VALUE,VAR=VALUE]``, e.g. ``vs=sparse-prefill`` or
``dense=sparse-prefill:VLLM_SPARSE_DEFAULT_PATTERN=dense,VLLM_SPARSE_MAX_DENSITY=1`` (density 1
through the sparse kernel: without ``MAX_DENSITY=1`` such rows run on FlashAttention). Prints a
table; asserts nothing.

``--kv-cache-dtype fp8``: every variant with vLLM's fp8 (e4m3) KV cache (FLASH_ATTN then runs
FA3's fp8 path; the sparse path reads the e4m3 cache with the layers' scales).

``--tensor-parallel-size N``: the engine (or the server) runs on N GPUs, each with 1/N of the
attention heads (``plant_band`` works on each rank's shard). Every run's environment keeps NVLink
multicast off (NCCL, PyTorch symmetric memory, NVSHMEM: :data:`MULTICAST_OFF`; a variant may not
change them) and vLLM's symmetric-memory all-reduce off: some shared GPU hosts must never create
multicast objects.

    python -m benchmarks.e2e --layers 4 --lengths 8192 32768 131072 --decode-batch 4
    python -m benchmarks.e2e --tensor-parallel-size 2 --lengths 131072 524288
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.infra import worker_extensions
from benchmarks.infra.worker_extensions.planted_band import WORKER_EXTENSION

# Modules vLLM's workers import by name (worker_extension_cls): the engines get this folder itself
# on PYTHONPATH (see run_env), not the repository root, so that nothing else of the checkout can
# shadow an installed package in them.
WORKER_EXTENSIONS = Path(worker_extensions.__file__).resolve().parent

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, rope_theta=500000.0)
DEFAULT_VARIANTS = ["FLASH_ATTN=FLASH_ATTN", "sparse=sparse-prefill",
                    "sparse-dense=sparse-prefill:VLLM_SPARSE_DEFAULT_PATTERN=dense,VLLM_SPARSE_MAX_DENSITY=1"]
# Set in every run's environment, whatever the caller's environment or a variant says: NVLink
# multicast stays off (NCCL's NVLS, PyTorch's symmetric memory, NVSHMEM), and vLLM's all-reduce on
# PyTorch symmetric memory is not used (NCCL and vLLM's custom all-reduce, CUDA IPC, remain).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                 "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def run_env(variant_env: dict[str, str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one variant's engine or server: ``base`` (default os.environ), the
    variant's variables, and :data:`MULTICAST_OFF` over both (a variant that sets one of those to
    another value is refused)."""
    clash = {k: v for k, v in variant_env.items() if k in MULTICAST_OFF and v != MULTICAST_OFF[k]}
    if clash:
        raise SystemExit(f"variant sets {clash}: these stay {MULTICAST_OFF} (NVLink multicast off)")
    base = os.environ if base is None else base
    path = os.pathsep.join(p for p in (str(WORKER_EXTENSIONS), base.get("PYTHONPATH", "")) if p)
    env = {**base, "PYTHONPATH": path, **variant_env, **MULTICAST_OFF}
    if env.get("VLLM_SPARSE_STATS_FILE"):  # read as soon as the run ends: every forward writes it
        env.setdefault("VLLM_SPARSE_STATS_WRITE_INTERVAL_S", "0")
    return env


def write_model(out: Path, layers: int, max_len: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
           "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
           **LLAMA3_8B}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


# Kernel-name patterns -> category of the profile breakdown (first match wins).
KERNEL_CATEGORIES = [
    ("sparse attention (ours)", r"_sparse_fwd_kernel"),
    ("decode-mode state (ours)", r"_update_summaries_kernel|_update_span_keys_kernel|_local_map_kernel|_nms_kernel"
                                 r"|_divide_kernel|_index_tokens_kernel|_span_scores_kernel|_build_summaries_kernel"),
    ("decode-mode attention (ours)", r"_page_scores_kernel|_token_scores_kernel|_topk_decode_kernel"
                                     r"|_combine_splits_kernel"),
    ("last-q scores (ours)", r"_lastq_|_merge_row_stats|_skew_colsum"),
    ("vs conversion (ours)", r"_vs_convert_kernel"),
    ("top-k select (ours)", r"_hist_kernel|_compact_kernel"),
    ("top-k / sort (torch)", r"(?i)topk|sort|radix|bitonic|scan"),
    ("FlashAttention", r"(?i)flash|fmha|flash_fwd"),
    ("GEMM", r"(?i)gemm|nvjet|cutlass|xmma|sm90_|sm80_|ampere_|cublas"),
]


def kernel_breakdown(trace_paths: list[Path], top: int = 24) -> dict:
    """GPU time of a torch-profiler trace (chrome JSON, possibly gzipped), by kernel category."""
    import gzip
    import re

    events, runtime = [], []
    for path in trace_paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            data = json.load(f)
        xs = [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]
        events += [e for e in xs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        runtime += [e for e in xs if e.get("cat") == "cuda_runtime"]
    if not events:
        return {"error": f"no kernel events in {[str(p) for p in trace_paths]}"}
    cats: dict[str, float] = {}
    names: dict[str, list] = {}
    intervals = []
    for e in events:
        name, dur = e.get("name", "?"), float(e.get("dur", 0.0))
        intervals.append((float(e["ts"]), float(e["ts"]) + dur))
        cat = next((c for c, pat in KERNEL_CATEGORIES if re.search(pat, name)), "other")
        cats[cat] = cats.get(cat, 0.0) + dur
        rec = names.setdefault(name[:90], [0.0, 0])
        rec[0] += dur
        rec[1] += 1
    events.sort(key=lambda e: float(e["ts"]))
    busy, end, last = 0.0, float("-inf"), "?"
    gaps = []  # idle stretches of the GPU: (us, kernel before, kernel after)
    for e in events:
        a, b = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if a > end > float("-inf"):
            gaps.append((a - end, last, e.get("name", "?")[:60]))
        if b > end:
            busy += b - max(a, end)
            end, last = b, e.get("name", "?")[:60]
    span = end - float(events[0]["ts"])
    biggest = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
    # where the idle time sits: gaps by size, the largest with their neighbours, and the host
    # calls that wait for the GPU (a sync inside a step leaves the GPU idle while the host relaunches)
    sizes = {"<20us": 0.0, "20-200us": 0.0, "0.2-2ms": 0.0, ">2ms": 0.0}
    for us, _, _ in gaps:
        key = "<20us" if us < 20 else "20-200us" if us < 200 else "0.2-2ms" if us < 2000 else ">2ms"
        sizes[key] += us / 1e6
    syncs: dict[str, list] = {}
    for e in runtime:
        n = e.get("name", "?")
        if re.search(r"(?i)synchronize|memcpy", n):
            rec = syncs.setdefault(n, [0, 0.0])
            rec[0] += 1
            rec[1] += float(e.get("dur", 0.0)) / 1e6
    return {"span_s": span / 1e6, "busy_s": busy / 1e6, "kernels": len(events),
            "categories_s": {k: v / 1e6 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top": [{"name": k, "s": v[0] / 1e6, "calls": v[1]} for k, v in biggest],
            "idle_by_gap_s": sizes,
            "largest_gaps": [{"us": round(us, 1), "after": a, "before": b} for us, a, b in sorted(gaps)[::-1][:12]],
            "host_waits": {k: {"calls": v[0], "s": round(v[1], 4)} for k, v in syncs.items()}}


def prompt_ids_of(n: int, seed: int, text_ids: list[int] | None = None) -> list[int]:
    """n token ids: random ones, or (``--prompt-text``) n consecutive ids of the tokenized text
    from an offset the seed picks, wrapping around, so that each length reads other text."""
    if text_ids:
        start = (seed * 7919) % len(text_ids)
        return [text_ids[(start + i) % len(text_ids)] for i in range(n)]
    rng = random.Random(seed)
    return [rng.randrange(10, 100000) for _ in range(n)]


def tokenize_text(model_dir: str, text_path: str, out_dir: str) -> str:
    """The text's token ids under the model's tokenizer, as a JSON file for the workers (which run
    without a tokenizer, so no timed request includes tokenization)."""
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(model_dir).encode(Path(text_path).read_text(), add_special_tokens=False)
    out = Path(out_dir) / "prompt-text-ids.json"
    out.write_text(json.dumps(ids))
    return str(out)


def prompt_text_ids(args) -> list[int] | None:
    """The ``--prompt-text`` token ids :func:`tokenize_text` wrote, or None (random prompts)."""
    return json.loads(Path(args.prompt_ids_file).read_text()) if args.prompt_ids_file else None


def emit(kind: str, **rec) -> None:
    print("RESULT " + json.dumps({"kind": kind, **rec}), flush=True)


def worker(args) -> None:
    """One variant, one engine: one JSON line per measurement."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    profile_dir = Path(tempfile.mkdtemp(prefix=f"e2e-profile-{args.label}-")) if args.profile_lengths else None
    extra = {} if profile_dir is None else {"profiler_config": {
        "profiler": "torch", "torch_profiler_dir": str(profile_dir), "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": False, "torch_profiler_dump_cuda_time_total": False}}
    llm = LLM(model=args.model, load_format="auto" if args.real_weights else "dummy", skip_tokenizer_init=True,
              dtype="bfloat16",
              attention_backend=args.backend, max_model_len=args.max_len, enforce_eager=not args.cudagraphs,
              tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
              max_num_batched_tokens=args.chunk, enable_prefix_caching=args.prefix_cache or args.decode_cached,
              gpu_memory_utilization=0.85,
              worker_extension_cls=WORKER_EXTENSION if args.structure == "band" else "",
              seed=0, max_num_seqs=max([8] + args.decode_batch),
              disable_log_stats=False, **extra)  # per-request token timestamps (decode step time)
    emit("startup", seconds=time.perf_counter() - t0)
    if args.structure == "band":
        emit("structure", workers=llm.collective_rpc("plant_band"))
    greedy = lambda n, **kw: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)  # noqa: E731
    text_ids = prompt_text_ids(args)
    prompt_ids = functools.partial(prompt_ids_of, text_ids=text_ids)

    salts = itertools.count()

    def timed(prompts, params):
        if args.prefix_cache or args.decode_cached:  # a fresh salt per call: these never hit the cache
            salt = f"e2e-{next(salts)}"
            prompts = [{**p, "cache_salt": salt} for p in prompts]
        t = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, out

    if args.warmup_len:
        # untimed: the first sparse forward JIT-compiles the Triton kernels (seconds, once per
        # process with a cold cache), which a single timed prefill would otherwise include
        t = timed([{"prompt_token_ids": prompt_ids(args.warmup_len, 7)}], greedy(1))[0]
        emit("warmup", n=args.warmup_len, seconds=t)
    for n in args.lengths:
        prompt = {"prompt_token_ids": prompt_ids(n, n)}
        best = min(timed([prompt], greedy(1))[0] for _ in range(args.repeats if n <= args.tokens_max_len else 1))
        tokens = None
        if n <= args.tokens_max_len:
            tokens = list(timed([prompt], greedy(8))[1][0].outputs[0].token_ids)
        emit("prefill", n=n, seconds=best, tokens=tokens)
    for n in args.profile_lengths:
        before = set(profile_dir.rglob("*.json*"))
        llm.start_profile()
        t = timed([{"prompt_token_ids": prompt_ids(n, n)}], greedy(1))[0]
        llm.stop_profile()
        deadline = time.time() + 120  # the worker writes the trace after stop_profile returns
        new = []
        while time.time() < deadline:
            new = [p for p in profile_dir.rglob("*.json*") if p not in before]
            new = [p for p in new if "worker" in p.name.lower()] or new
            if new and all(p.stat().st_size > 0 for p in new):
                time.sleep(2)
                break
            time.sleep(1)
        emit("profile", n=n, seconds=t, files=[p.name for p in new], **kernel_breakdown(new))
    if args.decode_cached:
        for context, batches in cached_decode_groups(decode_specs(args)):
            salt = f"decode-{context}"  # one salt for the priming and the timed runs: those hit the cache
            prompts = [{"prompt_token_ids": prompt_ids(context, 1000 + i), "cache_salt": salt}
                       for i in range(max(batches))]
            t = time.perf_counter()
            llm.generate(prompts, greedy(1), use_tqdm=False)
            emit("decode_prime", context=context, requests=len(prompts), seconds=time.perf_counter() - t)
            for batch in batches:
                runs = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    out = llm.generate(prompts[:batch], greedy(1 + args.decode_tokens), use_tqdm=False)
                    runs.append((time.perf_counter() - t, out))
                wall, out = min(runs, key=lambda r: r[0])
                steps = sorted((o.metrics.last_token_ts - o.metrics.first_token_ts) / args.decode_tokens
                               for o in out if o.metrics is not None and o.metrics.last_token_ts > 0)
                emit("decode", batch=batch, context=context, steps=args.decode_tokens, total_s=wall,
                     tokens_per_s=batch * args.decode_tokens / wall,
                     step_ms=1000 * steps[len(steps) // 2] if steps else None,
                     cached=sum(o.num_cached_tokens or 0 for o in out) / (batch * context),
                     tokens=[list(o.outputs[0].token_ids) for o in out])
    for batch, context in [] if args.decode_cached else decode_specs(args):
        prompts = [{"prompt_token_ids": prompt_ids(context, 1000 + i)} for i in range(batch)]
        # decode time = (prefill + 1 + N tokens) - (prefill + 1 token); both vary with the prefill, so
        # each is the best of --repeats (one run each gave +-20% on an H100)
        t1 = min(timed(prompts, greedy(1))[0] for _ in range(args.repeats))
        runs = [timed(prompts, greedy(1 + args.decode_tokens)) for _ in range(args.repeats)]
        t2, out = min(runs, key=lambda r: r[0])
        # The request that got its first token last decodes only in decode-only steps (the others'
        # prefills are done): its mean inter-token time is the decode step time, free of prefill noise.
        ms = [o.metrics for o in out]
        step_ms = None
        if all(m is not None and m.last_token_ts > m.first_token_ts > 0 for m in ms):
            last = max(ms, key=lambda m: m.first_token_ts)
            step_ms = 1000 * (last.last_token_ts - last.first_token_ts) / args.decode_tokens
        emit("decode", batch=batch, context=context, steps=args.decode_tokens,
             prefill_s=t1, total_s=t2, tokens_per_s=batch * args.decode_tokens / max(t2 - t1, 1e-9),
             step_ms=step_ms, tokens=[list(o.outputs[0].token_ids) for o in out])
    if args.mixed:
        long_n = max(args.lengths)
        prompts = [{"prompt_token_ids": prompt_ids(long_n, long_n)}] + \
                  [{"prompt_token_ids": prompt_ids(1024, 2000 + i)} for i in range(7)]
        t, out = timed(prompts, greedy(8))
        emit("mixed", long=long_n, short=7, seconds=t, tokens=[list(o.outputs[0].token_ids) for o in out])
    if args.prefix_cache:
        for n in (n for n in args.lengths if n <= args.tokens_max_len):
            # one salt for A and B: B's first half is a hit on A's blocks
            a = {"prompt_token_ids": prompt_ids(n, 50000 + n), "cache_salt": f"prefix-{n}"}
            b = {"prompt_token_ids": a["prompt_token_ids"][:n // 2] + prompt_ids(n - n // 2, 60000 + n),
                 "cache_salt": f"prefix-{n}"}
            llm.generate([a], greedy(1), use_tqdm=False)
            t = time.perf_counter()
            out = llm.generate([b], greedy(8), use_tqdm=False)[0]
            emit("prefix", n=n, seconds=time.perf_counter() - t, cached=out.num_cached_tokens,
                 tokens=list(out.outputs[0].token_ids))
    stats_file = os.environ.get("VLLM_SPARSE_STATS_FILE")
    if stats_file and os.path.exists(stats_file):  # written by the engine process
        emit("stats", **json.loads(Path(stats_file).read_text()))


def server_command(args, port: int) -> list[str]:
    """``vllm serve`` for one variant: token-id prompts only (no tokenizer, so no request's time
    includes tokenization), the model's weights with ``--model-dir``, else dummy ones."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
            "--load-format", "auto" if args.model_dir else "dummy",
            "--skip-tokenizer-init", "--dtype", "bfloat16", "--attention-backend", args.backend,
            "--max-model-len", str(args.max_len), "--max-num-batched-tokens", str(args.chunk),
            "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.85", "--port", str(port),
            "--tensor-parallel-size", str(args.tensor_parallel_size), "--kv-cache-dtype", args.kv_cache_dtype] + \
        ([] if args.cudagraphs else ["--enforce-eager"])


def server_worker(args, env) -> list[dict]:
    """Start the HTTP server for one variant, plant the band if asked, stream each prompt: time to
    the first token, and the greedy tokens of the length's first request."""
    import urllib.request

    port = 8000 + random.randrange(1000)
    cmd = server_command(args, port)
    text_ids = prompt_text_ids(args)
    if args.structure == "band":
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
        env = {**env, "VLLM_SERVER_DEV_MODE": "1"}  # serves /collective_rpc
    log = open(Path(args.log_dir) / f"server-{args.label}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def post(path: str, body: dict, timeout: float):
        req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=timeout)

    recs = []
    try:
        t0 = time.perf_counter()
        deadline = time.time() + 400
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"server did not start (exit {proc.poll()})") from None
                time.sleep(2)
        recs.append({"kind": "startup", "seconds": time.perf_counter() - t0})
        if args.structure == "band":
            with post("/collective_rpc", {"method": "plant_band"}, 120) as resp:
                recs.append({"kind": "structure", "workers": json.loads(resp.read())["results"]})
        for n in args.lengths:
            best = first = tokens = None
            for _ in range(args.repeats):
                body = {"model": args.model, "prompt": prompt_ids_of(n, n, text_ids), "max_tokens": 4, "temperature": 0,
                        "stream": True, "ignore_eos": True, "return_token_ids": True}
                got: list[int] = []
                t = time.perf_counter()
                ttft = None
                with post("/v1/completions", body, 900) as resp:
                    for line in resp:
                        if not line.startswith(b"data: {"):
                            continue
                        if ttft is None:
                            ttft = time.perf_counter() - t
                        for choice in json.loads(line[6:]).get("choices", []):
                            got += choice.get("token_ids") or []
                best = ttft if best is None else min(best, ttft)
                if first is None:
                    first, tokens = ttft, got
            # first: the first request of this length (includes any one-time work, e.g. a JIT compile)
            recs.append({"kind": "server", "n": n, "seconds": best, "first_seconds": first, "tokens": tokens})
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return recs


def decode_specs(args) -> list[tuple[int, int]]:
    """(requests, context) of each decode measurement; none when the batch is 0."""
    batches, lens = args.decode_batch, args.decode_len
    if len(batches) == 1:
        batches = batches * len(lens)
    if len(batches) != len(lens):
        raise SystemExit(f"--decode-batch takes one value or one per --decode-len ({len(lens)}), got {len(batches)}")
    return [(b, n) for b, n in zip(batches, lens) if b > 0]


def cached_decode_groups(specs: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """(context, batches) in first-seen order: --decode-cached primes each context once, for its
    largest batch, and measures every batch of that context from those cached prompts."""
    groups: dict[int, list[int]] = {}
    for batch, context in specs:
        groups.setdefault(context, []).append(batch)
    return list(groups.items())


def parse_variant(spec: str) -> tuple[str, str, dict[str, str]]:
    label, _, rest = spec.partition("=")
    backend, _, env = rest.partition(":")
    return label, backend, dict(kv.split("=", 1) for kv in env.split(",") if kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="LABEL=BACKEND[:VAR=VALUE,...]")
    ap.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=2, help="timed prefills per length (one above --tokens-max-len)")
    ap.add_argument("--tokens-max-len", type=int, default=65536,
                    help="compare 8 greedy tokens up to this length (one more prefill each)")
    ap.add_argument("--structure", choices=["band", "none"], default="band", help="see the module doc")
    ap.add_argument("--warmup-len", type=int, default=49152,
                    help="untimed prefill first (3 chunks: sparse at the default budgets); 0 = none")
    ap.add_argument("--decode-batch", type=int, nargs="+", default=[0],
                    help="requests per decode measurement: one for every --decode-len, or one each")
    ap.add_argument("--decode-len", type=int, nargs="+", default=[32768], help="context of each decode measurement")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-cached", action="store_true",
                    help="decode measured from the prefix cache (see the module doc); turns prefix caching on")
    ap.add_argument("--model-dir", default=None,
                    help="a real model folder instead of the dummy Llama-3-8B shape (needs --structure none)")
    ap.add_argument("--yarn", type=float, default=None, help="with --model-dir: serve a YaRN copy (rope factor)")
    ap.add_argument("--prompt-text", default=None,
                    help="with --model-dir: prompts are token ids of this text (tokenized once, before any "
                         "engine starts) instead of random ids")
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="prefix caching on, with a prompt whose first half is cached (see the module doc)")
    ap.add_argument("--server", action="store_true", help="measure TTFT through the HTTP server instead")
    ap.add_argument("--cudagraphs", action="store_true", help="default CUDA-graph mode instead of --enforce-eager")
    ap.add_argument("--profile-lengths", type=int, nargs="*", default=[],
                    help="one more prefill of each under the torch profiler: GPU time by kernel category")
    ap.add_argument("--profile-variants", nargs="*", default=None,
                    help="labels of the variants to profile (default: all)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="engine max_model_len (default: the longest prompt + 128)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="GPUs per engine (vLLM's tensor parallelism; NVLink multicast stays off)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="vLLM's --kv-cache-dtype for every variant (fp8: e4m3 with per-layer scales)")
    ap.add_argument("--log-dir", default=os.environ.get("OUT", "."), help="full stderr of each run goes here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--label", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--real-weights", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    if args.server and args.prefix_cache:
        raise SystemExit("--prefix-cache measures through the offline engine; it does not combine with --server")
    specs = decode_specs(args)  # checks the two lists fit together
    args.max_len = max(args.max_model_len, max([max(args.lengths)] + [n for _, n in specs]) + 128)
    if args.model_dir:
        if args.structure != "none":
            raise SystemExit("--model-dir takes --structure none (its weights are the model's)")
        args.model = args.model_dir
        if args.yarn:
            from vllm_sparse_tools.evaluation.accuracy import yarn_model_dir
            args.model = str(yarn_model_dir(args.model_dir, args.yarn, tempfile.mkdtemp(prefix="e2e-yarn-")))
        if args.prompt_text:
            args.prompt_ids_file = tokenize_text(args.model_dir, args.prompt_text, tempfile.mkdtemp(prefix="e2e-text-"))
    elif args.prompt_text:
        raise SystemExit("--prompt-text needs --model-dir (a tokenizer for the text)")
    else:
        args.model = str(write_model(Path(tempfile.mkdtemp(prefix="e2e-model-")), args.layers, args.max_len))
    variants = [parse_variant(v) for v in args.variants]
    envs = {label: run_env(venv) for label, _, venv in variants}  # a refused variant stops before any run
    results: dict[str, list[dict]] = {}
    for label, backend, _ in variants:
        env = envs[label]
        t0 = time.perf_counter()
        if args.server:
            args.backend, args.label = backend, label
            try:
                results[label] = server_worker(args, env)
            except Exception as e:
                print(f"[{label}] server run failed: {e}; log in {args.log_dir}/server-{label}.log")
                results[label] = []
            print(f"[{label}] {time.perf_counter() - t0:.0f} s", flush=True)
            (Path(args.log_dir) / "e2e-results.json").write_text(json.dumps(results, indent=1))
            continue
        # this module again, from the same working directory (the repository root)
        cmd = [sys.executable, "-m", "benchmarks.e2e", "--worker", "--backend", backend, "--label", label,
               "--model", args.model,
               "--max-len", str(args.max_len), "--chunk", str(args.chunk), "--repeats", str(args.repeats),
               "--tensor-parallel-size", str(args.tensor_parallel_size), "--kv-cache-dtype", args.kv_cache_dtype,
               "--decode-batch", *map(str, args.decode_batch), "--decode-len", *map(str, args.decode_len),
               "--decode-tokens", str(args.decode_tokens), "--tokens-max-len", str(args.tokens_max_len),
               "--structure", args.structure, "--warmup-len", str(min(args.warmup_len, args.max_len - 16)),
               "--lengths", *map(str, args.lengths)] + \
              (["--profile-lengths", *map(str, args.profile_lengths)]
               if args.profile_variants is None or label in args.profile_variants else []) + \
              (["--mixed"] if args.mixed else []) + (["--cudagraphs"] if args.cudagraphs else []) + \
              (["--prefix-cache"] if args.prefix_cache else []) + \
              (["--decode-cached"] if args.decode_cached else []) + (["--real-weights"] if args.model_dir else []) + \
              (["--prompt-ids-file", args.prompt_ids_file] if args.prompt_ids_file else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log = Path(args.log_dir) / f"e2e-{label}.stderr.log"
        log.write_text(proc.stderr)
        log.with_name(f"e2e-{label}.stdout.log").write_text(proc.stdout)  # vLLM logs to stdout
        results[label] = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        print(f"[{label}] exit {proc.returncode}, {time.perf_counter() - t0:.0f} s", flush=True)
        (Path(args.log_dir) / "e2e-results.json").write_text(json.dumps(results, indent=1))
        if proc.returncode != 0:
            # The root cause is the first traceback (often the engine core's), not the tail.
            lines = proc.stderr.splitlines()
            first = next((i for i, line in enumerate(lines) if "Traceback" in line), max(0, len(lines) - 40))
            print(f"[{label}] full stderr in {log}; first traceback:\n" + "\n".join(lines[first:first + 60]))
        sparse_lines = [line for line in (proc.stderr + proc.stdout).splitlines()
                        if "sparse-prefill" in line or "KV cache size" in line or "Available KV cache memory" in line]
        for line in sparse_lines[:6]:
            print(f"[{label}] {line[-220:]}")

    import torch
    import vllm
    model = (f"{Path(args.model_dir).name} (real weights{f', YaRN x{args.yarn:g}' if args.yarn else ''})"
             if args.model_dir else f"dummy Llama-3-8B shape, {args.layers} layers")
    print(f"\n{torch.cuda.get_device_name()}, vllm {vllm.__version__}, torch {torch.__version__}; {model}, "
          f"bf16, KV cache {args.kv_cache_dtype}, tensor parallel "
          f"{args.tensor_parallel_size}, "
          f"{'CUDA graphs' if args.cudagraphs else 'eager'}, chunk {args.chunk}, "
          f"prefix caching {'on' if args.prefix_cache or args.decode_cached else 'off'}, structure {args.structure}, "
          f"prompts {'token ids of ' + Path(args.prompt_text).name if args.prompt_text else 'random token ids'}; "
          f"variants: {args.variants}")
    labels = [v[0] for v in variants]
    base = labels[0]

    def get(label, kind, **match):
        for r in results.get(label, []):
            if r["kind"] == kind and all(r.get(k) == v for k, v in match.items()):
                return r
        return None

    kind = "server" if args.server else "prefill"
    print(f"\n{'TTFT through the HTTP server' if args.server else 'prefill + first token (offline LLM)'}, seconds")
    header = ["n"] + labels + [f"{l} speedup" for l in labels[1:]] + [f"{l} tokens equal" for l in labels[1:]]
    print("| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for n in args.lengths:
        rs = [get(label, kind, n=n) for label in labels]
        cells = [str(n)] + ["-" if r is None else f"{r['seconds']:.3f}" for r in rs]
        cells += ["-" if not (rs[0] and r) else f"{rs[0]['seconds'] / r['seconds']:.2f}x" for r in rs[1:]]
        cells += ["-" if not (rs[0] and r and r["tokens"] is not None) else str(rs[0]["tokens"] == r["tokens"])
                  for r in rs[1:]]
        print("| " + " | ".join(cells) + " |")
    if args.server:
        print("\nfirst request of each length (the table above: best of --repeats), seconds: "
              + "; ".join(f"{label} " + ", ".join(f"{r['n']}: {r['first_seconds']:.3f}" for r in results.get(label, [])
                                                  if r["kind"] == "server") for label in labels))
        return
    for batch, context in specs:
        print(f"\ndecode: {batch} requests x {context} tokens of context, {args.decode_tokens} new tokens each"
              + (" (from the prefix cache; cached share: " + ", ".join(
                  f"{label} {d['cached']:.3f}" for label in labels
                  if (d := get(label, "decode", batch=batch, context=context))) + ")" if args.decode_cached else ""))
        print("| variant | decode tokens/s | vs first | decode step ms (last request) | speed vs first "
              "| tokens equal first |")
        print("|---|---|---|---|---|---|")
        d0 = get(base, "decode", batch=batch, context=context)
        for label in labels:
            d = get(label, "decode", batch=batch, context=context)
            if not d:
                continue
            step = "-" if d.get("step_ms") is None else f"{d['step_ms']:.2f}"
            if not d0:
                print(f"| {label} | {d['tokens_per_s']:.1f} | - | {step} | - | - |")
                continue
            step_ratio = "-" if not (d.get("step_ms") and d0.get("step_ms")) else f"{d0['step_ms'] / d['step_ms']:.3f}"
            print(f"| {label} | {d['tokens_per_s']:.1f} | {d['tokens_per_s'] / d0['tokens_per_s']:.3f} | {step} | "
                  f"{step_ratio} | {d['tokens'] == d0['tokens']} |")
    if args.mixed:
        print("\nmixed batch: 1 long + 7 x 1K requests, 8 tokens each")
        print("| variant | seconds | short requests' tokens equal first | long request's tokens equal first |")
        print("|---|---|---|---|")
        m0 = get(base, "mixed")
        for label in labels:
            m = get(label, "mixed")
            if m:
                eq_s = m0 and m["tokens"][1:] == m0["tokens"][1:]
                eq_l = m0 and m["tokens"][0] == m0["tokens"][0]
                print(f"| {label} | {m['seconds']:.3f} | {eq_s} | {eq_l} |")
    if args.prefix_cache:
        print("\nprefix cache: first half of the prompt cached from an earlier one, 8 tokens; cached tokens "
              "(vLLM's count) / tokens equal first")
        print("| n | " + " | ".join(labels) + " |")
        print("|---" * (1 + len(labels)) + "|")
        for n in (n for n in args.lengths if n <= args.tokens_max_len):
            rs = [get(label, "prefix", n=n) for label in labels]
            print(f"| {n} | " + " | ".join("-" if r is None else
                                           f"{r['cached']} / {rs[0] is not None and r['tokens'] == rs[0]['tokens']}"
                                           for r in rs) + " |")
    for label in labels:
        for pr in (r for r in results.get(label, []) if r["kind"] == "profile"):
            if "error" in pr:
                print(f"\n{label} profile n={pr['n']}: {pr['error']}")
                continue
            print(f"\n{label} profile n={pr['n']}: {pr['seconds']:.3f} s under the profiler, kernels span "
                  f"{pr['span_s']:.3f} s, GPU busy {pr['busy_s']:.3f} s ({pr['kernels']} kernels)")
            print("| category | GPU s | share of busy |\n|---|---|---|")
            for cat, sec in pr["categories_s"].items():
                print(f"| {cat} | {sec:.3f} | {sec / pr['busy_s']:.1%} |")
            print("largest kernels: " + "; ".join(f"{k['name'][:60]} {k['s']:.3f} s x{k['calls']}" for k in pr["top"]))
            print("GPU idle by gap length (s): " + ", ".join(f"{k} {v:.3f}" for k, v in pr["idle_by_gap_s"].items()))
            print("largest gaps: " + "; ".join(f"{g['us']:.0f} us after {g['after'][:40]} before {g['before'][:40]}"
                                               for g in pr["largest_gaps"][:6]))
            print("host calls that may wait: " + ", ".join(f"{k} x{v['calls']} {v['s']:.3f} s"
                                                        for k, v in pr["host_waits"].items()))
    for label in labels:
        st = get(label, "stats")
        if st:
            print(f"\n{label} stats: density {st['density']}, sparse query tokens {st['sparse_query_tokens']:,}, "
                  f"dense {st['dense_query_tokens']:,}, dense reasons {st['dense_reasons']}")
    print("\nengine start-up: " + ", ".join(
        f"{label} {r['seconds']:.0f} s" for label in labels for r in [get(label, "startup")] if r))


if __name__ == "__main__":
    main()
