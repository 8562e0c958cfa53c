"""One vLLM engine (offline ``vllm.LLM``) on CUDA, run by ``tests/server/test_gpu_vllm_cuda.py`` in
its own process: the prompts of each scenario, greedy, and what the test compares, written as
JSON to ``--out``. The sparse settings come from the environment (``VLLM_SPARSE_*``), as in
``vllm serve``.

    python tests/_vllm_cuda_child.py --model DIR --backend FLASH_ATTN|sparse-prefill [--graphs]
        --scenarios long chunked mixed prefix decode --out result.json

Prompts are token ids cut from this repository's documentation and source (real text, present
wherever the tests run, no download), the same ids in every engine: each scenario reads its own
part of the text, so that no scenario hits the prefix cache of another.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 16384
CHUNK = 4096  # max_num_batched_tokens: longer prompts are prefilled in chunks of this many tokens
NEW_TOKENS = 8
DECODE_TOKENS = 24
TOP_LOGPROBS = 20  # per generated token: enough to find the other engine's token near the top
# One uniform decode batch of this many requests replays a full CUDA graph of this size.
CAPTURE_SIZES = [1, 2, 4, 8]
FLUSH_PROMPT = list(range(1000, 1032))  # short: runs dense, moves no sparse counter


def corpus_ids(tokenizer) -> list[int]:
    """The repository's docs and backend source, in a fixed order, as token ids."""
    files = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "vllm_sparse_backend").rglob("*.py"))
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    return tokenizer.encode(text, add_special_tokens=False)


def scenario_prompts(ids: list[int]) -> dict[str, list[list[int]]]:
    """Each scenario's prompts (token ids), from disjoint parts of ``ids``."""
    need = 60_000
    if len(ids) < need:
        raise SystemExit(f"the repository's text gives {len(ids)} tokens, fewer than {need}")
    long_alone = ids[0:3500]                    # one chunk (< CHUNK), a lone long row
    chunked = ids[4000:16000]                   # three chunks: the later ones with cached context
    mixed = [ids[17000:20000],                  # one long row and three short rows in one step
             ids[20000:20300], ids[20500:20700], ids[21000:21500]]
    prefix = ids[22000:28000]                   # shared by two prompts: the second hits the cache
    prefix_prompts = [prefix + ids[28000:29500], prefix + ids[30000:31500]]
    decode = [ids[32000:35000], ids[36000:36400], ids[37000:37300], ids[38000:38500]]
    return {"long": [long_alone], "chunked": [chunked], "mixed": mixed, "prefix": prefix_prompts,
            "decode": decode}


def _generated(output) -> dict:
    """Greedy token ids, and per position the top log-probabilities as [[token, logprob], ...]."""
    completion = output.outputs[0]
    top = [[[tok, lp.logprob] for tok, lp in sorted(pos.items(), key=lambda kv: -kv[1].logprob)]
           for pos in (completion.logprobs or [])]
    prompt_lp = None
    if output.prompt_logprobs is not None:
        ids = output.prompt_token_ids
        prompt_lp = [None if pos is None else pos[ids[i]].logprob for i, pos in enumerate(output.prompt_logprobs)]
    return {"tokens": list(completion.token_ids), "top": top, "prompt_logprobs": prompt_lp,
            "cached_tokens": output.num_cached_tokens}


def _stats(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    return json.loads(Path(path).read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--graphs", action="store_true", help="full CUDA graphs for decode batches")
    p.add_argument("--scenarios", nargs="+", required=True)
    p.add_argument("--prompt-logprobs", action="store_true",
                   help="also each prompt token's log-probability (long and chunked scenarios)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from vllm import LLM, SamplingParams

    # Without torch.compile (mode 0): the graphs are vLLM's full CUDA graphs of uniform decode
    # batches, captured in seconds; prefill and mixed steps run eagerly, as they do under any mode
    # (attention is never inside a piecewise graph).
    graphs = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                     "cudagraph_capture_sizes": CAPTURE_SIZES}} if args.graphs else {}
    llm = LLM(model=args.model, dtype="bfloat16", attention_backend=args.backend, max_model_len=MAX_MODEL_LEN,
              max_num_batched_tokens=CHUNK, enable_prefix_caching=True, enforce_eager=not args.graphs,
              gpu_memory_utilization=0.5, max_num_seqs=8, seed=0, **graphs)
    config = llm.llm_engine.vllm_config
    prompts = scenario_prompts(corpus_ids(llm.get_tokenizer()))
    stats_file = os.environ.get("VLLM_SPARSE_STATS_FILE")
    result = {"backend": args.backend, "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
              "num_layers": config.model_config.hf_text_config.num_hidden_layers, "scenarios": {}}

    def greedy(n: int, prompt_logprobs: bool = False) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=TOP_LOGPROBS,
                              prompt_logprobs=0 if prompt_logprobs else None)

    for name in args.scenarios:
        batch = [{"prompt_token_ids": ids} for ids in prompts[name]]
        if name == "prefix":  # the first prompt fills the cache; the second is the one compared
            llm.generate(batch[:1], greedy(1), use_tqdm=False)
            batch = batch[1:]
        want_lp = args.prompt_logprobs and name in ("long", "chunked")
        n = DECODE_TOKENS if name == "decode" else NEW_TOKENS
        outputs = llm.generate(batch, greedy(n, want_lp), use_tqdm=False)
        # A few forwards more: the sparse path's counts still on the device reach the stats file
        # at the next step (stats.refresh, in the builder), so the file read below holds this scenario whole.
        llm.generate([{"prompt_token_ids": FLUSH_PROMPT}], greedy(2), use_tqdm=False)
        result["scenarios"][name] = {"prompt_lens": [len(b["prompt_token_ids"]) for b in batch],
                                     "requests": [_generated(o) for o in outputs],
                                     "stats": _stats(stats_file)}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
