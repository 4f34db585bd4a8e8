"""The GLM-5.3 KDA layer vLLM builds once the plugin is loaded (constructed on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.kda_layers import bind_pages, make_layer, prompt_meta
from tests.support.tiny_glm import CONV_WIDTH, HEAD_DIM, LINEAR_HEADS
from tests.support.vllm_configs import MTP3
from vllm_recoverssm import ops

S = 3
PROMPT_ROW_FIELDS = ("num_prefills", "num_prefill_tokens", "non_spec_query_start_loc",
                     "non_spec_state_indices_tensor", "has_initial_state", "checkpoint")
"""What vLLM's own forward reads for the prompt rows of a step with speculative rows."""


def test_the_plugin_layer_replaces_vllms_and_reports_the_recovery_page(
    build_config: Any, distributed: None, tiny_glm: Path
) -> None:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

    from vllm_recoverssm.config.models import model_spec_from_hf_config
    from vllm_recoverssm.state.planner import PlanConfig, plan
    from vllm_recoverssm.vllm_plugin.attention.recover_kda import RecoverKDAAttentionBackend
    from vllm_recoverssm.vllm_plugin.models.glm5next.kda import RecoverGlm5NextLinearAttention

    cfg = build_config(*MTP3)
    seqs = cfg.scheduler_config.max_num_seqs
    # the default commit is fused into the next verify here (runner V2, no prefix caching):
    # two scratch rows per running request
    p = plan(PlanConfig(model=model_spec_from_hf_config(
        json.loads((tiny_glm / "config.json").read_text())), tp=1, num_spec=S,
        max_num_seqs=seqs, fused_commit=True))
    on = make_layer(cfg, recovery=True)
    off = make_layer(cfg, recovery=False)
    assert type(on) is type(off) is RecoverGlm5NextLinearAttention
    spec_on, spec_off = on.get_kv_cache_spec(cfg), off.get_kv_cache_spec(cfg)
    # the page vLLM allocates is conv + one FP32 state: the planner's "records in scratch"
    layout = p.layout("recovery_scratch")
    assert spec_on.page_size_bytes == layout.page_bytes
    assert spec_on.num_speculative_blocks == 0
    assert len(spec_on.shapes) == 2 and spec_on.shapes == spec_off.shapes
    # ... and the records are a scratch of 2 x max_num_seqs rows per layer, as planned
    corrections, kg = on.recovery_records()
    assert corrections.shape == (2 * seqs, LINEAR_HEADS, S + 1, HEAD_DIM)
    assert kg.shape == (2 * seqs, LINEAR_HEADS, S + 1, 2 * HEAD_DIM)
    assert (corrections.nbytes + kg.nbytes) * p.num_linear_layers == layout.scratch_bytes
    assert on.get_attn_backend() is RecoverKDAAttentionBackend
    # recovery off: exactly vLLM's layer behaviour
    assert spec_off.page_size_bytes == p.layout("full").page_bytes
    assert spec_off.num_speculative_blocks == S and len(spec_off.shapes) == 2
    assert off.get_attn_backend() is GDNAttentionBackend


def test_speculative_rows_run_recovery_verify(build_config: Any, distributed: None) -> None:
    from vllm.forward_context import set_forward_context

    from vllm_recoverssm.vllm_plugin.attention.recover_kda import (
        RecoverKDAMetadata,
    )
    from vllm_recoverssm.vllm_plugin.worker.state_layout import dim_first_conv

    cfg = build_config(*MTP3)
    layer = make_layer(cfg, recovery=True)
    blocks = 6
    bind_pages(layer, cfg, blocks)
    conv0 = layer.kv_cache[0].clone()
    state0 = layer.kv_cache[1].clone()
    h, d = LINEAR_HEADS, HEAD_DIM
    table = [[4], [0], [2]]  # block 0 is vLLM's null block
    n, T = 3, 3 * (S + 1)
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(T, 3 * h * d, generator=gen).to(torch.bfloat16)
    g1 = torch.randn(1, T, h, d, generator=gen).to(torch.bfloat16)
    beta = torch.randn(1, T, h, generator=gen).to(torch.bfloat16)
    qsl = torch.arange(0, T + 1, S + 1, dtype=torch.int32)
    meta = RecoverKDAMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=n, num_spec_decode_tokens=T, num_actual_tokens=T,
        spec_query_start_loc=qsl, spec_state_indices_tensor=torch.tensor(table).int(),
        spec_sequence_masks=torch.ones(n, dtype=torch.bool),
        spec_token_indx=torch.arange(T, dtype=torch.int32),
        non_spec_token_indx=torch.empty(0, dtype=torch.int32),
        num_accepted_tokens=torch.ones(n, dtype=torch.int32),
    )
    out = torch.zeros(1, T, h, d, dtype=torch.bfloat16)
    with set_forward_context({layer.prefix: meta}, cfg):
        layer._forward(qkv, g1, beta, out)

    # the same step through our ops, on copies, addressed directly
    slots = torch.tensor([4, -1, 2], dtype=torch.int32)
    conv = conv0.clone()
    weight = torch.cat([m.weight.reshape(h * d, CONV_WIDTH)
                        for m in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)])
    with dim_first_conv(conv.transpose(-1, -2), slots) as (view, idx):
        x = ops.conv_update(qkv, view, weight, None, idx, qsl, activation="silu")
    q, k, v = (t.reshape(T, h, d).contiguous() for t in x.split(h * d, dim=-1))
    rows = torch.arange(n, dtype=torch.int32)  # records: one scratch row per spec row
    corr = torch.zeros_like(layer.recovery_records()[0])
    kg = torch.zeros_like(layer.recovery_records()[1])
    want = ops.verify_recovery(
        q, k, v, g1[0].contiguous(), beta[0].contiguous(), layer.A_log.detach().reshape(h),
        layer.dt_bias.detach().reshape(h, d), state0, slots, qsl, corr, kg,
        lower_bound=-5.0, record_indices=rows)

    torch.testing.assert_close(out[0], want.to(out.dtype))
    assert out[0, S + 1: 2 * (S + 1)].abs().sum() == 0  # the null row
    assert out[0, : S + 1].abs().sum() > 0
    torch.testing.assert_close(layer.kv_cache[1], state0)  # verify never writes the checkpoint
    torch.testing.assert_close(layer.recovery_records()[0], corr)
    torch.testing.assert_close(layer.recovery_records()[1], kg)
    assert len(layer.kv_cache) == 2  # vLLM's own page: conv history and the checkpoint
    torch.testing.assert_close(layer.kv_cache[0], conv)
    assert not torch.equal(layer.kv_cache[0][4], conv0[4])  # the window advanced
    torch.testing.assert_close(layer.kv_cache[0][0], conv0[0])  # null block untouched


def test_b12x_adapter_refuses_the_plugins_record_scratch(build_config: Any,
                                                         distributed: None) -> None:
    """Why the plugin runs Triton on SM12x (vllm_plugin/kernels.py): b12x's real adapter,
    given a step's verify as the plugin's pages and record scratch hold it, refuses the
    scratch's rows by name before any kernel would launch."""
    from vllm_recoverssm.ops.b12x_kda import B12xKdaRecovery

    cfg = build_config(*MTP3)
    layer = make_layer(cfg, recovery=True)
    blocks = 6
    bind_pages(layer, cfg, blocks)
    h, d, n = LINEAR_HEADS, HEAD_DIM, 3
    T = n * (S + 1)
    corrections, kg = layer.recovery_records()
    assert corrections.shape[0] >= int(cfg.scheduler_config.max_num_seqs) > blocks  # rows
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, h, d, generator=gen).to(torch.bfloat16) for _ in range(3))
    g = torch.randn(T, h, d, generator=gen).to(torch.bfloat16)
    beta = torch.randn(T, h, generator=gen).to(torch.bfloat16)
    adapter = B12xKdaRecovery(num_heads=h, num_spec=S,
                              max_seqs=int(cfg.scheduler_config.max_num_seqs))
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=f"need {blocks} rows like the state pool"):
        adapter.verify(q, k, v, g, beta, layer.A_log.detach().reshape(h).float(),
                       layer.dt_bias.detach().reshape(h, d).float(), layer.kv_cache[1],
                       slots, torch.arange(0, T + 1, S + 1, dtype=torch.int32), corrections,
                       kg, lower_bound=-5.0, record_indices=torch.arange(n, dtype=torch.int32))


@pytest.mark.parametrize("recovery", [True, False], ids=["recovery", "full-state"])
def test_prompt_rows_run_the_reference_prefill_from_zero_or_the_slot(
    build_config: Any, distributed: None, recovery: bool
) -> None:
    """A first chunk starts from zeros whatever the slot held; a later chunk continues."""
    from vllm.forward_context import set_forward_context

    cfg = build_config(*MTP3)
    layer = make_layer(cfg, recovery=recovery)
    assert layer.own_ops  # vLLM's CPU platform has no KDA kernels
    bind_pages(layer, cfg, 6)
    h, d = LINEAR_HEADS, HEAD_DIM
    gen = torch.Generator().manual_seed(13)
    T = 9
    qkv = torch.randn(T, 3 * h * d, generator=gen).to(torch.bfloat16)
    g1 = torch.randn(1, T, h, d, generator=gen).to(torch.bfloat16)
    beta = torch.randn(1, T, h, generator=gen).to(torch.bfloat16)
    conv0, state0 = layer.kv_cache[0].clone(), layer.kv_cache[1].clone()
    meta = prompt_meta([0, 5, 9], [3, 4], [False, True])  # row 0 fresh, row 1 continues
    out = torch.zeros(1, T, h, d, dtype=torch.bfloat16)
    with set_forward_context({layer.prefix: meta}, cfg):
        layer._forward(qkv, g1, beta, out)

    weight = layer.merged_conv_weight()
    a_log, dt = layer.A_log.detach().reshape(h), layer.dt_bias.detach().reshape(h, d)
    for row, (lo, hi, slot, fresh) in enumerate([(0, 5, 3, True), (5, 9, 4, False)]):
        conv = torch.zeros_like(conv0[slot:slot + 1]) if fresh else conv0[slot:slot + 1].clone()
        state = torch.zeros_like(state0[slot:slot + 1]) if fresh else state0[
            slot:slot + 1].clone()
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32)
        idx = torch.tensor([0], dtype=torch.int32)
        view = conv.transpose(-1, -2).contiguous()
        x = ops.conv_prefill(qkv[lo:hi], view, weight, None, idx, qsl)
        q, k, v = (t.reshape(-1, h, d).contiguous() for t in x.split(h * d, dim=-1))
        want = ops.prefill(q, k, v, g1[0, lo:hi].contiguous(), beta[0, lo:hi].contiguous(),
                           a_log, dt, state, idx, qsl, -5.0, out_dtype=torch.bfloat16)
        assert torch.equal(out[0, lo:hi], want), row
        assert torch.equal(layer.kv_cache[1][slot], state[0]), row
        assert torch.equal(layer.conv_state_dim_first_view(layer.kv_cache[0])[slot, :, :3],
                           view[0, :, :3]), row
    torch.testing.assert_close(layer.kv_cache[1][5], state0[5])  # untouched block


def test_on_cuda_prompt_rows_go_to_vllms_kernels_with_a_two_tensor_page(
    build_config: Any, distributed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where vLLM has KDA kernels the layer keeps them for the non-speculative rows: they
    get metadata without speculative rows and vLLM's own two-tensor page. The prompt rows'
    fields stay vLLM's, the internal prefill checkpoint among them: on an H100 or H200
    vLLM's FlashKDA prefill writes a mid-chunk state block from it for the prefix cache,
    indexed by the non-speculative rows in the order of their query starts."""
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata

    from vllm_recoverssm.vllm_plugin.attention.recover_kda import RecoverKDAMetadata
    from vllm_recoverssm.vllm_plugin.models.glm5next import kda as plugin_kda

    cfg = build_config(*MTP3)
    layer = make_layer(cfg, recovery=True)
    layer.own_ops = False  # as on CUDA
    bind_pages(layer, cfg, 6)
    calls: list[Any] = []
    prompt_fields: list[tuple[Any, ...]] = []

    def vllm_forward(self: Any, qkv: Any, g1: Any, beta: Any, out: Any) -> None:
        meta = get_forward_context().attn_metadata[self.prefix]
        conv, state = self.kv_cache  # vLLM's unpack of the page
        calls.append((meta.num_spec_decodes, meta.spec_state_indices_tensor, qkv.shape[0]))
        prompt_fields.append(tuple(getattr(meta, f) for f in PROMPT_ROW_FIELDS))
        out.fill_(7)

    monkeypatch.setattr(plugin_kda, "_PARENT_FORWARD", vllm_forward)
    h, d = LINEAR_HEADS, HEAD_DIM
    n_spec, n_ns = S + 1, 5
    T = n_spec + n_ns
    gen = torch.Generator().manual_seed(17)
    qkv = torch.randn(T, 3 * h * d, generator=gen).to(torch.bfloat16)
    g1 = torch.randn(1, T, h, d, generator=gen).to(torch.bfloat16)
    beta = torch.randn(1, T, h, generator=gen).to(torch.bfloat16)
    meta = RecoverKDAMetadata(
        num_prefills=1, num_prefill_tokens=n_ns, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=1, num_spec_decode_tokens=n_spec, num_actual_tokens=T,
        spec_query_start_loc=torch.tensor([0, n_spec], dtype=torch.int32),
        spec_state_indices_tensor=torch.tensor([[2]], dtype=torch.int32),
        spec_sequence_masks=torch.tensor([True, False]),
        spec_token_indx=torch.arange(n_spec, dtype=torch.int32),
        non_spec_token_indx=torch.arange(n_spec, T, dtype=torch.int32),
        num_accepted_tokens=torch.ones(1, dtype=torch.int32),
        non_spec_query_start_loc=torch.tensor([0, n_ns], dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor([3], dtype=torch.int32),
        has_initial_state=torch.tensor([False]),
        checkpoint=MambaPrefillCheckpointMetadata(
            checkpoint_offsets=torch.tensor([n_ns - 1], dtype=torch.int32),
            state_indices=torch.tensor([4], dtype=torch.int32)),
    )
    out = torch.zeros(1, T, h, d, dtype=torch.bfloat16)
    with set_forward_context({layer.prefix: meta}, cfg):
        layer._forward(qkv, g1, beta, out)
        assert get_forward_context().attn_metadata[layer.prefix] is meta  # restored
    assert calls == [(0, None, n_ns)]
    (seen,) = prompt_fields  # the very objects vLLM's builder made, not copies
    assert [f for f, v in zip(PROMPT_ROW_FIELDS, seen, strict=True)
            if v is not getattr(meta, f)] == []
    assert bool((out[0, n_spec:] == 7).all())  # vLLM's rows
    assert not bool((out[0, :n_spec] == 7).any()) and out[0, :n_spec].abs().sum() > 0
