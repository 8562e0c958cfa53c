"""The paired benchmark (benchmarks/paired.py): its task families and held-out split, its
statistics against hand-computed values, prompt caching, and --report merging runs made apart.
Offline with test_tasks' sub-word fake tokenizer; the end-to-end run starts two real servers."""

from __future__ import annotations

import dataclasses
import gzip
import json
import lzma
import math
import re

import pytest
from test_tasks import TEXT, PieceTokenizer

from vllm_sparse_tools.evaluation import families as F
from vllm_sparse_tools.evaluation import paired as P
from vllm_sparse_tools.evaluation.intervals import mcnemar_exact_p, newcombe_paired_interval
from vllm_sparse_tools.evaluation.tasks import length_tolerance

TEXTS = {"austen": TEXT, "shakespeare": TEXT, "bible": TEXT, "gcide": TEXT}


@pytest.fixture(scope="module")
def tok():
    return PieceTokenizer()


def _document(tok, sample):
    user = tok.decode(sample.prompt_ids)[len("<user>"):].split("</user><assistant>")[0]
    return user.rsplit("\n\n", 1)


def _spec(family, split="tune", length=2500, seed=3, depth=0.4, index=0):
    return F.PromptSpec(family, F.templates(family, split)[index].name, "austen" if split == "tune" else "bible",
                        length, seed, depth)


@pytest.mark.parametrize("family", F.FAMILIES)
@pytest.mark.parametrize("split", F.SPLITS)
def test_every_value_once_at_its_depth_and_length(tok, family, split):
    for depth in (0.1, 0.5, 0.9):
        s = F.build(_spec(family, split, depth=depth), tok, TEXT)
        assert 2500 - length_tolerance(2500) <= s.n_tokens <= 2500
        document, question = _document(tok, s)
        for value in (*s.expected, *s.meta["forbidden"]):
            assert len(re.findall(rf"\b{value}\b", document)) == (
                1 if family != "variable_tracking" else 2 - (value in (s.expected[-1], s.meta["forbidden"][-1])))
        # the first fact sits where the sample says, near the requested depth, after a sentence end
        at = document.index(s.meta["facts"][0])
        assert abs(at / len(document) - s.needle_depths[0]) < 0.002
        assert abs(s.needle_depths[0] - depth) < 0.03
        assert document[:at].rstrip()[-1] in ".!?"
        assert F.hit(s, " ".join(s.expected)) and not F.hit(s, "")


def test_distractors_share_the_asked_needles_form(tok):
    for index, t in enumerate(F.TEMPLATES["distractor"]):
        s = F.build(_spec("distractor", t.split, index=[u.name for u in F.templates("distractor", t.split)].index(t.name)),
                    tok, TEXT)
        form = re.escape(t.fact).replace(r"\{key\}", r"([a-z]+ [a-z]+)").replace(r"\{value\}", r"(\d{7})")
        found = [re.fullmatch(form, fact) for fact in s.meta["facts"]]
        assert all(found) and 3 <= len(found) <= 5, s.meta["facts"]
        keys, values = [m.group(1) for m in found], [m.group(2) for m in found]
        assert keys[0] == s.meta["key"] and values[0] == s.expected[0]
        assert len(set(keys)) == len(keys) and len(set(values)) == len(values)
        assert values[1:] == s.meta["forbidden"]
        # an answer naming a distractor's value as well is a miss
        assert not F.hit(s, f"{values[0]} or {values[1]}")
        _, question = _document(tok, s)
        assert keys[0] in question and not any(v in question for v in values)


def test_passage_answer_is_the_extreme_and_not_at_either_end(tok):
    for split in F.SPLITS:
        for t in F.templates("passage", split):
            for seed in range(5):
                s = F.build(F.PromptSpec("passage", t.name, "austen", 1500, seed, 0.5), tok, TEXT)
                counts, people = s.meta["counts"], s.meta["people"]
                pick = max if t.name in ("baskets", "crates") else min
                assert people[counts.index(pick(counts))] == s.expected[0]
                assert s.expected[0] not in (people[0], people[-1])
                assert len(set(counts)) == len(counts)


def test_heldout_uses_no_text_or_template_of_tune():
    tune = F.plan("tune", list(TEXTS), [4096], 40)
    held = F.plan("heldout", list(TEXTS), [4096], 40)
    for specs, split in ((tune, "tune"), (held, "heldout")):
        assert {s.text for s in specs} == {n for n, sp in F.TEXT_SPLITS.items() if sp == split}
        assert all(F.template(s.family, s.template).split == split for s in specs)
    assert not {s.text for s in tune} & {s.text for s in held}
    assert not {(s.family, s.template) for s in tune} & {(s.family, s.template) for s in held}
    # every family has wordings on both sides
    assert all(F.templates(f, sp) for f in F.FAMILIES for sp in F.SPLITS)
    with pytest.raises(ValueError, match="no text of split 'heldout'"):
        F.plan("heldout", ["austen"], [4096], 10)
    with pytest.raises(ValueError, match="'novel' has no split"):
        F.plan("tune", ["austen", "novel"], [4096], 10)


def test_plan_counts_half_distractors_and_spreads_depths():
    specs = F.plan("tune", ["austen", "shakespeare"], [65536, 131072], 104)
    for n in (65536, 131072):
        at = [s for s in specs if s.length == n]
        assert len(at) == 104
        assert sum(s.family == "distractor" for s in at) == 52
        assert {f: sum(s.family == f for s in at) for f in F.FAMILIES if f != "distractor"} == {
            "multi_value": 13, "multi_query": 13, "variable_tracking": 13, "passage": 13}
        d = [s for s in at if s.family == "distractor"]
        assert [s.depth for s in d] == [round((i + 0.5) / 52, 4) for i in range(52)]
        assert {(s.text, s.template) for s in d} == {(t, m) for t in ("austen", "shakespeare") for m in ("code", "access")}
    assert len({s.key for s in specs}) == len(specs)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def test_mcnemar_exact_p_hand_computed():
    # 7 lost, 2 gained: P(X <= 2 | n=9) = (1 + 9 + 36) / 512; two-sided twice that
    assert mcnemar_exact_p(7, 2) == pytest.approx(2 * 46 / 512)
    assert mcnemar_exact_p(2, 7) == mcnemar_exact_p(7, 2)
    assert mcnemar_exact_p(5, 0) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(10, 1) == pytest.approx(2 * 12 / 2048)
    assert mcnemar_exact_p(3, 3) == 1.0  # 2 x 42/64 capped
    assert mcnemar_exact_p(0, 0) == 1.0


def test_newcombe_interval_hand_computed():
    # both 8, lost 5, gained 4, neither 9 (n = 26): reference 13/26, variant 12/26.
    # Wilson limits in the (2np + z^2 +- z sqrt(z^2 + 4np(1-p))) / (2(n + z^2)) form:
    z = 1.959963984540054
    def wilson(x, n):
        p = x / n
        root = z * math.sqrt(z * z + 4 * n * p * (1 - p))
        return (2 * x + z * z - root) / (2 * (n + z * z)), (2 * x + z * z + root) / (2 * (n + z * z))
    l1, u1 = wilson(13, 26)  # (29.8415 -+ 1.96 x sqrt(29.8415)) / 59.683
    l2, u2 = wilson(12, 26)  # (27.8415 -+ 1.96 x sqrt(29.6877)) / 59.683
    assert (l1, u1, l2, u2) == pytest.approx((0.32061, 0.67939, 0.28756, 0.64542), abs=1e-4)
    phi = (8 * 9 - 5 * 4) / math.sqrt(13 * 13 * 12 * 14)  # 0.2402
    d = 1 / 26
    low = d - math.sqrt((0.5 - l1) ** 2 - 2 * phi * (0.5 - l1) * (u2 - 12 / 26) + (u2 - 12 / 26) ** 2)
    high = d + math.sqrt((u1 - 0.5) ** 2 - 2 * phi * (u1 - 0.5) * (12 / 26 - l2) + (12 / 26 - l2) ** 2)
    got = newcombe_paired_interval(8, 5, 4, 9)
    assert got == pytest.approx((d, low, high), abs=1e-9)
    assert got == pytest.approx((0.03846, -0.17516, 0.24628), abs=1e-4)
    # no answer changed: a narrow interval about 0 (phi = 1), zero-wide at a hit rate of 1/2
    d0, lo0, hi0 = newcombe_paired_interval(60, 0, 0, 40)
    assert d0 == 0 and -0.01 < lo0 < -0.005 and 0.005 < hi0 < 0.01
    assert newcombe_paired_interval(50, 0, 0, 50) == pytest.approx((0, 0, 0), abs=1e-12)
    # few prompts, all lost: the interval stays within [-1, 1]
    d3, lo3, hi3 = newcombe_paired_interval(0, 3, 0, 0)
    assert d3 == 1 and 0 < lo3 < 1 and hi3 == pytest.approx(1)
    # a loss of 7 against 2 gains on 20 prompts: the interval still contains 0 (p = 0.18)
    d1, lo1, hi1 = newcombe_paired_interval(4, 7, 2, 7)
    assert d1 == pytest.approx(0.25) and lo1 < 0 < hi1
    # the same loss on 100 prompts of which 80 agree both ways does not
    d2, lo2, hi2 = newcombe_paired_interval(40, 15, 3, 42)
    assert d2 == pytest.approx(0.12) and 0 < lo2 < d2 < hi2


def _record(pid, hits, outputs=None, hsh="h", length=2048, family="distractor"):
    outputs = outputs or {}
    return {"id": pid, "family": family, "length": length, "hash": hsh,
            "outputs": {v: {"output": outputs.get(v, "1234567" if h else "7654321"), "hit": h,
                            "ttft_s": t, "loaded": False} for v, (h, t) in hits.items()}}


def test_compare_counts_lost_gained_changed():
    recs = ([_record(f"a{i}", {"dense": (True, 1.0), "sp": (True, 0.5)}) for i in range(5)]
            + [_record(f"b{i}", {"dense": (True, 1.0), "sp": (False, 0.5)}) for i in range(3)]
            + [_record("c", {"dense": (False, 1.0), "sp": (True, 0.5)})]
            + [_record("d", {"dense": (False, 1.0), "sp": (False, 0.5)}, {"dense": "No.", "sp": "no"})]
            + [_record("e", {"dense": (True, 1.0), "sp": (True, 0.5)}, {"dense": "It is 1234567.", "sp": "1234567"})])
    c = P.compare(recs, "dense", "sp")
    assert (c["n"], c["ref_hits"], c["hits"], c["lost"], c["gained"]) == (11, 9, 7, 3, 1)
    # changed: the 4 discordant prompts and "It is 1234567." vs "1234567"; "No." vs "no" is the same answer
    assert c["changed"] == 5
    assert c["p_mcnemar"] == pytest.approx(mcnemar_exact_p(3, 1))
    assert c["diff"] == pytest.approx(2 / 11)
    assert P.median_ttft(recs, "sp") == (0.5, False)
    row = P.summarize(recs, ["dense", "sp"])[-1]
    assert row["family"] == "all" and row["ttft"]["sp"]["ratio"] == pytest.approx(0.5)


def _doc(labels, records, model="m", split="tune"):
    return {"meta": {"model": model, "split": split, "variants": {v: None for v in labels}},
            "labels": labels, "prompts": records}


def test_report_merges_runs_made_apart_and_refuses_other_prompts(tmp_path):
    from benchmarks import paired as bench

    a = _doc(["dense"], [_record(f"p{i}", {"dense": (True, 2.0)}) for i in range(4)])
    b = _doc(["sp"], [_record(f"p{i}", {"sp": (i != 0, 1.0)}) for i in range(4)])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert bench.main(["--report", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["labels"] == ["dense", "sp"]
    row = next(r for r in merged["rows"] if r["family"] == "all")
    c = row["vs_reference"]["sp"]
    assert (c["n"], c["lost"], c["gained"], c["ref_hits"], c["hits"]) == (4, 1, 0, 4, 3)
    assert row["ttft"]["sp"]["ratio"] == pytest.approx(0.5)
    assert "sp" in (tmp_path / "m.txt").read_text()
    # the same prompt id with other tokens: refused
    b["prompts"][2]["hash"] = "other"
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit):
        bench.main(["--report", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="prompt p2 differs"):
        P.merge([a, b])
    with pytest.raises(ValueError, match="split"):
        P.merge([a, _doc(["sp"], [], split="heldout")])
    with pytest.raises(ValueError, match="answered by 'dense' in an earlier file"):
        P.merge([a, a])
    # the same variants on other prompts (another shard or length) join the table
    c = _doc(["dense", "sp"], [_record("q", {"dense": (True, 2.0), "sp": (False, 1.0)}, length=4096)])
    meta, records, labels = P.merge([a, b | {"prompts": b["prompts"][:2]}, c])
    assert labels == ["dense", "sp"] and len(records) == 5
    assert P.compare(records, "dense", "sp")["lost"] == 2


def test_prompts_cached_per_prompt_and_texts_read_compressed(tmp_path, monkeypatch):
    text = TEXT[:400_000]
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress(text.encode()))
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(text.encode()))
    assert P.read_text(tmp_path / "a.txt.xz") == text == P.read_text(tmp_path / "b.txt.gz")
    monkeypatch.setattr(P, "HFTokenizer", lambda _: PieceTokenizer())
    texts = {"austen": str(tmp_path / "a.txt.xz"), "shakespeare": str(tmp_path / "b.txt.gz")}
    specs = F.plan("tune", list(texts), [1200], 6)
    cache = tmp_path / "cache"
    first = P.build_prompts(tmp_path, texts, specs, cache, workers=1, log=lambda m: None)
    assert [s.key for s in first] == [s.key for s in specs]
    assert len(list(cache.iterdir())) == len(specs)

    def no_build(*_):
        raise AssertionError("built again")

    monkeypatch.setattr(F, "build", no_build)
    again = P.build_prompts(tmp_path, texts, specs, cache, workers=1, log=lambda m: None)
    assert again == first
    # another seed is another prompt: not taken from the cache
    with pytest.raises(AssertionError, match="built again"):
        P.build_prompts(tmp_path, texts, [dataclasses.replace(specs[0], seed=99)], cache, workers=1,
                        log=lambda m: None)


def test_servers_run_as_served_with_a_kv_cache_for_their_concurrency(tmp_path):
    from vllm_sparse_tools.evaluation import accuracy as acc

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 28, "num_key_value_heads": 2,
                                                      "hidden_size": 1536, "num_attention_heads": 12}))
    old = acc.server_args(tmp_path, 131072, dense=True, cuda=True, shared_gpu=True)
    assert "--enforce-eager" in old and "--no-enable-prefix-caching" in old
    served = acc.server_args(tmp_path, 131072, dense=False, cuda=True, shared_gpu=True, as_served=True,
                             max_num_seqs=8)
    assert "--enforce-eager" not in served and "--no-enable-prefix-caching" not in served
    assert served[served.index("--max-num-seqs") + 1] == "8"
    # 8 sequences of 131072 tokens x 28 layers x 2 (K, V) x 2 heads x 128 x 2 bytes, 1.25 headroom + 64 MiB
    need = int(8 * 131072 * 28 * 2 * 2 * 128 * 2 * 1.25) + (64 << 20)
    kv = int(served[served.index("--kv-cache-memory-bytes") + 1])
    assert need <= kv < need + (64 << 20)


def test_gcide_entries_become_plain_paragraphs():
    from vllm_sparse_tools.assets import gcide_text_from_dict

    data = ("00-database-info\n   This file was converted from the original database.\n\n"
            "Abditory \\Ab\"di*to*ry\\, n. [L. abditorium.]\n   A place for hiding or preserving\n"
            "   articles of value. --Cowell.\n   [1913 Webster]\n\n"
            "Ab \\Ab\\, n.\n   A month.\n   [1913 Webster]\n\nAbele \\A*bele\\, n. The white poplar.\n")
    text = gcide_text_from_dict(data)
    assert text.splitlines() == [
        "Abditory, n. [L. abditorium.] A place for hiding or preserving articles of value. --Cowell.",
        "Abele, n. The white poplar."]  # "Ab, n. A month." is under 20 characters: dropped
    assert gcide_text_from_dict(data, limit=10).splitlines() == text.splitlines()[:1]


def test_computed_density_from_the_stats_file_counts():
    from vllm_sparse_tools.evaluation.tasks import Sample

    samples = [Sample("distractor", n, 0, 0.5, list(range(n)), ("1",), "", 4) for n in (4, 2)]
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 3}
    # every causal pair, layers x heads: 2 x 3 x (4 x 5 / 2) + 2 x 3 x (2 x 3 / 2) = 60 + 18
    before = {"causal_pairs": 100, "computed_pairs": 50}
    after = {"causal_pairs": 130, "computed_pairs": 60}
    d = P.computed_density(before, after, cfg, samples)
    assert d["sparse_rows"] == pytest.approx(10 / 30)
    assert d["all"] == pytest.approx((78 - 30 + 10) / 78)
    assert P.computed_density(None, None, cfg, samples) == {"sparse_rows": None, "all": 1.0}


class _FakeServer:
    """An OpenAI completions endpoint that answers every prompt with a fixed text after a short
    wait and logs each request's prompt hash, start and end: the orchestration of a run (which
    prompts go when, how many at once, on which GPU), without vLLM."""

    def __init__(self, label, gpu, answer, log):
        import http.server
        import threading
        import time

        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, json.dumps({"data": [{"id": "m"}]}).encode(), "application/json")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                start = time.monotonic()
                with server.lock:
                    server.in_flight += 1
                    server.most = max(server.most, server.in_flight)
                time.sleep(0.05)
                events = [{"choices": [{"text": answer}]},
                          {"choices": [], "usage": {"prompt_tokens": len(body["prompt"])}}]
                payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                with server.lock:
                    server.in_flight -= 1
                log.append((gpu, label, P.prompt_hash(body["prompt"]), start, time.monotonic()))
                self._send(200, payload.encode(), "text/event-stream")

            def _send(self, status, data, kind):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.lock, self.in_flight, self.most = threading.Lock(), 0, 0
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host, self.port = self.httpd.server_address
        self.log_path = None
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def model(self):
        return "m"

    def first_error(self):
        return None

    def stop(self):
        self.httpd.shutdown()


@pytest.mark.parametrize("gpus", ["0", "0,1"])
def test_run_times_prompts_alone_per_gpu_then_sends_the_rest_concurrently(tmp_path, monkeypatch, gpus):
    from benchmarks import paired as bench
    from vllm_sparse_tools.evaluation import accuracy as acc

    cfg = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 64,
           "max_position_embeddings": 4096}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "austen.txt").write_text(TEXT[:300_000])
    log, launched, servers = [], [], []

    def launch(model_dir, variant, **kw):
        gpu = kw["env"]["CUDA_VISIBLE_DEVICES"]
        launched.append((variant.label, gpu, kw["shared_gpu"], kw["as_served"], kw["max_num_seqs"]))
        servers.append(_FakeServer(variant.label, gpu, "1234567" if variant.dense else "It is 7654321.", log))
        return acc.Launched(variant, "native", servers[-1], tmp_path / f"{variant.label}-stats.json", cfg,
                            kw["max_model_len"], None)

    monkeypatch.setattr(P, "HFTokenizer", lambda _: PieceTokenizer())
    monkeypatch.setattr(bench, "cuda_available", lambda: True)
    monkeypatch.setattr(bench, "wait_ready", lambda handle, timeout: 0.0)
    monkeypatch.setattr(bench, "STATS_INTERVAL_S", 0.0)
    monkeypatch.setattr(acc, "launch", launch)
    saved = []  # answers in each file written, to see that a run cut short keeps its answers
    write = P.write
    monkeypatch.setattr(P, "write", lambda j, t, meta, records, *a, **k: (
        saved.append(sum(len(r["outputs"]) for r in records)), write(j, t, meta, records, *a, **k)))
    out = tmp_path / "run"
    assert bench.main(["--model", str(tmp_path / "model"), "--text", f"austen={tmp_path / 'austen.txt'}",
                       "--lengths", "1200", "--prompts", "12", "--ttft-prompts", "3", "--concurrency", "3",
                       "--variants", "dense", "default", "--gpus", gpus, "--build-workers", "1",
                       "--prompt-cache", str(tmp_path / "cache"), "--out", str(out)]) == 0

    two = gpus == "0,1"
    assert launched == [("dense", "0", not two, True, 3), ("default", "1" if two else "0", not two, True, 3)]
    doc = json.loads(out.with_suffix(".json").read_text())
    hashes = {r["hash"] for r in doc["prompts"]}
    assert len(doc["prompts"]) == 12
    for label in ("dense", "default"):
        sent = [h for _, v, h, _, _ in log if v == label]
        # a warm-up the server never sees again, then every prompt once
        assert sent[0] not in hashes and sorted(sent[1:]) == sorted(hashes)
        assert sum(not r["outputs"][label]["loaded"] for r in doc["prompts"]) == 3
    # the timed prompts ran alone on their GPU: no other request of that GPU overlapped them
    timed = {(label, r["hash"]) for r in doc["prompts"] for label, a in r["outputs"].items() if not a["loaded"]}
    for gpu, label, h, start, end in log:
        if (label, h) in timed:
            assert not [o for o in log if o[0] == gpu and o[1:3] != (label, h) and o[3] < end and o[4] > start]
    # servers sharing a GPU take the timed prompts in turns, prompt by prompt, in the order A B, B A, A B
    if not two:
        turns = sorted((start, label, h) for _, label, h, start, _ in log if (label, h) in timed)
        assert [label for _, label, _ in turns] == ["dense", "default", "default", "dense", "dense", "default"]
        assert all(turns[k][2] == turns[k + 1][2] for k in range(0, 6, 2))
    # the rest with up to --concurrency in flight per server
    assert all(1 < s.most <= 3 for s in servers)
    row = next(r for r in doc["rows"] if r["family"] == "all")
    c = row["vs_reference"]["default"]
    assert (c["n"], c["lost"], c["gained"], c["changed"]) == (12, 0, 0, 12)
    assert "density" in doc["meta"] and doc["meta"]["density"]["default"]["sparse_rows"] is None
    # saved while the concurrent part runs (here after every answer), not only at each server's end
    assert len([n for n in saved if 6 < n < 24]) > 2
    if two:
        return
    # a run cut short goes on: prompts both variants answered stay out, one only dense answered goes again
    part = doc | {"prompts": doc["prompts"][:6]}
    part["prompts"][5] = part["prompts"][5] | {"outputs": {"dense": part["prompts"][5]["outputs"]["dense"]}}
    (tmp_path / "part.json").write_text(json.dumps(part))
    log.clear()
    assert bench.main(["--model", str(tmp_path / "model"), "--text", f"austen={tmp_path / 'austen.txt'}",
                       "--lengths", "1200", "--prompts", "12", "--ttft-prompts", "0", "--variants", "dense", "default",
                       "--build-workers", "1", "--prompt-cache", str(tmp_path / "cache"),
                       "--skip-answered", str(tmp_path / "part.json"), "--out", str(tmp_path / "rest")]) == 0
    rest = json.loads((tmp_path / "rest.json").read_text())
    assert {r["hash"] for r in rest["prompts"]} == {r["hash"] for r in doc["prompts"][5:]}
    sent = {v: sorted(h for _, v2, h, _, _ in log[2:] if v2 == v) for v in ("dense", "default")}  # after warm-ups
    assert sent["default"] == sorted(r["hash"] for r in doc["prompts"][5:])
    assert sent["dense"] == sorted(r["hash"] for r in doc["prompts"][6:])
    meta, records, labels = P.merge([part, rest])  # no prompt answered twice by one variant
    assert len(records) == 12 and P.compare(records, "dense", "default")["n"] == 12
    # a new variant against answers dense gave before: no dense server starts, and the files join
    launched.clear()
    assert bench.main(["--model", str(tmp_path / "model"), "--text", f"austen={tmp_path / 'austen.txt'}",
                       "--lengths", "1200", "--prompts", "12", "--ttft-prompts", "0", "--build-workers", "1",
                       "--variants", "dense", "wide=vertical_size=2000", "--prompt-cache", str(tmp_path / "cache"),
                       "--skip-answered", str(out.with_suffix(".json")), "--out", str(tmp_path / "wide"),
                       "--concurrency", "1", "--first", doc["prompts"][9]["id"], doc["prompts"][4]["id"]]) == 0
    assert [label for label, *_ in launched] == ["wide"]
    # --first: those prompts go before the rest (one at a time here, after the warm-up)
    assert {h for *_, h, _, _ in log[-12:-10]} == {doc["prompts"][9]["hash"], doc["prompts"][4]["hash"]}
    wide = json.loads((tmp_path / "wide.json").read_text())
    meta, records, labels = P.merge([doc, wide])
    assert labels == ["dense", "default", "wide"] and P.compare(records, "dense", "wide")["n"] == 12


# ---------------------------------------------------------------------------------------------
# Peers: another project's sparse attention served beside ours (evaluation/peers.py)
# ---------------------------------------------------------------------------------------------

CALIBRATED = {"config_groups": {"group_0": {"algorithm": "skip_softmax", "targets": ["Qwen2Attention"],
                                            "threshold_scale_factor": {"prefill": {"a": 7.9, "b": 8.6}},
                                            "target_sparsity": {"prefill": 0.5}}},
              "producer": {"name": "modelopt", "version": "0.47.0"}}


def _model_folder(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2,
                                                 "num_key_value_heads": 1, "hidden_size": 64,
                                                 "max_position_embeddings": 32768, "rope_theta": 1e6}))
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_peer_model_folder_links_the_weights_keeps_yarn_and_adds_the_sparse_config(tmp_path):
    from vllm_sparse_tools.evaluation import accuracy as acc
    from vllm_sparse_tools.evaluation.peers import Peer, read_sparse_attention_config

    model = _model_folder(tmp_path / "qwen")
    yarn = acc.yarn_model_dir(model, 4, tmp_path / "work")
    out = Peer("modelopt_worker.ModelOptSparseWorker", "", CALIBRATED).model_dir(yarn, tmp_path / "work")
    assert out not in (model, yarn)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).is_symlink() and (out / name).resolve() == (model / name).resolve()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == {**json.loads((yarn / "config.json").read_text()), "sparse_attention_config": CALIBRATED}
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_scaling"]["factor"] == 4
    assert cfg["max_position_embeddings"] == 4 * 32768
    # the folders it was made from are left as they were
    assert "sparse_attention_config" not in (model / "config.json").read_text() + (yarn / "config.json").read_text()

    # the config: the exported config.json or the bare object; a file without groups is refused
    (tmp_path / "export.json").write_text(json.dumps({"model_type": "qwen2", "sparse_attention_config": CALIBRATED}))
    (tmp_path / "bare.json").write_text(json.dumps(CALIBRATED))
    assert read_sparse_attention_config(tmp_path / "export.json") == CALIBRATED
    assert read_sparse_attention_config(tmp_path / "bare.json") == CALIBRATED
    for bad in ({"algorithm": "skip_softmax"}, {"config_groups": {"group_0": {"targets": []}}}, [1]):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"--peer-sparse-config .*bad.json: needs a 'config_groups'"):
            read_sparse_attention_config(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="--peer-sparse-config .*missing.json"):
        read_sparse_attention_config(tmp_path / "missing.json")


def test_peer_server_runs_the_workers_class_on_flash_attn_eager_with_its_pythonpath(tmp_path, monkeypatch):
    from vllm_sparse_tools.evaluation import accuracy as acc
    from vllm_sparse_tools.evaluation.peers import UNCALIBRATED, Peer
    from vllm_sparse_tools.evaluation.variants import parse_variant

    started = []
    monkeypatch.setattr(acc, "start_server", lambda model_dir, args, env, log: started.append((model_dir, args, env)))
    monkeypatch.setenv("PYTHONPATH", "/caller")
    model = _model_folder(tmp_path / "qwen")
    peer = Peer("modelopt_worker.ModelOptSparseWorker", "/site-mo:/peers", UNCALIBRATED)
    kw = dict(workdir=tmp_path / "work", max_model_len=131072, min_sparse_query_len=None, max_density=None,
              cuda=True, as_served=True, shared_gpu=True, max_num_seqs=8, peer=peer)
    for spec in ("modelopt=peer", "dense", "default"):
        acc.launch(model, parse_variant(spec, peers=True), **kw)
    (peer_dir, args, env), (dense_dir, dense_args, dense_env), (_, ours, ours_env) = started
    assert args[args.index("--attention-backend") + 1] == "FLASH_ATTN"
    assert args[args.index("--worker-cls") + 1] == "modelopt_worker.ModelOptSparseWorker"
    assert args.count("--enforce-eager") == 1  # as served otherwise: the peer asks for eager itself
    assert env["PYTHONPATH"] == "/site-mo:/peers:/caller"
    assert not [k for k in env if k.startswith("VLLM_SPARSE_")]
    assert json.loads((peer_dir / "config.json").read_text())["sparse_attention_config"] == UNCALIBRATED
    # the reference and our variant: no worker, no peer path, the model as it is
    assert dense_dir == model and "--worker-cls" not in dense_args + ours and "--enforce-eager" not in dense_args
    assert "PYTHONPATH" not in dense_env and ours[ours.index("--attention-backend") + 1] == "sparse-prefill"
    assert "VLLM_SPARSE_STATS_FILE" in ours_env
    with pytest.raises(ValueError, match="'modelopt' is a peer: it needs the peer's worker \\(--peer-worker-cls\\)"):
        acc.launch(model, parse_variant("modelopt=peer", peers=True), **{**kw, "peer": None})
    with pytest.raises(ValueError, match="a peer runs on CUDA only"):
        acc.server_args(model, 4096, dense=True, cuda=False, worker_cls="m.W")


def test_peer_specs_and_the_errors_that_name_the_missing_flag(tmp_path, monkeypatch, capsys):
    from benchmarks import paired as bench
    from vllm_sparse_tools.evaluation.inputs import choose_variants
    from vllm_sparse_tools.evaluation.variants import Variant, parse_variant

    assert parse_variant("modelopt=peer", peers=True) == Variant("modelopt", None, peer=True)
    v = parse_variant("modelopt=peer", peers=True)
    assert (v.peer, v.dense, v.ours) == (True, False, False)
    assert (parse_variant("dense").dense, parse_variant("default").ours) == (True, True)
    with pytest.raises(ValueError, match="or LABEL=peer"):
        parse_variant("peers")
    # a benchmark that does not serve peers refuses them rather than serving one dense
    with pytest.raises(ValueError, match="variant 'mo=peer': peers run in python -m benchmarks.paired only"):
        choose_variants(["dense", "mo=peer"], tmp_path, "m", tmp_path)
    with pytest.raises(ValueError, match="peers run in python -m benchmarks.paired only"):
        parse_variant("mo=peer")  # load.py parses its specs so
    assert choose_variants(["dense", "mo=peer"], tmp_path, "m", tmp_path, peers=True)[1].peer

    model = _model_folder(tmp_path / "qwen")
    (tmp_path / "austen.txt").write_text(TEXT[:1000])
    monkeypatch.setattr(bench, "cuda_available", lambda: True)
    argv = ["--model", str(model), "--text", f"austen={tmp_path / 'austen.txt'}", "--variants", "dense", "mo=peer",
            "--out", str(tmp_path / "run")]
    for extra, message in (([], "variant 'mo' is a peer: --peer-worker-cls MODULE.CLASS names its vLLM worker"),
                           (["--peer-worker-cls", "m.W", "--peer-sparse-config", str(tmp_path / "qwen" / "config.json")],
                            "--peer-sparse-config .*config.json: needs a 'config_groups' object")):
        with pytest.raises(SystemExit):
            bench.main(argv + extra)
        assert re.search(message, capsys.readouterr().err)
    monkeypatch.setattr(bench, "cuda_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(argv + ["--peer-worker-cls", "m.W"])
    assert "variant 'mo' is a peer: it runs on CUDA only" in capsys.readouterr().err


def test_a_run_with_a_peer_serves_every_variant_eager_and_records_the_peer(tmp_path, monkeypatch):
    from benchmarks import paired as bench
    from vllm_sparse_tools.evaluation import accuracy as acc

    model = _model_folder(tmp_path / "qwen")
    (tmp_path / "austen.txt").write_text(TEXT[:300_000])
    (tmp_path / "calibrated.json").write_text(json.dumps(CALIBRATED))
    launched, log = [], []

    def launch(model_dir, variant, **kw):
        launched.append((variant.label, kw["enforce_eager"], kw["peer"]))
        server = _FakeServer(variant.label, "0", "1234567", log)
        return acc.Launched(variant, "native", server, tmp_path / f"{variant.label}-stats.json",
                            acc.model_config(model_dir), kw["max_model_len"], None)

    monkeypatch.setattr(P, "HFTokenizer", lambda _: PieceTokenizer())
    monkeypatch.setattr(bench, "cuda_available", lambda: True)
    monkeypatch.setattr(bench, "wait_ready", lambda handle, timeout: 0.0)
    monkeypatch.setattr(bench, "STATS_INTERVAL_S", 0.0)
    monkeypatch.setattr(acc, "launch", launch)
    assert bench.main(["--model", str(model), "--text", f"austen={tmp_path / 'austen.txt'}", "--lengths", "1200",
                       "--prompts", "4", "--ttft-prompts", "1", "--variants", "dense", "modelopt=peer",
                       "--peer-worker-cls", "modelopt_worker.ModelOptSparseWorker", "--peer-pythonpath", "/site-mo",
                       "--peer-sparse-config", str(tmp_path / "calibrated.json"), "--build-workers", "1",
                       "--prompt-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run")]) == 0
    peer = launched[0][2]
    assert (peer.worker_cls, peer.pythonpath, peer.sparse_attention_config) == (
        "modelopt_worker.ModelOptSparseWorker", "/site-mo", CALIBRATED)
    assert launched == [("dense", True, peer), ("modelopt", True, peer)]  # eager both: TTFTs eager to eager
    meta = json.loads((tmp_path / "run.json").read_text())["meta"]
    assert meta["enforce_eager"] and meta["variants"] == {"dense": None, "modelopt": "peer"}
    assert meta["peer"] == {"worker_cls": "modelopt_worker.ModelOptSparseWorker", "sparse_attention_config": CALIBRATED}
    assert "density" not in meta  # the peer writes no statistics file of ours
