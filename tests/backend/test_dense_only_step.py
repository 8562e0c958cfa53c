"""A step in which no row runs sparse costs nothing of ours per layer (issue 53): the CUDA
builder hands back FlashAttention's own metadata, and the impl's forward passes it to
FlashAttention before touching the runtime, the stats, the metrics or the planning."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_sparse_backend.backends import common  # noqa: E402
from vllm_sparse_backend.settings import load_settings  # noqa: E402
from vllm_sparse_backend.prefill.plan import rank_heads  # noqa: E402
from vllm_sparse_backend.runtime import WorkerRuntime  # noqa: E402

cuda_backend = pytest.importorskip("vllm_sparse_backend.backends.cuda")
FlashAttentionMetadata = pytest.importorskip("vllm.v1.attention.backends.flash_attn").FlashAttentionMetadata


class _Untouchable:
    """Stands in for the worker runtime where nothing of ours may run: any use raises."""

    def __getattr__(self, name):
        raise AssertionError(f"per-layer work of ours on a dense-only step: runtime.{name}")


def _raise(name):
    def entry(*args, **kwargs):
        raise AssertionError(f"per-layer work of ours on a dense-only step: {name}")
    return entry


def _fa_metadata(n):
    return FlashAttentionMetadata(num_actual_tokens=n, max_query_len=n, query_start_loc=torch.tensor([0, n]),
                                  max_seq_len=n, seq_lens=torch.tensor([n]), block_table=torch.zeros(1, 4),
                                  slot_mapping=torch.arange(n))


def _common(q_len):
    return SimpleNamespace(num_reqs=1, max_query_len=q_len, num_actual_tokens=q_len, causal=True,
                           query_start_loc_cpu=torch.tensor([0, q_len], dtype=torch.int32),
                           seq_lens_cpu_upper_bound=torch.tensor([q_len], dtype=torch.int32))


def _builder(runtime, settings):
    """The builder of a group that can run sparse, as __init__ leaves it (no FlashAttention set-up on CPU)."""
    b = object.__new__(cuda_backend.SparsePrefillMetadataBuilder)
    b.runtime, b.sparse_enabled, b._decode_mode = runtime, True, None
    b._head_sets, b._row_heads, b._uses_kernel_table = None, None, False
    b._plan_from, b._stats_file = settings.gating.min_sparse_query_len, None
    return b


@pytest.fixture
def flash(monkeypatch):
    """FlashAttention's builder and forward, recording what reaches them."""
    built, forwarded = [], []

    def build(self, common_prefix_len, cm, fast_build=False):
        built.append(_fa_metadata(cm.max_query_len))
        return built[-1]

    monkeypatch.setattr(cuda_backend.FlashAttentionMetadataBuilder, "build", build)
    monkeypatch.setattr(cuda_backend.FlashAttentionImpl, "forward",
                        lambda self, layer, q, k, v, cache, md, out, *a: forwarded.append(md) or out)
    for name in ("plan_sparse_step", "count_dense_tokens", "layer_heads", "run_sparse_rows_paged",
                 "run_sparse_rows", "sparse_path_failed", "step_decode_plan"):
        monkeypatch.setattr(cuda_backend, name, _raise(name))
    return built, forwarded


def _forward_layers(md, layers=3):
    impl = object.__new__(cuda_backend.SparsePrefillImpl)
    impl.runtime = _Untouchable()
    query, output = torch.zeros(md.num_actual_tokens, 2, 8), torch.zeros(md.num_actual_tokens, 2, 8)
    return [impl.forward(object(), query, query, query, None, md, output) is output for _ in range(layers)]


def test_a_short_step_is_flash_attention_s_own(monkeypatch, flash):
    built, forwarded = flash
    settings = load_settings()
    md = _builder(_Untouchable(), settings).build(0, _common(settings.gating.min_sparse_query_len - 1))
    assert built == [md]  # untouched, and no setting or plan read for it
    assert _forward_layers(md) == [True] * 3
    assert forwarded == [md] * 3


def test_a_long_row_kept_dense_by_the_plan_costs_no_layer_work(monkeypatch, flash):
    built, forwarded = flash
    # budgets denser than max_density: the plan keeps the row dense for the whole step
    monkeypatch.setenv("VLLM_SPARSE_MAX_DENSITY", "0.01")
    settings = load_settings()
    runtime = WorkerRuntime(settings)
    monkeypatch.setattr(cuda_backend, "plan_sparse_step", common.plan_sparse_step)  # once per step: allowed
    builder = _builder(runtime, settings)
    builder._head_sets = common.distinct_head_sets({"layer": rank_heads(None, settings, 0, 8, 2)})
    md = builder.build(0, _common(settings.gating.min_sparse_query_len))
    assert built == [md]
    assert runtime.stats.dense_reasons == {"budgets denser than max_density": 1}
    assert _forward_layers(md) == [True] * 3
    assert forwarded == [md] * 3
