"""vLLM plugin: speculative-state recovery for GLM-5.3 in ``vllm serve``.

vLLM calls :func:`register` (entry point ``vllm.general_plugins: recoverssm``) in every
process it starts. Registration is cheap and touches nothing but GLM-5.3:

* the GLM-5.3 model classes are re-registered with subclasses
  (:mod:`.models.glm5next.model`) that report the recovery page layout, hand vLLM's GPU
  model runner (V2) a model state that commits accepted state before any request-boundary
  checkpoint is captured (:mod:`.worker.model_state`), and swap the KDA layer for one
  whose speculative path runs our verify (:mod:`.models.glm5next.kda`). vLLM imports these
  lazily, only when a GLM-5.3 model is resolved;
* ``EngineArgs`` learns the recovery mode (auto / ``--use-replayssm`` / ``--no-use-replayssm``
  / ``additional_config``; :mod:`.engine_args`);
* vLLM's KV-connector factory learns ``RecoverSSMCheckpointConnector``
  (:mod:`.distributed.kv_connector`): request-boundary checkpoints through LMCache.
"""

from __future__ import annotations

import logging
import sys

from ..ops.backends import choose_kernel_backend
from .config import CONFIG_KEY, decide_for_vllm_config, deployment_from_vllm_config, plugin_logger

MODEL_MODULE = "vllm_recoverssm.vllm_plugin.models.glm5next.model"
OVERRIDDEN_ARCHITECTURES = {
    "Glm5NextForCausalLM": f"{MODEL_MODULE}:RecoverGlm5NextForCausalLM",
    "Glm5NextForConditionalGeneration": f"{MODEL_MODULE}:RecoverGlm5NextForConditionalGeneration",
}

_registered = False

__all__ = [
    "CONFIG_KEY",
    "OVERRIDDEN_ARCHITECTURES",
    "choose_kernel_backend",
    "decide_for_vllm_config",
    "deployment_from_vllm_config",
    "register",
]


def register() -> None:
    """Entry point for ``vllm.general_plugins``; safe to call more than once per process."""
    global _registered
    if _registered:
        return
    from . import compat

    compat.check_supported_version()
    for arch, target in OVERRIDDEN_ARCHITECTURES.items():
        compat.register_model(arch, target)
    from . import patch

    patched = patch.apply("register")
    from .distributed import kv_connector

    kv_connector.register()
    _registered = True
    from .. import __version__

    announce(
        f"vllm-recoverssm {__version__} plugin loaded: GLM-5.3 speculative-state recovery "
        "is automatic when eligible (--no-use-replayssm keeps full states); installed: "
        f"{len(OVERRIDDEN_ARCHITECTURES)} model classes, patches {', '.join(patched)}, "
        "the RecoverSSMCheckpointConnector"
    )


def announce(message: str) -> None:
    """Log ``message`` at INFO through vLLM's logging, or to stderr before it is set up.

    vLLM configures its log handlers only after parsing the command line, so in the front
    end (e.g. ``vllm serve --help``) a plugin's log line would otherwise be dropped.
    """
    log = plugin_logger()
    if logging.getLogger("vllm").handlers:
        log.info(message)
        return
    from .compat import vllm_logging_level

    if getattr(logging, vllm_logging_level().upper(), logging.INFO) <= logging.INFO:
        print(f"INFO [vllm-recoverssm] {message}", file=sys.stderr)
