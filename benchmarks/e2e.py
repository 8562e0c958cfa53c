"""End-to-end prefill through vLLM's offline engine: FLASH_ATTN vs sparse-prefill, side by side.

Writes a dummy-weight model folder (Llama-3-8B shape by default, ``--load-format dummy``), then
runs each backend in its own subprocess (a fresh engine each), feeding random token ids of each
length and timing one ``generate`` with max_tokens=1 (prefill + first token, best of --repeats).
With ``--check-tokens`` it also generates 8 greedy tokens per prompt and reports whether the
sparse backend's tokens equal FLASH_ATTN's (use a density-1 configuration for that check:
``--sparse-env VLLM_SPARSE_VERTICAL_SIZE=1000000 VLLM_SPARSE_SLASH_SIZE=1000000``).

    python benchmarks/e2e.py --layers 32 --lengths 8192 32768 131072 --check-tokens

Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, rope_theta=500000.0)


def write_model(out: Path, layers: int, max_len: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
           "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
           **LLAMA3_8B}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def worker(args) -> None:
    """One backend, one engine: print one JSON line per prompt length."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              attention_backend=args.backend, max_model_len=args.max_len, enforce_eager=True,
              max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
              gpu_memory_utilization=0.85, seed=0)
    rng = random.Random(0)
    for n in args.lengths:
        ids = [rng.randrange(10, 100000) for _ in range(n)]
        prompt = {"prompt_token_ids": ids}
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            times.append(time.perf_counter() - t0)
        tokens = None
        if args.check_tokens:
            out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               use_tqdm=False)
            tokens = list(out[0].outputs[0].token_ids)
        print("RESULT " + json.dumps({"backend": args.backend, "n": n, "prefill_s": min(times), "tokens": tokens}),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--backends", nargs="+", default=["FLASH_ATTN", "sparse-prefill"])
    ap.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--check-tokens", action="store_true")
    ap.add_argument("--sparse-env", nargs="*", default=[], help="VAR=VALUE settings for the sparse backend")
    ap.add_argument("--log-dir", default=os.environ.get("OUT", "."), help="full stderr of each backend's run goes here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    max_len = max(args.lengths) + 64
    model = write_model(Path(tempfile.mkdtemp(prefix="e2e-model-")), args.layers, max_len)
    results: dict[tuple[str, int], dict] = {}
    for backend in args.backends:
        env = dict(os.environ)
        if backend != "FLASH_ATTN":
            env.update(kv.split("=", 1) for kv in args.sparse_env)
        cmd = [sys.executable, __file__, "--worker", "--backend", backend, "--model", str(model),
               "--max-len", str(max_len), "--chunk", str(args.chunk), "--repeats", str(args.repeats),
               "--lengths", *map(str, args.lengths)] + (["--check-tokens"] if args.check_tokens else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log = Path(args.log_dir) / f"e2e-{backend}.stderr.log"
        log.write_text(proc.stderr)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[(backend, r["n"])] = r
        if proc.returncode != 0:
            # The root cause is the first traceback (often the engine core's), not the tail.
            lines = proc.stderr.splitlines()
            first = next((i for i, l in enumerate(lines) if "Traceback" in l), max(0, len(lines) - 40))
            print(f"[{backend}] exit {proc.returncode}; full stderr in {log}; first traceback:\n"
                  + "\n".join(lines[first:first + 60]))

    import torch
    import vllm
    print(f"\ndevice {torch.cuda.get_device_name()}, vllm {vllm.__version__}, torch {torch.__version__}, "
          f"{args.layers} layers Llama-3-8B shape, bf16, eager, chunk {args.chunk}, sparse env {args.sparse_env}")
    base = args.backends[0]
    print("| n | " + " | ".join(f"{b} s" for b in args.backends) + " | speedup | tokens equal |")
    print("|---" * (len(args.backends) + 3) + "|")
    for n in args.lengths:
        row = [results.get((b, n)) for b in args.backends]
        times = ["-" if r is None else f"{r['prefill_s']:.3f}" for r in row]
        speed = "-"
        if row[0] and row[-1]:
            speed = f"{row[0]['prefill_s'] / row[-1]['prefill_s']:.2f}x"
        equal = "-"
        if args.check_tokens and row[0] and row[-1]:
            equal = str(row[0]["tokens"] == row[-1]["tokens"])
        print(f"| {n} | " + " | ".join(times) + f" | {speed} | {equal} |")


if __name__ == "__main__":
    main()
