"""Cross-check the layouts against vLLM's own MambaSpec accounting.

Runs only where vLLM is importable (``make install-vllm`` / ``make install-vllm033``).
vLLM 0.32 has the shape helpers of records kept in the page
(``append_kda_recoverssm_record``), against which the planner's "records in page" layout is
checked; 0.33 removed them (its records live in a scratch), so there only the full-state
and "records in scratch" pages are compared.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
mamba_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")

import torch  # noqa: E402

from vllm_recoverssm.config.models import GLM_5_3, KIMI_LINEAR, QWEN3_NEXT_80B_A3B  # noqa: E402
from vllm_recoverssm.state import build_layouts  # noqa: E402

Shapes = mamba_utils.MambaStateShapeCalculator
Dtypes = mamba_utils.MambaStateDtypeCalculator
HAS_RECORDS_IN_PAGE = hasattr(Shapes, "append_kda_recoverssm_record")


def vllm_spec(model, tp, S, recovery, cache_mode, P, records_in_page=True):
    if model.kind == "kda":
        shapes = Shapes.kda_state_shape(tp, model.linear_num_heads, model.linear_head_dim,
                                        conv_kernel_size=model.conv_kernel, num_spec=S)
        dtypes = Dtypes.kda_state_dtype(torch.bfloat16, "auto", "auto")
    else:
        shapes = Shapes.gated_delta_net_state_shape(
            tp, model.linear_num_k_heads, model.linear_num_heads, model.linear_k_head_dim,
            model.linear_head_dim, model.conv_kernel, S)
        dtypes = Dtypes.gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32")
    if recovery and records_in_page:
        shapes = Shapes.append_kda_recoverssm_record(
            shapes, model.linear_num_heads, model.linear_head_dim, tp, S + 1)
        dtypes = Dtypes.append_kda_recoverssm_record(dtypes, torch.bfloat16)
    return kv_iface.MambaSpec(
        shapes=tuple(shapes), dtypes=tuple(dtypes), block_size=64,
        mamba_cache_mode=cache_mode, num_speculative_blocks=0 if recovery else S,
        num_prefill_checkpoint_blocks=P,
    )


@pytest.mark.parametrize("model", [GLM_5_3, KIMI_LINEAR, QWEN3_NEXT_80B_A3B],
                         ids=lambda m: m.name)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("S", [1, 3, 7])
@pytest.mark.parametrize("cache_mode, P", [("none", 0), ("align", 0), ("align", 1)])
def test_matches_vllm_mambaspec(model, tp, S, cache_mode, P):
    cfg = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=cache_mode))
    lays = build_layouts(model, tp=tp, num_spec=S, cache_mode=cache_mode,
                         prefill_checkpoint_blocks=P)
    native = vllm_spec(model, tp, S, False, cache_mode, P)
    assert lays["full"].page_bytes == native.page_size_bytes
    assert lays["full"].reserve_bytes_per_request == native.max_memory_usage_bytes(cfg)
    if model.kind == "kda":  # records in a scratch: vLLM's own page, no speculative blocks
        scratch = vllm_spec(model, tp, S, True, cache_mode, P, records_in_page=False)
        assert lays["recovery_scratch"].page_bytes == scratch.page_size_bytes \
            == native.page_size_bytes
        assert lays["recovery_scratch"].reserve_bytes_per_request == \
            scratch.max_memory_usage_bytes(cfg)
    if model.kind == "kda" and HAS_RECORDS_IN_PAGE:  # vLLM 0.32: records in KDA pages
        rec = vllm_spec(model, tp, S, True, cache_mode, P)
        assert lays["recovery_in_page"].page_bytes == rec.page_size_bytes
        assert lays["recovery_in_page"].reserve_bytes_per_request == \
            rec.max_memory_usage_bytes(cfg)
