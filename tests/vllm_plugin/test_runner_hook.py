"""vLLM's GPU model runner (V2) model state: commit accepted state, then capture.

The model state is the plugin's real subclass of vLLM's ``MambaHybridModelState``; vLLM's
own ``RecoverSSMState`` drives the commit through our metadata. Tensors are on the CPU, so
our ops run their PyTorch reference. The only stand-in is vLLM's one-line Triton kernel
that scatters the accepted counts (Triton has no CPU backend in vLLM's CPU build).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_recoverssm import ops
from vllm_recoverssm.ops import reference as ref

from .conftest import MTP3, on_gpu

S, H, D, KC, BLOCKS = 3, 2, 16, 4, 6
C, W = 3 * H * D, KC - 1 + S
LOWER = -5.0
NAMES = ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]


class _ScatterAccepted:
    """CPU stand-in for vLLM's ``_scatter_num_accepted_kernel[grid](...)``."""

    def __getitem__(self, grid: Any) -> Any:
        def run(idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                num_accepted: torch.Tensor) -> None:
            for row, req in enumerate(idx_mapping.tolist()):
                if req >= 0:
                    num_accepted[req] = max(int(num_sampled[row]), 1)
        return run


def make_layer(gen: torch.Generator) -> SimpleNamespace:
    def rnd(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    # vLLM's default "SD" conv layout: [blocks, width, dim]; the layer views it (dim, width)
    conv = rnd(BLOCKS, W, C, dtype=torch.bfloat16)
    return SimpleNamespace(
        kv_cache=(conv, rnd(BLOCKS, H, D, D, scale=0.1), torch.zeros(BLOCKS, H, S + 1, D),
                  torch.zeros(BLOCKS, H, S + 1, 2 * D, dtype=torch.bfloat16)),
        A_log=torch.nn.Parameter(rnd(1, 1, H, 1, scale=0.5)),
        dt_bias=torch.nn.Parameter(rnd(H * D, scale=0.5)),
        local_num_heads=H, head_dim=D, kda_lower_bound=LOWER, conv_size=KC,
        conv_state_dim_first_view=lambda c: c.transpose(-1, -2),
    )


def spec_step(layers: dict[str, Any], slots: list[int], gen: torch.Generator) -> dict[str, Any]:
    """Run conv update + recovery verify of S+1 tokens per row, as the layer does."""
    from vllm_recoverssm.vllm_plugin.attention.recover_kda import dim_first_conv, to_ops_slots

    n = len(slots)
    T = n * (S + 1)
    qsl = torch.arange(0, T + 1, S + 1, dtype=torch.int32)
    idx = to_ops_slots(torch.tensor(slots, dtype=torch.int32))
    inputs = {}
    for name, m in layers.items():
        x = torch.randn(T, C, generator=gen).to(torch.bfloat16)
        w = torch.randn(C, KC, generator=gen) * 0.5
        with dim_first_conv(m.conv_state_dim_first_view(m.kv_cache[0]), idx) as (conv, li):
            y = ops.conv_update(x, conv, w, None, li, qsl, activation="silu")
        q, k, v = (t.reshape(T, H, D).contiguous() for t in y.split(H * D, dim=-1))
        g = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
        b = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        a_log, dt = m.A_log.reshape(H), m.dt_bias.reshape(H, D)
        ops.verify_recovery(q, k, v, g, b, a_log, dt, m.kv_cache[1], idx, qsl, m.kv_cache[2],
                            m.kv_cache[3], lower_bound=LOWER, record_indices=idx)
        inputs[name] = (q, k, v, g, b, a_log.detach(), dt.detach())
    return inputs


def expected_state(m: Any, inp: Any, slot: int, row: int, n: int, s0: torch.Tensor) -> Any:
    q, k, v, g, b, a_log, dt = inp
    s = s0.clone()
    for t in range(row * (S + 1), row * (S + 1) + n):
        _, s, _ = ref.kda_step(s, q[t], k[t], v[t], g[t], b[t], a_log, dt, LOWER)
    return s


@pytest.fixture
def state_and_layers(build_config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.model_states import mamba_hybrid

    from vllm_recoverssm.vllm_plugin.attention.recover_kda import (
        RecoverKDAMetadata,
        RecoveryCommitContext,
    )
    from vllm_recoverssm.vllm_plugin.worker import model_state as ms

    monkeypatch.setattr(mamba_hybrid, "_scatter_num_accepted_kernel", _ScatterAccepted())
    cfg = build_config(*MTP3)
    # the recovery model state sets vLLM's derived flag on the (shared) config
    monkeypatch.setattr(cfg.cache_config, "use_kda_recoverssm", False)
    gen = torch.Generator().manual_seed(7)
    layers = {name: make_layer(gen) for name in NAMES}

    def make(recovery: bool) -> tuple[Any, RecoverKDAMetadata]:
        with set_current_vllm_config(cfg), (on_gpu() if recovery else _Null()):
            state = ms.RecoverMambaHybridModelState(cfg, torch.nn.Module(), None,
                                                    torch.device("cpu"))
        slots = [3, 0, 5]  # block 0 is vLLM's null block
        n = len(slots)
        meta = RecoverKDAMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
            num_spec_decodes=n, num_spec_decode_tokens=n * (S + 1),
            num_actual_tokens=n * (S + 1),
            spec_query_start_loc=torch.arange(0, n * (S + 1) + 1, S + 1, dtype=torch.int32),
            spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32)[:, None],
            spec_sequence_masks=torch.ones(n, dtype=torch.bool),
            num_accepted_tokens=torch.ones(n, dtype=torch.int32),
            commit_context=RecoveryCommitContext(NAMES, layers),
            spec_request_rows=torch.arange(n),
        )
        return state, meta

    return make, layers, gen


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_commit_runs_before_capture_and_capture_sees_the_committed_state(
    state_and_layers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_recoverssm.vllm_plugin.worker import model_state as ms

    make, layers, gen = state_and_layers
    state, meta = make(recovery=True)
    assert state.use_recovery and state.recoverssm is not None
    assert state.vllm_config.cache_config.use_kda_recoverssm  # vLLM's capture limit
    slots = [3, -1, 5]
    pre = {n: (m.kv_cache[1].clone(), m.kv_cache[0].clone()) for n, m in layers.items()}
    inputs = spec_step(layers, [3, 0, 5], gen)
    conv_after_verify = {n: m.kv_cache[0].clone() for n, m in layers.items()}

    events: list[str] = []
    for fn in ("commit", "conv_compact"):
        original = getattr(ops, fn)
        monkeypatch.setattr(ops, fn, lambda *a, _o=original, _n=fn, **k: (
            events.append(_n), _o(*a, **k))[1])
    captured: list[Any] = []

    def capture(step: Any) -> None:
        events.append("capture")
        captured.append((step, {n: (m.kv_cache[1].clone(), m.kv_cache[0].clone())
                                for n, m in layers.items()}))

    ms.register_boundary_capture(capture)
    try:
        state.recoverssm.record_step(
            {n: meta for n in NAMES}, [[SimpleNamespace(layer_names=NAMES)]],
            for_capture=False)
        num_sampled = torch.tensor([2, 4, 4], dtype=torch.int32)
        state.postprocess_state(torch.tensor([0, 1, 2], dtype=torch.int32), num_sampled)
    finally:
        ms.unregister_boundary_capture(capture)

    assert events == ["commit", "conv_compact", "conv_compact", "capture"]
    step, seen = captured[0]
    assert step.recovery and step.bias.tolist() == [0, 0, 0]
    for name, m in layers.items():
        state_seen, conv_seen = seen[name]
        for row, slot in enumerate(slots):
            n = int(num_sampled[row])
            if slot < 0:  # the null row touches nothing
                continue
            want = expected_state(m, inputs[name], slot, row, n, pre[name][0][slot])
            torch.testing.assert_close(state_seen[slot], want, atol=1e-5, rtol=0)
            assert not torch.allclose(state_seen[slot], pre[name][0][slot])
            # conv history compacted to offset 0: the window after the n accepted tokens
            torch.testing.assert_close(conv_seen[slot, : KC - 1],
                                       conv_after_verify[name][slot, n - 1 : n - 1 + KC - 1])
        # block 0 (null) and untouched blocks are unchanged
        torch.testing.assert_close(state_seen[0], pre[name][0][0])
        torch.testing.assert_close(conv_seen[0], pre[name][1][0])
    # the accepted counts vLLM keeps for the next step
    assert state.num_accepted_tokens_gpu[:3].tolist() == [2, 4, 4]


def test_full_state_mode_captures_without_commit(state_and_layers: Any) -> None:
    """Negative control: without recovery nothing commits; the hook gets vLLM's offsets."""
    from vllm_recoverssm.vllm_plugin.worker import model_state as ms

    make, layers, gen = state_and_layers
    state, meta = make(recovery=False)
    assert not state.use_recovery and state.recoverssm is None
    spec_step(layers, [3, 0, 5], gen)
    before = {n: m.kv_cache[1].clone() for n, m in layers.items()}
    captured: list[Any] = []
    ms.register_boundary_capture(captured.append)
    try:
        state.postprocess_state(torch.tensor([0, 1, 2], dtype=torch.int32),
                                torch.tensor([2, 4, 1], dtype=torch.int32))
    finally:
        ms.unregister_boundary_capture(captured.append)
    assert not captured[0].recovery and captured[0].bias.tolist() == [1, 3, 0]
    for name, m in layers.items():
        torch.testing.assert_close(m.kv_cache[1], before[name])
