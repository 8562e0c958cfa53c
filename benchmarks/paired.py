"""Paired accuracy: does a variant lose answers dense gets, prompt by prompt, with power to see a few?

The same prompts (``vllm_sparse_tools.evaluation.families``: distractor needles of one form, at
least half of them; multi-value; multi-query; variable tracking; a question over a made-up
passage) through one ``vllm serve`` per variant, as served (CUDA graphs, prefix caching, the
library's gating; ``dense`` = FLASH_ATTN on CUDA), greedy. Per length and family and per length
overall, each variant against the first: hits, hits lost and gained, answers changed, McNemar's
exact p, the 95% interval of the hit-rate difference (Newcombe's method 10), median TTFT over
prompts sent alone and its ratio to the reference's.

    python -m benchmarks.paired --model smollm2 --lengths 2048 --prompts 8 --variants dense default
    # GPU, texts staged first on a machine with network (python -m benchmarks.paired --stage-texts .gpu/texts):
    python -m benchmarks.paired --model /tmp/models/qwen2.5-coder-1.5b-instruct --yarn 4 \\
        --text austen=.gpu/texts/austen.txt.xz --text shakespeare=.gpu/texts/shakespeare.txt.xz \\
        --lengths 65536 131072 --prompts 104 --concurrency 8 --variants dense default --gpus 0,1
    python -m benchmarks.paired --report a.json b.json --out merged   # runs made side by side

A ``LABEL=peer`` variant is another project's sparse attention (``vllm_sparse_tools.evaluation.peers``:
``--peer-worker-cls``, ``--peer-pythonpath``, ``--peer-sparse-config``); it runs eager, so then every server does.
A ``kv_placement=host`` variant runs only with ``--unverified-host-kv`` (``vllm_sparse_tools.evaluation.host_kv``).

``--split heldout`` uses only the texts and templates ``tune`` never uses (bible, gcide). Prompts
are built in a process pool and cached per prompt (``--prompt-cache``). Servers start together
(a fixed KV cache each where they share a GPU). First ``--ttft-prompts`` prompts per length go one
at a time to a GPU's servers in turn (the others idle): the TTFTs; the rest with ``--concurrency``
in flight. ``--skip-answered`` continues a run cut short. Writes ``<out>.json`` (every prompt, each
variant's answer, hit and TTFT, the hash of its tokens) and ``<out>.txt`` (the tables).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import http.client
import json
import lzma
import os
import pathlib
import platform
import signal
import sys
import tempfile
import threading
import time

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.paired ...")

from vllm_sparse_tools import assets  # noqa: E402
from vllm_sparse_tools.demo import ServerError, cuda_available, wait_ready  # noqa: E402
from vllm_sparse_tools.evaluation import accuracy as acc  # noqa: E402
from vllm_sparse_tools.evaluation import families, host_kv, inputs, paired, peers  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# The sparse servers' stats file is rewritten at most this often (the library's default): only
# totals are read, after an idle wait, so the timed prefills need not rewrite it per layer.
STATS_INTERVAL_S = 1.0
# What a dead or misbehaving server raises in a client: that variant is recorded as failed.
SERVER_ERRORS = (ServerError, OSError, http.client.HTTPException, json.JSONDecodeError)


def stats_now(server: acc.Launched) -> dict | None:
    """The stats file once its last forward is in it (``server``: anything with a ``stats_path``)."""
    time.sleep(STATS_INTERVAL_S + 0.5)
    return acc.settled_stats(server.stats_path)
def stage_texts(folder: pathlib.Path) -> list[str]:
    """Write every known text, xz-compressed, into ``folder``; return the --text arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name in families.TEXT_SPLITS:
        path = folder / f"{name}.txt.xz"
        if not path.is_file():
            data = assets.ASSETS[name]().read_bytes()
            path.with_suffix(".tmp").write_bytes(lzma.compress(data, preset=6))
            path.with_suffix(".tmp").replace(path)
        out.append(f"--text {name}={path}")
    return out


def parse_texts(p: argparse.ArgumentParser, specs: list[str] | None, split: str) -> dict[str, str]:
    """NAME=PATH pairs; without any, the split's texts from the asset cache (fetched on first use)."""
    if not specs:
        return {n: str(assets.ASSETS[n]()) for n, s in families.TEXT_SPLITS.items() if s == split}
    texts = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or name not in families.TEXT_SPLITS:
            p.error(f"--text {spec!r}: NAME=PATH with NAME one of {', '.join(families.TEXT_SPLITS)}")
        if not pathlib.Path(path).is_file():
            p.error(f"--text {spec!r}: no such file")
        texts[name] = path
    return texts


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help=f"{', '.join(inputs.MODELS)}, or a model folder")
    p.add_argument("--variants", nargs="+", default=["dense", "default"],
                   help="the reference first (normally dense); presets, LABEL=FIELD=VALUE[,...] or LABEL=peer")
    peers.add_arguments(p)
    host_kv.add_argument(p)
    p.add_argument("--head-config-dir", default=str(REPO / "head_configs"))
    p.add_argument("--text", action="append", metavar="NAME=PATH",
                   help="a haystack text (plain, .xz or .gz); names: " + ", ".join(
                       f"{n} ({s})" for n, s in families.TEXT_SPLITS.items())
                   + "; default: the split's texts from the asset cache")
    p.add_argument("--split", choices=families.SPLITS, default="tune",
                   help="tune: texts and templates for tuning; heldout: the ones tune never uses")
    p.add_argument("--lengths", nargs="+", type=int, default=[2048])
    p.add_argument("--prompts", type=int, default=104, help="prompts per length (half distractor needles)")
    p.add_argument("--families", nargs="+", default=list(families.FAMILIES), choices=families.FAMILIES)
    p.add_argument("--seed", type=int, default=0, help="first seed of each family and length")
    p.add_argument("--shard", default="1/1", metavar="I/N",
                   help="run every N-th prompt from the I-th (runs of the N shards, e.g. on other GPUs "
                        "or in other calls, are joined with --report)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="prompts in flight per server after the timed ones (default 8 on CUDA, 1 on CPU)")
    p.add_argument("--ttft-prompts", type=int, default=8,
                   help="prompts per length sent one at a time first, for the TTFT (0: TTFTs under load)")
    p.add_argument("--gpus", default="0", help="CUDA: comma-separated GPU ids; variant i on GPU i mod count")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="CUDA: one server at a time, with vLLM's share of the GPU's memory")
    p.add_argument("--yarn", type=float, default=None, metavar="FACTOR",
                   help="serve every prompt on a YaRN copy of the model (FACTOR over the trained context)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill chunk (default: the whole prompt on CPU, vLLM's own on CUDA, 8192 on an H200)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: every server without CUDA graphs")
    p.add_argument("--prompt-cache", type=pathlib.Path, default=REPO / ".gpu" / "paired-prompts",
                   help="folder of built prompts, one file per (tokenizer, text, family, template, length, seed)")
    p.add_argument("--build-workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", help="output path without extension (default: benchmarks/results/"
                                 "paired_<device>_<model>_<split>_<date>)")
    p.add_argument("--report", nargs="+", metavar="JSON", default=None,
                   help="start nothing: rebuild the tables from these files (same prompts; the first "
                        "file's first variant is the reference) into --out")
    p.add_argument("--skip-answered", nargs="+", metavar="JSON", default=[],
                   help="send each variant only the prompts these runs did not answer with it, and start no "
                        "server for a variant they answered all of (dense answers repeat exactly; join: --report)")
    p.add_argument("--first", nargs="+", metavar="ID", default=[], help="send these prompts (distractor/130000/124, ...) first")
    p.add_argument("--stage-texts", type=pathlib.Path, metavar="DIR", default=None,
                   help="write every known text xz-compressed into DIR (e.g. .gpu/texts) and print "
                        "the --text arguments; needs the network on first use")
    args = p.parse_args(argv)

    if args.stage_texts:
        print(" ".join(stage_texts(args.stage_texts)))
        return 0
    if args.report:
        if not args.out:
            p.error("--report needs --out")
        try:
            meta, records, labels = paired.merge([json.loads(pathlib.Path(f).read_text()) for f in args.report])
        except ValueError as e:
            p.error(str(e))
        meta["merged_from"] = args.report
        out_json, out_txt = inputs.result_paths(args.out, args.out)
        paired.write(out_json, out_txt, meta, records, labels)
        return 0
    return run(p, args)


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    model_dir, model_name, variants = inputs.model_and_variants(p, args, peers=True)
    labels = [v.label for v in variants]
    texts = parse_texts(p, args.text, args.split)
    cuda = cuda_available()
    peer = peers.from_arguments(p, args, variants, cuda)
    args.enforce_eager = args.enforce_eager or peer is not None  # the peer runs eager: TTFTs eager to eager
    device = "cuda" if cuda else "cpu"
    concurrency = args.concurrency or (8 if cuda else 1)
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    if cuda and not gpus:
        p.error("--gpus: no GPU id")
    shard, _, shards = args.shard.partition("/")
    if not (shard.isdigit() and shards.isdigit() and 1 <= int(shard) <= int(shards)):
        p.error(f"--shard {args.shard!r}: I/N with 1 <= I <= N")
    try:
        specs = families.plan(args.split, list(texts), args.lengths, args.prompts, args.families, args.seed)
    except ValueError as e:
        p.error(str(e))
    specs = specs[int(shard) - 1::int(shards)]

    def log(m: str) -> None: print(m, flush=True)  # noqa: E704

    samples = paired.build_prompts(model_dir, texts, specs, args.prompt_cache, args.build_workers, log)
    done = paired.answered([json.loads(pathlib.Path(f).read_text()) for f in args.skip_answered])
    hashes = {s.key: paired.prompt_hash(s.prompt_ids) for s in samples} if done else {}  # once per prompt
    todo = {v: {s.key for s in samples if (s.key, hashes.get(s.key), v) not in done} for v in labels}
    samples = [s for s in samples if any(s.key in todo[v] for v in labels)]
    cfg = acc.model_config(model_dir)
    native = cfg.get("max_position_embeddings") or 0
    limit = int(native * args.yarn) if args.yarn else native
    max_model_len = -(-(max(s.n_tokens + s.max_tokens for s in samples) + 16) // 256) * 256
    if limit and max_model_len > limit:
        max_model_len = limit
        if max(s.n_tokens + s.max_tokens for s in samples) > limit:
            p.error(f"prompts need more than the model's {limit} tokens"
                    + ("" if args.yarn else " (--yarn FACTOR serves longer prompts with YaRN)"))
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-sparse-paired-"))
    serve_dir = acc.yarn_model_dir(model_dir, args.yarn, workdir) if args.yarn else model_dir

    date = datetime.date.today().isoformat()
    short = inputs.short_model_name(args.model, model_name)
    out_json, out_txt = inputs.result_paths(
        args.out, REPO / "benchmarks" / "results" / f"paired_{device}_{short}_{args.split}_{date}")
    meta = {"model": model_name, "model_dir": str(model_dir), "device": device, "host": platform.node(),
            "date": date, "split": args.split, "lengths": args.lengths, "prompts_per_length": args.prompts,
            "shard": args.shard, "families": args.families, "seed": args.seed, "yarn": args.yarn, "max_model_len": max_model_len,
            "texts": {n: paired.sha256_text(paired.read_text(t)) for n, t in texts.items()},
            "concurrency": concurrency, "ttft_prompts_per_length": args.ttft_prompts,
            "max_num_batched_tokens": args.max_num_batched_tokens, "enforce_eager": args.enforce_eager,
            "unverified_host_kv": args.unverified_host_kv, "gpus": gpus if cuda else None,
            "variants": {v.label: "peer" if v.peer else v.overrides for v in variants}, "commands": [" ".join(sys.argv)],
            "peer": peer and {"worker_cls": peer.worker_cls, "sparse_attention_config": peer.sparse_attention_config},
            "interval": "Newcombe method 10 (reference - variant hit rate, 95%)"}
    records = {s.key: paired.prompt_record(s) for s in samples}
    timed = paired.timed_subset([s for s in samples if all(s.key in todo[v] for v in labels)], args.ttft_prompts)
    timed_keys = {s.key for s in timed}
    rest = sorted((s for s in samples if s.key not in timed_keys), key=lambda s: s.key not in args.first)
    lock = threading.Lock()

    def save() -> None:
        with lock:
            paired.write(out_json, out_txt, meta, list(records.values()), labels, log=lambda m: None)

    # Which servers run together: all at once on CUDA (on their GPUs), else one at a time.
    together, live = cuda and not args.one_at_a_time, [i for i, v in enumerate(labels) if todo[v]]  # none: no server
    rounds = [live] if together else [[i] for i in live]
    gpu_of = {i: gpus[i % len(gpus)] for i in range(len(variants))} if cuda else {}
    log(f"{len(samples)} prompts ({len(timed)} timed alone), max-model-len {max_model_len}, "
        f"{len(rounds)} round(s) of servers, concurrency {concurrency}; out {out_json}")
    for members in rounds:
        per_gpu: dict[str, list[int]] = {}
        for i in members:
            per_gpu.setdefault(gpu_of.get(i, "cpu"), []).append(i)
        servers: dict[int, acc.Launched] = {}
        try:
            for gpu, idx in per_gpu.items():
                for i in idx:
                    servers[i] = acc.launch(
                        serve_dir, variants[i], workdir=workdir, max_model_len=max_model_len,
                        min_sparse_query_len=None, max_density=None, cuda=cuda,
                        max_num_batched_tokens=args.max_num_batched_tokens, shared_gpu=len(idx) > 1,
                        as_served=True, max_num_seqs=max(concurrency, 2), stats_write_interval_s=STATS_INTERVAL_S,
                        enforce_eager=args.enforce_eager, prometheus_multiproc=True, peer=peer,
                        unverified_host_kv=args.unverified_host_kv,
                        env={"CUDA_VISIBLE_DEVICES": gpu} if cuda else None)
            failed: dict[int, str] = {}
            stats_before: dict[int, dict | None] = {}
            for i, server in servers.items():
                try:
                    log(f"[{labels[i]}] ready in {wait_ready(server.handle, args.start_timeout):.0f} s "
                        f"({server.handle.log_path})")
                    paired.warm_up(server, samples)
                    stats_before[i] = stats_now(server) if variants[i].ours else None
                except SERVER_ERRORS as e:
                    failed[i] = str(e)

            def timed_on(gpu_members: list[int]) -> None:
                answers: dict[int, dict[str, paired.Answer]] = {i: {} for i in gpu_members}
                paired.send_timed_in_turns({i: servers[i] for i in gpu_members}, timed, answers, failed,
                                           SERVER_ERRORS, log)
                for i in gpu_members:
                    keep(i, answers[i])

            def bulk(i: int) -> None:
                answers: dict[str, paired.Answer] = {}
                t0 = time.monotonic()
                step = max(1, len(rest) // 10)

                def save_now_and_then(key: str, answer: paired.Answer) -> None:
                    # ten saves over the run: one cut short by a time limit keeps most of its answers
                    if len(answers) % step == 0:
                        keep(i, dict(answers))

                try:
                    paired.send_concurrent(servers[i], [s for s in rest if s.key in todo[labels[i]]], answers,
                                           concurrency, log, on_answer=save_now_and_then)
                except SERVER_ERRORS as e:
                    failed[i] = str(e)
                keep(i, answers)
                log(f"[{labels[i]}] {len(rest)} prompts in {time.monotonic() - t0:.0f} s")

            def keep(i: int, answers: dict[str, paired.Answer]) -> None:
                with lock:
                    for key, a in answers.items():
                        records[key]["outputs"][labels[i]] = {"output": a.output, "hit": a.hit,
                                                              "ttft_s": a.ttft_s, "loaded": a.loaded}
                save()

            # Timed prompts: one request at a time per GPU, its servers in turn, GPUs in parallel; then the rest.
            with concurrent.futures.ThreadPoolExecutor(len(per_gpu)) as pool:
                list(pool.map(timed_on, per_gpu.values()))
            with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(bulk, [i for i in servers if i not in failed]))
            for i in servers:
                if i not in failed and variants[i].ours:
                    meta.setdefault("density", {})[labels[i]] = paired.computed_density(
                        stats_before[i], stats_now(servers[i]), cfg, samples)
            for i, err in failed.items():  # no half variants in the tables
                acc.report_failure(servers[i], log)
                log(f"[{labels[i]}] FAILED: {err[:500]}")
                meta.setdefault("errors", {})[labels[i]] = err[:2000]
                for r in records.values():
                    r["outputs"].pop(labels[i], None)
        finally:
            for server in servers.values():
                server.handle.stop()
    paired.write(out_json, out_txt, meta, list(records.values()), labels, log)
    print(f"wrote {out_json} and {out_txt} (server logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
