"""The router (prefill/route.py): its reasons are the label values docs/metrics.md lists, and the
start-up question the CUDA builder and the profiling-run claim both ask."""

import json

from vllm_sparse_backend.settings import SparseSettings
from vllm_sparse_backend.observability.metrics import NO_METRICS, label_value
from vllm_sparse_backend.prefill.route import DenseReason, group_dense_reason
from vllm_sparse_backend.observability.stats import SparseStats

# written out by hand from docs/metrics.md (sparse_prefill_dense_fallbacks_total's reason label)
COUNTED_LABELS = {
    DenseReason.CACHED_CONTEXT_ON_CPU: "cached_context_on_cpu",
    DenseReason.CANNOT_PAY: "cost_model_sparse_cannot_pay_at_this_length",
    DenseReason.LONGER_THAN_MAX: "sequence_longer_than_max_sparse_seq_len",
    DenseReason.PROMPT_END: "chunk_ending_its_prompt_within_exact_prompt_end",
    DenseReason.BUDGETS: "budgets_denser_than_max_density",
    DenseReason.COST_MODEL: "cost_model_dense_predicted_faster",
    DenseReason.ESTIMATED_DENSITY: "estimated_density_above_max_density",
    DenseReason.EVERY_KEY: "sparse_selection_covers_every_key",
    DenseReason.SPARSE_PATH_ERROR: "sparse_path_error",
}


def test_counted_reasons_keep_their_label_values_and_file_keys(tmp_path):
    assert {reason: label_value(reason) for reason in COUNTED_LABELS} == COUNTED_LABELS
    stats = SparseStats(_prom=NO_METRICS)
    stats.exporting = True
    stats.record_dense_reason(DenseReason.BUDGETS, rows=2)
    stats.dump(str(tmp_path / "stats.json"))
    # the stats file shows the plain string, as before the enum
    assert json.loads((tmp_path / "stats.json").read_text())["dense_reasons"] == {
        "budgets denser than max_density": 2}


def test_group_dense_reason_in_order():
    on = SparseSettings(kernel="auto")
    assert group_dense_reason(on, unsupported=None) is None
    assert group_dense_reason(SparseSettings(enabled=False), unsupported="x")[0] is DenseReason.DISABLED
    assert group_dense_reason(on, unsupported="logits soft-capping", dcp_size=2) == (
        DenseReason.LAYER_UNSUPPORTED, "logits soft-capping")
    assert group_dense_reason(on, unsupported=None, dcp_size=2, claim_failed="OOM")[0] \
        is DenseReason.DECODE_CONTEXT_PARALLEL
    assert group_dense_reason(on, unsupported=None, claim_failed="OOM", triton_why="no triton") == (
        DenseReason.CLAIM_FAILED, "OOM")
    assert group_dense_reason(on, unsupported=None, triton_why="no triton") == (
        DenseReason.TRITON_UNUSABLE, "no triton")
    # the PyTorch reference needs no Triton path
    assert group_dense_reason(SparseSettings(kernel="torch"), unsupported=None, triton_why="no triton") is None
