"""vLLM's cache config: the derived RecoverSSM flag, set for GLM-5.3 recovery."""

from __future__ import annotations

from typing import Any


def mark_kda_recoverssm(vllm_config: Any) -> None:
    """Set ``cache_config.use_kda_recoverssm`` on a config that runs GLM-5.3 recovery.

    vLLM derives the flag only for its own KDA RecoverSSM (Kimi), never for GLM-5.3. With
    it, vLLM's ``MambaHybridModelState`` creates the ``RecoverSSMState`` whose commit calls
    the plugin's metadata, and CUDA-graph capture keeps mixed batches within the verify
    window; no GLM-5.3 code of vLLM reads it otherwise.
    """
    vllm_config.cache_config.use_kda_recoverssm = True
