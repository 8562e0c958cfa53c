"""The CUDA impl's sparse branch, driven directly on CPU: a step whose rows are all sparse never
calls FlashAttention, so the glue (paged-cache views, estimation, the torch reference or the
Triton kernel as batched kernel, stats) runs here against the float64 reference."""

import importlib.util
import types

import pytest
import torch

pytest.importorskip("vllm")

from vllm_sparse_backend.backends import common  # noqa: E402
from vllm_sparse_backend.backends.common import SparseStepMetadata  # noqa: E402
from vllm_sparse_backend.settings import load_settings  # noqa: E402
from vllm_sparse_kernels.reference.index import index_to_dense_mask  # noqa: E402
from vllm_sparse_backend.prefill.estimate import estimate_index  # noqa: E402
from vllm_sparse_backend.prefill.plan import SparseRow, rank_heads  # noqa: E402
from vllm_sparse_backend.prefill.route import DenseReason  # noqa: E402
from vllm_sparse_kernels.kv_layout import gather_paged_kv  # noqa: E402
from vllm_sparse_backend.runtime import WorkerRuntime  # noqa: E402

from vllm_sparse_kernels.reference.dense import masked_attention_f64  # noqa: E402

cuda_backend = pytest.importorskip("vllm_sparse_backend.backends.cuda")

pytestmark = pytest.mark.kernels  # `make test` runs these with triton, under its interpreter on CPU


LAYER_NAME = "model.layers.0.self_attn.attn"


class _Layer:
    """What the impl reads from vLLM's attention layer: its name (to find its heads in the runtime)."""

    layer_name = LAYER_NAME


def _step(dtype, gen, settings):
    h, hkv, d, page = 8, 2, 128, 16
    geoms = [(300, 0), (170, 230)]  # (q_len, ctx_len)
    pages = [-(-(q + c) // page) for q, c in geoms]
    n_pages = sum(pages) + 4
    # vLLM's layout: physical [pages, page, Hkv, 2D] (NHD), logical view [pages, Hkv, page, 2D]
    kv_cache = torch.randn(n_pages, page, hkv, 2 * d, generator=gen).to(dtype).permute(0, 2, 1, 3)
    perm = torch.randperm(n_pages, generator=gen).int()
    table = torch.zeros(4, max(pages) + 3, dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used:used + n]
        used += n
    t = sum(q for q, _ in geoms) + 5  # padded tokens after the rows
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype)
    query = qkv[:, :h * d].view(t, h, d)  # strided, as the attention layer passes it
    rows, tok = [], 0
    for i, (q_len, ctx) in enumerate(geoms):
        rows.append(SparseRow(i, tok, q_len, ctx))
        tok += q_len
    md = SparseStepMetadata(t, max(q for q, _ in geoms), [], rows, table)
    return query, kv_cache, md, (h, hkv, d)


def _impl(settings, h, d, hkv):
    impl = object.__new__(cuda_backend.SparsePrefillImpl)  # no FlashAttention set-up on CPU
    impl.num_heads, impl.head_size, impl.scale, impl.logits_soft_cap = h, d, d ** -0.5, 0.0
    impl.num_kv_heads, impl.kv_cache_dtype = hkv, "auto"  # FlashAttentionImpl.__init__ sets them
    impl.runtime = WorkerRuntime(settings)  # what SparsePrefillImpl.__init__ gets from worker_runtime()
    # the heads the builder's resolve_group_heads resolves for a single-GPU layer, kept by the runtime
    impl.runtime.layer_heads[LAYER_NAME] = rank_heads(None, settings, 0, h, hkv)
    return impl


@pytest.fixture
def sparse_env(monkeypatch, tmp_path):
    """Settings as a backend object of the engine reads them from its environment."""
    def apply(**env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("VLLM_SPARSE_STATS_FILE", str(tmp_path / "stats.json"))
        return load_settings()
    return apply


def _check(kernel, dtype, sparse_env, tol):
    settings = sparse_env(VLLM_SPARSE_KERNEL=kernel, VLLM_SPARSE_VERTICAL_SIZE="50", VLLM_SPARSE_SLASH_SIZE="90",
                          VLLM_SPARSE_LAST_Q="32")
    gen = torch.Generator().manual_seed(3)
    query, kv_cache, md, (h, hkv, d) = _step(dtype, gen, settings)
    output = torch.full((query.shape[0], h, d), float("nan"), dtype=dtype)
    impl = _impl(settings, h, d, hkv)
    impl.forward(_Layer(), query, None, None, kv_cache, md, output)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    for r in md.sparse_rows:
        k, v = gather_paged_kv(key_cache, value_cache, md.block_table[r.row], r.ctx_len + r.q_len)
        q = query[r.tok_start:r.tok_start + r.q_len]
        idx = estimate_index(q, k, r.ctx_len, impl.runtime.layer_heads[LAYER_NAME].heads, settings, d ** -0.5).index
        ref = masked_attention_f64(q, k, v, index_to_dense_mask(idx, r.q_len, r.ctx_len), d ** -0.5)
        got = output[r.tok_start:r.tok_start + r.q_len].double()
        assert ((got - ref).norm() / ref.norm()) < tol
    assert torch.isnan(output[sum(r.q_len for r in md.sparse_rows):]).all(), "padding tokens untouched"
    return impl


def test_sparse_branch_with_the_torch_reference(sparse_env):
    impl = _check("torch", torch.float32, sparse_env, 1e-5)
    assert impl._use_triton is False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                    reason="needs triton's interpreter (CPU); run by make test with the kernel site")
def test_sparse_branch_with_the_triton_kernel(sparse_env, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    impl = _check("triton", torch.float16, sparse_env, 1e-2)
    assert impl._use_triton is True
    assert impl._head_groups.share == 4  # kv_group_shared (default): one list per KV head, 4 heads stacked


# fp8 KV cache: vLLM allocates it as bytes (FlashAttention views it as e4m3), stores K / k_scale
# and V / v_scale, and FlashAttention 3 has the layer quantize the query too (query / q_scale).
E4M3 = torch.float8_e4m3fn
K_SCALE, V_SCALE, Q_SCALE = 0.043, 0.021, 0.05


class _Fp8Layer(_Layer):
    """What the impl reads from vLLM's attention layer: also the per-layer scales (0-dim fp32 buffers)."""

    def __init__(self):
        self._q_scale, self._k_scale, self._v_scale = (torch.tensor(s) for s in (Q_SCALE, K_SCALE, V_SCALE))


def _check_fp8(kernel, model_dtype, quantized_query, sparse_env, tol):
    # budgets small enough (and one always-kept column and diagonal) that the selection depends
    # on the scores (about half of the causal pairs): estimation must see the scaled keys too
    settings = sparse_env(VLLM_SPARSE_KERNEL=kernel, VLLM_SPARSE_VERTICAL_SIZE="8", VLLM_SPARSE_SLASH_SIZE="2",
                          VLLM_SPARSE_KEEP_FIRST_COLUMNS="1", VLLM_SPARSE_KEEP_LAST_DIAGONALS="1",
                          VLLM_SPARSE_LAST_Q="32")
    gen = torch.Generator().manual_seed(4)
    query, kv_cache, md, (h, hkv, d) = _step(torch.float32, gen, settings)
    kv = kv_cache.permute(0, 2, 1, 3)  # physical [pages, page, Hkv, 2D]
    kv8 = torch.cat([kv[..., :d] / K_SCALE, kv[..., d:] / V_SCALE], -1).to(E4M3)
    kv_bytes = kv8.view(torch.uint8).permute(0, 2, 1, 3)  # the logical view vLLM hands the impl
    if quantized_query:
        query = (query / Q_SCALE).to(E4M3)
        q_ref = query.double() * Q_SCALE
    else:
        query = query.to(model_dtype)
        q_ref = query.double()
    output = torch.full((query.shape[0], h, d), float("nan"), dtype=model_dtype)
    impl = _impl(settings, h, d, hkv)
    impl.kv_cache_dtype = "fp8"
    assert common.unsupported_reason(impl) is None  # an fp8 layer goes sparse
    impl.forward(_Fp8Layer(), query, None, None, kv_bytes, md, output)
    k_deq, v_deq = kv8[..., :d].double() * K_SCALE, kv8[..., d:].double() * V_SCALE
    for r in md.sparse_rows:
        k, v = gather_paged_kv(k_deq, v_deq, md.block_table[r.row], r.ctx_len + r.q_len)
        q = q_ref[r.tok_start:r.tok_start + r.q_len]
        idx = estimate_index(q.float(), k.float(), r.ctx_len, impl.runtime.layer_heads[LAYER_NAME].heads,
                             settings, d ** -0.5).index
        ref = masked_attention_f64(q, k, v, index_to_dense_mask(idx, r.q_len, r.ctx_len), d ** -0.5)
        got = output[r.tok_start:r.tok_start + r.q_len].double()
        assert ((got - ref).norm() / ref.norm()) < tol
    assert torch.isnan(output[sum(r.q_len for r in md.sparse_rows):]).all(), "padding tokens untouched"
    return impl


@pytest.mark.parametrize("quantized_query", [False, True])
def test_fp8_layer_sparse_branch_with_the_torch_reference(sparse_env, quantized_query):
    _check_fp8("torch", torch.float32, quantized_query, sparse_env, 1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                    reason="needs triton's interpreter (CPU); run by make test with the kernel site")
@pytest.mark.parametrize("quantized_query", [False, True])
def test_fp8_layer_sparse_branch_with_the_triton_kernel(sparse_env, monkeypatch, quantized_query):
    # the scales reach estimation and kernel as the layer's device tensors (q_scale folded into
    # k_scale where the layer quantized the query); a scale lost anywhere breaks the comparison
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    impl = _check_fp8("triton", torch.float16, quantized_query, sparse_env, 1e-2)
    assert impl._use_triton is True


def test_fp8_e4m3_declared_where_flash_attention_runs_it(monkeypatch):
    """The backend accepts fp8 / fp8_e4m3 exactly where FlashAttention (decode and the dense rows)
    accepts them, never e5m2 (FlashAttention has no e5m2 path); every layer with an e4m3 cache is
    a sparse candidate, an e5m2 one would run dense with the reason logged."""
    from vllm.v1.attention.backends import flash_attn

    backend = cuda_backend.SparsePrefillBackend
    for fa_runs_fp8 in (True, False):
        for probe in ("flash_attn_supports_kv_cache_dtype", "flash_attn_supports_fp8"):  # 0.32+ / 0.26
            monkeypatch.setattr(flash_attn, probe, lambda *a, _v=fa_runs_fp8, **k: _v, raising=False)
        assert backend.supports_kv_cache_dtype("fp8") is fa_runs_fp8
        assert backend.supports_kv_cache_dtype("fp8_e4m3") is fa_runs_fp8
        assert backend.supports_kv_cache_dtype("fp8_e5m2") is False
        assert backend.supports_kv_cache_dtype("bfloat16") and backend.supports_kv_cache_dtype("auto")
    impl = object.__new__(cuda_backend.SparsePrefillImpl)
    for dtype, reason in (("fp8", None), ("fp8_e4m3", None), ("auto", None), ("fp8_e5m2", "KV cache dtype fp8_e5m2")):
        impl.kv_cache_dtype = dtype
        assert common.unsupported_reason(impl) == reason
    cpu_like = types.SimpleNamespace(kv_cache_dtype="fp8")  # an impl listing no fp8 cache (the CPU twin)
    assert common.unsupported_reason(cpu_like) == "KV cache dtype fp8"


def test_preferred_block_size_is_one_tma_page_on_hopper(sparse_env, monkeypatch):
    """vLLM asks the backend for a block size when --block-size is not given: 64 (one page per
    kernel tile, loaded with TMA) on compute capability 9.0+, vLLM's default elsewhere, with
    decode_mode topk / spans (budgets in pages), or what kv_block_size says."""
    backend = cuda_backend.SparsePrefillBackend
    for hopper in (True, False):
        monkeypatch.setattr(cuda_backend.current_platform, "has_device_capability",
                            lambda cap, _h=hopper: _h and cap <= 90, raising=False)
        sparse_env()
        assert backend.get_preferred_block_size(16) == (64 if hopper else 16)
        sparse_env(VLLM_SPARSE_DECODE_MODE="topk")
        assert backend.get_preferred_block_size(16) == 16
        monkeypatch.delenv("VLLM_SPARSE_DECODE_MODE")
        sparse_env(VLLM_SPARSE_KV_BLOCK_SIZE="32")
        assert backend.get_preferred_block_size(16) == 32
        monkeypatch.delenv("VLLM_SPARSE_KV_BLOCK_SIZE")
    with pytest.raises(Exception, match="VLLM_SPARSE_KV_BLOCK_SIZE=.48.: Input should be .auto."):
        sparse_env(VLLM_SPARSE_KV_BLOCK_SIZE="48")


class _RaisingVerticalSlash:
    """Stands in for the vertical-slash pattern and raises from both estimators."""

    def __init__(self, real, error):
        self._real, self._error = real, error

    def __getattr__(self, name):
        return getattr(self._real, name)

    def select(self, *args, **kwargs):
        raise self._error

    def estimate_paged(self, *args, **kwargs):
        raise self._error


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_an_error_in_the_sparse_path_sends_the_step_to_flash_attention(sparse_env, monkeypatch, kernel):
    """The error boundary: an estimator that raises (here a pattern replaced through the registry)
    sends the step's sparse rows to FlashAttention with their own metadata, counts them under
    'sparse path error' and logs the cause once; the next step tries the sparse path again."""
    from vllm_sparse_backend.prefill.patterns import PATTERNS

    if kernel == "triton":
        if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
            pytest.skip("needs triton's interpreter (CPU)")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # max_density 1: no row of these short prompts is sent to FlashAttention by its budgets first
    settings = sparse_env(VLLM_SPARSE_KERNEL=kernel, VLLM_SPARSE_VERTICAL_SIZE="50", VLLM_SPARSE_SLASH_SIZE="90",
                          VLLM_SPARSE_LAST_Q="32", VLLM_SPARSE_MAX_DENSITY="1")
    monkeypatch.setitem(PATTERNS, "vertical_slash",
                        _RaisingVerticalSlash(PATTERNS["vertical_slash"], ValueError("injected estimator fault")))
    gen = torch.Generator().manual_seed(3)
    query, kv_cache, md, (h, hkv, d) = _step(torch.float16 if kernel == "triton" else torch.float32, gen, settings)
    md.fallback = {r.row: f"metadata of row {r.row}" for r in md.sparse_rows}
    calls = []
    monkeypatch.setattr(cuda_backend.FlashAttentionImpl, "forward",
                        lambda self, layer, q, k, v, cache, metadata, out, *a: calls.append((metadata, q.shape[0])))
    impl = _impl(settings, h, d, hkv)
    output = torch.zeros(query.shape[0], h, d, dtype=query.dtype)
    with pytest.MonkeyPatch.context() as logs:
        logged = []
        logs.setattr(impl.runtime, "log_once", lambda msg, *args, **kw: logged.append(msg % args))
        impl.forward(_Layer(), query, None, None, kv_cache, md, output)
        impl.forward(_Layer(), query, None, None, kv_cache, md, output)
    assert calls == [(f"metadata of row {r.row}", r.q_len) for r in md.sparse_rows] * 2
    assert impl.runtime.stats.dense_reasons == {DenseReason.SPARSE_PATH_ERROR: 2 * len(md.sparse_rows)}
    assert any("injected estimator fault" in line for line in logged)


def test_a_device_error_is_not_swallowed(sparse_env, monkeypatch):
    """After an illegal memory access the CUDA context is lost: the error reaches vLLM."""
    from vllm_sparse_backend.prefill.patterns import PATTERNS

    settings = sparse_env(VLLM_SPARSE_KERNEL="torch", VLLM_SPARSE_VERTICAL_SIZE="50", VLLM_SPARSE_SLASH_SIZE="90")
    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setitem(PATTERNS, "vertical_slash", _RaisingVerticalSlash(PATTERNS["vertical_slash"], fault))
    query, kv_cache, md, (h, hkv, d) = _step(torch.float32, torch.Generator().manual_seed(3), settings)
    md.fallback = {r.row: None for r in md.sparse_rows}
    impl = _impl(settings, h, d, hkv)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        impl.forward(_Layer(), query, None, None, kv_cache, md, torch.zeros(query.shape[0], h, d))
    assert common.recoverable(torch.OutOfMemoryError("CUDA out of memory")) and common.recoverable(KeyError("x"))


def _accelerator_error(text, code):
    error = torch.AcceleratorError(text)
    error.error_code = code  # what torch sets where its C++ side raised the error
    return error


@pytest.mark.parametrize("error, fatal", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),
    (RuntimeError("CUDA error: misaligned address"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), True),
    (_accelerator_error("CUDA error: out of memory", 2), False),
    (_accelerator_error("CUDA error: misaligned address", 716), True),
    (_accelerator_error("CUDA error: unspecified launch failure", 719), True),
    (_accelerator_error("CUDA error: device-side assert triggered", 710), True),
    (_accelerator_error("an accelerator error without CUDA's words", 700), True),
    (KeyError("x"), False), (ValueError("shape mismatch"), False), (RuntimeError("expected a 3-D tensor"), False),
])
def test_recoverable_by_type_and_cuda_error_code(error, fatal):
    """Out of memory falls back dense; any other CUDA error has lost the context and is fatal."""
    assert common.recoverable(error) is not fatal


def test_log_once_remembers_a_bounded_number_of_texts(monkeypatch):
    """Distinct texts (an error's varying message) do not grow log_once's memory forever: the least
    recently logged is forgotten, and logs again should it recur."""
    from vllm_sparse_backend import runtime as runtime_module

    rt = WorkerRuntime(load_settings())
    logged = []
    monkeypatch.setattr(runtime_module.logger, "log", lambda level, msg, *args: logged.append(msg % args))
    memory = runtime_module.LOG_ONCE_MEMORY
    for i in range(memory + 10):
        rt.log_once("fault %d", i)
    rt.log_once("fault %d", memory + 9)  # remembered: not logged again
    rt.log_once("fault %d", 0)  # forgotten (the least recent): logged again
    assert len(rt._logged) == memory
    assert logged.count("sparse-prefill: fault 0") == 2
    assert len(logged) == memory + 11


def test_a_fault_recording_the_stats_keeps_the_sparse_output_and_counts_nothing_twice(sparse_env, monkeypatch):
    """The rows ran: an error while recording them (after the first row's count) is logged, the
    output stays the sparse path's, and no row is counted again as a sparse path error."""
    settings = sparse_env(VLLM_SPARSE_KERNEL="torch", VLLM_SPARSE_VERTICAL_SIZE="50", VLLM_SPARSE_SLASH_SIZE="90",
                          VLLM_SPARSE_LAST_Q="32")
    query, kv_cache, md, (h, hkv, d) = _step(torch.float32, torch.Generator().manual_seed(3), settings)
    healthy = torch.zeros(query.shape[0], h, d)
    _impl(settings, h, d, hkv).forward(_Layer(), query, None, None, kv_cache, md, healthy)

    def record_then_fail(stats, outcome, *args):
        row, est = outcome.sparse[0]
        stats.record_sparse_row(row.q_len, 1, None, est.head_patterns)
        raise OSError("injected stats fault")

    monkeypatch.setattr(cuda_backend, "record_layer", record_then_fail)
    md.fallback = {r.row: None for r in md.sparse_rows}
    monkeypatch.setattr(cuda_backend.FlashAttentionImpl, "forward", lambda self, *a: a[5].zero_())
    impl = _impl(settings, h, d, hkv)
    output = torch.zeros(query.shape[0], h, d)
    impl.forward(_Layer(), query, None, None, kv_cache, md, output)
    assert torch.equal(output, healthy)
    assert impl.runtime.stats.sparse_rows == 1 and DenseReason.SPARSE_PATH_ERROR not in impl.runtime.stats.dense_reasons


def test_a_planning_error_counts_the_long_rows_and_their_tokens(sparse_env):
    settings = sparse_env(VLLM_SPARSE_MIN_SPARSE_QUERY_LEN="256")
    rt = WorkerRuntime(settings)
    cm = types.SimpleNamespace(num_reqs=3, query_start_loc_cpu=torch.tensor([0, 300, 301, 1000, 0]))
    common.sparse_path_failed(rt, ValueError("injected planning fault"), common.long_query_lens(rt, cm))
    assert rt.stats.dense_reasons == {DenseReason.SPARSE_PATH_ERROR: 2}
    assert rt.stats.dense_query_tokens == 300 + 699
