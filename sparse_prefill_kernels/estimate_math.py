"""Torch arithmetic on pooled attention scores that both estimators of an index share: the GPU
ones (:mod:`.estimate`) and the package's torch reference estimators (``vllm_sparse_backend.patterns``).
Torch only (no triton)."""

from __future__ import annotations

import torch

from .index_format import num_blocks


def block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n, h, D] -> [h, ceil(n / block_size), D]: mean of each block of ``block_size`` rows (the
    last block may be short). Queries are blocked from the chunk start, keys from position 0."""
    n, h, d = x.shape
    nb = num_blocks(n, block_size)
    pad = nb * block_size - n
    sums = torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad)).view(nb, block_size, h, d).sum(1)
    # the last block holds block_size - pad rows (built with device ops: no host-to-device write)
    counts = torch.full((nb,), float(block_size), device=x.device) - pad * (torch.arange(nb, device=x.device) == nb - 1)
    return (sums / counts[:, None, None]).transpose(0, 1)


def sum_head_groups(x: torch.Tensor, n: int) -> torch.Tensor:
    """Sum of every ``n`` consecutive heads (leading axis): [h, ...] -> [h // n, ...]."""
    return x if n == 1 else x.reshape(x.shape[0] // n, n, *x.shape[1:]).sum(1)


def cumulative_budget(scores: torch.Tensor, gamma: torch.Tensor | float) -> torch.Tensor:
    """Smallest k per row such that the k largest normalised scores sum to >= gamma. [h] int64."""
    total = scores.sum(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    sorted_scores = (scores / total).sort(-1, descending=True).values
    csum = sorted_scores.cumsum(-1)
    gamma = torch.as_tensor(gamma, dtype=csum.dtype, device=csum.device).reshape(-1, 1)
    # number of prefixes still below gamma, plus the one that reaches it
    k = (csum < gamma).sum(-1) + 1
    return k.clamp(max=scores.shape[-1])


def sqrt_js_divergence(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """sqrt(JSD(p || q)) over the last dim, natural log; p and q are distributions."""
    m = 0.5 * (p + q)

    def kl(a, b):
        return torch.where(a > 0, a * (torch.log(a.clamp_min(eps)) - torch.log(b.clamp_min(eps))),
                           torch.zeros_like(a)).sum(-1)

    return torch.sqrt((0.5 * (kl(p, m) + kl(q, m))).clamp_min(0.0))


def rescale_block_mask(mask: torch.Tensor, from_b: int, to_b: int, nqb: int, nkb: int) -> torch.Tensor:
    """Block mask at block size from_b -> block size to_b (any-pooling when coarsening)."""
    if from_b > to_b:
        r = from_b // to_b
        mask = mask.repeat_interleave(r, dim=1).repeat_interleave(r, dim=2)
    elif from_b < to_b:
        r = to_b // from_b
        h, a, b = mask.shape
        mask = torch.nn.functional.pad(mask, (0, (-b) % r, 0, (-a) % r))
        mask = mask.view(h, mask.shape[1] // r, r, mask.shape[2] // r, r).any(4).any(2)
    return mask[:, :nqb, :nkb]
