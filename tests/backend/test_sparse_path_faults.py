"""A fault in the sparse path, judged by the attention output and the counts (issue 57), for both
impls, in-process on the CPU:

- the CPU twin with vLLM's own CPU attention kernel (its paged cache written by vLLM's op), so
  every row the fallback sends dense runs on the real dense kernel;
- the CUDA impl's builder and forward with FlashAttention replaced by float64 attention over the
  paged cache that reads what FlashAttention reads (its metadata's rows, sequence lengths and
  block table): FlashAttention does not run on a CPU, and the boundary under test is ours.

A fault in planning, in estimation, in the kernel call or in building the step's metadata must
leave every token of the step equal to dense causal attention (float64) and count the long rows
once each under ``sparse path error`` (rows and query tokens, per step for build-time faults and
per layer for forward-time ones). A fault while recording the counts must leave the sparse
path's own output and count nothing as an error. The step is really sparse (about 3/4 of the
causal pairs), so that a sparse row left in place of its dense recomputation shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402

from vllm_sparse_backend import runtime as runtime_module  # noqa: E402
from vllm_sparse_backend.backends import common  # noqa: E402
from vllm_sparse_backend.settings import load_settings  # noqa: E402
from vllm_sparse_backend.observability import stats as stats_module  # noqa: E402
from vllm_sparse_backend.prefill import run as run_module  # noqa: E402
from vllm_sparse_backend.prefill.estimate import estimate_index  # noqa: E402
from vllm_sparse_backend.prefill.patterns import PATTERNS  # noqa: E402
from vllm_sparse_backend.prefill.plan import rank_heads  # noqa: E402
from vllm_sparse_backend.prefill.route import DenseReason  # noqa: E402
from vllm_sparse_backend.runtime import WorkerRuntime  # noqa: E402
from vllm_sparse_kernels.kv_layout import gather_paged_kv  # noqa: E402
from vllm_sparse_kernels.reference.dense import causal_mask, masked_attention_f64  # noqa: E402
from vllm_sparse_kernels.reference.index import index_to_dense_mask  # noqa: E402

cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
cpu_backend = pytest.importorskip("vllm_sparse_backend.backends.cpu")
cuda_backend = pytest.importorskip("vllm_sparse_backend.backends.cuda")
FlashAttentionMetadata = pytest.importorskip("vllm.v1.attention.backends.flash_attn").FlashAttentionMetadata

H, HKV, D, PAGE = 4, 2, 64, 32
SCALE = D ** -0.5
MIN_SPARSE = 128
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
# (query length, cached context): two long rows around a short one (a dense run between them).
# The CPU twin runs only rows without cached context sparse (it cannot read its packed cache).
CPU_ROWS = [(300, 0), (40, 0), (200, 0)]
CUDA_ROWS = [(300, 0), (40, 0), (170, 230)]
# float32 kernels against float64 attention (the tolerance of the sparse-branch tests)
REL_TOL = 1e-5


@pytest.fixture
def settings(monkeypatch, tmp_path):
    # small budgets with one kept column and diagonal: the selection is a real subset of the keys
    env = {"MIN_SPARSE_QUERY_LEN": str(MIN_SPARSE), "VERTICAL_SIZE": "8", "SLASH_SIZE": "2",
           "KEEP_FIRST_COLUMNS": "1", "KEEP_LAST_DIAGONALS": "1", "LAST_Q": "32", "MAX_DENSITY": "1",
           "KERNEL": "torch", "STATS_FILE": str(tmp_path / "stats.json"), "STATS_WRITE_INTERVAL_S": "0"}
    for key, value in env.items():
        monkeypatch.setenv("VLLM_SPARSE_" + key, value)
    return load_settings()


@dataclass
class _Step:
    """One engine step: each row's queries and every key/value of its sequence, the step's paged
    cache (context and this chunk written), and vLLM's CommonAttentionMetadata of it."""

    rows: list[tuple[int, int]]
    query: torch.Tensor  # [tokens, H, D]
    keys: list[torch.Tensor]  # per row [ctx + q, HKV, D]
    values: list[torch.Tensor]
    cm: CommonAttentionMetadata

    def tokens(self, i: int) -> slice:
        start = sum(q for q, _ in self.rows[:i])
        return slice(start, start + self.rows[i][0])

    def chunk_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's fresh K/V [tokens, HKV, D]: what vLLM hands forward."""
        return (torch.cat([k[c:] for k, (_, c) in zip(self.keys, self.rows)]),
                torch.cat([v[c:] for v, (_, c) in zip(self.values, self.rows)]))

    def dense(self, i: int) -> torch.Tensor:
        q_len, ctx = self.rows[i]
        return masked_attention_f64(self.query[self.tokens(i)], self.keys[i], self.values[i],
                                    causal_mask(H, q_len, ctx), SCALE)

    def sparse(self, i: int, settings, heads) -> torch.Tensor:
        """The row as the sparse path computes it: attention over the keys the estimator selects."""
        q_len, ctx = self.rows[i]
        q = self.query[self.tokens(i)]
        index = estimate_index(q, self.keys[i], ctx, heads.heads, settings, SCALE, heads.share).index
        return masked_attention_f64(q, self.keys[i], self.values[i], index_to_dense_mask(index, q_len, ctx), SCALE)


def _step(rows, seed=5) -> tuple[_Step, list[int]]:
    """The step and each token's cache slot (pages of every row shuffled over the cache)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-(q + c) // PAGE) for q, c in rows]
    order = torch.randperm(sum(pages), generator=gen).tolist()
    table = torch.zeros(len(rows), max(pages), dtype=torch.int32)
    slots, keys, values, used = [], [], [], 0
    for i, ((q_len, ctx), n) in enumerate(zip(rows, pages)):
        table[i, :n] = torch.tensor(order[used:used + n])
        used += n
        slots.append([int(table[i, p // PAGE]) * PAGE + p % PAGE for p in range(ctx + q_len)])
        keys.append(torch.randn(ctx + q_len, HKV, D, generator=gen))
        values.append(torch.randn(ctx + q_len, HKV, D, generator=gen))
    query = torch.randn(sum(q for q, _ in rows), H, D, generator=gen)
    qsl = torch.tensor([0] + [sum(q for q, _ in rows[:i + 1]) for i in range(len(rows))], dtype=torch.int32)
    seq = torch.tensor([q + c for q, c in rows], dtype=torch.int32)
    chunk_slots = torch.tensor([s for (_, c), row in zip(rows, slots) for s in row[c:]])
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(rows),
                                 num_actual_tokens=int(qsl[-1]), max_query_len=max(q for q, _ in rows),
                                 max_seq_len=int(seq.max()), block_table_tensor=table, slot_mapping=chunk_slots,
                                 causal=True, seq_lens_cpu_upper_bound=seq)
    return _Step(rows, query, keys, values, cm), slots


def _runtime(settings) -> WorkerRuntime:
    """The worker's runtime with each layer's heads resolved, as the builder's start-up leaves it."""
    runtime = WorkerRuntime(settings)
    for name in LAYERS:
        runtime.layer_heads[name] = rank_heads(None, settings, 0, H, HKV)
    return runtime


class _Layer:
    """What an impl reads from vLLM's attention layer."""

    _k_scale_float = _v_scale_float = 1.0

    def __init__(self, name: str, isa: str | None = None):
        self.layer_name, self.isa = name, isa


# -- the CPU twin, on vLLM's CPU attention kernel --------------------------------------------

def _cpu_impl(runtime):
    """The impl as CPUAttentionBackendImpl.__init__ leaves it (built without a current vLLM config)."""
    impl = object.__new__(cpu_backend.SparsePrefillCPUImpl)
    impl.num_heads, impl.head_size, impl.scale, impl.num_kv_heads = H, D, SCALE, HKV
    impl.logits_soft_cap, impl.alibi_slopes, impl.sliding_window, impl.sinks = 0, None, -1, None
    impl.kv_cache_dtype, impl.is_fp8_kv_cache, impl.num_queries_per_kv = "auto", False, H // HKV
    impl.attn_type, impl.use_zentorch_sdpa = AttentionType.DECODER, False
    impl.runtime, impl._vllm_config = runtime, None
    return impl


def _cpu_builder(runtime, isa):
    """The builder of a group that runs sparse, as __init__ leaves it (its layers need no vLLM config here)."""
    b = object.__new__(cpu_backend.SparsePrefillCPUMetadataBuilder)
    b.num_heads, b.num_kv_heads, b.head_dim, b.block_size, b.dtype = H, HKV, D, PAGE, torch.float32
    b.window_size, b.kv_cache_dtype, b.isa = -1, "auto", isa
    b.is_cross_attention = b.is_encoder_only_attention = False
    b.runtime, b.sparse_enabled, b._head_sets = runtime, True, None
    return b


def _run_cpu(settings, runtime=None):
    """One step through the CPU twin's builder and two layers; (step, each layer's output, runtime)."""
    runtime = runtime or _runtime(settings)
    step, _ = _step(CPU_ROWS)
    isa = cpu_attn._get_attn_isa(torch.float32, PAGE, D, "auto")
    key, value = step.chunk_kv()
    kv_cache = torch.zeros(int(step.cm.block_table_tensor.max()) + 1, HKV, PAGE, 2 * D)
    outputs = []
    md = _cpu_builder(runtime, isa).build(0, step.cm)
    for name in LAYERS:
        impl, layer = _cpu_impl(runtime), _Layer(name, isa)
        impl.do_kv_cache_update(layer, key, value, kv_cache, step.cm.slot_mapping)  # vLLM's op, packed for its kernel
        output = torch.full_like(step.query, float("nan"))
        impl.forward(layer, step.query, key, value, kv_cache, md, output)
        outputs.append(output)
    return step, outputs, runtime


# -- the CUDA impl, FlashAttention computed in float64 ---------------------------------------

def _flash_build(self, common_prefix_len, cm, fast_build=False):
    """FlashAttention's metadata of the rows of ``cm``, the fields its kernel reads."""
    return FlashAttentionMetadata(num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
                                  query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len,
                                  seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
                                  slot_mapping=cm.slot_mapping)


def _flash_forward(self, layer, query, key, value, kv_cache, md, output, *args):
    """Causal attention of md's rows over the paged cache, as FlashAttention reads it."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    qsl = md.query_start_loc.tolist()
    for i, (a, b) in enumerate(zip(qsl, qsl[1:])):
        seq = int(md.seq_lens[i])
        k, v = gather_paged_kv(key_cache, value_cache, md.block_table[i], seq)
        output[a:b] = masked_attention_f64(query[a:b], k, v, causal_mask(H, b - a, seq - (b - a)), SCALE).float()
    return output


def _cuda_builder(runtime, settings):
    """The builder of a group that runs sparse with kernel=torch, as __init__ leaves it."""
    b = object.__new__(cuda_backend.SparsePrefillMetadataBuilder)
    b.runtime, b.sparse_enabled, b._decode_mode = runtime, True, None
    b._head_sets, b._row_heads, b._uses_kernel_table = None, None, False
    b._plan_from, b._stats_file = settings.gating.min_sparse_query_len, settings.observability.stats_file
    return b


def _cuda_impl(runtime):
    impl = object.__new__(cuda_backend.SparsePrefillImpl)  # no FlashAttention set-up on CPU
    impl.num_heads, impl.head_size, impl.scale, impl.logits_soft_cap = H, D, SCALE, 0.0
    impl.num_kv_heads, impl.kv_cache_dtype = HKV, "auto"
    impl.runtime = runtime
    return impl


def _run_cuda(settings, runtime=None):
    runtime = runtime or _runtime(settings)
    step, slots = _step(CUDA_ROWS)
    # vLLM's layout: physical [pages, page, HKV, 2D], handed to the impl as [pages, HKV, page, 2D]
    cache = torch.zeros(int(step.cm.block_table_tensor.max()) + 1, PAGE, HKV, 2 * D)
    for row_slots, k, v in zip(slots, step.keys, step.values):
        at = torch.tensor(row_slots)
        cache[at // PAGE, at % PAGE] = torch.cat([k, v], dim=-1)
    kv_cache = cache.permute(0, 2, 1, 3)
    key, value = step.chunk_kv()
    md = _cuda_builder(runtime, settings).build(0, step.cm)
    outputs = []
    for name in LAYERS:
        output = torch.full_like(step.query, float("nan"))
        _cuda_impl(runtime).forward(_Layer(name), step.query, key, value, kv_cache, md, output)
        outputs.append(output)
    return step, outputs, runtime


@pytest.fixture
def flash(monkeypatch):
    monkeypatch.setattr(cuda_backend.FlashAttentionMetadataBuilder, "build", _flash_build)
    monkeypatch.setattr(cuda_backend.FlashAttentionImpl, "forward", _flash_forward)


IMPLS = {"cpu": (_run_cpu, CPU_ROWS), "cuda": (_run_cuda, CUDA_ROWS)}


# -- the faults ------------------------------------------------------------------------------

def _log_lines(monkeypatch) -> list[str]:
    """What the runtime's log_once and the stats' warnings write to the plugin's log, from now on."""
    lines = []
    monkeypatch.setattr(runtime_module.logger, "log", lambda level, msg, *args: lines.append(msg % args))
    monkeypatch.setattr(stats_module.logger, "warning", lambda msg, *args: lines.append(msg % args))
    return lines


class _Fault(Exception):
    """What the injected faults raise: a Python-level error, recoverable."""


def _raise(*args, **kwargs):
    raise _Fault("injected fault")


class _RaisingEstimators:
    """The vertical-slash pattern, with both estimators raising (every row, every layer)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    select = estimate_paged = staticmethod(_raise)


def _second_call_raises(real):
    """``real``, raising on every second call: each layer's first sparse row is computed and
    written into the output before its second one fails."""
    calls = []

    def call(*args, **kwargs):
        calls.append(None)
        if len(calls) % 2 == 0:
            raise _Fault("injected kernel fault")
        return real(*args, **kwargs)
    return call


def _inject(fault, impl, monkeypatch):
    """Inject ``fault``; returns where it is counted: 'step' (once, at build) or 'layer'."""
    backend = cpu_backend if impl == "cpu" else cuda_backend
    if fault == "planning":
        monkeypatch.setattr(common, "plan_step", _raise)
        return "step"
    if fault == "metadata":  # building a dense run's or a sparse row's own metadata
        monkeypatch.setattr(backend, "slice_rows", _raise)
        return "step"
    if fault == "estimation":
        monkeypatch.setitem(PATTERNS, "vertical_slash", _RaisingEstimators(PATTERNS["vertical_slash"]))
        return "layer"
    assert fault == "kernel"
    monkeypatch.setattr(run_module, "sparse_attention", _second_call_raises(run_module.sparse_attention))
    return "layer"


@pytest.mark.parametrize("fault", ["planning", "metadata", "estimation", "kernel"])
@pytest.mark.parametrize("impl", ["cpu", "cuda"])
def test_a_fault_in_the_sparse_path_gives_dense_attention_and_counts_each_row_once(
        settings, monkeypatch, flash, impl, fault):
    run, rows = IMPLS[impl]
    counted_per = _inject(fault, impl, monkeypatch)
    logged = _log_lines(monkeypatch)
    step, outputs, runtime = run(settings)
    for output in outputs:
        for i in range(len(rows)):
            ref = step.dense(i)
            got = output[step.tokens(i)].double()
            assert ((got - ref).norm() / ref.norm()) < REL_TOL, (impl, fault, i)
    long_rows = [q for q, _ in rows if q >= MIN_SPARSE]
    short_tokens = sum(q for q, _ in rows if q < MIN_SPARSE)
    stats = runtime.stats
    if counted_per == "step":  # the step ran dense whole: its long rows, once
        assert stats.dense_reasons == {DenseReason.SPARSE_PATH_ERROR: len(long_rows)}
        assert stats.dense_query_tokens == sum(long_rows)
    else:  # each layer: its long rows, and the dense run's tokens
        assert stats.dense_reasons == {DenseReason.SPARSE_PATH_ERROR: len(LAYERS) * len(long_rows)}
        assert stats.dense_query_tokens == len(LAYERS) * (sum(long_rows) + short_tokens)
    assert stats.sparse_rows == 0 and stats.sparse_query_tokens == 0  # a row finished before the fault is not counted
    assert sum("injected" in line for line in logged) == 1  # once, though every step and layer raise it


class _RaisingMetrics:
    """The Prometheus metrics, every update raising (prometheus-client's multiprocess files on a
    full disk)."""

    def __getattr__(self, name):
        return _raise


def _inject_stats_fault(fault, stats, monkeypatch):
    if fault == "metrics":
        stats._prom = _RaisingMetrics()
    elif fault == "stats file":
        monkeypatch.setattr(stats, "dump", _raise)
    else:
        assert fault == "counters"
        for name in ("record_sparse_row", "record_dense_reason", "record_dense_tokens"):
            monkeypatch.setattr(stats, name, _raise)


@pytest.mark.parametrize("fault", ["metrics", "stats file", "counters"])
@pytest.mark.parametrize("impl", ["cpu", "cuda"])
def test_a_fault_recording_the_counts_keeps_the_sparse_output(settings, monkeypatch, flash, impl, fault):
    """The rows ran sparse: a stats write that raises changes neither the output nor the routing,
    and nothing is counted as a sparse path error."""
    run, rows = IMPLS[impl]
    runtime = _runtime(settings)
    logged = _log_lines(monkeypatch)
    _inject_stats_fault(fault, runtime.stats, monkeypatch)
    step, outputs, runtime = run(settings, runtime)
    heads = runtime.layer_heads[LAYERS[0]]
    for output in outputs:
        for i, (q_len, _) in enumerate(rows):
            want = step.sparse(i, settings, heads) if q_len >= MIN_SPARSE else step.dense(i)
            got = output[step.tokens(i)].double()
            assert ((got - want).norm() / want.norm()) < REL_TOL, (impl, fault, i)
            if q_len >= MIN_SPARSE:  # really sparse: a dense recomputation would not pass
                assert ((step.dense(i) - want).norm() / want.norm()) > 0.05
    assert DenseReason.SPARSE_PATH_ERROR not in runtime.stats.dense_reasons
    assert any("injected fault" in line for line in logged)
    if fault == "stats file":  # the counts are recorded before the write: all there
        assert runtime.stats.sparse_rows == len(LAYERS) * sum(q >= MIN_SPARSE for q, _ in rows)
