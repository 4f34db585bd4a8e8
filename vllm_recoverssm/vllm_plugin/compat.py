"""Every vLLM internal the plugin touches, for vLLM 0.32 and 0.33, in one place.

The rest of the plugin imports vLLM only through this module, so what differs between
versions is decided here and nowhere else. Names are resolved lazily (module
``__getattr__``): importing the plugin costs nothing until a GLM-5.3 model is built.

Differences that matter to the plugin (0.32.0 -> 0.33.0, read from both releases' Python
sources):

* 0.33 removed ``MambaStateShapeCalculator/MambaStateDtypeCalculator
  .append_kda_recoverssm_record``; the plugin no longer needs them, since the update
  records live in a per-layer scratch, not in the state pages.
* 0.33's ``KVConnectorBase_V1`` adds ``supports_sleep_mode``, ``unregister_kv_caches`` and
  ``restore_kv_caches`` with no-op defaults, which the checkpoint connector inherits; its
  V2 runner moves ``wait_for_save`` before the commit when no drafter runs, one reason
  the connector is for runner V1 only. The V1 runner keeps the order the connector relies
  on in both versions: ``handle_preemptions`` first in a step, the forward, sampling,
  ``_update_states_after_model_execute`` (the commit), the drafter, then ``wait_for_save``.
* Everything else the plugin calls has the same name and signature in both versions; the
  patches that change vLLM's behaviour (:mod:`.patch`) check what they replace at install
  time, so a future change fails at start-up with a message, not mid-request.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

SUPPORTED_VLLM = ((0, 32), (0, 33))
"""Minor versions of vLLM this plugin supports (both inclusive)."""


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is outside the supported range, or lacks a hook we need."""


_KV_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

_LAZY: dict[str, tuple[str, str]] = {
    # models
    "Glm5NextLinearAttention": ("vllm.models.glm5next.common.kda", "Glm5NextLinearAttention"),
    "Glm5NextForCausalLM": ("vllm.models.glm5next.common.model", "Glm5NextForCausalLM"),
    "Glm5NextForConditionalGeneration": (
        "vllm.models.glm5next.common.model", "Glm5NextForConditionalGeneration"),
    "eager_break_during_capture": (
        "vllm.compilation.breakable_cudagraph", "eager_break_during_capture"),
    "get_forward_context": ("vllm.forward_context", "get_forward_context"),
    "MHCPreOp": ("vllm.model_executor.layers.mhc", "MHCPreOp"),
    "MHCPostOp": ("vllm.model_executor.layers.mhc", "MHCPostOp"),
    "MHCFusedPostPreOp": ("vllm.model_executor.layers.mhc", "MHCFusedPostPreOp"),
    # attention metadata
    "GDNAttentionBackend": ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionBackend"),
    "GDNAttentionMetadata": ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadata"),
    "GDNAttentionMetadataBuilder": (
        "vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder"),
    "RecoverSSMMetadata": (
        "vllm.v1.attention.backends.recoverssm_metadata", "RecoverSSMMetadata"),
    "RecoverSSMPostprocessMetadata": (
        "vllm.v1.attention.backends.recoverssm_metadata", "RecoverSSMPostprocessMetadata"),
    "NULL_BLOCK_ID": ("vllm.v1.attention.backends.utils", "NULL_BLOCK_ID"),
    # model runner V2 (GPU)
    "MambaHybridModelState": (
        "vllm.v1.worker.gpu.model_states.mamba_hybrid", "MambaHybridModelState"),
    "RecoverSSMState": ("vllm.v1.worker.gpu.model_states.recoverssm", "RecoverSSMState"),
    # KV connectors (request-boundary checkpoints)
    "KVConnectorBase_V1": (_KV_BASE, "KVConnectorBase_V1"),
    "KVConnectorMetadata": (_KV_BASE, "KVConnectorMetadata"),
    "KVConnectorRole": (_KV_BASE, "KVConnectorRole"),
    "KVConnectorTransferResults": (_KV_BASE, "KVConnectorTransferResults"),
    "KVConnectorWorkerMetadata": (_KV_BASE, "KVConnectorWorkerMetadata"),
    "SupportsHMA": (_KV_BASE, "SupportsHMA"),
    "KVConnectorFactory": (
        "vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory"),
    "CacheHitSource": ("vllm.v1.metrics.cache_hit_source", "CacheHitSource"),
    "RequestStatus": ("vllm.v1.request", "RequestStatus"),
    "AttentionSpec": ("vllm.v1.kv_cache_interface", "AttentionSpec"),
    "MambaSpec": ("vllm.v1.kv_cache_interface", "MambaSpec"),
    "CircularBufferSpec": ("vllm.v1.kv_cache_interface", "CircularBufferSpec"),
    # configuration
    "EngineArgs": ("vllm.engine.arg_utils", "EngineArgs"),
    "ModelRegistry": ("vllm", "ModelRegistry"),
    "VllmConfig": ("vllm.config", "VllmConfig"),
}


def __getattr__(name: str) -> Any:
    """Resolve one of the vLLM names listed in ``_LAZY`` on first use."""
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


# -- version -----------------------------------------------------------------------------

def parse_version(text: str) -> tuple[int, int]:
    """``"0.32.0+cpu"`` -> ``(0, 32)``; raises ``ValueError`` for anything else."""
    m = re.match(r"^\s*(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"cannot read a vLLM version from {text!r}")
    return int(m.group(1)), int(m.group(2))


def vllm_version() -> str:
    """The installed vLLM's version string."""
    import vllm

    return str(vllm.__version__)


def check_supported_version(version: str | None = None) -> tuple[int, int]:
    """Raise :class:`UnsupportedVllmError` unless vLLM (or ``version``) is supported."""
    text = vllm_version() if version is None else version
    lo, hi = SUPPORTED_VLLM
    try:
        parsed = parse_version(text)
    except ValueError:
        parsed = (-1, -1)
    if not lo <= parsed <= hi:
        raise UnsupportedVllmError(
            f"vllm-recoverssm supports vLLM {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, but vLLM "
            f"{text} is installed; install a supported vLLM (pip install "
            f"'vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}') or leave the plugin out "
            "(pip uninstall vllm-recoverssm, or VLLM_PLUGINS set to the plugins you want)"
        )
    return parsed


# -- logging and platform ------------------------------------------------------------------

def configure_vllm_logging() -> None:
    """Import vLLM's logger module, which installs the ``vllm`` logger's handlers."""
    import vllm.logger  # noqa: F401


def vllm_logging_level() -> str:
    """vLLM's ``VLLM_LOGGING_LEVEL`` setting."""
    import vllm.envs as envs

    return str(envs.VLLM_LOGGING_LEVEL)


def kda_state_dtypes(vllm_config: Any) -> tuple[Any, Any]:
    """The (conv, recurrent) state dtypes vLLM resolves for KDA layers of this config."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    cache = vllm_config.cache_config
    return MambaStateDtypeCalculator.kda_state_dtype(  # type: ignore[no-any-return]
        vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)


def current_platform() -> Any:
    """vLLM's detected platform object."""
    from vllm.platforms import current_platform as platform

    return platform


def cuda_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or None without a CUDA GPU."""
    platform = current_platform()
    if not platform.is_cuda():
        return None
    cap = platform.get_device_capability()
    return None if cap is None else (int(cap.major), int(cap.minor))


def platform_name() -> str:
    """``"cuda"``, ``"cpu"`` or vLLM's name for another platform."""
    platform = current_platform()
    if platform.is_cuda():
        return "cuda"
    if platform.is_cpu():
        return "cpu"
    return str(getattr(platform, "device_type", "other"))


def platform_has_kda_kernels() -> bool:
    """Whether vLLM itself can run GLM-5.3's KDA prompt rows on this platform.

    vLLM's KDA prefill and decode kernels are Triton/CUDA kernels (its
    ``gather_initial_states`` asserts a CUDA or XPU tensor); its CPU platform has none.
    """
    platform = current_platform()
    return bool(platform.is_cuda_alike() or platform.is_xpu())


# -- layers and model registration -----------------------------------------------------------

def _replace(owner: Any, label: str, name: str, replacement: Callable[..., Any]) -> None:
    original = getattr(owner, name, None)
    if original is None:
        raise UnsupportedVllmError(f"vLLM's {label} has no attribute {name}")
    have = list(inspect.signature(original).parameters)
    want = list(inspect.signature(replacement).parameters)
    if have != want:
        raise UnsupportedVllmError(
            f"vLLM's {label}.{name} takes ({', '.join(have)}); the plugin's replacement "
            f"was written for ({', '.join(want)})")
    setattr(owner, name, replacement)


def replace_method(cls: Any, name: str, replacement: Callable[..., Any]) -> None:
    """Replace ``cls.name`` with ``replacement``, which takes the same parameters.

    Raises :class:`UnsupportedVllmError` at start-up when vLLM's method is missing or its
    parameters changed, instead of computing something else mid-request.
    """
    _replace(cls, cls.__name__, name, replacement)


def replace_module_function(module: str, name: str, replacement: Callable[..., Any]) -> None:
    """Replace the function ``name`` of vLLM's module ``module`` with ``replacement``,
    which takes the same parameters (checked as :func:`replace_method` does)."""
    _replace(importlib.import_module(module), module, name, replacement)


def register_model(architecture: str, target: str) -> None:
    """Register (or override) ``architecture`` with the class at ``"module:Class"``."""
    __getattr__("ModelRegistry").register_model(architecture, target)


def register_oot_layer(base: Any, replacement: type) -> None:
    """Make vLLM build ``replacement`` wherever it builds the pluggable layer ``base``."""
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get(base.__name__) is not replacement:
        base.register_oot(replacement)


def forward_attn_metadata(prefix: str) -> Any:
    """The attention metadata vLLM's forward context holds for the layer ``prefix``."""
    table = __getattr__("get_forward_context")().attn_metadata
    return table.get(prefix) if isinstance(table, dict) else None


def set_forward_attn_metadata(prefix: str, metadata: Any) -> Any:
    """Replace the layer ``prefix``'s metadata in the forward context; returns the old."""
    table = __getattr__("get_forward_context")().attn_metadata
    assert isinstance(table, dict)
    saved = table[prefix]
    table[prefix] = metadata
    return saved


# -- KV connectors ----------------------------------------------------------------------------

def register_kv_connector(name: str, module_path: str, class_name: str) -> None:
    """Register a KV connector with vLLM's factory under ``name`` (idempotent).

    vLLM resolves the class lazily, in each process that builds a connector.
    """
    factory: Any = __getattr__("KVConnectorFactory")
    try:
        factory.register_connector(name, module_path, class_name)
    except ValueError:
        # vLLM raises for a second registration of a name; ours is the same target.
        cls = factory.get_connector_class_by_name(name)
        if (cls.__module__, cls.__name__) != (module_path, class_name):
            raise UnsupportedVllmError(
                f"another KV connector is already registered as {name!r} "
                f"({cls.__module__}.{cls.__name__})"
            ) from None


def tensor_parallel_rank_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the tensor-parallel size."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())


def uses_v2_model_runner(vllm_config: Any) -> bool:
    """Whether vLLM runs this config with its GPU model runner V2."""
    return bool(vllm_config.use_v2_model_runner)


def batch_request_ids(input_batch: Any) -> list[str | None]:
    """The request id of each row of runner V2's ``InputBatch``."""
    return list(input_batch.req_ids)


def layer_table(owner: Any) -> dict[str, Any]:
    """The layers vLLM built, by name (``static_forward_context``); ``owner`` is a
    ``VllmConfig`` or a model runner, both of which hold the compilation config."""
    return owner.compilation_config.static_forward_context  # type: ignore[no-any-return]


def is_mamba_spec(spec: Any) -> bool:
    """Whether a KV-cache group spec is a Mamba-style state (KDA, GDN) spec."""
    return isinstance(spec, __getattr__("MambaSpec"))


def is_circular_buffer_spec(spec: Any) -> bool:
    """Whether a KV-cache group spec is a one-block-per-request ring (GLM-5.3's indexer
    tail cache: the raw keys of the pool still being compressed)."""
    return isinstance(spec, __getattr__("CircularBufferSpec"))


def is_attention_spec(spec: Any) -> bool:
    """Whether a KV-cache group spec holds per-token attention KV (full attention, MLA)."""
    return isinstance(spec, __getattr__("AttentionSpec"))


def group_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a group spec (a uniform-type group lists several)."""
    specs = getattr(spec, "kv_cache_specs", None)
    return list(specs.values()) if isinstance(specs, dict) else [spec]


def kv_connector_worker() -> Any | None:
    """This process's KV connector worker side (``_worker`` of the connector vLLM built for
    this rank), if a connector with one runs here (an in-process engine:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "_worker", None)


def kv_connector_worker_stats() -> dict[str, Any] | None:
    """The counters of this process's request-boundary checkpoint connector worker, if one
    runs here (see :func:`kv_connector_worker`)."""
    stats = getattr(kv_connector_worker(), "stats", None)
    return stats.as_dict() if stats is not None else None


def in_process_engine_core(llm: Any) -> Any | None:
    """The engine core of an offline ``vllm.LLM`` when it runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); None when it runs in a process of its own."""
    client = getattr(llm.llm_engine, "engine_core", None)
    return getattr(client, "engine_core", None)


def engine_has_connector_work(core: Any) -> bool:
    """The scheduler still holds requests that ended (blocks kept for a connector) but no
    live ones: one more engine step hands their exports to the workers."""
    scheduler = core.scheduler
    return bool(scheduler.has_requests()) and not scheduler.has_unfinished_requests()
