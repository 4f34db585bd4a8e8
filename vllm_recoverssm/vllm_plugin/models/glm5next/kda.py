"""GLM-5.3 KDA layer that serves every row, with recovery or full speculative states.

``RecoverGlm5NextLinearAttention`` replaces vLLM's ``Glm5NextLinearAttention`` through
``PluggableLayer.register_oot`` (done by :func:`register_layer` when the GLM-5.3 model
module is imported).

State layout. A request's page is vLLM's own: conv history (``Kc-1+S`` columns) and one
FP32 recurrent state, so every vLLM code path that reads the page sees the two tensors it
expects. Under recovery the KV-cache spec reserves no speculative blocks (one page per
request instead of ``S+1``), and the per-token update records live in two per-layer
scratch buffers of ``max_num_seqs`` rows (FP32 corrections, raw k|g in the activation
dtype), indexed by the speculative row of the step: they only live from verify to the
commit after sampling, so no cached or exported page carries them. With the commit fused
into the next verify they live one step longer, so the scratch has two halves
(``2 * max_num_seqs`` rows) and a step writes the half the previous one did not.

Rows. Speculative rows under recovery run :func:`.cpu.kda_rows.recovery_rows` (conv at offset
0, recovery verify). On a platform where vLLM has KDA kernels (CUDA) every other row, and
every row with recovery off, runs vLLM's own code. Where vLLM has none (its CPU platform)
the layer runs every row with the project's ops in both modes (:mod:`.cpu.kda_rows`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from ... import compat
from ...attention.recover_kda import RecoverKDAAttentionBackend, RecoverKDAMetadata
from ...config import fused_commit_enabled, recovery_enabled
from ...patch.kda_layer import undecorated_forward
from .cpu.kda_rows import full_state_rows, prompt_rows, recovery_rows

_BASE: Any = compat.Glm5NextLinearAttention
_PARENT_FORWARD = undecorated_forward(_BASE)
"""vLLM's ``_forward`` without its capture-break decorator: ours already carries it."""

_SPEC_ONLY_FIELDS = dict(
    num_spec_decodes=0, num_spec_decode_tokens=0, spec_query_start_loc=None,
    spec_state_indices_tensor=None, spec_sequence_masks=None, spec_sequence_masks_cpu=None,
    spec_token_indx=None, non_spec_token_indx=None, num_accepted_tokens=None,
    uniform_spec_sequence_length=None,
)


def _flat(weight: torch.Tensor) -> torch.Tensor:
    """A conv weight stored ``[dim, 1, width]`` as ``[dim, width]``."""
    return weight.reshape(weight.shape[0], -1)


class RecoverGlm5NextLinearAttention(_BASE):  # type: ignore[misc]
    """GLM-5.3 KDA with speculative-state recovery (see the module docstring)."""

    use_recovery: bool = False
    own_ops: bool = False
    _merged_conv_weight: torch.Tensor | None

    def __init__(self, config: Any, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(config, vllm_config, prefix)
        self.use_recovery = recovery_enabled(vllm_config)
        self.own_ops = not compat.platform_has_kda_kernels()
        # Triton on CUDA tensors (SM12x included: vllm_plugin/kernels.py says why not
        # b12x), the PyTorch reference elsewhere.
        self.ops_backend = "auto"
        if self.use_recovery:
            rows = int(vllm_config.scheduler_config.max_num_seqs)
            if fused_commit_enabled(vllm_config):
                rows *= 2  # one half written by this step, one read as pending records
            window = int(self.num_spec) + 1
            h, d = self.local_num_heads, self.head_dim
            # Buffers move with the model; non-persistent ones are neither loaded nor
            # saved, and vLLM's dummy loader leaves them alone.
            self.register_buffer(
                "recovery_corrections",
                torch.zeros(rows, h, window, d, dtype=torch.float32), persistent=False)
            self.register_buffer(
                "recovery_kg",
                torch.zeros(rows, h, window, 2 * d, dtype=vllm_config.model_config.dtype),
                persistent=False)

    # -- state layout ----------------------------------------------------------------
    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        """One page per request under recovery: no speculative blocks."""
        spec = super().get_kv_cache_spec(vllm_config)
        if self.use_recovery:
            spec = dataclasses.replace(spec, num_speculative_blocks=0)
        return spec

    def get_attn_backend(self) -> Any:
        """The recovery backend (narrowed metadata) when recovery is on."""
        if self.use_recovery:
            return RecoverKDAAttentionBackend
        return super().get_attn_backend()

    def recovery_records(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scratch record buffers: corrections ``[rows, h, S+1, D]`` FP32 and raw
        k|g ``[rows, h, S+1, 2D]`` (activation dtype)."""
        return (cast(torch.Tensor, self.recovery_corrections),
                cast(torch.Tensor, self.recovery_kg))

    def conv_state_dim_first_view(self, conv_state: torch.Tensor) -> torch.Tensor:
        """The conv state as ``[slots, dim, width]`` whatever vLLM's layout setting."""
        return conv_state if self._conv_state_dim_first else conv_state.transpose(-1, -2)

    def merged_conv_weight(self) -> torch.Tensor:
        """q|k|v short-conv weights as one ``[dim, width]`` tensor (built once)."""
        if self._merged_conv_weight is None:
            self._merged_conv_weight = torch.cat(
                [_flat(cast(torch.Tensor, m.weight))
                 for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)], dim=0
            ).contiguous()
        return cast(torch.Tensor, self._merged_conv_weight)

    # -- forward -----------------------------------------------------------------------
    @compat.eager_break_during_capture
    def _forward(self, qkv_proj_states: torch.Tensor, g1: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
        meta = compat.forward_attn_metadata(self.prefix)
        if meta is None:
            return  # profile / warm-up runs without metadata, as in vLLM's layer
        if self.own_ops:
            self._forward_own_ops(meta, qkv_proj_states, g1, beta, core_attn_out)
            return
        if (not isinstance(meta, RecoverKDAMetadata) or meta.num_spec_decodes == 0
                or meta.spec_sequence_masks is None):
            _PARENT_FORWARD(self, qkv_proj_states, g1, beta, core_attn_out)
            return
        n = meta.num_actual_tokens
        ns_idx = meta.non_spec_token_indx
        if ns_idx is not None and ns_idx.numel() > 0:
            s_idx = meta.spec_token_indx
            assert s_idx is not None
            out = recovery_rows(self, meta, qkv_proj_states.index_select(0, s_idx),
                                g1.index_select(1, s_idx), beta.index_select(1, s_idx))
            core_attn_out[0].index_copy_(0, s_idx.long(), out.to(core_attn_out.dtype))
            ns_meta = dataclasses.replace(cast(Any, meta), num_actual_tokens=ns_idx.numel(),
                                          **_SPEC_ONLY_FIELDS)
            ns_out = core_attn_out.new_empty((1, ns_idx.numel(), *core_attn_out.shape[2:]))
            saved = compat.set_forward_attn_metadata(self.prefix, ns_meta)
            try:
                _PARENT_FORWARD(self, qkv_proj_states.index_select(0, ns_idx),
                                g1.index_select(1, ns_idx), beta.index_select(1, ns_idx),
                                ns_out)
            finally:
                compat.set_forward_attn_metadata(self.prefix, saved)
            core_attn_out[0].index_copy_(0, ns_idx.long(), ns_out[0])
        else:
            # Every token belongs to a speculative row; tokens past the last row (graph
            # padding) belong to no row and come out as zeros, as in vLLM's own path.
            out = recovery_rows(self, meta, qkv_proj_states[:n], g1[:, :n], beta[:, :n])
            core_attn_out[0, :n] = out.to(core_attn_out.dtype)

    def _forward_own_ops(self, meta: Any, qkv: torch.Tensor, g1: torch.Tensor,
                         beta: torch.Tensor, core_attn_out: torch.Tensor) -> None:
        """Every row of the step with the project's ops (no vLLM KDA kernels here)."""
        n = meta.num_actual_tokens
        out = core_attn_out[0]
        out[:n].zero_()  # tokens of no row (padding) come out as zeros
        spec = meta.spec_sequence_masks is not None and meta.num_spec_decodes > 0
        ns_idx = meta.non_spec_token_indx
        if not spec:
            t = int(meta.non_spec_query_start_loc[-1])
            res = prompt_rows(self, meta, qkv[:t], g1[:, :t], beta[:, :t])
            out[:t] = res.to(out.dtype)
            return
        spec_rows = recovery_rows if self.use_recovery else full_state_rows
        mixed = ns_idx is not None and ns_idx.numel() > 0
        if mixed:
            s_idx = meta.spec_token_indx
            assert s_idx is not None
            res = spec_rows(self, meta, qkv.index_select(0, s_idx), g1.index_select(1, s_idx),
                            beta.index_select(1, s_idx))
            out.index_copy_(0, s_idx.long(), res.to(out.dtype))
            res = prompt_rows(self, meta, qkv.index_select(0, ns_idx),
                              g1.index_select(1, ns_idx), beta.index_select(1, ns_idx))
            out.index_copy_(0, ns_idx.long(), res.to(out.dtype))
        else:
            t = int(meta.spec_query_start_loc[meta.num_spec_decodes])
            res = spec_rows(self, meta, qkv[:t], g1[:, :t], beta[:, :t])
            out[:t] = res.to(out.dtype)


_registered = False


def register_layer() -> None:
    """Swap vLLM's GLM-5.3 KDA layer for this one (idempotent)."""
    global _registered
    if _registered:
        return
    compat.register_oot_layer(_BASE, RecoverGlm5NextLinearAttention)
    _registered = True
