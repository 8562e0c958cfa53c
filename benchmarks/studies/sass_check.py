"""Compile the sparse prefill kernels' variants for sm90 (Hopper) without a GPU and write their
SASS, to check that a refactor leaves what the GPU executes unchanged.

    PYTHONPATH=<site with the GPU's triton> python -m benchmarks.studies.sass_check OUT_DIR [CASE ...]
    python -m benchmarks.studies.sass_check --compare OLD_DIR NEW_DIR

A stand-in driver gives Triton the sm90 target and every launch becomes a warm-up (compile
only), so the launchers run as they would on a GPU (on CPU tensors) and Triton's own ptxas
assembles the cubin. Writes ``<case>.sass`` (cuobjdump, encodings stripped) and
``<case>.ttgir`` per case and prints registers, shared memory and a SASS hash. ``--compare``
says per case whether the SASS is identical, identical up to the constant-bank offsets of the
kernel parameters, or different (instruction counts). Uses Triton internals (checked with
3.6): an offline check, not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

import torch

SERVING = {  # what serving launches: _sparse_fwd_kernel
    "tma_hd128": dict(tma=True),
    "tma_hd128_whole_fp8_softcap": dict(tma=True, kv=torch.float8_e4m3fn, softcap=30.0, whole=True),
    "tma_hd64": dict(d=64, tma=True),
    "tma_shared4": dict(shared=True, tma=True),
    "gather_p16_hd128": dict(page=16),
    "gather_p16_hd64_bn128": dict(page=16, d=64),
    "gather_p16_hd128_whole_fp8": dict(page=16, kv=torch.float8_e4m3fn, whole=False),
    "gather_p16_shared4_softcap": dict(page=16, shared=True, softcap=20.0),
}
VARIANTS = {  # tests and benchmarks only: _sparse_fwd_variants_kernel
    "dense_tma_hd128": dict(dense=True, tma=True),
    "dense_p16_hd128": dict(dense=True, page=16),
    "dense_p16_hd64": dict(dense=True, page=16, d=64),
    "dense_p16_group6": dict(dense=True, page=16, h=12, heads_per_program=4),
    "merged2_p16": dict(page=16, merge=2),
    "merged2_tma": dict(merge=2, tma=True),
    "lse_p16": dict(page=16, return_lse=True),
    "lse_tma": dict(tma=True, return_lse=True),
    "rowmajor_noprefetch_p16": dict(page=16, kv_major=False, prefetch=False),
}


def _fake_sm90_driver():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Sm90())
    return triton


def _compile_only(modules, compiled: list):
    """Every JIT kernel of the modules compiles at its launch and is not run."""
    import triton

    for mod in modules:
        for name in dir(mod):
            k = getattr(mod, name)
            if isinstance(k, triton.runtime.jit.JITFunction):
                def run(*a, _run=k.run, grid=None, warmup=False, **kw):
                    compiled.append(_run(*a, grid=grid, warmup=True, **kw))
                k.run = run


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _sass(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    lines = [re.sub(r"\s+/\* 0x[0-9a-f]+ \*/", "", ln) for ln in text.splitlines()
             if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    regs = re.search(r"REG:(\d+)", res)
    return "\n".join(lines), regs.group(1) if regs else "?"


def _launch(sa, d=128, h=8, hkv=2, page=64, kv=None, dense=False, shared=False, merge=0, whole=None, **kw):
    from vllm_sparse_kernels.index_format import SparseIndex

    t, pages = 300, 32  # 300 keys fit 32 pages of 16; 32: the block table's stride specialises as 16 would
    q = torch.randn(t, h, d, dtype=torch.bfloat16)
    kc = torch.randn(pages, page, hkv, d, dtype=torch.bfloat16)
    vc = torch.randn(pages, page, hkv, d, dtype=torch.bfloat16)
    if kv is not None:
        kc, vc = kc.to(kv), vc.to(kv)
        kw.update(k_scale=torch.ones(1), v_scale=torch.ones(1))
    if whole is not None:
        kw["whole_rows"] = torch.tensor([whole])
    table = torch.arange(pages, dtype=torch.int32).view(1, -1)
    rows = [(0, 0, t, 0)]
    index = None
    if not dense:
        lists, nqb = hkv if shared else h, -(-t // 64)
        def full(shape, value):
            return torch.full(shape, value, dtype=torch.int32)

        # every query block lists key block 0, no ranges, no columns
        index = [SparseIndex(64, full((lists, nqb), 1), full((lists, nqb, 1), 0), full((lists, nqb), 0),
                             full((lists, nqb, 1), -1), full((lists, nqb), 0), full((lists, nqb, 1), -1))]
        if merge:
            index = sa.merge_group_heads(sa.pack_rows(rows, index), merge)
    sa.sparse_prefill_attention(q, kc, vc, table, rows, index, d ** -0.5, torch.empty_like(q), **kw)


def compile_cases(out_dir: str, only: list[str]) -> None:
    _fake_sm90_driver()
    import vllm_sparse_kernels.prefill.attention as sa

    compiled: list = []
    _compile_only([sa], compiled)
    os.makedirs(out_dir, exist_ok=True)
    for name, kw in {**SERVING, **VARIANTS}.items():
        if only and name not in only:
            continue
        n = len(compiled)
        _launch(sa, **kw)
        assert len(compiled) == n + 1, name
        ck = compiled[-1]
        sass, regs = _sass(ck.asm["cubin"])
        with open(os.path.join(out_dir, name + ".sass"), "w") as f:
            f.write(sass)
        with open(os.path.join(out_dir, name + ".ttgir"), "w") as f:
            f.write(ck.asm["ttgir"])
        print(f"{name:30s} {ck.name:28s} regs={regs:>3s} shared={ck.metadata.shared:6d} "
              f"sass={hashlib.sha1(sass.encode()).hexdigest()[:12]} instructions={sass.count(chr(10)) + 1}", flush=True)


def compare(old: str, new: str) -> None:
    def norm(text):
        return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", re.sub(r"/\*[0-9a-f]+\*/", "", ln)).strip()
                for ln in text.splitlines()]

    for f in sorted(os.listdir(old)):
        if not f.endswith(".sass") or not os.path.exists(os.path.join(new, f)):
            continue
        a, b = open(os.path.join(old, f)).read(), open(os.path.join(new, f)).read()
        if a == b:
            verdict = "identical"
        elif norm(a) == norm(b):
            verdict = "identical up to parameter offsets"
        else:
            verdict = f"DIFFERENT ({len(norm(a))} vs {len(norm(b))} instructions)"
        print(f"{f[:-5]:30s} {verdict}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="OUT_DIR [CASE ...], or OLD_DIR NEW_DIR with --compare")
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args(argv)
    if args.compare:
        compare(*args.dirs[:2])
    else:
        compile_cases(args.dirs[0], args.dirs[1:])


if __name__ == "__main__":
    sys.exit(main())
