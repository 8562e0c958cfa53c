"""Target of a spawned process in test_registration.py; must not load vLLM plugins on import."""

import pickle


def unpickle_then_load_plugins(payload, q):
    # Like vLLM's engine-core/worker processes: unpickle the parent's config first, plugins after.
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    member = pickle.loads(payload)
    q.put((member is E.CUSTOM, "SPARSE-PREFILL" in E._member_map_))
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    q.put((E.CUSTOM.get_path(), E["SPARSE-PREFILL"] is E.CUSTOM))
