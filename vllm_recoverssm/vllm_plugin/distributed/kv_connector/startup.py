"""Start-up checks of KV connectors for GLM-5.3: ours configured right, LMCache's refused
where they cannot be correct.

Run in the front end after vLLM built its config (:func:`..engine_args.check_at_startup`),
so every refusal is one line at engine start, before any process is spawned:

* ``RecoverSSMCheckpointConnector``: its settings (:mod:`.settings`), and what it is
  verified for: GLM-5.3; vLLM's model runner V2 (its GPU default) with asynchronous
  scheduling and prefix caching (align mode) or without them, or runner V1 without both
  (V1's commit limit needs each step's sampled tokens before the next step is planned, and
  only V2's model state moves align-mode state blocks); pipeline parallel size 1. It also
  sets ``kv_load_failure_policy="recompute"``: a restore that fails on any rank makes vLLM
  compute the request from scratch.
* ``LMCacheConnectorV1`` cannot hold a hybrid model's state (it does not support vLLM's
  hybrid KV-cache manager; vLLM would fail later with an obscure message): refused.
* ``LMCacheMPConnector`` moves block-aligned state pages only, which needs prefix caching
  (mamba cache mode ``align``): refused without it. Under recovery it is a generic
  connector for the eligibility rules (automatic mode keeps full states, forced recovery
  fails, listing it); under full state with prefix caching it is LMCache's own supported
  path.
"""

from __future__ import annotations

from typing import Any

from ... import compat
from ...config import is_glm53
from ...patch.kv_connector import recompute_failed_loads
from .settings import CONNECTOR_NAME, settings_from_config

LMCACHE_V1 = "LMCacheConnectorV1"
LMCACHE_MP = "LMCacheMPConnector"


class ConnectorRefusedError(ValueError):
    """A KV connector cannot be correct for this deployment (one line, at start-up)."""


def check_kv_connector(vllm_config: Any) -> None:
    """Raise :class:`ConnectorRefusedError` (or the settings' error) for a connector that
    cannot work here; configure ours. A no-op without a connector."""
    kt = vllm_config.kv_transfer_config
    if kt is None or kt.kv_connector is None:
        return
    name = kt.kv_connector
    glm = is_glm53(vllm_config)
    arch = vllm_config.model_config.architecture
    cache = vllm_config.cache_config
    if name == CONNECTOR_NAME:
        settings_from_config(vllm_config)
        problem = None
        if not glm:
            problem = (f"it checkpoints the plugin's GLM-5.3 KDA layers, and {arch} is not "
                       "GLM-5.3")
        elif (vllm_config.scheduler_config.async_scheduling
              and not compat.uses_v2_model_runner(vllm_config)):
            problem = ("asynchronous scheduling needs vLLM's model runner V2 (its default on "
                       "GPUs): remove VLLM_USE_V2_MODEL_RUNNER=0 or pass "
                       "--no-async-scheduling")
        elif (cache.enable_prefix_caching and cache.mamba_cache_mode == "align"
              and not compat.uses_v2_model_runner(vllm_config)):
            problem = ("prefix caching (align-mode state blocks) needs vLLM's model runner "
                       "V2 (its default on GPUs): remove VLLM_USE_V2_MODEL_RUNNER=0 or pass "
                       "--no-enable-prefix-caching")
        elif vllm_config.parallel_config.pipeline_parallel_size > 1:
            problem = "pipeline parallelism is not supported"
        if problem:
            raise ConnectorRefusedError(f"kv_connector {CONNECTOR_NAME}: {problem}")
        recompute_failed_loads(kt)
        return
    if not glm:
        return
    if name == LMCACHE_V1:
        raise ConnectorRefusedError(
            f"kv_connector {LMCACHE_V1} cannot store GLM-5.3's KDA state (it does not "
            f"support vLLM's hybrid KV-cache manager); use {CONNECTOR_NAME} for "
            "request-boundary checkpoints")
    if name == LMCACHE_MP and not (cache.enable_prefix_caching
                                   and cache.mamba_cache_mode == "align"):
        raise ConnectorRefusedError(
            f"kv_connector {LMCACHE_MP} stores block-aligned state pages only and needs "
            f"prefix caching (mamba cache mode 'align'); enable prefix caching or use "
            f"{CONNECTOR_NAME}")
