"""GLM-5.3 model classes registered by the plugin over vLLM's own.

They add three things to vLLM's ``Glm5NextForCausalLM`` /
``Glm5NextForConditionalGeneration`` and change nothing else:

* the mamba state shapes/dtypes vLLM's platform uses to size and align hybrid pages
  include the recovery records when recovery is on (the layer reports the same layout);
* ``get_model_state_cls`` hands the GPU model runner (V2) a model state that commits
  accepted state after sampling and only then runs request-boundary captures;
* importing this module swaps the KDA layer (``PluggableLayer.register_oot``).
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.models.glm5next.common.model import (
    Glm5NextForCausalLM,
    Glm5NextForConditionalGeneration,
)

from ...config import recovery_enabled
from ...worker.model_state import RecoverMambaHybridModelState
from .kda import register_layer

register_layer()


def recovery_state_shapes(vllm_config: Any, base: tuple[Any, ...]) -> tuple[Any, ...]:
    """``base`` (conv, checkpoint) plus the record shapes when recovery is on."""
    if not recovery_enabled(vllm_config):
        return base
    text = vllm_config.model_config.hf_text_config
    return MambaStateShapeCalculator.append_kda_recoverssm_record(
        base, text.linear_num_heads, text.linear_head_dim,
        vllm_config.parallel_config.tensor_parallel_size,
        vllm_config.num_speculative_tokens + 1,
    )


def recovery_state_dtypes(vllm_config: Any, base: tuple[Any, ...]) -> tuple[Any, ...]:
    """``base`` dtypes plus the record dtypes (FP32, activation) when recovery is on."""
    if not recovery_enabled(vllm_config):
        return base
    return MambaStateDtypeCalculator.append_kda_recoverssm_record(
        base, vllm_config.model_config.dtype
    )


class _RecoveryModelMixin:
    """What both GLM-5.3 entry classes add: record-aware page sizing and the model state
    that commits before it captures. Listed first in the bases, so ``super()`` reaches
    vLLM's class."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: Any) -> Any:
        """State shapes for page sizing, records included under recovery."""
        return recovery_state_shapes(
            vllm_config, super().get_mamba_state_shape_from_config(vllm_config)  # type: ignore[misc]
        )

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: Any) -> Any:
        """State dtypes for page sizing, records included under recovery."""
        return recovery_state_dtypes(
            vllm_config, super().get_mamba_state_dtype_from_config(vllm_config)  # type: ignore[misc]
        )

    @staticmethod
    def get_model_state_cls() -> type[RecoverMambaHybridModelState]:
        """The model-runner-V2 state that commits before it captures."""
        return RecoverMambaHybridModelState


class RecoverGlm5NextForCausalLM(_RecoveryModelMixin, Glm5NextForCausalLM):
    """vLLM's GLM-5.3 text model with the recovery page layout and commit ordering."""


class RecoverGlm5NextForConditionalGeneration(
    _RecoveryModelMixin, Glm5NextForConditionalGeneration
):
    """vLLM's GLM-5.3 (vision-language wrapper) with the same additions."""
