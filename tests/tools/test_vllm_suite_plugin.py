"""benchmarks/infra/vllm_suite_plugin.py: how it puts this backend into vLLM's attention-backend
tests, checked on fake test modules shaped like vLLM 0.33's test_attention_backends.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

from repo_files import REPO_ROOT


def _plugin():
    from benchmarks.infra import vllm_suite_plugin

    return vllm_suite_plugin


class _Mock:
    def __init__(self, device, k_scale=1.0, v_scale=1.0):
        self.device, self._k_scale, self._v_scale = device, k_scale, v_scale


def _suite(backends=("FLASH_ATTN", "FLEX_ATTENTION")):
    built = []

    def create_vllm_config(model_name="m", block_size=16):
        config = types.SimpleNamespace(model=model_name, block_size=block_size,
                                       attention_config=types.SimpleNamespace(backend=None))
        built.append(config)
        return config

    return types.SimpleNamespace(BACKENDS_TO_TEST=list(backends), OTHER_LIST=["TRITON_ATTN"], NOT_A_LIST="x",
                                 create_vllm_config=create_vllm_config, MockAttentionLayer=_Mock, built=built)


def test_add_appends_once_to_the_same_list_object():
    plugin, suite = _plugin(), _suite()
    backends = suite.BACKENDS_TO_TEST  # the tests read this object when they run
    assert plugin.extend_backend_lists(suite, ["BACKENDS_TO_TEST", "MISSING", "NOT_A_LIST"], "OURS", "add") \
        == ["BACKENDS_TO_TEST"]
    assert suite.BACKENDS_TO_TEST is backends
    assert backends == ["FLASH_ATTN", "FLEX_ATTENTION", "OURS"]
    assert suite.OTHER_LIST == ["TRITON_ATTN"] and suite.NOT_A_LIST == "x"
    assert plugin.extend_backend_lists(suite, ["BACKENDS_TO_TEST"], "OURS", "add") == []
    assert backends.count("OURS") == 1


def test_only_leaves_the_backend_alone_in_each_named_list():
    plugin, suite = _plugin(), _suite()
    backends = suite.BACKENDS_TO_TEST
    assert plugin.extend_backend_lists(suite, ["BACKENDS_TO_TEST", "OTHER_LIST"], "OURS", "only") \
        == ["BACKENDS_TO_TEST", "OTHER_LIST"]
    assert backends == ["OURS"] and suite.BACKENDS_TO_TEST is backends and suite.OTHER_LIST == ["OURS"]
    assert plugin.extend_backend_lists(suite, ["BACKENDS_TO_TEST"], "OURS", "only") == []
    with pytest.raises(ValueError, match="mode"):
        plugin.extend_backend_lists(suite, ["BACKENDS_TO_TEST"], "OURS", "replace")


def test_configs_built_by_the_suite_select_the_backend():
    plugin, suite = _plugin(), _suite()
    assert plugin.select_backend_in_configs(suite, "OURS")
    config = suite.create_vllm_config("Qwen/Qwen3-0.6B", block_size=64)
    assert config.attention_config.backend == "OURS"
    assert (config.model, config.block_size) == ("Qwen/Qwen3-0.6B", 64)  # arguments passed through
    assert suite.built == [config]
    assert suite.create_vllm_config.__name__ == "create_vllm_config"
    assert not plugin.select_backend_in_configs(suite, "OURS")  # wrapped once, not twice
    suite.create_vllm_config()
    assert len(suite.built) == 2
    assert not plugin.select_backend_in_configs(types.SimpleNamespace(), "OURS")


def test_mock_layers_get_one_name_each_with_one_layer_index():
    plugin, suite = _plugin(), _suite()
    assert plugin.name_mock_layers(suite)
    a, b = suite.MockAttentionLayer("cuda:0", 0.5, 2.0), suite.MockAttentionLayer("cuda:0")
    assert isinstance(a, _Mock) and (a.device, a._k_scale, a._v_scale) == ("cuda:0", 0.5, 2.0)
    assert a.layer_name != b.layer_name
    for layer in (a, b):
        assert len(re.findall(r"\d+", layer.layer_name)) == 1  # what extract_layer_index needs
    assert suite.MockAttentionLayer.__name__ == _Mock.__name__  # reports name the class as before
    assert not plugin.name_mock_layers(suite)  # its layers have a name now
    assert not plugin.name_mock_layers(types.SimpleNamespace(MockAttentionLayer=object()))


def test_modules_without_backend_lists_are_left_alone():
    plugin = _plugin()
    suite = _suite()
    del suite.BACKENDS_TO_TEST
    create = suite.create_vllm_config
    assert plugin.adapt_module(suite, "OURS", ["BACKENDS_TO_TEST"], "add") == {}
    assert suite.create_vllm_config is create and suite.MockAttentionLayer is _Mock
    changed = plugin.adapt_module(_suite(), "OURS", ["BACKENDS_TO_TEST"], "add")
    assert changed == {"lists": ["BACKENDS_TO_TEST"], "configs_select_backend": True, "mock_layers_named": True}


def test_sparse_path_verdict():
    verdict = _plugin().sparse_path_verdict
    assert verdict(12, {}) is None
    assert verdict(12, {"too dense": 3}) is None  # the density fallback is the backend working
    assert verdict(0, {}) == "no row ran the sparse path"
    assert verdict(0, {"too dense": 3}) == "no row ran the sparse path"
    assert verdict(0, {_plugin().EVERY_KEY_REASON: 135}) is None  # density 1: the kernel computed every key
    assert "raised on 2" in verdict(12, {_plugin().SPARSE_PATH_ERROR: 2})


def test_error_reason_matches_the_backend():
    from vllm_sparse_backend.prefill.route import DenseReason

    assert _plugin().SPARSE_PATH_ERROR == DenseReason.SPARSE_PATH_ERROR


def test_every_key_reason_matches_the_backend():
    from vllm_sparse_backend.prefill.route import DenseReason

    assert _plugin().EVERY_KEY_REASON == DenseReason.EVERY_KEY


FAKE_SUITE = '''
import types
from vllm.v1.attention.backends.registry import AttentionBackendEnum

BACKENDS_TO_TEST = [AttentionBackendEnum.FLASH_ATTN]


def create_vllm_config():
    return types.SimpleNamespace(attention_config=types.SimpleNamespace(backend=None))


class MockAttentionLayer:
    def __init__(self, device):
        self.device = device


def test_reads_the_lists_at_run_time():
    ours = AttentionBackendEnum.CUSTOM
    assert BACKENDS_TO_TEST[-1] is ours and len(BACKENDS_TO_TEST) == {expected_len}
    assert create_vllm_config().attention_config.backend is ours
    assert MockAttentionLayer("cpu").layer_name != MockAttentionLayer("cpu").layer_name
    assert ours.get_path() == "vllm_sparse_backend.backends.cuda.SparsePrefillBackend"  # registered
'''


def _run_fake_suite(tmp_path, *options, expected_len):
    pytest.importorskip("vllm")
    (tmp_path / "test_fake_suite.py").write_text(textwrap.dedent(FAKE_SUITE.format(expected_len=expected_len)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("VLLM_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.infra.vllm_suite_plugin",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull,
                           str(tmp_path / "test_fake_suite.py"), *options],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_through_pytest_add_mode(tmp_path):
    got = _run_fake_suite(tmp_path, expected_len=2)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "1 passed" in got.stdout
    assert "'lists': ['BACKENDS_TO_TEST']" in got.stdout
    assert "sparse path: the backend never ran in this process" in got.stdout


@pytest.mark.slow
def test_through_pytest_require_sparse_fails_a_green_session_that_ran_nothing_sparse(tmp_path):
    got = _run_fake_suite(tmp_path, "--sparse-backend-mode", "only", "--sparse-backend-require-sparse",
                          expected_len=1)
    assert "1 passed" in got.stdout, got.stdout[-3000:] + got.stderr[-3000:]
    assert got.returncode == 1
    assert "FAILED --sparse-backend-require-sparse: the backend never ran" in got.stdout
