"""pytest plugin: vLLM's own attention-backend tests, run from vLLM's source tree, with this
backend among the backends they hold against their reference.

    python3 -m pytest -p benchmarks.infra.vllm_suite_plugin --rootdir SRC \\
        SRC/tests/v1/attention/test_attention_backends.py -k test_causal_backend_correctness \\
        [--sparse-backend-mode add|only] [--sparse-backend-lists BACKENDS_TO_TEST,...] \\
        [--sparse-backend-require-sparse]

(``benchmarks/infra/vllm_backend_tests.sh`` runs it on the GPU machine.) The suite stays vLLM's:
nothing of it is copied here. vLLM 0.33's ``test_attention_backends.py`` keeps the backends it
compares in module-level lists of ``AttentionBackendEnum`` members (``BACKENDS_TO_TEST``) that each
test reads when it runs, so after collection has imported a test module the plugin changes, in
that module only:

* the backend lists named by ``--sparse-backend-lists``: ``add`` appends CUSTOM (this backend's
  member) beside vLLM's backends, ``only`` leaves CUSTOM alone in them;
* ``create_vllm_config``, wrapped so the configs it builds select CUSTOM: the backend's metadata
  builder plans sparse rows only when CUSTOM is the selected backend (in vLLM only the selector
  reads that field, and these tests never call it, so vLLM's own backends run as before);
* ``MockAttentionLayer``, given a ``layer_name``: vLLM's Attention layers have one, and the
  backend resolves (and caches, per name) a layer's head patterns by it. Each mock layer gets a
  name of its own because the tests vary the head count between cases.

At the end the terminal summary says what was changed and what the sparse path did in this
process (the backend's statistics: rows computed sparse, rows sent back to FlashAttention and
why). ``--sparse-backend-require-sparse`` fails the session when no row ran the sparse path
(rows that skipped keys, or rows at density 1, which the statistics count as dense under
:data:`EVERY_KEY_REASON`, the backend's DenseReason.EVERY_KEY) or the sparse path raised (its error boundary sends such rows to
FlashAttention, which would hide the failure): the density-1 run's check that the suite
exercised the sparse kernels at all.
"""

from __future__ import annotations

import functools
import itertools

import pytest

DEFAULT_LISTS = "BACKENDS_TO_TEST"
SPARSE_PATH_ERROR = "sparse path error"  # vllm_sparse_backend.prefill.route.DenseReason.SPARSE_PATH_ERROR
# vllm_sparse_backend.prefill.route.DenseReason.EVERY_KEY: a row whose budgets cover every key ran the
# sparse path (estimation and kernel, with max_density 1) but is counted as a dense row
EVERY_KEY_REASON = "sparse selection covers every key"
_CHANGES = pytest.StashKey[dict]()  # test module's node id -> what adapt_module changed
_VERDICT = pytest.StashKey[str]()  # why --sparse-backend-require-sparse failed the session


def extend_backend_lists(module, list_names: list[str], member, mode: str) -> list[str]:
    """Put ``member`` into the module's backend lists named ``list_names`` (in place: the tests
    read the module's list object when they run); returns the names of the lists changed.
    ``mode``: ``add`` appends it where missing, ``only`` makes it the list's one entry. Names the
    module lacks, or that are not lists, are left alone."""
    if mode not in ("add", "only"):
        raise ValueError(f"mode must be 'add' or 'only', not {mode!r}")
    changed = []
    for name in list_names:
        backends = getattr(module, name, None)
        if not isinstance(backends, list):
            continue
        if mode == "only":
            if backends != [member]:
                backends[:] = [member]
                changed.append(name)
        elif member not in backends:
            backends.append(member)
            changed.append(name)
    return changed


def select_backend_in_configs(module, member) -> bool:
    """Wrap the module's ``create_vllm_config`` so every config it returns selects ``member``
    (``attention_config.backend``); False where the module has none or it is wrapped already."""
    build = getattr(module, "create_vllm_config", None)
    if not callable(build) or getattr(build, "selects_backend", None) is not None:
        return False

    @functools.wraps(build)
    def create_vllm_config(*args, **kwargs):
        config = build(*args, **kwargs)
        config.attention_config.backend = member
        return config

    create_vllm_config.selects_backend = member
    module.create_vllm_config = create_vllm_config
    return True


def name_mock_layers(module, prefix: str = "vllm_suite.layers") -> bool:
    """Replace the module's ``MockAttentionLayer`` by a subclass whose every instance has a
    ``layer_name`` of its own (``<prefix>.<n>.attn``: one integer, which vLLM's
    ``extract_layer_index`` reads); False where the module has no such class or its class
    already has a ``layer_name`` (this swap done before)."""
    base = getattr(module, "MockAttentionLayer", None)
    if not isinstance(base, type) or hasattr(base, "layer_name"):
        return False
    numbers = itertools.count()

    class NamedMockAttentionLayer(base):
        layer_name = None  # each instance's own, from __init__; on the class, it marks the swap done

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.layer_name = f"{prefix}.{next(numbers)}.attn"

    NamedMockAttentionLayer.__name__ = NamedMockAttentionLayer.__qualname__ = base.__name__
    module.MockAttentionLayer = NamedMockAttentionLayer
    return True


def adapt_module(module, member, list_names: list[str], mode: str) -> dict:
    """All three changes to one test module; what was changed (empty when the module holds none
    of the named lists: modules without them are not vLLM's backend comparisons)."""
    if not any(isinstance(getattr(module, n, None), list) for n in list_names):
        return {}
    return {"lists": extend_backend_lists(module, list_names, member, mode),
            "configs_select_backend": select_backend_in_configs(module, member),
            "mock_layers_named": name_mock_layers(module)}


def sparse_path_verdict(sparse_rows: int, dense_reasons: dict) -> str | None:
    """Why a run that should have exercised the sparse path did not, or None."""
    if dense_reasons.get(SPARSE_PATH_ERROR):
        return f"the sparse path raised on {dense_reasons[SPARSE_PATH_ERROR]} (row, layer) pairs"
    if sparse_rows == 0 and not dense_reasons.get(EVERY_KEY_REASON):
        return "no row ran the sparse path"
    return None


def _custom_member():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CUSTOM


def _process_stats():
    """The sparse path's statistics of this process, or None where the backend never ran."""
    from vllm_sparse_backend.runtime import worker_runtime

    if worker_runtime.cache_info().currsize == 0:
        return None
    return worker_runtime().stats


def pytest_addoption(parser):
    group = parser.getgroup("sparse-backend", "vllm-sparse-backend in vLLM's attention tests")
    group.addoption("--sparse-backend-mode", choices=("add", "only"), default="add",
                    help="add: this backend beside vLLM's; only: this backend alone (default add)")
    group.addoption("--sparse-backend-lists", default=DEFAULT_LISTS,
                    help=f"comma-separated module-level backend lists to change (default {DEFAULT_LISTS})")
    group.addoption("--sparse-backend-require-sparse", action="store_true",
                    help="fail the session unless rows ran sparse and the sparse path never raised")


def pytest_configure(config):
    from vllm_sparse_backend import register

    register()  # what vLLM's plugin loader does in an engine; idempotent
    config.stash[_CHANGES] = {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    names = [n.strip() for n in config.getoption("--sparse-backend-lists").split(",") if n.strip()]
    mode = config.getoption("--sparse-backend-mode")
    changes = config.stash[_CHANGES]
    member = None
    for item in items:
        holder = item.getparent(pytest.Module)
        if holder is None or holder.nodeid in changes:
            continue
        member = member if member is not None else _custom_member()
        changes[holder.nodeid] = adapt_module(holder.obj, member, names, mode)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not config.getoption("--sparse-backend-require-sparse") or exitstatus not in (0, 1):
        return
    stats = _process_stats()
    why = sparse_path_verdict(stats.sparse_rows, dict(stats.dense_reasons)) if stats else "the backend never ran"
    if why is not None:
        config.stash[_VERDICT] = why
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    changes = config.stash.get(_CHANGES, {})
    tr = terminalreporter
    tr.section("vllm-sparse-backend")
    for nodeid, what in changes.items():
        tr.write_line(f"{nodeid}: {what or 'no backend list: unchanged'}")
    stats = _process_stats()
    if stats is None:
        tr.write_line("sparse path: the backend never ran in this process")
    else:
        tr.write_line(f"sparse path: {stats.sparse_rows} (row, layer) pairs sparse, "
                      f"{stats.sparse_query_tokens} query tokens sparse, {stats.dense_query_tokens} dense; "
                      f"pairs computed {stats.computed_pairs} of {stats.causal_pairs}; "
                      f"kept dense: {dict(stats.dense_reasons) or 'none'}")
    if _VERDICT in config.stash:
        tr.write_line(f"FAILED --sparse-backend-require-sparse: {config.stash[_VERDICT]}", red=True)
