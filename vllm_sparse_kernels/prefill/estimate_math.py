"""Torch arithmetic on pooled attention scores that both estimators of an index share: the GPU
ones (:mod:`.estimate`) and the package's torch reference estimators (``vllm_sparse_backend.patterns``).
Torch only (no triton)."""

from __future__ import annotations

import torch

from ..index_format import num_blocks

# ``normalizer_sample``: the keys the last-q estimate's row sums always read whole, from the start
# (the sinks) and before the first query (the window), around the sampled middle; and the tile
# that is read or skipped as one (the last-q kernels' key tile).
NORMALIZER_FIRST_KEYS = 1024
NORMALIZER_WINDOW = 4096
NORMALIZER_TILE = 64
# Queries per call of the GPU last-q estimator (``vs_index.LAST_Q``): a longer last-q window is
# taken 64 queries at a time from the chunk's end, each call normalising its own rows.
LAST_QUERIES_PER_CALL = 64
# A sampled normaliser's max is of the keys read: a skipped key may score above it, so the
# exponent of a probability is capped here (fp32 exp overflows past 88).
SAMPLED_EXP_CAP = 80.0


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
    if isinstance(gamma, torch.Tensor):
        gamma = gamma.to(dtype=csum.dtype, device=csum.device).reshape(-1, 1)
    # (a Python number stays one: copying it to the GPU would wait for the device)
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


def antidiagonal_block_mass(q: torch.Tensor, k: torch.Tensor, ctx_len: int, stride: int, block_size: int,
                            scale: float, share: int = 1) -> torch.Tensor:
    """Estimated softmax mass of each (query block, key block) pair: fp32 [H // share, NQB, NKB].

    q: [q_len, H, D] the chunk's queries; k: [ctx_len + q_len, Hkv, D] every key of the row
    (query head h reads KV head h // (H / Hkv)). Each ``stride`` x ``stride`` cell of the score
    map is represented by the logits on its anti-diagonal and on the one next to it,
    q[i*s + s-1-t] . (k[j*s + t] + k[j*s + t + 1]) summed over t (XAttention's anti-diagonal
    scoring, widened to two lines: one anti-diagonal meets only the diagonals of one parity,
    so a single slash line could fall between them in every cell). Unlike a mean-pooled block,
    the two lines cross every diagonal and every column of the cell, so neither a slash nor a
    vertical line is averaged away. One matmul of the strided, reversed queries against the
    strided key pairs computes all cells (1 / stride of dense attention's QK work). The cell
    sums, divided by ``stride``, are softmaxed over each strided query row's causal cells (a
    cell is causal when its first key is at or before the row's last query), and the
    probabilities are summed per block: every block row then holds ``block_size / stride`` of
    mass (less in a short last block). Non-causal blocks hold 0. ``share`` > 1: the mass of
    every ``share`` consecutive heads is added (a KV group's
    selection). Query rows are strided from the chunk start, keys from position 0.
    """
    q_len, h, d = q.shape
    kv_len, hkv, _ = k.shape
    s = stride
    if block_size % s:
        raise ValueError(f"antidiagonal stride {s} does not divide block_size {block_size}")
    nqs, nks = num_blocks(q_len, s), num_blocks(kv_len, s)
    qs = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, nqs * s - q_len)).view(nqs, s, h, d).flip(1)
    qs = qs.permute(2, 0, 1, 3).reshape(hkv, (h // hkv) * nqs, s * d)
    kz = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, nks * s + 1 - kv_len))
    ks = (kz[:-1] + kz[1:]).view(nks, s, hkv, d)  # k[x] + k[x + 1]: both anti-diagonals in one operand
    ks = ks.permute(2, 0, 1, 3).reshape(hkv, nks, s * d)
    # GQA without expanding K: a group's query rows share one [nks, s * D] operand
    cells = torch.matmul(qs, ks.transpose(1, 2)).view(h, nqs, nks).float().mul_(scale / s)
    last_q = ctx_len + torch.clamp(torch.arange(nqs, device=q.device) * s + s - 1, max=q_len - 1)
    future = torch.arange(nks, device=q.device)[None, :] * s > last_q[:, None]
    probs = torch.softmax(cells.masked_fill_(future, float("-inf")), dim=-1)
    del cells
    r = block_size // s
    nqb, nkb = num_blocks(q_len, block_size), num_blocks(kv_len, block_size)
    probs = torch.nn.functional.pad(probs, (0, nkb * r - nks, 0, nqb * r - nqs))
    mass = probs.view(h, nqb, r, nkb, r).sum((2, 4))
    return sum_head_groups(mass, share)


def mass_block_counts(mass: torch.Tensor, topk: torch.Tensor, block_mass: float | None) -> torch.Tensor:
    """Key blocks to keep per block row of ``mass`` [h, NQB, NKB]: int64 [h * NQB], the head's
    ``topk`` [h], or with ``block_mass`` the fewest blocks whose mass reaches that share of the
    row's (:func:`cumulative_budget`), at most ``topk``."""
    h, nqb, nkb = mass.shape
    k = topk.to(device=mass.device, dtype=torch.int64).repeat_interleave(nqb)
    if block_mass is None:
        return k
    return torch.minimum(k, cumulative_budget(mass.reshape(h * nqb, nkb), block_mass))


def sampled_block_mass(q: torch.Tensor, k: torch.Tensor, ctx_len: int, block_size: int, scale: float,
                       samples: int, share: int = 1, max_scores: int = 1 << 26) -> torch.Tensor:
    """Estimated softmax mass of each (query block, key block) pair from a few real queries of
    each query block: fp32 [H // share, NQB, NKB].

    q: [q_len, H, D] the chunk's queries; k: [ctx_len + q_len, Hkv, D] every key of the row. For
    every query block, ``samples`` of its queries (the last one and others ``block_size //
    samples`` apart going back, kept inside the block) get their exact causal softmax over all
    keys; their probabilities are summed per key block and averaged, so every block row holds
    1 of mass, and a share of it (``block_mass``) is a share of real attention. This is what a
    query block's own rows attend to, seen through a sample of them, instead of a pooled or
    strided summary (it costs ``samples / block_size`` of dense attention's QK work). The
    scores are computed for a slice of query blocks at a time, at most ``max_scores`` fp32
    values. ``share`` > 1: the mass of every ``share`` consecutive heads is added."""
    q_len, h, d = q.shape
    kv_len, hkv, _ = k.shape
    b, m = block_size, max(1, min(samples, block_size))
    g = h // hkv
    nqb, nkb = num_blocks(q_len, b), num_blocks(kv_len, b)
    dev = q.device
    starts = torch.arange(nqb, device=dev) * b
    last = torch.clamp(starts + b, max=q_len) - 1
    rows = torch.maximum(last[:, None] - torch.arange(m, device=dev)[None, :] * (b // m), starts[:, None])  # [NQB, m]
    kt = k.permute(1, 2, 0)  # [Hkv, D, kv_len]
    keys = torch.arange(kv_len, device=dev)
    mass = torch.empty(h, nqb, nkb, dtype=torch.float32, device=dev)
    step = max(1, max_scores // (h * m * kv_len))
    for s0 in range(0, nqb, step):  # slices of query blocks: host ints, no device read
        r = rows[s0:s0 + step].reshape(-1)  # [n]
        n = r.shape[0]
        qs = q[r].view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
        logits = torch.matmul(qs, kt).view(h, n, kv_len).float().mul_(scale)
        logits.masked_fill_(keys[None, None, :] > (r + ctx_len)[None, :, None], float("-inf"))
        p = torch.softmax(logits, dim=-1)
        del logits
        p = torch.nn.functional.pad(p, (0, nkb * b - kv_len)).view(h, n // m, m, nkb, b)
        mass[:, s0:s0 + step] = p.sum(-1).mean(2)
    return sum_head_groups(mass, share)


def scored_block_mass(scoring: str, q: torch.Tensor, k: torch.Tensor, ctx_len: int, block_size: int, scale: float,
                      share: int = 1, *, stride: int = 16, samples: int = 2) -> torch.Tensor:
    """The block mass of ``block_scoring`` ``"antidiagonal"`` (:func:`antidiagonal_block_mass`,
    ``stride``) or ``"sampled"`` (:func:`sampled_block_mass`, ``samples``): fp32 [H // share, NQB, NKB]."""
    if scoring == "antidiagonal":
        return antidiagonal_block_mass(q, k, ctx_len, stride, block_size, scale, share)
    if scoring == "sampled":
        return sampled_block_mass(q, k, ctx_len, block_size, scale, samples, share)
    raise ValueError(f"block scoring {scoring!r} has no block mass")


def sampled_normalizer_region(q0_pos: int, sample: int, first_keys: int = NORMALIZER_FIRST_KEYS,
                              window: int = NORMALIZER_WINDOW) -> tuple[int, int]:
    """The keys [far_lo, far_hi) whose row sums a sampled pass 1 (``normalizer_sample`` =
    ``sample`` > 1) estimates from one key tile (64 keys) in ``sample``, tiles from far_lo on; both
    ends on that grid: far_lo the first at or after ``first_keys``, far_hi the last at or before
    ``window`` keys ahead of the first query (position ``q0_pos``). (0, 0) when ``sample`` is 1."""
    if sample < 1:
        raise ValueError(f"normalizer_sample {sample}: at least 1")
    if sample == 1:
        return 0, 0
    step = NORMALIZER_TILE * sample
    far_lo = -(-first_keys // step) * step
    return far_lo, max(far_lo, (q0_pos - window) // step * step)


def sampled_softmax(s: torch.Tensor, key_pos: torch.Tensor, q0_pos: int, sample: int,
                    first_keys: int = NORMALIZER_FIRST_KEYS, window: int = NORMALIZER_WINDOW) -> torch.Tensor:
    """softmax over the last dim of scores ``s`` [..., keys] (-inf where masked) as a sampled
    pass 1 normalises it: the row max and sum over the keys it reads (the keys outside
    :func:`sampled_normalizer_region`, and one tile in ``sample`` inside it, that tile's sum
    counted ``sample`` times), the exponent capped at :data:`SAMPLED_EXP_CAP`. ``key_pos``: the
    position of each key; ``q0_pos``: the first query's. ``sample`` 1: the softmax itself."""
    if sample == 1:
        return torch.softmax(s, dim=-1)
    far_lo, far_hi = sampled_normalizer_region(q0_pos, sample, first_keys, window)
    inside = (key_pos >= far_lo) & (key_pos < far_hi)
    read = ~inside | ((key_pos - far_lo) // NORMALIZER_TILE % sample == 0)
    weight = torch.where(inside, float(sample), 1.0) * read
    seen = torch.where(read, s, float("-inf"))  # a skipped key may be far above the max: no exp of it
    m = seen.amax(-1, keepdim=True)
    l = (torch.exp(seen - m) * weight).sum(-1, keepdim=True)
    return torch.exp((s - m).clamp(max=SAMPLED_EXP_CAP)) / l
