"""vLLM's engine as the harness sees it: loaders, preloads and the counters tests read.

The plugin's own door to vLLM is :mod:`vllm_recoverssm.vllm_plugin.compat`; what only the
test and demo harness needs (an in-process engine's allocation, the fork server's preload
list, the random loader's base class) lives here, so ``vllm serve`` never imports it.
"""

from __future__ import annotations

from typing import Any

from ..vllm_plugin import compat


def dummy_model_loader_cls() -> Any:
    """vLLM's ``dummy`` load-format loader class."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    return DummyModelLoader


def register_model_loader(load_format: str, loader_cls: type) -> None:
    """Register ``loader_cls`` as vLLM's loader for ``--load-format load_format``."""
    from vllm.model_executor.model_loader import register_model_loader as register

    register(load_format)(loader_cls)


# Buffers a model's own ``load_weights`` derives from the weights it loaded (vLLM's DFlash
# draft stacks its context K/V projections into one GEMM there). A loader that fills the
# parameters itself must build them too, before vLLM's CPU platform may swap a linear
# layer's weight for a packed copy and leave an empty tensor in its place.
_WEIGHT_DERIVED_BUILDERS = ("_build_fused_kv_buffers",)


def build_weight_derived_buffers(model: Any) -> int:
    """Build what ``model``'s modules derive from their weights at load; returns how many
    builders ran."""
    ran = 0
    for module in model.modules():
        for name in _WEIGHT_DERIVED_BUILDERS:
            build = getattr(type(module), name, None)
            if callable(build):
                build(module)
                ran += 1
    return ran


ENGINE_PRELOAD = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.layers.linear",
    "vllm.v1.spec_decode.eagle",
    "vllm.v1.sample.sampler",
)
"""vLLM's modules an engine process imports before it builds an engine, that the fork
server of :mod:`.engine_fork` imports once (one that a vLLM version lacks is skipped)."""


def worker_connector_stats(worker: Any) -> dict[str, Any] | None:
    """In a worker (``LLM.collective_rpc``): its rank's connector counters."""
    del worker  # the connector is this process's, one per rank
    return compat.kv_connector_worker_stats()


def in_process_model_runner(core: Any) -> Any:
    """The (single) worker's model runner of an in-process engine core."""
    return core.model_executor.driver_worker.worker.model_runner


# -- the offline engine's allocation (tests and demos, in-process engine core) ------------------

def kv_allocation(llm: Any) -> dict[str, Any]:
    """State memory of an in-process ``vllm.LLM`` as its engine allocated it.

    Needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core lives in this process).
    Covers the KV-cache group(s) of the model's KDA layers: blocks, bytes, blocks one
    request reserves (``MambaSpec.max_memory_usage_bytes`` over its page), vLLM's maximum
    concurrency, and the recovery record scratch the layers hold, rank by rank (the
    workers may run in processes of their own, as under tensor parallelism).
    """
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    core = compat.in_process_engine_core(llm)
    if core is None:
        raise RuntimeError("kv_allocation needs an in-process engine core "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    kv_config = core.scheduler.kv_cache_config
    vllm_config = llm.llm_engine.vllm_config
    allocated = sum(int(t.size) for t in kv_config.kv_cache_tensors)
    per_block = allocated // kv_config.num_blocks
    blocks = 0
    for group in kv_config.kv_cache_groups:
        spec = group.kv_cache_spec
        blocks = max(blocks, spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)
    per_rank = [int(n) for n in llm.apply_model(recovery_scratch_bytes)]
    cache = vllm_config.cache_config
    align = cache.enable_prefix_caching and cache.mamba_cache_mode == "align"
    return dict(
        align_block_size=int(cache.mamba_block_size) if align else None,
        num_blocks=int(kv_config.num_blocks), allocated_bytes=allocated,
        bytes_per_block=per_block, blocks_per_request=int(blocks),
        state_bytes_per_request=per_block * int(blocks),
        max_concurrency=float(get_max_concurrency_for_kv_cache_config(vllm_config, kv_config)),
        scratch_bytes=per_rank[0], scratch_bytes_per_rank=per_rank,
    )


def recovery_scratch_bytes(model: Any) -> int:
    """Bytes of the recovery record scratch the KDA layers of ``model`` (one tensor
    parallel rank's) hold; 0 with full states. Runs in each worker (``LLM.apply_model``)."""
    total = 0
    for module in model.modules():
        records = getattr(module, "recovery_records", None)
        if callable(records) and getattr(module, "use_recovery", False):
            total += sum(int(t.nbytes) for t in records())
    return total
