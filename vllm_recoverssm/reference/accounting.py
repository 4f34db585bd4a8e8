"""State bytes per request: measured from the runtime's pools, and the planner's figure.

The measured figure counts what a request really held: the most state-pool slots it had
at once times the bytes of one slot in the allocated tensors (recurrent state + conv window
of every KDA layer), plus, in recovery mode, its row of the record scratch. The planner's
figure (:func:`vllm_recoverssm.state.state_bytes_per_request`, records in scratch) is
computed from the model's dimensions alone; the two must agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_recoverssm.config.models import AttentionSpec, ModelSpec
from vllm_recoverssm.state import state_bytes_per_request

from .model_config import ModelConfig
from .step_inputs import FULL_STATE, RECOVERY

if TYPE_CHECKING:
    from .runtime import SpecRuntime


def model_spec(config: ModelConfig, max_model_len: int = 4096) -> ModelSpec:
    """The planner's description of the reference model."""
    return ModelSpec(
        name="recoverssm-reference",
        architecture="ReferenceHybridForCausalLM",
        kind="kda",
        num_layers=config.num_layers,
        num_linear_layers=len(config.kda_layers),
        num_attention_layers=len(config.attention_layers),
        linear_num_heads=config.num_kda_heads,
        linear_head_dim=config.kda_head_dim,
        linear_num_k_heads=config.num_kda_heads,
        linear_k_head_dim=config.kda_head_dim,
        conv_kernel=config.conv_kernel,
        lower_bound=config.lower_bound,
        attention=AttentionSpec(kind="gqa", num_kv_heads=config.num_attn_heads,
                                head_dim=config.attn_head_dim),
        max_model_len=max_model_len,
        dtype=config.dtype,  # type: ignore[arg-type]
    )


def planned_state_bytes(
    config: ModelConfig, mode: str, num_spec: int, prefix_caching: bool
) -> int:
    """The planner's linear-state bytes per running request (records in a scratch area)."""
    if mode not in (RECOVERY, FULL_STATE):
        raise ValueError(f"argument 'mode': expected recovery or full_state, got {mode!r}")
    return state_bytes_per_request(
        model_spec(config),
        tp=1,
        num_spec=num_spec,
        mode="recovery" if mode == RECOVERY else "full",
        records="scratch",
        cache_mode="align" if prefix_caching else "none",
        activation_bytes=config.torch_dtype.itemsize,
        state_bytes=4,
    )


def measured_state_bytes(runtime: SpecRuntime) -> int:
    """Peak slots any request held x bytes per slot (+ one record row in recovery mode)."""
    pools = runtime.pools
    return runtime.stats.peak_slots_per_request * pools.slot_bytes + pools.record_row_bytes
