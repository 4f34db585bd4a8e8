"""GLM-5.3's manifold-constrained hyper-connections (mHC) on vLLM's CPU platform.

GLM-5.3-Flash keeps ``hc_mult`` residual streams. Before each block (KDA/MLA, MLP) a
pre step mixes the streams into one block input and RMS-normalises it with the layer's
norm weight; after it a post step expands the block output back into the streams. vLLM
folds the norm into its mHC ops. Its CPU forms ignore ``norm_weight`` and take only
bfloat16/float16 inputs, so on the CPU platform every block reads an unnormalised input
(transformers' model and vLLM's CUDA/ROCm forms normalise). The forms here compute what
transformers' ``Glm5NextTextHyperConnection`` and decoder layer compute, in float32, for
any activation dtype, with the norm applied.
"""

from __future__ import annotations

from typing import Any

import torch


def applies() -> bool:
    """On vLLM's CPU platform only: its CUDA and ROCm forms apply the norm."""
    from .. import compat

    return compat.platform_name() == "cpu"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is None:
        return x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * normed.to(x.dtype).float()).to(x.dtype)


def _sinkhorn(comb: torch.Tensor, eps: float, repeat: int) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor,
           hc_base: torch.Tensor, rms_eps: float, hc_pre_eps: float, hc_sinkhorn_eps: float,
           hc_post_mult_value: float, sinkhorn_repeat: int, n_splits: int = 1,
           norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mHC pre block: ``(post [.., n, 1], comb [.., n, n], block input [.., d])``.

    ``residual`` is ``[..., n, d]``; the block input is the ``pre``-weighted sum of the
    streams, RMS-normalised with ``norm_weight`` when given.
    """
    del n_splits  # a split-K factor of the GPU kernels; one pass here
    n, d = residual.shape[-2:]
    streams = residual.reshape(-1, n, d)
    flat = streams.reshape(-1, n * d).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    mixes = flat @ fn.float().t()
    scale, base = hc_scale.float(), hc_base.float()
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + hc_pre_eps
    post = hc_post_mult_value * torch.sigmoid(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb_logits = (mixes[:, 2 * n:] * scale[2] + base[2 * n:]).view(-1, n, n)
    comb = _sinkhorn(torch.softmax(comb_logits, dim=-1) + hc_sinkhorn_eps, hc_sinkhorn_eps,
                     sinkhorn_repeat)
    block_input = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(residual.dtype)
    outer = residual.shape[:-2]
    return (post.view(*outer, n, 1), comb.view(*outer, n, n),
            _rms_norm(block_input, norm_weight, norm_eps).view(*outer, d))


def hc_post(x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor,
            comb_res_mix: torch.Tensor) -> torch.Tensor:
    """The mHC post block: streams ``comb^T @ residual + post * x``, ``[..., n, d]``."""
    n, d = residual.shape[-2:]
    streams = residual.reshape(-1, n, d).float()
    comb = comb_res_mix.reshape(-1, n, n).float()
    post = post_layer_mix.reshape(-1, n, 1).float()
    out = comb.transpose(-1, -2) @ streams + post * x.reshape(-1, 1, d).float()
    return out.to(residual.dtype).view(residual.shape)


def _pre_method(self: Any, residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor,
                hc_base: torch.Tensor, rms_eps: float, hc_pre_eps: float,
                hc_sinkhorn_eps: float, hc_post_mult_value: float, sinkhorn_repeat: int,
                n_splits: int = 1, norm_weight: torch.Tensor | None = None,
                norm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                  hc_post_mult_value, sinkhorn_repeat, n_splits, norm_weight, norm_eps)


def _post_method(self: Any, x: torch.Tensor, residual: torch.Tensor,
                 post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor) -> torch.Tensor:
    return hc_post(x, residual, post_layer_mix, comb_res_mix)


def _fused_method(self: Any, x: torch.Tensor, residual: torch.Tensor,
                  post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor, fn: torch.Tensor,
                  hc_scale: torch.Tensor, hc_base: torch.Tensor, rms_eps: float,
                  hc_pre_eps: float, hc_sinkhorn_eps: float, hc_post_mult_value: float,
                  sinkhorn_repeat: int, n_splits: int = 1, tile_n: int = 1,
                  norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    del tile_n
    streams = hc_post(x, residual, post_layer_mix, comb_res_mix)
    post, comb, block_input = hc_pre(streams, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                                     hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat,
                                     n_splits, norm_weight, norm_eps)
    return streams, post, comb, block_input


def install() -> None:
    """Replace the CPU forms of vLLM's three mHC ops (before any model is built)."""
    from .. import compat

    compat.replace_method(compat.MHCPreOp, "forward_cpu", _pre_method)
    compat.replace_method(compat.MHCPostOp, "forward_cpu", _post_method)
    compat.replace_method(compat.MHCFusedPostPreOp, "forward_cpu", _fused_method)
