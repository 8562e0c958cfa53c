"""Passkey demo: a real vLLM OpenAI server with the sparse-prefill backend finds a number
hidden in a few thousand tokens of Jane Austen.

    python -m vllm_sparse_tools.demo [--tokens 4000] [--port 0] [--keep-server]
    vllm-sparse demo [the same options]

Steps: fetch the model and the text (``assets``), start ``vllm serve`` in a child process
group, wait for ``/health``, build a chat prompt with the needle "The secret passcode for the
blue door is NNNNN." at 50% depth, ask for the passcode, and print the answer, the timings and
the sparse statistics the backend wrote. Then, unless ``--no-dense-run``, stop that server,
serve the same model on vLLM's own attention (the ``--dense`` flags, everything else equal),
send it the same request, and print both times and what their ratio means: the share of
attention skipped is not a speed-up by itself. The servers are always stopped at the end (also
on Ctrl-C). Exit status 0 if the sparse server's answer is right, 1 otherwise.

The building blocks are reusable (tests start servers with them): ``start_server``,
``wait_ready``, ``ServerHandle``, ``cut_to_tokens``, ``insert_needle``, ``passkey_prompt``.
HTTP uses the standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Protocol, Sequence

from . import assets

# Sparse settings for the demo server (the backend reads VLLM_SPARSE_* from the environment;
# variables already set by the caller take precedence). The library defaults (vertical-slash
# 1000/1000, sparse from 4096 query tokens) target 32K-1M prompts; at the demo's 4K tokens they
# would select everything, so the demo runs FlexPrefill, which sizes each head's budget from the
# input (gamma 0.9, tau 0.1 as in the paper; a 256-token minimum instead of 1024 for 4K prompts).
DEMO_SPARSE_ENV: dict[str, str] = {
    "VLLM_SPARSE_MIN_SPARSE_QUERY_LEN": "1024",
    "VLLM_SPARSE_DEFAULT_PATTERN": "flex_prefill",
    "VLLM_SPARSE_GAMMA": "0.9",
    "VLLM_SPARSE_MIN_BUDGET": "256",
}

SERVED_MODEL_NAME = "smollm2-135m"
# Always set for the server: no hub access; on CPU, let vLLM use every core for the worker.
BASE_SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}

NEEDLE = "The secret passcode for the blue door is {key}."
QUESTION = "What is the secret passcode for the blue door? Answer with the number only."
# The assistant turn is pre-filled with the needle's own words, so the model's next tokens
# are the number itself: SmolLM2 then answers " 48213." and stops (measured 24/24 at 3K-6K).
ANSWER_PREFIX = "The secret passcode for the blue door is"

_LOG_TAIL_LINES = 40


class ServerError(RuntimeError):
    """The server did not start, died, or answered with an error."""


class Tokenizer(Protocol):
    """What the prompt builders need; ``ServerHandle`` provides it over HTTP."""

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def count_chat_tokens(self, messages: list[dict], **flags: Any) -> int: ...


# ---------------------------------------------------------------------------------------------
# Server process
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ServerHandle:
    """A vLLM OpenAI server running in its own process group."""

    proc: subprocess.Popen
    port: int
    log_path: pathlib.Path
    host: str = "127.0.0.1"
    _model: str | None = dataclasses.field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 256 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"(cannot read {self.log_path}: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def first_error(self, context: int = 30) -> str | None:
        """The first traceback in the log (often far above its tail), or the line where the
        server was told to shut down (it was sent SIGTERM/SIGINT); None if neither."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return None
        for i, line in enumerate(lines):
            if "Traceback (most recent call last)" in line:
                return "\n".join(lines[i:i + context])
        for line in lines:
            if "shutdown triggered" in line:
                return line + "\n(the API server received SIGTERM or SIGINT)"
        return None

    def request(self, method: str, path: str, body: Any = None, timeout: float = 1800) -> Any:
        """Send one HTTP request; return the decoded JSON reply or raise ServerError."""
        status, data = _http(self.host, self.port, method, path, body, timeout)
        if status != 200:
            raise ServerError(f"{method} {path}: HTTP {status}: {data[:1000]!r}")
        return json.loads(data) if data else None

    def model(self) -> str:
        """The served model name (the first entry of /v1/models)."""
        if self._model is None:
            self._model = self.request("GET", "/v1/models")["data"][0]["id"]
        return self._model

    def tokenize(self, text: str) -> list[int]:
        return self.request("POST", "/tokenize", {"model": self.model(), "prompt": text,
                                                  "add_special_tokens": False})["tokens"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.request("POST", "/detokenize",
                            {"model": self.model(), "tokens": list(ids)})["prompt"]

    def count_chat_tokens(self, messages: list[dict], **flags: Any) -> int:
        """Prompt length of a chat request after the chat template (flags as in the request)."""
        return self.request("POST", "/tokenize", {"model": self.model(), "messages": messages,
                                                  **flags})["count"]

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the server; SIGKILL its whole process group if anything is left after
        ``grace`` seconds. Idempotent. Returns the server's exit status."""
        pgid = self.proc.pid  # start_new_session=True made it the group leader
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not _group_alive(pgid):
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            # SIGKILL is asynchronous: give the members a moment to actually go away.
            deadline = time.monotonic() + 5
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _http(host: str, port: int, method: str, path: str, body: Any = None,
          timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, payload, headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _group_alive(pgid: int) -> bool:
    """True while the process group has a member that is not a zombie."""
    proc = pathlib.Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after "(comm)": state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(model_dir: str | os.PathLike, extra_args: Sequence[str], host: str,
                   port: int) -> list[str]:
    """``vllm serve MODEL_DIR EXTRA_ARGS --host H --port P`` through ``vllm_sparse_backend.vllm_cli``
    (the ``vllm`` CLI; vllm-cpu's own ``vllm`` script is broken)."""
    return [sys.executable, "-m", "vllm_sparse_backend.vllm_cli", "serve", str(model_dir),
            *map(str, extra_args), "--host", host, "--port", str(port)]


def start_server(model_dir: str | os.PathLike, extra_args: Sequence[str],
                 env: dict[str, str] | None, log_path: str | os.PathLike,
                 port: int | None = None, *, host: str = "127.0.0.1") -> ServerHandle:
    """Start a vLLM OpenAI server on ``model_dir`` in a new process group; do not wait.

    ``env`` is added to this process's environment (on top of HF_HUB_OFFLINE=1 and
    VLLM_CPU_NUM_OF_RESERVED_CPU=0); stdout and stderr go to ``log_path``. ``port`` None or 0
    picks a free port. Follow with ``wait_ready()``; stop with ``handle.stop()`` (or use the
    handle as a context manager).
    """
    port = port or free_port(host)
    log_path = pathlib.Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(pathlib.Path(model_dir).resolve(), extra_args, host, port)
    full_env = {**os.environ, **BASE_SERVER_ENV, **(env or {})}
    # the server runs in another folder (below): a relative PYTHONPATH entry (make test's
    # .venv/kernel-site) would name nothing there, so it is resolved here, where it was meant
    if full_env.get("PYTHONPATH"):
        full_env["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p) for p in full_env["PYTHONPATH"].split(os.pathsep) if p)
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        # cwd: the log's folder, never a source checkout (`python -m` puts the working directory
        # first on sys.path): the server runs the installed plugin (make venv installs it).
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, cwd=log_path.parent,
                                stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    return ServerHandle(proc=proc, port=port, log_path=log_path, host=host)


def wait_ready(handle: ServerHandle, timeout: float = 300.0, poll: float = 0.5) -> float:
    """Wait until ``GET /health`` returns 200; return the seconds waited.

    Raises ServerError (with the log's tail) as soon as the process exits, or at the timeout.
    """
    t0 = time.monotonic()
    while True:
        if not handle.alive():
            raise ServerError(f"server exited with status {handle.proc.returncode} before it "
                              f"was ready; log {handle.log_path}:\n{handle.log_tail()}")
        try:
            status, _ = _http(handle.host, handle.port, "GET", "/health", timeout=5)
            if status == 200:
                return time.monotonic() - t0
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() - t0 > timeout:
            raise ServerError(f"server not ready after {timeout:.0f} s; log {handle.log_path}:\n"
                              f"{handle.log_tail()}")
        time.sleep(poll)


# ---------------------------------------------------------------------------------------------
# Passkey prompt
# ---------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019_)\]]*(?:\s+|$)")


def cut_to_tokens(tok: Tokenizer, text: str, n_tokens: int) -> str:
    """The longest start of ``text`` that is at most ``n_tokens`` tokens, ending on a line
    break (or at least a word boundary) so the haystack does not stop mid-word."""
    if n_tokens <= 0:
        return ""
    ids = tok.tokenize(text)
    if len(ids) <= n_tokens:
        return text
    cut = tok.detokenize(ids[:n_tokens])
    for sep in ("\n", " "):
        i = cut.rfind(sep)
        if i > 0 and len(cut) - i < 400:
            return cut[:i]
    return cut


def insert_needle(text: str, needle: str, depth: float) -> tuple[str, int]:
    """Put ``needle`` after the first sentence end at or after ``depth`` (0..1) of the text's
    characters (else the last one before it). Returns the new text and the needle's offset."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth}")
    target = int(len(text) * depth)
    m = _SENTENCE_END.search(text, target)
    if m is None:
        ends = list(_SENTENCE_END.finditer(text, 0, target))
        m = ends[-1] if ends else None
    if m is not None:
        at = m.end()
    elif depth >= 1.0 or target >= len(text):
        at = len(text)
    else:
        at = 0 if depth <= 0 else target
    before, after = text[:at], text[at:]
    sep_before = "" if not before or before[-1].isspace() else " "
    sep_after = "" if not after or after[0].isspace() else " "
    return before + sep_before + needle + sep_after + after, at + len(sep_before)


def passkey_messages(document: str) -> list[dict]:
    """Chat messages: the document and the question, then the pre-filled answer start."""
    return [{"role": "user", "content": f"{document}\n\n{QUESTION}"},
            {"role": "assistant", "content": ANSWER_PREFIX}]


# Request flags that make the server continue the pre-filled assistant turn.
CONTINUE_FLAGS = {"add_generation_prompt": False, "continue_final_message": True}


def passkey_prompt(handle: Tokenizer, text: str, n_tokens: int, depth: float, key: int | str,
                   *, offset: int = 0, max_tokens: int = 10) -> dict:
    """A /v1/chat/completions body whose prompt is about ``n_tokens`` tokens: a slice of
    ``text`` (from ``offset``) with the needle at ``depth``, then the question, with the
    assistant's answer pre-filled up to the number. Greedy, ``max_tokens`` new tokens.

    ``handle`` is a running ``ServerHandle`` (or any object with its tokenizer methods).
    """
    needle = NEEDLE.format(key=key)
    # Tokens used by everything but the haystack: chat template, needle, question, prefix.
    overhead = handle.count_chat_tokens(passkey_messages(needle), **CONTINUE_FLAGS)
    budget = n_tokens - overhead
    if budget <= 0:
        raise ValueError(f"n_tokens={n_tokens} leaves no room for text (overhead {overhead})")
    if offset:
        nl = text.find("\n", offset)  # start on a fresh line
        offset = nl + 1 if 0 <= nl < offset + 2000 else offset
    # ~4 characters per token in English prose; take generously and let the tokenizer cut.
    source = text[offset:offset + 8 * budget + 1000]
    haystack = cut_to_tokens(handle, source, budget)
    document, _ = insert_needle(haystack, needle, depth)
    body = {"messages": passkey_messages(document), **CONTINUE_FLAGS,
            "temperature": 0, "max_tokens": max_tokens}
    model = getattr(handle, "model", None)
    if callable(model):
        body = {"model": model(), **body}
    return body


def first_number(answer: str) -> str | None:
    m = re.search(r"\d+", answer)
    return m.group(0) if m else None


# ---------------------------------------------------------------------------------------------
# Sparse statistics
# ---------------------------------------------------------------------------------------------

def read_stats(path: str | os.PathLike) -> dict | None:
    """The backend's statistics JSON (or the last line of a JSON-lines file); None if absent."""
    try:
        raw = pathlib.Path(path).read_text()
    except OSError:
        return None
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        try:
            return json.loads(raw.strip().splitlines()[-1])
        except ValueError:
            return None


def describe_stats(stats: dict | None) -> list[str]:
    """Human-readable lines for the statistics."""
    if stats is None:
        return ["sparse statistics: none written, so the sparse path did not run"]
    sparse = int(stats.get("sparse_query_tokens", 0))
    dense = int(stats.get("dense_query_tokens", 0))
    causal = int(stats.get("causal_pairs", 0))
    computed = int(stats.get("computed_pairs", 0))
    lines = []
    if causal > 0:
        lines.append(f"attention skipped: {100.0 * (1 - computed / causal):.1f}% of the causal "
                     f"attention in sparse rows ({computed:,} of {causal:,} query-key pairs "
                     f"computed)")
    else:
        lines.append("attention skipped: 0% (no query token took the sparse path)")
    total = sparse + dense
    share = f" ({100.0 * sparse / total:.1f}% sparse)" if total else ""
    # The backend counts every layer's pass over a query token.
    lines.append(f"query tokens (summed over layers): {sparse:,} sparse, {dense:,} dense{share}")
    for key, label in (("head_patterns", "head patterns"), ("dense_reasons", "kept dense")):
        if stats.get(key):
            lines.append(f"{label}: " + ", ".join(f"{k} {v:,}" for k, v in stats[key].items()))
    return lines


# ---------------------------------------------------------------------------------------------
# The demo
# ---------------------------------------------------------------------------------------------

def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch where there is clearly no GPU."""
    if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def demo_server_args(cuda: bool, dense: bool = False) -> list[str]:
    """Server flags for SmolLM2 at 8K context; CPU needs fp32 and an explicit KV-cache size."""
    args = [] if dense else ["--attention-backend", "sparse-prefill"]
    args += ["--served-model-name", SERVED_MODEL_NAME]
    # fp32 on CPU: without avx512_bf16, bf16 compute is several times slower there.
    args += ["--dtype", "bfloat16"] if cuda else ["--dtype", "float32"]
    args += ["--enforce-eager", "--max-model-len", "8192"]
    if not cuda:  # 512M holds 11,648 tokens of this model's fp32 KV cache; 256M is too small
        args += ["--kv-cache-memory-bytes", "512M"]
    args += ["--max-num-batched-tokens", "8192", "--no-enable-prefix-caching"]
    return args


# Below this difference between the two times the demo calls them the same (one request each on
# a machine that may be doing other work).
SAME_TIME_TOLERANCE = 0.10


def compare_with_dense(sparse_s: float, dense_s: float, cuda: bool) -> list[str]:
    """Two lines: both times to answer the same request, then what their ratio means."""
    times = (f"sparse-prefill {sparse_s:.1f} s, vLLM's own attention {dense_s:.1f} s, "
             "same prompt and server flags")
    ratio = sparse_s / dense_s if dense_s > 0 else float("inf")
    if ratio > 1 + SAME_TIME_TOLERANCE:
        verdict = f"sparse-prefill was {ratio:.1f}x slower: "
        if cuda:
            verdict += ("at a few thousand tokens choosing what to skip costs more than the skipped "
                        "attention; the gain starts near 128K tokens (docs/accuracy.md)")
        else:
            verdict += ("on CPU the sparse path computes in PyTorch against vLLM's compiled kernel; it is "
                        "there for correctness, not speed (docs/deployment.md)")
    elif ratio < 1 - SAME_TIME_TOLERANCE:
        verdict = f"sparse-prefill was {1 / ratio:.1f}x faster: the skipped attention saved more than the selection cost"
    else:
        verdict = ("about the same time: at this length the skipped attention and the cost of choosing it "
                   "cancel out")
    return [times, verdict]


def _ask(handle: ServerHandle, body: dict) -> tuple[str, dict, float]:
    """The answer, the usage block and the seconds one chat request took."""
    started = time.monotonic()
    reply = handle.request("POST", "/v1/chat/completions", body)
    seconds = time.monotonic() - started
    return reply["choices"][0]["message"].get("content") or "", reply.get("usage") or {}, seconds


def _stop(handle: ServerHandle) -> None:
    if handle.proc.poll() is None:
        t0 = time.monotonic()
        status = handle.stop()
        print(f"server:  stopped in {time.monotonic() - t0:.1f} s (exit status {status})")


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


DESCRIPTION = ("Passkey demo: a real vLLM OpenAI server with the sparse-prefill backend finds a number "
               "hidden in a few thousand tokens of Jane Austen; then a second server on vLLM's own attention "
               "answers the same request, and the demo prints both times. Exit status 0 if the sparse "
               "server's answer is right, 1 otherwise.")
MIN_TOKENS, MAX_TOKENS = 200, 8100  # the model's context is 8192


def _prompt_tokens(value: str) -> int:
    try:
        tokens = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if not MIN_TOKENS <= tokens <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"must be within {MIN_TOKENS}..{MAX_TOKENS} "
                                         "(the model's context is 8192)")
    return tokens


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, on ``python -m vllm_sparse_tools.demo`` and ``vllm-sparse demo`` alike."""
    parser.add_argument("--tokens", type=_prompt_tokens, default=4000,
                        help=f"prompt length in tokens, {MIN_TOKENS}..{MAX_TOKENS} (model context: 8192; "
                        "default 4000)")
    parser.add_argument("--port", type=int, default=0, help="server port (0: any free port)")
    parser.add_argument("--keep-server", action="store_true",
                        help="keep the server running after the answer, until Ctrl-C")
    parser.add_argument("--depth", type=float, default=0.5, help="needle depth, 0..1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random passcode")
    parser.add_argument("--dense", action="store_true",
                        help="run vLLM's own attention backend instead (baseline)")
    parser.add_argument("--no-dense-run", action="store_true",
                        help="skip the second server that times vLLM's own attention on the same prompt "
                        "(about a minute less on a small CPU machine)")
    parser.add_argument("--cache-dir", default=None, help=f"asset cache (default: ${assets.CACHE_ENV} or "
                        f"{assets.DEFAULT_CACHE})")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="seconds to wait for the server to answer /health (default 300)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_sparse_tools.demo", description=DESCRIPTION)
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv))


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo with the options :func:`add_demo_arguments` defines; the exit status."""
    t0 = time.monotonic()
    model_dir = assets.ensure_smollm2(args.cache_dir)
    text_path = assets.ensure_text(args.cache_dir)
    print(f"model:   {model_dir}")
    print(f"text:    {text_path}  (assets ready in {time.monotonic() - t0:.1f} s)")
    text = text_path.read_text(encoding="utf-8")
    key = random.Random(args.seed).randint(10000, 99999)

    cuda = cuda_available()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-sparse-demo-"))
    stats_path = workdir / "sparse-stats.json"
    server_tmp = workdir / "tmp"  # vLLM leaves socket files in TMPDIR; keep them in here
    server_tmp.mkdir()
    # the stats file is read right after the request: written on every forward, not once a second
    env = {"TMPDIR": str(server_tmp), "VLLM_SPARSE_STATS_FILE": str(stats_path),
           "VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "0"}
    if not args.dense:  # the demo's defaults; VLLM_SPARSE_* set by the caller win
        env.update({k: v for k, v in DEMO_SPARSE_ENV.items() if k not in os.environ})
    backend = "dense (vLLM default)" if args.dense else "sparse-prefill"
    device = "CUDA" if cuda else "CPU"
    print(f"server:  {backend} backend on {device}, log {workdir / 'server.log'}")

    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    handle = None
    ok = False
    keep_logs = True
    try:
        handle = start_server(model_dir, demo_server_args(cuda, args.dense), env,
                              workdir / "server.log", args.port or None)
        ready_s = wait_ready(handle, args.start_timeout)
        print(f"server:  ready at {handle.url} in {ready_s:.1f} s")

        t1 = time.monotonic()
        body = passkey_prompt(handle, text, args.tokens, args.depth, key)
        build_s = time.monotonic() - t1
        answer, usage, answer_s = _ask(handle, body)
        ok = first_number(answer) == str(key)
        print(f"prompt:  {usage.get('prompt_tokens')} tokens, passcode {key} at "
              f"{args.depth:.0%} depth (built in {build_s:.1f} s)")
        print(f"answer:  {answer!r} -> {'CORRECT' if ok else 'WRONG'}")
        print(f"time to answer: {answer_s:.1f} s ({usage.get('completion_tokens')} new tokens)")

        stats = read_stats(stats_path)
        if stats is None and not args.keep_server and not args.dense:
            _stop(handle)  # the backend may write its statistics only at shutdown
            stats = read_stats(stats_path)
        if args.dense and stats is None:
            print("sparse:  dense run, no sparse statistics")
        else:
            for i, line in enumerate(describe_stats(stats)):
                print(("sparse:  " if i == 0 else "         ") + line)

        if args.keep_server and handle.alive():
            print(f"server still running at {handle.url} (pid {handle.proc.pid}); "
                  "press Ctrl-C to stop it")
            try:
                handle.proc.wait()
            except KeyboardInterrupt:
                print()
        elif not (args.dense or args.no_dense_run):
            _stop(handle)  # one server at a time: the two would share the machine's cores
            dense_log = workdir / "server-dense.log"
            print(f"dense:   the same request on vLLM's own attention, log {dense_log}")
            handle = start_server(model_dir, demo_server_args(cuda, dense=True), {"TMPDIR": str(server_tmp)},
                                  dense_log, args.port or None)
            wait_ready(handle, args.start_timeout)
            dense_answer, _, dense_s = _ask(handle, body)
            dense_ok = first_number(dense_answer) == str(key)
            print(f"dense:   answer {dense_answer!r} -> {'CORRECT' if dense_ok else 'WRONG'}")
            times, meaning = compare_with_dense(answer_s, dense_s, cuda)
            print(f"speed:   {times}")
            print(f"         {meaning}")
        keep_logs = False
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the server", file=sys.stderr)
    except (ServerError, OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        if handle is not None:
            if "log " not in str(e):
                print(f"server log {handle.log_path}, last {_LOG_TAIL_LINES} lines:\n"
                      f"{handle.log_tail()}", file=sys.stderr)
            first = handle.first_error()
            if first:
                print(f"first error in {handle.log_path}:\n{first}", file=sys.stderr)
    finally:
        if handle is not None:
            _stop(handle)
        signal.signal(signal.SIGTERM, old_term)
        if keep_logs:
            print(f"kept {workdir} for inspection", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
