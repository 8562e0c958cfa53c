import pytest
import torch


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
    kv_len = ctx_len + q_len
    qpos = torch.arange(q_len) + ctx_len
    m = torch.arange(kv_len)[None, :] <= qpos[:, None]
    return m[None].expand(h, -1, -1)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def load_script(relpath: str, name: str | None = None):
    """Import a script of the repository that is not in a package (``deploy/check.py``) as a module."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    # registered first, as an import would: dataclasses look their module up while it executes
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
