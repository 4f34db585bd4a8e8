"""GLM-5.3 KDA layer whose speculative path runs recovery verify.

``RecoverGlm5NextLinearAttention`` replaces vLLM's ``Glm5NextLinearAttention`` through
``PluggableLayer.register_oot`` (done by :func:`register_layer` when the GLM-5.3 model
module is imported). With recovery off for the deployment it is the parent layer, unchanged.
With recovery on:

* its state is four tensors per page — conv history, the FP32 checkpoint, and the
  per-token records (FP32 corrections, raw k|g) — built with vLLM's own
  ``append_kda_recoverssm_record`` shape/dtype helpers, and its KV-cache spec reserves no
  speculative blocks (one page per request, not S+1);
* its metadata comes from :class:`~..attention.recover_kda.RecoverKDAMetadataBuilder`
  (one state column per speculative row);
* speculative rows run :func:`vllm_recoverssm.ops.conv_update` (zero offset) and
  :func:`vllm_recoverssm.ops.verify_recovery` (reads the checkpoint, writes records);
  prompt and non-speculative rows still run vLLM's own code, called with the speculative
  rows taken out of the metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.models.glm5next.common.kda import Glm5NextLinearAttention

from .... import ops
from ...attention.recover_kda import (
    RecoverKDAAttentionBackend,
    RecoverKDAMetadata,
    dim_first_conv,
)
from ...config import recovery_enabled

_PARENT_FORWARD = getattr(Glm5NextLinearAttention._forward, "__wrapped__",
                          Glm5NextLinearAttention._forward)
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


@contextmanager
def _metadata_for(prefix: str, metadata: Any) -> Iterator[None]:
    """Show ``metadata`` to the layer ``prefix`` for the duration of a call."""
    table = get_forward_context().attn_metadata
    assert isinstance(table, dict)
    saved = table[prefix]
    table[prefix] = metadata
    try:
        yield
    finally:
        table[prefix] = saved


class RecoverGlm5NextLinearAttention(Glm5NextLinearAttention):
    """GLM-5.3 KDA with speculative-state recovery (see the module docstring)."""

    use_recovery: bool = False

    def __init__(self, config: Any, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(config, vllm_config, prefix)
        self.use_recovery = recovery_enabled(vllm_config)
        # Triton on CUDA tensors, the PyTorch reference elsewhere; on SM12x with b12x the
        # group's commit context carries b12x's verify/commit and both run there.
        self.ops_backend = "auto"
        self._b12x_params: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- state layout ----------------------------------------------------------------
    def get_state_shape(self) -> Any:
        """Conv + checkpoint, plus the record tensors under recovery."""
        base = super().get_state_shape()
        if not self.use_recovery:
            return base
        return MambaStateShapeCalculator.append_kda_recoverssm_record(
            cast(Any, base), self.num_heads, self.head_dim, self.tp_size, self.num_spec + 1
        )

    def get_state_dtype(self) -> Any:
        """Dtypes matching :meth:`get_state_shape` (records: FP32, activation dtype)."""
        base = super().get_state_dtype()
        if not self.use_recovery:
            return base
        return MambaStateDtypeCalculator.append_kda_recoverssm_record(
            base, self.model_config.dtype
        )

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
        return self._merged_conv_weight

    def float_gate_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``A_log`` ``[h]`` and ``dt_bias`` ``[h, D]`` as float32 (built once: b12x binds
        their addresses)."""
        if self._b12x_params is None:
            h, d = self.local_num_heads, self.head_dim
            self._b12x_params = (
                self.A_log.detach().reshape(h).float().contiguous(),
                self.dt_bias.detach().reshape(h, d).float().contiguous(),
            )
        return self._b12x_params

    # -- forward -----------------------------------------------------------------------
    @eager_break_during_capture
    def _forward(self, qkv_proj_states: torch.Tensor, g1: torch.Tensor, beta: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
        meta = None
        if self.use_recovery:
            table = get_forward_context().attn_metadata
            meta = table.get(self.prefix) if isinstance(table, dict) else None
        if (not isinstance(meta, RecoverKDAMetadata) or meta.num_spec_decodes == 0
                or meta.spec_sequence_masks is None):
            _PARENT_FORWARD(self, qkv_proj_states, g1, beta, core_attn_out)
            return
        n = meta.num_actual_tokens
        ns_idx = meta.non_spec_token_indx
        mixed = ns_idx is not None and ns_idx.numel() > 0
        if mixed:
            assert meta.spec_token_indx is not None
            s_idx = meta.spec_token_indx
            out = self.verify_spec_rows(meta, qkv_proj_states.index_select(0, s_idx),
                                        g1.index_select(1, s_idx), beta.index_select(1, s_idx))
            core_attn_out[0].index_copy_(0, s_idx, out.to(core_attn_out.dtype))
            ns_meta = dataclasses.replace(meta, num_actual_tokens=ns_idx.numel(),
                                          **_SPEC_ONLY_FIELDS)
            ns_out = core_attn_out.new_empty((1, ns_idx.numel(), *core_attn_out.shape[2:]))
            with _metadata_for(self.prefix, ns_meta):
                _PARENT_FORWARD(self, qkv_proj_states.index_select(0, ns_idx),
                                g1.index_select(1, ns_idx), beta.index_select(1, ns_idx),
                                ns_out)
            core_attn_out[0].index_copy_(0, ns_idx, ns_out[0])
        else:
            # Every token belongs to a speculative row; tokens past the last row (graph
            # padding) belong to no row and come out as zeros, as in vLLM's own path.
            out = self.verify_spec_rows(meta, qkv_proj_states[:n], g1[:, :n], beta[:, :n])
            core_attn_out[0, :n] = out.to(core_attn_out.dtype)

    def verify_spec_rows(self, meta: RecoverKDAMetadata, qkv: torch.Tensor,
                         raw_g: torch.Tensor, raw_beta: torch.Tensor) -> torch.Tensor:
        """Conv update + recovery verify of the speculative rows; returns ``[T, h, D]``.

        ``qkv`` is ``[T, 3*h*D]`` (before the short conv), ``raw_g`` ``[1, T, h, D]`` and
        ``raw_beta`` ``[1, T, h]`` (both raw, as the projections produce them).
        """
        conv_state, state, corrections, kg = self.kv_cache
        h, d = self.local_num_heads, self.head_dim
        # The checks that read device values would sync the host every layer and step;
        # vLLM's metadata is trusted on the GPU, checked everywhere else.
        check = not qkv.is_cuda
        n = meta.num_spec_decodes
        slots = meta.spec_slots().contiguous()
        assert meta.spec_query_start_loc is not None
        qsl = meta.spec_query_start_loc[: n + 1].to(torch.int32).contiguous()
        conv_view = self.conv_state_dim_first_view(conv_state)
        with dim_first_conv(conv_view, slots) as (conv, idx):
            x = ops.conv_update(qkv.contiguous(), conv, self.merged_conv_weight(),
                                self.q_conv1d.bias, idx, qsl, activation="silu",
                                backend=self.ops_backend, validate=check)
        q, k, v = (t.reshape(-1, h, d).contiguous()
                   for t in x.split(self.local_projection_size, dim=-1))
        b12x = meta.commit_context.b12x if meta.commit_context is not None else None
        if b12x is not None:
            a_log, dt_bias = self.float_gate_params()
            return b12x.verify(
                q, k, v, raw_g[0].reshape(-1, h, d).contiguous(),
                raw_beta[0].reshape(-1, h).contiguous(), a_log, dt_bias, state, slots, qsl,
                corrections, kg, lower_bound=self.kda_lower_bound, record_indices=slots,
                validate=check,
            )
        return ops.verify_recovery(
            q, k, v, raw_g[0].reshape(-1, h, d).contiguous(),
            raw_beta[0].reshape(-1, h).contiguous(), self.A_log.reshape(h),
            self.dt_bias.reshape(h, d), state, slots, qsl, corrections, kg,
            lower_bound=self.kda_lower_bound, record_indices=slots,
            backend=self.ops_backend, validate=check,
        )


_registered = False


def register_layer() -> None:
    """Swap vLLM's GLM-5.3 KDA layer for the recovery one (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.custom_op import op_registry_oot

    name = Glm5NextLinearAttention.__name__
    if op_registry_oot.get(name) is not RecoverGlm5NextLinearAttention:
        Glm5NextLinearAttention.register_oot(RecoverGlm5NextLinearAttention)
    _registered = True
