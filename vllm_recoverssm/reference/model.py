"""The tiny GLM-5.3-shaped hybrid model: KDA layers, attention every fourth layer, MTP head.

``HybridModel.forward`` runs one flat step (decode and prefill rows together) and returns
the last layer's hidden states; ``logits`` applies the final norm and the LM head. The MTP
head (one extra layer, as in GLM's multi-token prediction) predicts the token after next
from a hidden state and the embedding of the next token.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vllm_recoverssm import ops

from .layers import (
    MLP,
    KDAMixer,
    PagedAttention,
    RMSNorm,
    _init_linear,
    _linear,
    _normal_,
    plan_decode_verify,
)
from .model_config import ModelConfig
from .pools import ModelPools
from .step_inputs import StepInputs


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (KDA or attention), then a dense MLP."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.is_attention = config.is_attention(index)
        self.mixer_norm = RMSNorm(config.hidden_size)
        self.mixer: KDAMixer | PagedAttention = (
            PagedAttention(config) if self.is_attention else KDAMixer(config)
        )
        self.mlp_norm = RMSNorm(config.hidden_size)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def init_weights(self, gen: torch.Generator) -> None:
        """Initialise the block's weights from ``gen``."""
        self.mixer_norm.init_weights(gen)
        self.mixer.init_weights(gen)
        self.mlp_norm.init_weights(gen)
        self.mlp.init_weights(gen)

    def forward(self, x: torch.Tensor, step: StepInputs, pools: ModelPools,
                verify_step: ops.VerifyPlan | None = None) -> torch.Tensor:
        """Residual stream after this block (``verify_step``: see :class:`KDAMixer`)."""
        h = self.mixer_norm(x)
        if isinstance(self.mixer, PagedAttention):
            h = self.mixer(h, step.attention, pools.attention[self.index])
        else:
            h = self.mixer(h, step.linear, pools.kda[self.index], step.validate, step.backend,
                           verify_step)
        x = x + h
        return x + self.mlp(self.mlp_norm(x))


class MTPHead(nn.Module):
    """Multi-token prediction layer: ``h' = block(proj([norm(embed(t)), norm(h)]))``.

    Given the hidden state ``h`` that predicted token ``t``, ``h'`` predicts the token after
    ``t`` through the shared final norm and LM head; feeding ``h'`` back drafts further.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_norm = RMSNorm(config.hidden_size)
        self.hidden_norm = RMSNorm(config.hidden_size)
        self.proj = _linear(2 * config.hidden_size, config.hidden_size)
        self.mlp_norm = RMSNorm(config.hidden_size)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def init_weights(self, gen: torch.Generator) -> None:
        """Initialise the head's weights from ``gen``."""
        for norm in (self.embed_norm, self.hidden_norm, self.mlp_norm):
            norm.init_weights(gen)
        _init_linear(self.proj, gen)
        self.mlp.init_weights(gen)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """Next hidden state ``[N, hidden]``."""
        x = self.proj(torch.cat([self.embed_norm(token_embedding), self.hidden_norm(hidden)],
                                dim=-1))
        return x + self.mlp(self.mlp_norm(x))


class HybridModel(nn.Module):
    """Embedding, the GLM-5.3 layer pattern, final norm, LM head and an MTP head.

    Build it with :func:`build_model`; weights are random from ``config.seed``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)
        self.mtp = MTPHead(config)

    def init_weights(self, gen: torch.Generator) -> None:
        """Draw every weight from ``gen`` in a fixed order."""
        _normal_(self.embed.weight, gen, 1.0)
        for layer in self.layers:
            layer.init_weights(gen)  # type: ignore[operator]
        self.final_norm.init_weights(gen)
        # A sharper LM head than unit gain keeps greedy decoding from settling on one token.
        _normal_(self.lm_head.weight, gen, 4.0 / math.sqrt(self.config.hidden_size))
        self.mtp.init_weights(gen)

    def kda_mixers(self) -> list[KDAMixer]:
        """The KDA mixers, in layer order."""
        return [layer.mixer for layer in self.layers  # type: ignore[misc]
                if isinstance(layer.mixer, KDAMixer)]

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed.weight.device

    def forward(self, step: StepInputs, pools: ModelPools) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the last layer (before the final norm).

        With ``step.validate``, the decode rows' index tensors are checked once here for
        every KDA layer; each layer's verify then checks only its own tensors.
        """
        x = self.embed(step.token_ids)
        verify_step = None
        if step.validate and pools.kda:
            verify_step = plan_decode_verify(step.linear, next(iter(pools.kda.values())))
        for layer in self.layers:
            x = layer(x, step, pools, verify_step)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """FP32 logits ``[..., vocab]`` of hidden states (final norm, then the LM head)."""
        return self.final_norm(hidden).float() @ self.lm_head.weight.t()

    def mtp_step(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One MTP step: the hidden state that predicts the token after ``tokens``."""
        return self.mtp(hidden, self.embed(tokens))


# Parameters kept in FP32 whatever the activation dtype: the KDA gate (the ops require
# FP32) and the LM head (so that greedy argmax is not decided by bfloat16 rounding).
_FP32_PARAMS = ("A_log", "dt_bias", "lm_head.weight")


def build_model(config: ModelConfig, device: torch.device | str = "cpu") -> HybridModel:
    """The model with random weights from ``config.seed``, on ``device``, in inference mode."""
    model = HybridModel(config)
    model.init_weights(torch.Generator().manual_seed(config.seed))
    model.requires_grad_(False)
    model.to(device=device)
    for name, param in model.named_parameters():
        if not name.endswith(_FP32_PARAMS):
            param.data = param.data.to(config.torch_dtype)
    return model.eval()
