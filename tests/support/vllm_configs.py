"""vLLM configs as the plugin tests build them, and what they change on a copy.

``BASE_ARGS`` are the ``vllm serve`` arguments every config test starts from; the helpers
decide as on a GPU, ask for a recovery mode, or turn on align-mode prefix caching on a
copy of a real ``VllmConfig``, and plan its KV cache with vLLM's own planner.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

BASE_ARGS = [
    "--skip-tokenizer-init", "--load-format", "dummy", "--dtype", "bfloat16",
    "--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching",
]
MTP3 = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']



@contextmanager
def on_gpu(capability: tuple[int, int] = (9, 0), v2_runner: bool = True) -> Iterator[None]:
    """Decide as on a CUDA GPU of ``capability`` with vLLM's model runner V2.

    The configs are built on this CPU machine, where vLLM picks its V1 runner and there is
    no GPU; everything else about the deployment is the real config's.
    """
    from vllm.config import VllmConfig

    from vllm_recoverssm.vllm_plugin import config as plugin_config

    with mock.patch.object(plugin_config, "cuda_capability", lambda: capability), \
            mock.patch.object(VllmConfig, "use_v2_model_runner",
                              property(lambda self: v2_runner)):
        yield


def with_recovery_mode(vllm_config: Any, mode: str) -> Any:
    """A copy of ``vllm_config`` that asks for recovery ``mode`` (auto, on, off)."""
    import copy

    from vllm_recoverssm.vllm_plugin.config import CONFIG_KEY

    cfg = copy.copy(vllm_config)
    object.__setattr__(cfg, "additional_config",
                       {**dict(vllm_config.additional_config or {}), CONFIG_KEY: mode})
    return cfg


def with_prefix_caching(vllm_config: Any, block_size: int = 16) -> Any:
    """A copy of ``vllm_config`` with prefix caching on, as vLLM sets it up on a GPU.

    vLLM's default for hybrid models is prefix caching in mamba cache mode ``align`` with
    one state block per ``block_size`` tokens (``MambaModelConfig.verify_and_update_config``).
    Its CPU platform turns prefix caching off for MLA models such as GLM-5.3, so the
    configs built here get the GPU's cache settings applied to a copy.
    """
    import copy

    cfg = copy.copy(vllm_config)
    cache = copy.copy(vllm_config.cache_config)
    cache.enable_prefix_caching = True
    cache.mamba_cache_mode = "align"
    cache.mamba_block_size = block_size
    object.__setattr__(cfg, "cache_config", cache)
    return cfg


def kv_cache_configs(cfg: Any, specs: list[dict[str, Any]], memory: list[int]) -> Any:
    """vLLM's KV-cache planning: 0.33 moved it and takes the global groups separately."""
    try:
        from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found]
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(cfg, specs, memory)
    return get_kv_cache_configs(cfg, specs, memory, get_global_kv_cache_groups(cfg, specs))
