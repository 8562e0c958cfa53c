"""Exact sparse attention in plain PyTorch: the CPU serving path (and setting kernel=torch).

Computes softmax(Q K^T * scale + mask) V where mask allows exactly the (query, key) pairs of a
:class:`SparseIndex` that are causal. It favours clarity over speed, but it only touches the
selected keys: work and memory grow with the selected area, not with the full n x n square.
Tests check it against the float64 dense oracle of :mod:`.reference.dense`, and the Triton
kernels against it in float64.

GQA is handled by indexing K/V with ``kv_head = q_head // group`` (no repeated KV tensors).

Torch only (no triton): the CPU serving path imports it.
"""

from __future__ import annotations

import torch

from .index_format import SparseIndex, range_stops
from .kv_layout import kv_head_map

# Upper bound on gathered key elements per step (query blocks are processed in groups).
_GATHER_BUDGET = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _selected_positions(index: SparseIndex, qb0: int, qb1: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions [G, H, K] and validity [G, H, K] for query blocks qb0..qb1-1."""
    b = index.block_size
    within = torch.arange(b, device=index.block_index.device)
    blocks = index.block_index[:, qb0:qb1].transpose(0, 1).to(torch.int64)  # [G, H, MAXB]
    pos_b = blocks[..., None].clamp(min=0) * b + within
    ok_b = (blocks[..., None] >= 0) & (pos_b < kv_len)
    starts = index.range_start[:, qb0:qb1].transpose(0, 1)  # [G, H, MAXR]
    pos_r = starts.to(torch.int64)[..., None].clamp(min=0) + within
    ok_r = (starts[..., None] >= 0) & (pos_r < range_stops(starts, b)[..., None]) & (pos_r < kv_len)
    cols = index.column_index[:, qb0:qb1].transpose(0, 1).to(torch.int64)  # [G, H, MAXC]
    g, h = blocks.shape[:2]
    ok = torch.cat([ok_b.reshape(g, h, -1), ok_r.reshape(g, h, -1), cols >= 0], dim=-1)
    pos = torch.cat([pos_b.reshape(g, h, -1), pos_r.reshape(g, h, -1), cols], dim=-1).clamp(0, kv_len - 1)
    return pos, ok


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    ctx_len: int,
    scale: float,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Sparse attention of one row.

    q: [q_len, H, D]; k: [kv_len, Hkv, D]; v: [kv_len, Hkv, Dv] with kv_len = ctx_len + q_len.
    Returns (out [q_len, H, Dv] in q's dtype, number of (query, key) pairs computed over all heads).
    Rows whose selection is empty (impossible for indices built by this package, which always
    keep the diagonal block) get a zero output.
    """
    q_len, h, d = q.shape
    kv_len, hkv, dv = v.shape
    if k.shape[0] != kv_len or kv_len != ctx_len + q_len:
        raise ValueError(f"kv_len={kv_len} (k: {k.shape[0]}) must equal ctx_len + q_len = {ctx_len + q_len}")
    b = index.block_size
    ct = compute_dtype(q.dtype)
    if out is None:
        out = torch.empty(q_len, h, dv, dtype=q.dtype, device=q.device)
    kvh = kv_head_map(h, hkv, q.device)
    # Flattened [Hkv * kv_len, D] views so one gather serves all heads: row = kv_head * kv_len + pos.
    k_flat = k.transpose(0, 1).reshape(hkv * kv_len, d)
    v_flat = v.transpose(0, 1).reshape(hkv * kv_len, dv)
    width = (index.block_index.shape[-1] + index.range_start.shape[-1]) * b + index.column_index.shape[-1]
    group = max(1, _GATHER_BUDGET // max(1, h * width * max(d, dv)))
    nqb = index.num_query_blocks
    computed = 0
    for qb0 in range(0, nqb, group):
        qb1 = min(nqb, qb0 + group)
        r0, r1 = qb0 * b, min(q_len, qb1 * b)
        pos, ok = _selected_positions(index, qb0, qb1, kv_len)  # [G, H, K]
        g = qb1 - qb0
        rows = torch.arange(r0, qb1 * b, device=q.device)  # may run past q_len in the last block
        qpos = (rows + ctx_len).view(g, 1, b, 1)
        allowed = ok[:, :, None, :] & (pos[:, :, None, :] <= qpos) & (rows < q_len).view(g, 1, b, 1)
        flat = kvh.view(1, h, 1) * kv_len + pos
        kg = k_flat.index_select(0, flat.reshape(-1)).view(*flat.shape, d).to(ct)  # [G, H, K, D]
        vg = v_flat.index_select(0, flat.reshape(-1)).view(*flat.shape, dv).to(ct)
        qg = torch.zeros(g * b, h, d, dtype=ct, device=q.device)
        qg[: r1 - r0] = q[r0:r1].to(ct)
        qg = qg.view(g, b, h, d).transpose(1, 2)  # [G, H, B, D]
        o = _masked_attention(qg, kg, vg, allowed, scale, softcap)
        out[r0:r1] = o.transpose(1, 2).reshape(g * b, h, dv)[: r1 - r0].to(out.dtype)
        # Pairs computed: for each selected key, the rows of its query block at or after it.
        q_last = torch.clamp(torch.arange(qb0, qb1, device=q.device) * b + b, max=q_len) - 1 + ctx_len
        n_rows = torch.clamp(q_last - (torch.arange(qb0, qb1, device=q.device) * b + ctx_len) + 1, min=0)
        per_key = torch.minimum(q_last.view(g, 1, 1) - pos + 1, n_rows.view(g, 1, 1)).clamp(min=0)
        computed += int((per_key * ok).sum())
    return out, computed


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                      softcap: float) -> torch.Tensor:
    """softmax(q k^T * scale [softcapped] + mask) v on [..., B, K] tiles; rows with no allowed key -> 0."""
    if softcap <= 0:
        # An additive float mask keeps torch on its fused CPU attention kernel (a boolean mask is
        # converted per call, which is several times slower).
        bias = torch.where(allowed, 0.0, float("-inf")).to(q.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return o.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    denom = p.sum(-1, keepdim=True)
    return torch.matmul(p, v) / torch.where(denom > 0, denom, torch.ones_like(denom))


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     query_rows: int = 512) -> torch.Tensor:
    """softmax(q k^T x scale, causal) v for the last ``q`` positions of a sequence of ``s`` keys:
    query ``[q, H, D]``, key / value ``[s, Hkv, D]`` (H a multiple of Hkv, GQA); query row ``i``
    sits at position ``s - q + i`` and sees keys ``0 .. s - q + i``. ``[q, H, D]`` in the query's dtype.
    ``query_rows`` per call bounds the ``[H, rows, s]`` scores a call materialises."""
    q_len, s = query.shape[0], key.shape[0]
    group = query.shape[1] // key.shape[1]
    k = key.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, s, D]
    v = value.to(query.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    out = torch.empty_like(query)
    positions = torch.arange(s, device=query.device)
    for a in range(0, q_len, query_rows):
        b = min(a + query_rows, q_len)
        rows = torch.arange(s - q_len + a, s - q_len + b, device=query.device)
        bias = torch.where(positions[None, :] <= rows[:, None], 0.0, float("-inf")).to(query.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(query[a:b].transpose(0, 1), k, v, attn_mask=bias,
                                                             scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out
