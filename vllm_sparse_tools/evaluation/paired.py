"""The paired benchmark's parts: prompts built once and cached, sent with bounded concurrency,
compared prompt by prompt against a reference variant (``benchmarks/paired.py``).

A record per prompt holds every variant's answer, hit and time to first token, so that the
tables (hits lost and gained, answers changed, McNemar's exact p, Newcombe's interval of the
difference) can be rebuilt from the JSON of runs made apart (:func:`merge`), as long as they
ran the same prompts (checked by the hash of each prompt's token ids).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gzip
import hashlib
import json
import lzma
import os
import pathlib
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from . import families
from .accuracy import Launched, causal_pairs_all, fmt, length_label, stats_delta, stream_completion
from .intervals import mcnemar_exact_p, newcombe_paired_interval
from .tasks import HFTokenizer, Sample
from ..demo import ServerError

# ---------------------------------------------------------------------------------------------
# Texts and prompts
# ---------------------------------------------------------------------------------------------


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file, plain or compressed (``.xz``, ``.gz``): texts travel compressed to a
    GPU machine without network."""
    path = pathlib.Path(path)
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix, open)
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_digest(model_dir: str | os.PathLike) -> str:
    """What identifies a model folder's tokenizer: a hash of its tokenizer files (the YaRN copy
    and the original folder share them, and so share cached prompts)."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "tokenizer.model", "special_tokens_map.json", "chat_template.jinja"):
        f = pathlib.Path(model_dir) / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def prompt_hash(prompt_ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, prompt_ids)).encode()).hexdigest()[:16]


def cache_path(cache_dir: pathlib.Path, tokenizer: str, text_sha: str,
               spec: families.PromptSpec) -> pathlib.Path:
    """One file per prompt, named by what decides it: tokenizer, text, family, template,
    length, seed and depth."""
    key = json.dumps([tokenizer, text_sha, dataclasses.asdict(spec)], sort_keys=True)
    return cache_dir / f"{spec.family}-{spec.length}-{spec.seed}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _sample_from_json(d: dict) -> Sample:
    return Sample(**{**d, "expected": tuple(d["expected"]), "needle_depths": tuple(d["needle_depths"])})


# A build worker's tokenizer and texts, loaded once per process by the pool's initializer.
_WORKER: dict[str, Any] = {}


def _init_worker(model_dir: str, text_paths: dict[str, str]) -> None:
    _WORKER["tok"] = HFTokenizer(model_dir)
    _WORKER["texts"] = {name: read_text(p) for name, p in text_paths.items()}


def _build_one(spec: families.PromptSpec, out: str) -> str:
    sample = families.build(spec, _WORKER["tok"], _WORKER["texts"][spec.text])
    tmp = pathlib.Path(out + ".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(sample)))
    tmp.replace(out)  # a reader never sees half a file
    return out


def build_prompts(model_dir: str | os.PathLike, text_paths: dict[str, str], specs: Sequence[families.PromptSpec],
                  cache_dir: str | os.PathLike, workers: int = 1,
                  log: Callable[[str], None] = print) -> list[Sample]:
    """The prompts of ``specs`` (in their order), built in ``workers`` processes where the
    cache has no file for them yet."""
    cache_dir = pathlib.Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_digest(model_dir)
    text_sha = {name: sha256_text(read_text(p)) for name, p in text_paths.items()}
    paths = [cache_path(cache_dir, tok, text_sha[s.text], s) for s in specs]
    todo = [(s, str(p)) for s, p in zip(specs, paths) if not p.is_file()]
    if todo:
        t0 = time.monotonic()
        args = (str(model_dir), {k: str(v) for k, v in text_paths.items()})
        if workers > 1:
            with concurrent.futures.ProcessPoolExecutor(workers, initializer=_init_worker, initargs=args) as pool:
                for f in concurrent.futures.as_completed([pool.submit(_build_one, *t) for t in todo]):
                    f.result()
        else:
            _init_worker(*args)
            for t in todo:
                _build_one(*t)
        log(f"built {len(todo)} prompts in {time.monotonic() - t0:.0f} s ({workers} processes); "
            f"{len(specs) - len(todo)} from the cache {cache_dir}")
    return [_sample_from_json(json.loads(p.read_text())) for p in paths]


# ---------------------------------------------------------------------------------------------
# Sending
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    output: str
    hit: bool
    ttft_s: float
    loaded: bool  # sent while other prompts were in flight: its TTFT includes their work


def warm_up(server: Launched, samples: Sequence[Sample]) -> None:
    """One request the length of the longest prompt, its tokens reversed: the first long
    prefill pays one-time costs, and with prefix caching on no measured prompt may share a
    cached prefix with it."""
    longest = list(max(samples, key=lambda s: s.n_tokens).prompt_ids)[::-1]
    stream_completion(server.handle.host, server.handle.port,
                      {"model": server.handle.model(), "prompt": longest, "max_tokens": 2, "temperature": 0})


def _ask(server: Launched, model: str, s: Sample) -> tuple[str, float]:
    text, ttft, _, usage = stream_completion(server.handle.host, server.handle.port, {
        "model": model, "prompt": list(s.prompt_ids), "max_tokens": s.max_tokens, "temperature": 0})
    if usage.get("prompt_tokens") not in (None, s.n_tokens):
        raise ServerError(f"{s.key}: server counted {usage['prompt_tokens']} prompt tokens, sent {s.n_tokens}")
    return text, ttft


def timed_subset(samples: Sequence[Sample], per_length: int) -> list[Sample]:
    """Up to ``per_length`` prompts of each length, spread over the families (every k-th)."""
    out = []
    for n in sorted({s.target_tokens for s in samples}):
        group = [s for s in samples if s.target_tokens == n]
        step = max(1, len(group) // per_length) if per_length else len(group) + 1
        out += group[::step][:per_length]
    return out


def send_timed(server: Launched, samples: Sequence[Sample], into: dict[str, Answer],
               log: Callable[[str], None]) -> None:
    """One prompt at a time (the server otherwise idle): times to first token without load."""
    model = server.handle.model()
    for s in samples:
        text, ttft = _ask(server, model, s)
        into[s.key] = Answer(text, families.hit(s, text), round(ttft, 4), False)
        log(f"[{server.variant.label}] {s.key} (alone): hit {int(into[s.key].hit)}, ttft {ttft:.2f} s; "
            f"{text.strip()[:60]!r}")


def send_timed_in_turns(servers: dict[int, Launched], samples: Sequence[Sample], into: dict[int, dict[str, Answer]],
                        failed: dict[int, str], errors: tuple[type[BaseException], ...],
                        log: Callable[[str], None]) -> None:
    """Each prompt to every server in turn, one request at a time (the others idle), the order
    reversed every other prompt; a server that raises one of ``errors`` goes into ``failed``
    and gets no more. Why turns: a short prompt's time to first token flips between two levels
    about 10 ms apart, in runs of several prompts, on FlashAttention's server as on ours (1K
    prompts on one H200, 2026-11-29); a block of prompts per server can land on either level
    and reads as a speed difference of up to 30%, while turns time both servers in each run."""
    order = list(servers)
    for k, s in enumerate(samples):
        for i in order if k % 2 == 0 else order[::-1]:
            if i not in failed:
                try:
                    send_timed(servers[i], [s], into[i], log)
                except errors as e:
                    failed[i] = str(e)


def send_concurrent(server: Launched, samples: Sequence[Sample], into: dict[str, Answer], concurrency: int,
                    log: Callable[[str], None], on_answer: Callable[[str, Answer], None] | None = None) -> None:
    """Every prompt of ``samples`` with at most ``concurrency`` in flight; answers go into
    ``into`` as they come (a failure leaves the finished ones there), each also handed to
    ``on_answer`` (one at a time), so that a run cut short keeps them."""
    model = server.handle.model()
    lock = threading.Lock()
    done = [0]

    def one(s: Sample) -> None:
        text, ttft = _ask(server, model, s)
        with lock:
            into[s.key] = Answer(text, families.hit(s, text), round(ttft, 4), concurrency > 1)
            if on_answer is not None:
                on_answer(s.key, into[s.key])
            done[0] += 1
            if done[0] % max(1, len(samples) // 10) == 0 or done[0] == len(samples):
                log(f"[{server.variant.label}] {done[0]}/{len(samples)} prompts answered")

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in concurrent.futures.as_completed([pool.submit(one, s) for s in samples]):
            f.result()


def computed_density(before: dict | None, after: dict | None, cfg: dict,
                     samples: Sequence[Sample]) -> dict[str, float | None]:
    """What a sparse server computed over ``samples`` (its statistics file read after the
    warm-up and after the last prompt): ``sparse_rows``, computed / causal pairs of the rows that
    ran sparse; ``all``, the computed share of every causal pair of every prompt (rows run dense
    count whole). Prompts share no cached prefix beyond the chat template's first tokens."""
    causal = stats_delta(after, before, "causal_pairs")
    computed = stats_delta(after, before, "computed_pairs")
    total = sum(causal_pairs_all(cfg, s.n_tokens) for s in samples)
    return {"sparse_rows": computed / causal if causal else None,
            "all": (total - causal + computed) / total if total else None}


# ---------------------------------------------------------------------------------------------
# Records, comparison and tables
# ---------------------------------------------------------------------------------------------


def prompt_record(s: Sample) -> dict[str, Any]:
    return {"id": s.key, "family": s.task, "text": s.meta["text"], "template": s.meta["template"],
            "split": s.meta["split"], "seed": s.seed, "length": s.target_tokens, "n_tokens": s.n_tokens,
            "depth": s.depth, "needle_depths": list(s.needle_depths), "expected": list(s.expected),
            "forbidden": s.meta.get("forbidden", []), "hash": prompt_hash(s.prompt_ids), "outputs": {}}


def compare(records: Iterable[dict], reference: str, variant: str) -> dict[str, Any]:
    """The paired comparison of ``variant`` with ``reference`` over the records both answered."""
    pairs = [(r["outputs"][reference], r["outputs"][variant]) for r in records
             if reference in r["outputs"] and variant in r["outputs"]]
    n = len(pairs)
    if not n:
        return {"n": 0}
    both = sum(a["hit"] and b["hit"] for a, b in pairs)
    lost = sum(a["hit"] and not b["hit"] for a, b in pairs)
    gained = sum(b["hit"] and not a["hit"] for a, b in pairs)
    diff, low, high = newcombe_paired_interval(both, lost, gained, n - both - lost - gained)
    return {"n": n, "ref_hits": both + lost, "hits": both + gained, "lost": lost, "gained": gained,
            "changed": sum(families.normalize(a["output"]) != families.normalize(b["output"]) for a, b in pairs),
            "p_mcnemar": mcnemar_exact_p(lost, gained), "diff": diff, "diff_low": low, "diff_high": high}


def median_ttft(records: Iterable[dict], variant: str) -> tuple[float | None, bool]:
    """Median TTFT of ``variant`` over the prompts timed alone; over every prompt (flagged as
    under load) when none was."""
    answers = [r["outputs"][variant] for r in records if variant in r["outputs"]]
    alone = [a["ttft_s"] for a in answers if not a["loaded"]]
    if alone:
        return statistics.median(alone), False
    return (statistics.median(a["ttft_s"] for a in answers), True) if answers else (None, False)


def summarize(records: Sequence[dict], labels: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (length, family) and per length ("all"): each variant after the first
    against the first, and the variants' median TTFTs."""
    rows = []
    for length in sorted({r["length"] for r in records}):
        at = [r for r in records if r["length"] == length]
        for family in [*sorted({r["family"] for r in at}), "all"]:
            cell = at if family == "all" else [r for r in at if r["family"] == family]
            ref_ttft, _ = median_ttft(cell, labels[0])
            row: dict[str, Any] = {"length": length, "family": family, "ttft": {}}
            for v in labels:
                t, loaded = median_ttft(cell, v)
                row["ttft"][v] = {"median_s": t, "loaded": loaded,
                                  "ratio": t / ref_ttft if t is not None and ref_ttft else None}
            row["vs_reference"] = {v: compare(cell, labels[0], v) for v in labels[1:]}
            rows.append(row)
    return rows


def format_tables(rows: Sequence[dict], labels: Sequence[str]) -> str:
    ref = labels[0]
    head = (f"{'length':>6} {'family':<17} {'variant':<12} {'n':>4} {'ref':>4} {'hits':>4} {'lost':>4} "
            f"{'gain':>4} {'chg':>4} {'p':>6} {'ref-var [95%]':>22} {'ttft':>7} {'/ref':>5}")
    lines = [head, "-" * len(head)]
    for row in rows:
        t_ref = row["ttft"][ref]
        lines.append(f"{length_label(row['length']):>6} {row['family']:<17} {ref[:12]:<12} "
                     f"{'':>4} {'':>4} {'':>4} {'':>4} {'':>4} {'':>4} {'':>6} {'':>22} "
                     f"{fmt(t_ref['median_s'], '.2f') + ('*' if t_ref['loaded'] else ''):>7} {'1':>5}")
        for v in labels[1:]:
            c, t = row["vs_reference"][v], row["ttft"][v]
            if not c["n"]:
                lines.append(f"{'':>6} {'':<17} {v[:12]:<12} (no paired prompts)")
                continue
            interval = f"{c['diff']:+.3f} [{c['diff_low']:+.3f},{c['diff_high']:+.3f}]"
            lines.append(f"{'':>6} {'':<17} {v[:12]:<12} {c['n']:>4} {c['ref_hits']:>4} {c['hits']:>4} "
                         f"{c['lost']:>4} {c['gained']:>4} {c['changed']:>4} {c['p_mcnemar']:>6.3f} "
                         f"{interval:>22} {fmt(t['median_s'], '.2f') + ('*' if t['loaded'] else ''):>7} "
                         f"{fmt(t['ratio'], '.2f'):>5}")
        if row["family"] == "all":
            lines.append("")
    return "\n".join(lines)


LEGEND = ("# per length and family, each variant against the first (the reference) on the same prompts: "
          "n prompts both answered; ref / hits: the reference's and the variant's hits; lost: the "
          "reference hit, the variant missed; gain: the other way round; chg: answers whose words or "
          "numbers differ; p: McNemar's exact two-sided p (binomial on lost vs gained); ref-var: "
          "reference hit rate - variant hit rate with its 95% interval by Newcombe's method 10 (Wilson "
          "intervals of both rates and the correlation of the pairs); ttft: median seconds to the "
          "first streamed token over the prompts sent alone (* : over all prompts, under load); /ref: "
          "that median over the reference's")


def write(out_json: pathlib.Path, out_txt: pathlib.Path, meta: dict, records: Sequence[dict],
          labels: Sequence[str], log: Callable[[str], None] = print) -> None:
    rows = summarize(records, labels)
    out_json.write_text(json.dumps({"meta": meta, "labels": list(labels), "rows": rows,
                                    "prompts": list(records)}, indent=1) + "\n")
    title = (f"# {meta.get('model')} on {meta.get('device')}, split {meta.get('split')}, "
             f"{len(records)} prompts; variants " + ", ".join(labels))
    text = "\n".join([title, LEGEND, "", format_tables(rows, labels)])
    if meta.get("density"):
        text += "\ncomputed share of the prompts' causal attention pairs (sparse servers, every prompt): " + ", ".join(
            f"{v} {fmt(d['all'], '.3f')} (rows run sparse: {fmt(d['sparse_rows'], '.3f')})"
            for v, d in meta["density"].items())
    missing = [v for v in labels if not any(v in r["outputs"] for r in records)]
    if missing:
        text += "\nno answers (not run, or failed: see meta.errors): " + ", ".join(missing)
    out_txt.write_text(text + "\n")
    log(text)


def answered(docs: Sequence[dict]) -> set[tuple[str, str, str]]:
    """(prompt id, token hash, variant) of every answer in ``docs`` (earlier runs' JSON). A run
    cut short goes on by sending each variant only the prompts it has not answered, and is
    joined to the earlier files with :func:`merge`."""
    return {(r["id"], r["hash"], v) for doc in docs for r in doc["prompts"] for v in r["outputs"]}


def merge(docs: Sequence[dict]) -> tuple[dict, list[dict], list[str]]:
    """Runs made side by side, as one: (meta, records, labels). The first file's first variant
    is the reference. Files may hold other variants, or the same ones on other prompts (shards,
    lengths); refused: files of another model or split, a prompt whose tokens differ between
    files (same id, another hash), and a prompt answered by the same variant in two files."""
    if not docs:
        raise ValueError("nothing to merge")
    meta = json.loads(json.dumps(docs[0]["meta"]))
    labels: list[str] = []
    by_id: dict[str, dict] = {}
    for i, doc in enumerate(docs):
        for field in ("model", "split"):
            if doc["meta"].get(field) != meta.get(field):
                raise ValueError(f"file {i + 1} has {field} {doc['meta'].get(field)!r}, the first "
                                 f"{meta.get(field)!r}")
        labels += [v for v in doc["labels"] if v not in labels]
        for r in doc["prompts"]:
            have = by_id.get(r["id"])
            if have is None:
                by_id[r["id"]] = json.loads(json.dumps(r))
            elif have["hash"] != r["hash"]:
                raise ValueError(f"file {i + 1}: prompt {r['id']} differs from an earlier file's "
                                 f"(hash {r['hash']} vs {have['hash']}): not the same prompts")
            else:
                twice = [v for v in r["outputs"] if v in have["outputs"]]
                if twice:
                    raise ValueError(f"file {i + 1}: prompt {r['id']} was answered by {twice[0]!r} in an "
                                     "earlier file too")
                have["outputs"].update(r["outputs"])
        if i:
            meta["variants"] = {**meta.get("variants", {}), **doc["meta"].get("variants", {})}
            meta["commands"] = meta.get("commands", []) + doc["meta"].get("commands", [])
            meta["errors"] = {**meta.get("errors", {}), **doc["meta"].get("errors", {})}
            # one server's density per file: shards of one variant keep a line each
            for v, d in doc["meta"].get("density", {}).items():
                meta.setdefault("density", {})[v if v not in meta.get("density", {}) else f"{v} (file {i + 1})"] = d
    return meta, list(by_id.values()), labels
