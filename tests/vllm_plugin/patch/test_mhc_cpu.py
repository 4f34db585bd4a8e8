"""The CPU mHC forms against transformers' GLM-5.3-Flash hyper-connection, and the patch
seam's replacement check."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_recoverssm.vllm_plugin import compat
from vllm_recoverssm.vllm_plugin.patch import REGISTER, mhc_cpu

glm5_next = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")


def hyper_connection(hidden: int = 64, n: int = 4, seed: int = 0) -> Any:
    from transformers import Glm5NextTextConfig

    config = Glm5NextTextConfig(hidden_size=hidden, hc_mult=n, num_hidden_layers=1,
                                layer_types=["linear_attention"], mlp_layer_types=["dense"],
                                indexer_types=["full"])
    hc = glm5_next.Glm5NextTextHyperConnection(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hc.fn.copy_(0.3 * torch.randn(hc.fn.shape, generator=gen))
        hc.base.copy_(0.5 * torch.randn(hc.base.shape, generator=gen))
        hc.scale.copy_(0.5 + torch.rand(3, generator=gen))
    return hc, config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pre_and_post_compute_transformers_layer(dtype: torch.dtype) -> None:
    """hc_pre + norm + block + hc_post == transformers' attn_hc, input_layernorm and
    stream update of one decoder layer."""
    hc, config = hyper_connection()
    n, d = config.hc_mult, config.hidden_size
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(5, n, d, generator=gen).to(dtype)
    norm = glm5_next.Glm5NextTextRMSNorm(d, config.rms_norm_eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(d, generator=gen))
        block = lambda x: torch.tanh(x.float()).to(x.dtype)  # noqa: E731
        post, comb, collapsed = hc(streams.unsqueeze(0))
        want_input = norm(collapsed)[0]
        out = block(want_input)
        want = (post.to(dtype).unsqueeze(-1) * out.unsqueeze(0).unsqueeze(-2)
                + torch.matmul(comb.to(dtype).transpose(-1, -2), streams.unsqueeze(0)))[0]
        got_post, got_comb, got_input = mhc_cpu.hc_pre(
            streams, hc.fn.float(), hc.scale.float(), hc.base.float(), config.rms_norm_eps,
            config.hc_eps, config.hc_eps, 2.0, config.hc_sinkhorn_iters,
            norm_weight=norm.weight, norm_eps=config.rms_norm_eps)
        got = mhc_cpu.hc_post(block(got_input), streams, got_post, got_comb)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got_input.dtype == dtype and got.dtype == dtype
    torch.testing.assert_close(got_post[..., 0], post[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got_comb, comb[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got_input, want_input, rtol=tol, atol=tol)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_without_a_norm_weight_the_block_input_is_not_normalised() -> None:
    hc, config = hyper_connection()
    gen = torch.Generator().manual_seed(2)
    streams = 3 * torch.randn(2, config.hc_mult, config.hidden_size, generator=gen)
    args = (streams, hc.fn.detach(), hc.scale.detach(), hc.base.detach(), 1e-5, 1e-6, 1e-6,
            2.0, 20)
    _, _, raw = mhc_cpu.hc_pre(*args)
    _, _, normed = mhc_cpu.hc_pre(*args, norm_weight=torch.ones(config.hidden_size),
                                  norm_eps=1e-5)
    torch.testing.assert_close(normed.square().mean(-1), torch.ones(2), rtol=1e-4, atol=1e-4)
    # unnormalised rows keep the streams' scale (mean square far from 1)
    assert (raw.square().mean(-1) - 1).abs().min() > 0.5


def test_the_register_names_what_why_and_until_when() -> None:
    names = [p.name for p in REGISTER]
    assert names == sorted(set(names), key=names.index)
    for p in REGISTER:
        assert p.what and p.why and p.versions and p.until


def test_a_replacement_with_other_parameters_is_refused() -> None:
    class Op:
        def forward_cpu(self, x: int, y: int) -> int:
            return x + y

    def wrong(self: Any, x: int) -> int:
        return x

    with pytest.raises(compat.UnsupportedVllmError, match=r"takes \(self, x, y\)"):
        compat.replace_method(Op, "forward_cpu", wrong)
    with pytest.raises(compat.UnsupportedVllmError, match="has no attribute forward_cuda"):
        compat.replace_method(Op, "forward_cuda", wrong)
    assert Op().forward_cpu(1, 2) == 3


def test_the_replacements_take_vllms_parameters(vllm_module: Any) -> None:
    """vLLM's three CPU forms have the parameters the replacements were written for."""
    import inspect

    for cls, fn in ((compat.MHCPreOp, mhc_cpu._pre_method),
                    (compat.MHCPostOp, mhc_cpu._post_method),
                    (compat.MHCFusedPostPreOp, mhc_cpu._fused_method)):
        assert (list(inspect.signature(cls.forward_cpu).parameters)
                == list(inspect.signature(fn).parameters))
