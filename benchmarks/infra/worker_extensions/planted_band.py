"""The planted RoPE band of ``benchmarks/e2e.py`` (``--structure band``), as a vLLM worker extension.

Dummy weights make every attention row nearly uniform, where no sparse pattern finds anything to
skip. :func:`plant_band` rewrites the dummy weights of one worker in place so that attention has
the local band real long-context heads show (see e2e.py's module doc for the construction).

It reaches the workers the one way both vLLM's offline engine and its HTTP server offer: the
engine is started with ``worker_extension_cls="planted_band.PlantedBandWorker"`` (this folder on
``PYTHONPATH``), which adds the method ``plant_band`` to every worker, and the benchmark calls it
by name (``LLM.collective_rpc("plant_band")``, or ``POST /collective_rpc {"method": "plant_band"}``
on a server started with ``VLLM_SERVER_DEV_MODE=1``). Nothing is pickled: only the name travels.
"""

from __future__ import annotations

WORKER_EXTENSION = "planted_band.PlantedBandWorker"


def plant_band(worker, logit_at_zero: float = 12.0) -> str:
    """Rewrite one worker's (one tensor-parallel rank's) dummy weights: see the module doc."""
    import torch

    inner = worker.model_runner.model.model
    with torch.no_grad():
        emb = inner.embed_tokens.weight
        gen = torch.Generator(device=emb.device).manual_seed(0)
        common = torch.randn(emb.shape[1], generator=gen, device=emb.device)
        emb.mul_(300.0).add_(common.to(emb.dtype))  # uniform +-1e-3 -> +-0.3 around one vector
        x = common / common.pow(2).mean().sqrt()  # what an input norm of weight 1 makes of it
        for layer in inner.layers:
            attn = layer.self_attn
            layer.input_layernorm.weight.fill_(1.0)
            h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
            w = attn.qkv_proj.weight  # [(h + 2 hkv) * d, hidden]: q rows, k rows, v rows
            k = w[h * d:(h + hkv) * d].view(hkv, d, -1)
            theta = attn.rotary_emb.base ** (-torch.arange(0, d, 2, device=w.device, dtype=torch.float32) / d)
            k.mul_(theta.repeat(2).pow(-0.25)[None, :, None].to(w.dtype))  # neox pairs (i, i + d/2)
            q0 = k[0].float() @ x
            k.mul_(float((logit_at_zero * d ** 0.5 / q0.pow(2).sum()) ** 0.5))
            w[:h * d].view(hkv, h // hkv, d, -1).copy_(k[:, None].expand(hkv, h // hkv, d, k.shape[-1]))
    return f"band planted in {len(inner.layers)} layers"


class PlantedBandWorker:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; ``self`` is the worker."""

    def plant_band(self) -> str:
        return plant_band(self)
