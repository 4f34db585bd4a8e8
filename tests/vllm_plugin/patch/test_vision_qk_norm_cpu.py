"""The CPU form of the vision blocks' fused q/k RMSNorm against transformers' vision
RMSNorm of GLM-5.3-Flash."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_recoverssm.vllm_plugin.patch import vision_qk_norm_cpu

glm5_next = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_normalised_as_transformers_does(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norms = []
    for _ in range(2):
        norm = glm5_next.Glm5NextRMSNorm(32, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(32, generator=gen))
        norms.append(norm.to(dtype))
    q, k = (3 * torch.randn(7, 32, generator=gen)).to(dtype), torch.randn(7, 32).to(dtype)
    got_q, got_k = vision_qk_norm_cpu.fused_q_kv_rmsnorm(q, k, norms[0].weight,
                                                         norms[1].weight, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        torch.testing.assert_close(got_q, norms[0](q), rtol=tol, atol=tol)
        torch.testing.assert_close(got_k, norms[1](k), rtol=tol, atol=tol)


def test_mismatched_rows_are_refused() -> None:
    with pytest.raises(ValueError, match=r"got \(3, 8\) and \(4, 8\)"):
        vision_qk_norm_cpu.fused_q_kv_rmsnorm(torch.ones(3, 8), torch.ones(4, 8),
                                              torch.ones(8), torch.ones(8), 1e-6)


def test_the_replacement_takes_vllms_parameters(vllm_module: Any) -> None:
    import importlib
    import inspect

    module = importlib.import_module(vision_qk_norm_cpu.TARGET)
    assert (list(inspect.signature(module.fused_q_kv_rmsnorm).parameters)
            == list(inspect.signature(vision_qk_norm_cpu.fused_q_kv_rmsnorm).parameters))
