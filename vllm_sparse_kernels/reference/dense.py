"""Dense masked attention in float64 with an explicit mask: the ground truth that the torch
sparse attention (:mod:`vllm_sparse_kernels.torch_attention`) and the kernels are checked
against, written independently of both (GQA by repeating K/V, a materialised mask); and the
log-sum-exp of the same scores. Tiny sizes only. Torch only.
"""

from __future__ import annotations

import torch

from ..index_format import SparseIndex
from .index import index_to_dense_mask


def masked_attention_f64(q, k, v, mask, scale):
    """Independent ground truth: float64 softmax(QK^T*scale + mask)V with an explicit mask.

    q [q_len, H, D], k/v [kv_len, Hkv, D], mask bool [H, q_len, kv_len]; GQA by repeating K/V here
    (the reference under test never repeats them). Rows with an empty mask give zeros.
    """
    h, hkv = q.shape[1], k.shape[1]
    rep = h // hkv
    qd = q.double().transpose(0, 1)
    kd = k.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    vd = v.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vd).transpose(0, 1)


def causal_mask(h, q_len, ctx_len):
    """bool [h, q_len, kv_len]: dense causal attention of a chunk of q_len queries after ctx_len keys."""
    kv_len = ctx_len + q_len
    qpos = torch.arange(q_len) + ctx_len
    m = torch.arange(kv_len)[None, :] <= qpos[:, None]
    return m[None].expand(h, -1, -1)


def sparse_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: SparseIndex, ctx_len: int,
                         scale: float, softcap: float = 0.0) -> torch.Tensor:
    """float64 log-sum-exp per (head, query) of the pairs the index allows ([H, q_len]), from the
    dense mask: tiny sizes only. q: [q_len, H, D]; k: [kv_len, Hkv, D] (v: unused, the
    signature of :func:`vllm_sparse_kernels.torch_attention.sparse_attention`)."""
    q_len, h, d = q.shape
    kvh = torch.arange(h) // (h // k.shape[1])
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()[:, kvh]) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    allowed = index_to_dense_mask(index.to("cpu"), q_len, ctx_len)
    return torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)
