"""The q/k RMSNorm of GLM-5.3-Flash's vision attention on vLLM's CPU platform.

vLLM's GLM-5.3 vision blocks normalise each head's q and k rows with one fused Triton
kernel (``vllm.models.common.ops.fused_q_kv_rmsnorm``), which has no CPU form, so an
image prompt stops on vLLM's CPU engine. The form here computes what that kernel
computes: per row, in float32, ``x * rsqrt(mean(x^2) + eps) * weight``, cast back.
"""

from __future__ import annotations

import torch

TARGET = "vllm.models.glm5next.common.multimodal"
"""The module whose ``fused_q_kv_rmsnorm`` (imported by name) the vision blocks call."""


def applies() -> bool:
    """On vLLM's CPU platform only: on GPUs the Triton kernel runs."""
    from .. import compat

    return compat.platform_name() == "cpu"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            * weight.float()).to(x.dtype)


def fused_q_kv_rmsnorm(qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor,
                       kv_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalise the rows of ``qr`` with ``q_weight`` and of ``kv`` with
    ``kv_weight`` (``[tokens, width]`` each)."""
    if qr.ndim != 2 or kv.ndim != 2 or qr.shape[0] != kv.shape[0]:
        raise ValueError(f"expected two [tokens, width] tensors of one token count, got "
                         f"{tuple(qr.shape)} and {tuple(kv.shape)}")
    return _rms_norm(qr, q_weight, eps), _rms_norm(kv, kv_weight, eps)


def install() -> None:
    """Point the vision blocks at the PyTorch form (before any model is built)."""
    from .. import compat

    compat.replace_module_function(TARGET, "fused_q_kv_rmsnorm", fused_q_kv_rmsnorm)
