"""Study (issue 55), run once on one H200 (2026-11-29) and removed after: the skip-softmax filter's cost and gain, kernel alone (serving kernel, one layer, 128K,
VS 1000 / 6096 planted index, paged cache of 64-key pages). Queries: random (nothing below any
threshold: the filter's overhead), or with a strong sink (the first 256 keys aligned with every
query, so that tiles after it lie far below the running maximum).
Run from the repo root on the GPU machine: python3 benchmarks/studies/skip_softmax_kernel.py 131072"""
import sys, os, torch, math
sys.path.insert(0, os.getcwd())
from benchmarks.kernels import random_qkv, paged_cache, vs_index, bench
from benchmarks.common import SHAPES
from vllm_sparse_kernels.prefill import attention as sa

n = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
shape = "qwen2.5-1.5b"
h, hkv, d = SHAPES[shape]
gen = torch.Generator(device="cuda").manual_seed(0)
q0, k, v = random_qkv(n, shape, gen)
kc, vc, bt = paged_cache(k, v, 64, "cuda")
ix = vs_index(h, n, 1000, 6096, "cuda", gen)
rows = [(0, 0, n, 0)]
print(torch.__version__, torch.cuda.get_device_name(), "n", n, "shape", shape, (h, hkv, d), flush=True)
u = torch.nn.functional.normalize(torch.randn(d, device="cuda", generator=gen), dim=0)
k2 = k.clone(); k2[:256] += (6 * u).to(k.dtype)  # a strong sink: the first 256 keys align with every query
kc2, vc2, _ = paged_cache(k2, v, 64, "cuda")
for sharp in (1.0, "sink"):
    if sharp == "sink":
        q = (q0.float() + 6 * u).to(torch.bfloat16); kc, vc = kc2, vc2
        bt = _
    else:
        q = (q0.float() * sharp).to(torch.bfloat16)
    ref = torch.empty_like(q)
    sa.sparse_prefill_attention(q, kc, vc, bt, rows, [ix], d ** -0.5, ref)
    base = None
    for thr in (0.0, 1e-4, 1e-3, 1e-2):
        out = torch.empty_like(q)
        fn = lambda: sa.sparse_prefill_attention(q, kc, vc, bt, rows, [ix], d ** -0.5, out, skip_below=thr)
        t = bench(fn)
        base = base or t
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"q {sharp} skip_below {thr:g}: {t:.3f} ms ({base / t:.3f}x of off), rel L2 err vs off {err:.2e}", flush=True)
