"""State bytes per request: measured from the runtime's pools, and the planner's figure.

The measured figure counts what a request really held: the most state-pool slots it had
at once times the bytes of one slot in the allocated tensors (recurrent state + conv window
of every KDA layer), plus, in recovery mode, its rows of the record scratch (two with the
fused commit, which reads the previous step's row while it writes the next). The
planner's figure (:func:`vllm_recoverssm.state.state_bytes_per_request`, records in
scratch, one row) is computed from the model's dimensions alone, plus for the fused commit
one more row by DESIGN.md section 3's formula; the two must agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_recoverssm.config.models import AttentionSpec, ModelSpec
from vllm_recoverssm.config.state_mode import StateMode
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


def record_row_bytes(config: ModelConfig, num_spec: int) -> int:
    """One request's records in every KDA layer: ``h (S+1) D (4 + 2b)`` (DESIGN.md 3)."""
    per_layer = config.num_kda_heads * (num_spec + 1) * config.kda_head_dim * (
        4 + 2 * config.torch_dtype.itemsize)
    return len(config.kda_layers) * per_layer


def planned_state_bytes(
    config: ModelConfig, mode: str, num_spec: int, prefix_caching: bool, fused: bool = False
) -> int:
    """The planner's linear-state bytes per running request (records in a scratch area);
    ``fused`` adds the second record row the fused commit double-buffers."""
    if mode not in (RECOVERY, FULL_STATE):
        raise ValueError(f"argument 'mode': expected recovery or full_state, got {mode!r}")
    extra = record_row_bytes(config, num_spec) if fused and mode == RECOVERY else 0
    return extra + state_bytes_per_request(
        model_spec(config),
        tp=1,
        num_spec=num_spec,
        mode=StateMode.parse(mode),
        records="scratch",
        cache_mode="align" if prefix_caching else "none",
        activation_bytes=config.torch_dtype.itemsize,
        state_bytes=4,
    )


def measured_state_bytes(runtime: SpecRuntime) -> int:
    """Peak slots any request held x bytes per slot (+ its record rows in recovery mode)."""
    pools = runtime.pools
    rows = 2 if runtime.config.fused else 1
    return runtime.stats.peak_slots_per_request * pools.slot_bytes + rows * pools.record_row_bytes
