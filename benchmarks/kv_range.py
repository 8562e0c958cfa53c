"""How far a model's queries, keys and values reach, layer by layer: does an fp8 (e4m3) KV cache fit it?

vLLM's ``--kv-cache-dtype fp8`` stores K and V as e4m3 divided by a per-layer scale (1.0 when the
checkpoint has none, which is every model this project can fetch offline), and with FlashAttention
3 quantizes the query the same way. e4m3 keeps 3 mantissa bits: a value v is stored to within
half a step of 2^(floor(log2 |v|) - 3), i.e. about 6% of |v|, and nothing above 448 fits. A
component of hundreds (Qwen2's k_proj biases) then moves every score it enters by tens.

This runs the model in transformers (fp32, CPU is fine) on a stretch of text and prints, per
layer, the largest |q|, |k| and |v| the projections produce (biases included, before RoPE) and
the largest norm of a RoPE pair of q and k (RoPE rotates each pair, so a cached component can
reach that norm but no more), with the e4m3 step at the largest cached value::

    python -m benchmarks.kv_range --model qwen-coder-1.5b --tokens 2048

Qwen2.5-Coder-1.5B-Instruct on 2,048 tokens of Austen (2026-11-25,
``benchmarks/results/kv_range_cpu_qwen-coder-1.5b_2026-11-25.txt``): |k| reaches 359 in layer 0
(a RoPE pair of norm 461, past e4m3's 448; steps of 32 there) and 112 in layer 1 (10-70
elsewhere), |v| at most 22; vLLM's fp8 KV cache (scale 1.0) turns its answers into word salad
with FLASH_ATTN and with this backend alike
(``benchmarks/results/accuracy_h100_qwen-coder-1.5b_fp8kv130k_2026-11-25.*``).
"""

from __future__ import annotations

import argparse
import math

import torch

if not __package__:
    raise SystemExit("run from the repository root: python -m benchmarks.kv_range ...")

E4M3_MAX = 448.0


def e4m3_step(x: float) -> float:
    """Spacing of e4m3 values around |x| (normal range; subnormals below 2^-6 are 2^-9 apart)."""
    if x < 2.0 ** -6:
        return 2.0 ** -9
    return 2.0 ** (math.floor(math.log2(x)) - 3)


def _pair_norm_max(x: torch.Tensor, head_dim: int) -> float:
    """Largest norm of the (i, i + head_dim / 2) pairs that RoPE rotates together ([..., H * D])."""
    h = x.reshape(*x.shape[:-1], -1, head_dim)
    half = head_dim // 2
    return float(torch.sqrt(h[..., :half] ** 2 + h[..., half:] ** 2).amax())


@torch.no_grad()
def kv_ranges(model, input_ids: torch.Tensor) -> list[dict]:
    """Per decoder layer: max |q|, |k|, |v| of the projections (before RoPE) and the max RoPE pair
    norm of q and k, over the tokens of ``input_ids`` ([1, T])."""
    layers = model.model.layers
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    seen: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            def keep(mod, inp, out, key=(i, name)):
                seen[key] = out.detach().float()
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(keep))
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for i in range(len(layers)):
        q, k, v = (seen[i, n] for n in ("q_proj", "k_proj", "v_proj"))
        rows.append({"layer": i, "q": float(q.abs().amax()), "k": float(k.abs().amax()), "v": float(v.abs().amax()),
                     "q_pair": _pair_norm_max(q, head_dim), "k_pair": _pair_norm_max(k, head_dim)})
    return rows


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_sparse_tools.evaluation import inputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen-coder-1.5b", help=f"{', '.join(inputs.MODELS)}, or a model folder")
    ap.add_argument("--text", default="austen", help=f"{', '.join(inputs.TEXTS)}, or a text file")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--offset", type=int, default=200_000, help="characters of the text skipped first")
    args = ap.parse_args(argv)
    model_dir, name = inputs.resolve_model(args.model)
    text, text_name = inputs.resolve_text(args.text)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    body = text[args.offset:args.offset + 8 * args.tokens]
    ids = tok(body, return_tensors="pt").input_ids[:, :args.tokens]
    rows = kv_ranges(model, ids)
    print(f"# {name}, {ids.shape[1]} tokens of {text_name}: largest |x| per layer (biases included, "
          f"before RoPE); 'pair' = largest RoPE pair norm (what a cached component can reach); e4m3 holds "
          f"up to {E4M3_MAX:g}, in steps of 1/8 of the power of two below the value")
    print("| layer | max q | max q pair | max k | max k pair | e4m3 step at k pair | max v |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['q']:.1f} | {r['q_pair']:.1f} | {r['k']:.1f} | {r['k_pair']:.1f} | "
              f"{e4m3_step(r['k_pair']):g} | {r['v']:.1f} |")
    worst = max(rows, key=lambda r: r["k_pair"])
    over = [r["layer"] for r in rows if max(r["k_pair"], r["q_pair"], r["v"]) > E4M3_MAX]
    print(f"largest cached |k| bound: {worst['k_pair']:.1f} (layer {worst['layer']}); layers past e4m3's "
          f"{E4M3_MAX:g} at scale 1: {over or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
