"""Layers of the reference hybrid model: norms, MLP, paged attention and the KDA mixer.

Weights are random, drawn from one seeded generator (see :meth:`init_weights` on each
module) so that every process and device builds the same model. Projections are drawn with
standard deviation ``fan_in ** -0.5`` so activations keep unit scale through the stack.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_recoverssm import ops

from .model_config import ModelConfig
from .pools import AttentionLayerPools, KDALayerPools
from .step_inputs import FULL_STATE, AttentionInputs, LinearInputs

RMS_EPS = 1e-6


def _normal_(param: torch.Tensor, gen: torch.Generator, std: float, mean: float = 0.0) -> None:
    # Drawn on the CPU so that the same seed gives the same weights on every device.
    values = torch.randn(param.shape, generator=gen) * std + mean
    with torch.no_grad():
        param.copy_(values.to(param.dtype))


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


def _init_linear(layer: nn.Linear, gen: torch.Generator, gain: float = 1.0) -> None:
    _normal_(layer.weight, gen, gain / math.sqrt(layer.in_features))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMS norm over the last dimension, computed in float32, returned in ``x.dtype``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    return (xf * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """RMS norm with a learned scale (initialised near 1)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def init_weights(self, gen: torch.Generator) -> None:
        """Scale ~ N(1, 0.1^2)."""
        _normal_(self.weight, gen, 0.1, mean=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` over its last dimension."""
        return rms_norm(x, self.weight)


class MLP(nn.Module):
    """Dense SwiGLU MLP."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = _linear(hidden, 2 * intermediate)
        self.down = _linear(intermediate, hidden)

    def init_weights(self, gen: torch.Generator) -> None:
        """Unit-gain projections."""
        _init_linear(self.gate_up, gen)
        _init_linear(self.down, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate) * up)``."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of ``x`` ``[T, heads, dim]``."""
    dim = x.shape[-1]
    inv_freq = theta ** (
        -torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    xf = x.float()
    half = dim // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class PagedAttention(nn.Module):
    """Full causal attention whose keys and values live in a paged cache.

    Each token writes its key and value at ``kv_slots`` and attends to the positions
    ``0..position`` of its request, gathered through the request's block table. All shapes
    depend only on the step's token and row counts, so the layer can be captured in a CUDA
    graph. Keys written by rejected draft tokens sit past the committed length and are
    overwritten by the next step before any token can attend to them.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.num_attn_heads
        self.head_dim = config.attn_head_dim
        self.rope_theta = config.rope_theta
        width = self.heads * self.head_dim
        self.q_proj = _linear(config.hidden_size, width)
        self.k_proj = _linear(config.hidden_size, width)
        self.v_proj = _linear(config.hidden_size, width)
        self.o_proj = _linear(width, config.hidden_size)

    def init_weights(self, gen: torch.Generator) -> None:
        """Unit-gain projections."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            _init_linear(proj, gen)

    def forward(
        self, x: torch.Tensor, attn: AttentionInputs, cache: AttentionLayerPools
    ) -> torch.Tensor:
        """Attention output ``[T, hidden]``; writes this step's keys and values first."""
        T = x.shape[0]
        H, D = self.heads, self.head_dim
        q = apply_rope(self.q_proj(x).view(T, H, D), attn.positions, self.rope_theta)
        k = apply_rope(self.k_proj(x).view(T, H, D), attn.positions, self.rope_theta)
        v = self.v_proj(x).view(T, H, D)
        block_size = cache.keys.shape[1]
        flat_keys = cache.keys.view(-1, H, D)
        flat_values = cache.values.view(-1, H, D)
        flat_keys.index_copy_(0, attn.kv_slots, k)
        flat_values.index_copy_(0, attn.kv_slots, v)
        offsets = torch.arange(block_size, device=x.device)
        rows = attn.block_tables[:, :, None] * block_size + offsets  # [N, pages, B]
        key_index = rows.reshape(rows.shape[0], -1)[attn.row_of_token]  # [T, pages*B]
        keys = flat_keys[key_index].float()
        values = flat_values[key_index].float()
        scores = torch.einsum("thd,tkhd->thk", q.float(), keys) / math.sqrt(D)
        key_pos = torch.arange(key_index.shape[1], device=x.device)
        future = key_pos[None, :] > attn.positions[:, None]
        scores = scores.masked_fill(future[:, None, :], float("-inf"))
        out = torch.einsum("thk,tkhd->thd", scores.softmax(-1), values)
        return self.o_proj(out.to(x.dtype).reshape(T, H * D))


class KDAMixer(nn.Module):
    """Kimi Delta Attention with GLM-5.3's bounded gate.

    q, k and v pass one causal depthwise short conv (width ``conv_kernel``) with SiLU; the
    raw gate (``f_proj``), raw beta (``b_proj``) and the per-head ``A_log`` / ``dt_bias``
    feed the recurrence in :mod:`vllm_recoverssm.ops`; the output is RMS-normalised per
    head, gated by ``sigmoid(g_proj(x))`` and projected back to the hidden size.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads = config.num_kda_heads
        self.head_dim = config.kda_head_dim
        self.conv_kernel = config.conv_kernel
        self.lower_bound = config.lower_bound
        width = self.heads * self.head_dim
        self.qkv_proj = _linear(config.hidden_size, 3 * width)
        self.conv_weight = nn.Parameter(torch.zeros(3 * width, config.conv_kernel))
        self.f_proj = _linear(config.hidden_size, width)
        self.b_proj = _linear(config.hidden_size, self.heads)
        self.g_proj = _linear(config.hidden_size, width)
        self.o_norm = RMSNorm(self.head_dim)
        self.o_proj = _linear(width, config.hidden_size)
        # The gate parameters stay FP32 whatever the activation dtype (the ops require it).
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.heads, self.head_dim))

    def init_weights(self, gen: torch.Generator) -> None:
        """Projections at unit gain; decays spread between fast and slow heads."""
        for proj in (self.qkv_proj, self.f_proj, self.b_proj, self.g_proj, self.o_proj):
            _init_linear(proj, gen)
        _normal_(self.conv_weight, gen, 0.5)
        self.o_norm.init_weights(gen)
        with torch.no_grad():
            # exp(A_log) in [1, 8] (Kimi-style range); dt_bias ~ N(-2, 1) so that most
            # channels keep a decay close to 1 and the state carries context.
            a = 1.0 + 7.0 * torch.rand(self.heads, generator=gen)
            self.A_log.copy_(a.log())
        _normal_(self.dt_bias, gen, 1.0, mean=-2.0)

    def forward(
        self, x: torch.Tensor, lin: LinearInputs, pools: KDALayerPools, validate: bool,
        backend: str = "auto", verify_step: ops.VerifyPlan | None = None,
    ) -> torch.Tensor:
        """Mixer output ``[T, hidden]``; reads and writes the state per ``lin``.

        ``verify_step``: the decode rows' index tensors, checked once for every layer of
        the step (:func:`plan_decode_verify`); the verify then checks only this layer's
        tensors.
        """
        T = x.shape[0]
        H, D = self.heads, self.head_dim
        Td = lin.num_decode_tokens
        qkv = self.qkv_proj(x)
        parts = []
        if lin.num_decode_rows:
            parts.append(ops.conv_update(
                qkv[:Td].contiguous(), pools.conv, self.conv_weight, None,
                lin.decode_conv_indices, lin.decode_query_start_loc,
                conv_offsets=lin.conv_offsets, activation="silu", validate=validate,
                backend=backend,
            ))
        if lin.num_prefill_rows:
            parts.append(ops.conv_prefill(
                qkv[Td:].contiguous(), pools.conv, self.conv_weight, None,
                lin.prefill_state_indices, lin.prefill_query_start_loc, activation="silu",
                backend=backend, validate=validate,
            ))
        mixed = parts[0] if len(parts) == 1 else torch.cat(parts)
        q, k, v = (t.reshape(T, H, D).contiguous() for t in mixed.chunk(3, dim=-1))
        raw_g = self.f_proj(x).view(T, H, D).contiguous()
        raw_beta = self.b_proj(x).contiguous()
        A_log, dt_bias = self.A_log.float(), self.dt_bias.float()
        outs = []
        if lin.num_decode_rows:
            args = (q[:Td], k[:Td], v[:Td], raw_g[:Td], raw_beta[:Td], A_log, dt_bias,
                    pools.state, lin.decode_state_indices)
            if lin.mode == FULL_STATE:
                assert lin.num_accepted is not None
                outs.append(ops.verify_full(
                    *args, lin.num_accepted, lin.decode_query_start_loc,
                    lower_bound=self.lower_bound, validate=validate, backend=backend,
                    step=verify_step,
                ))
            elif lin.fused:
                assert pools.corrections is not None and pools.kg is not None
                assert lin.prev_lens is not None
                # the previous step's records sit in the other half of the same scratch
                outs.append(ops.verify_fused(
                    *args, lin.decode_query_start_loc, pools.corrections, pools.kg,
                    lin.prev_lens, lower_bound=self.lower_bound,
                    record_indices=lin.record_indices,
                    prev_record_indices=lin.prev_record_indices, validate=validate,
                    backend=backend, step=verify_step,
                ))
            else:
                assert pools.corrections is not None and pools.kg is not None
                outs.append(ops.verify_recovery(
                    *args, lin.decode_query_start_loc, pools.corrections, pools.kg,
                    lower_bound=self.lower_bound, validate=validate, backend=backend,
                    step=verify_step,
                ))
        if lin.num_prefill_rows:
            outs.append(ops.prefill(
                q[Td:], k[Td:], v[Td:], raw_g[Td:], raw_beta[Td:], A_log, dt_bias,
                pools.state, lin.prefill_state_indices, lin.prefill_query_start_loc,
                self.lower_bound, out_dtype=x.dtype, backend=backend, validate=validate,
            ))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        gate = torch.sigmoid(self.g_proj(x).view(T, H, D).float())
        o = (rms_norm(o, self.o_norm.weight).float() * gate).to(x.dtype)
        return self.o_proj(o.reshape(T, H * D))


def plan_decode_verify(lin: LinearInputs, pools: KDALayerPools) -> ops.VerifyPlan | None:
    """The decode rows' verify plan for every KDA layer of a step (None without decode rows).

    Every layer's pools have the sizes of ``pools`` (one layer's), so the index tensors
    checked here once hold for each layer's verify, which :meth:`KDAMixer.forward` then
    runs with it.
    """
    if not lin.num_decode_rows:
        return None
    si, qsl, dev = lin.decode_state_indices, lin.decode_query_start_loc, pools.state.device
    slots, tokens = pools.state.shape[0], lin.num_decode_tokens
    if lin.mode == FULL_STATE:
        return ops.plan_verify(si, qsl, num_slots=slots, num_tokens=tokens,
                               window=si.shape[1], device=dev, num_accepted=lin.num_accepted)
    assert pools.corrections is not None
    rows, window = pools.corrections.shape[0], pools.corrections.shape[2]
    if not lin.fused:
        return ops.plan_verify(si, qsl, num_slots=slots, num_tokens=tokens, window=window,
                               device=dev, record_rows=rows)
    # the previous step's records sit in the other half of the same scratch
    return ops.plan_verify(si, qsl, num_slots=slots, num_tokens=tokens, window=window,
                           device=dev, record_indices=lin.record_indices, record_rows=rows,
                           prev_lens=lin.prev_lens, prev_record_indices=lin.prev_record_indices,
                           prev_record_rows=rows, prev_shares_pool=True)
