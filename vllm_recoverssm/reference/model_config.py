"""Shape of the tiny GLM-5.3-shaped hybrid model the reference runtime runs.

GLM-5.3 stacks KDA (Kimi Delta Attention) layers with a full-attention layer every fourth
layer, each followed by an MLP. This config keeps that pattern at toy sizes: the CPU preset
is small enough for CI, the GPU preset uses GLM-5.3's 128-dim KDA heads so that the Triton
kernels run at their real head size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Activation dtypes the model accepts, by name."""


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the hybrid model; every field is plain data so the config is hashable.

    Layer ``i`` is full attention when ``(i + 1) % full_attn_interval == 0`` (GLM-5.3: every
    fourth layer), otherwise KDA. ``lower_bound`` is the bounded-gate floor (GLM-5.3: -5).
    """

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 8
    full_attn_interval: int = 4
    num_kda_heads: int = 4
    kda_head_dim: int = 64
    conv_kernel: int = 4
    num_attn_heads: int = 4
    attn_head_dim: int = 64
    intermediate_size: int = 512
    lower_bound: float = -5.0
    rope_theta: float = 10000.0
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_layers", "full_attn_interval", "num_kda_heads",
            "kda_head_dim", "num_attn_heads", "attn_head_dim", "intermediate_size",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"argument '{name}': expected a positive int, got {value!r}")
        if not 2 <= self.conv_kernel <= 8:
            raise ValueError(f"argument 'conv_kernel': expected 2..8, got {self.conv_kernel}")
        if not self.lower_bound < 0:
            raise ValueError(
                f"argument 'lower_bound': expected a negative bound, got {self.lower_bound}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"argument 'dtype': expected one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if self.attn_head_dim % 2:
            raise ValueError(
                f"argument 'attn_head_dim': rotary embeddings need an even size, got "
                f"{self.attn_head_dim}"
            )
        if not self.kda_layers:
            raise ValueError(
                f"argument 'num_layers': {self.num_layers} layers with full_attn_interval "
                f"{self.full_attn_interval} leave no KDA layer"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activation dtype (conv history, activations, raw k / raw g records)."""
        return DTYPES[self.dtype]

    def is_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` is full attention (else KDA)."""
        return (layer + 1) % self.full_attn_interval == 0

    @property
    def kda_layers(self) -> list[int]:
        """Indices of the KDA layers."""
        return [i for i in range(self.num_layers) if not self.is_attention(i)]

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the full-attention layers."""
        return [i for i in range(self.num_layers) if self.is_attention(i)]

    @property
    def conv_channels(self) -> int:
        """Channels of one KDA layer's short conv: q, k and v together (3 * H * D)."""
        return 3 * self.num_kda_heads * self.kda_head_dim

    def describe(self) -> str:
        """One line naming the layer pattern and sizes."""
        return (
            f"{self.num_layers} layers ({len(self.kda_layers)} KDA + "
            f"{len(self.attention_layers)} attention), hidden {self.hidden_size}, "
            f"{self.num_kda_heads} KDA heads x {self.kda_head_dim}, vocab {self.vocab_size}, "
            f"{self.dtype}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready dict."""
        return asdict(self)

    def with_dtype(self, dtype: str) -> ModelConfig:
        """The same model with another activation dtype."""
        return replace(self, dtype=dtype)


CPU_MODEL = ModelConfig()
"""CPU default: 8 layers (6 KDA + 2 attention), hidden 256, 4 KDA heads of 64."""

GPU_MODEL = ModelConfig(
    vocab_size=4096,
    hidden_size=1024,
    num_kda_heads=8,
    kda_head_dim=128,
    num_attn_heads=8,
    attn_head_dim=128,
    intermediate_size=2048,
    dtype="bfloat16",
)
"""GPU default: GLM-5.3's 128-dim KDA heads (8 of them), bfloat16 activations."""

GLM_TP2_MODEL = replace(GPU_MODEL, hidden_size=2048, num_layers=16, num_kda_heads=32,
                        num_attn_heads=16, intermediate_size=4096)
"""GLM-5.3's KDA width per GPU at tensor parallel size 2 (32 heads x 128, a 2 MiB FP32
state per request and layer) on 12 KDA + 4 attention layers: the state operations weigh
in a step as they do in the real model, where the tiny ``GPU_MODEL`` leaves the step to
the host."""

TEST_MODEL = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_layers=4,
    num_kda_heads=2,
    kda_head_dim=16,
    num_attn_heads=2,
    attn_head_dim=16,
    intermediate_size=128,
)
"""The smallest model with the GLM-5.3 pattern (3 KDA + 1 attention), for fast tests."""
