"""GLM-5.3 model classes registered by the plugin over vLLM's own.

They add two things to vLLM's ``Glm5NextForCausalLM`` / ``Glm5NextForConditionalGeneration``
and change nothing else:

* ``get_model_state_cls`` hands vLLM's GPU model runner (V2) a model state that commits
  accepted state after sampling and only then runs request-boundary captures (runner V1
  commits through :mod:`...worker.commit`);
* importing this module swaps the KDA layer (``PluggableLayer.register_oot``) and installs
  the patches of :mod:`...patch` that apply on this platform.

The state pages keep vLLM's own shapes (conv history + one FP32 state): the update
records live in per-layer scratch buffers, not in the pages.
"""

from __future__ import annotations

from typing import Any

from ... import compat, patch
from ...config import plugin_logger
from ...worker.model_state import RecoverMambaHybridModelState
from .kda import register_layer

register_layer()
_PATCHES = patch.apply("model")
if _PATCHES:
    plugin_logger().info("patched vLLM (vllm_recoverssm.vllm_plugin.patch): %s",
                         ", ".join(_PATCHES))

_CAUSAL_LM: Any = compat.Glm5NextForCausalLM
_CONDITIONAL: Any = compat.Glm5NextForConditionalGeneration


class _RecoveryModelMixin:
    """What both GLM-5.3 entry classes add: the model state that commits before it
    captures. Listed first in the bases, so ``super()`` reaches vLLM's class."""

    @staticmethod
    def get_model_state_cls() -> type[RecoverMambaHybridModelState]:
        """The model-runner-V2 state that commits before it captures."""
        return RecoverMambaHybridModelState


class RecoverGlm5NextForCausalLM(_RecoveryModelMixin, _CAUSAL_LM):  # type: ignore[misc]
    """vLLM's GLM-5.3 text model with the recovery layer and commit ordering."""


class RecoverGlm5NextForConditionalGeneration(  # type: ignore[misc]
    _RecoveryModelMixin, _CONDITIONAL
):
    """vLLM's GLM-5.3 (vision-language wrapper) with the same additions."""
