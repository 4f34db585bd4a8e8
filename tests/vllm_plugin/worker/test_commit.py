"""vLLM's GPU model runner (V2) model state: commit accepted state, then capture.

The verify records live in each layer's scratch (one row per speculative row of the step),
not in the pages; the commit reads them from there.

The model state is the plugin's real subclass of vLLM's ``MambaHybridModelState``; vLLM's
own ``RecoverSSMState`` drives the commit through our metadata. Tensors are on the CPU, so
our ops run their PyTorch reference. The only stand-in is vLLM's one-line Triton kernel
that scatters the accepted counts (Triton has no CPU backend in vLLM's CPU build).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.vllm_configs import MTP3, on_gpu, with_recovery_mode
from vllm_recoverssm import ops
from vllm_recoverssm.ops import reference as ref

S, H, D, KC, BLOCKS = 3, 2, 16, 4, 6
C, W = 3 * H * D, KC - 1 + S
LOWER = -5.0
NAMES = ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]
SCRATCH_ROWS = 8  # the layer's max_num_seqs


class _ScatterAccepted:
    """CPU stand-in for vLLM's ``_scatter_num_accepted_kernel[grid](...)``."""

    def __getitem__(self, grid: Any) -> Any:
        def run(idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                num_accepted: torch.Tensor) -> None:
            for row, req in enumerate(idx_mapping.tolist()):
                if req >= 0:
                    num_accepted[req] = max(int(num_sampled[row]), 1)
        return run


def make_layer(gen: torch.Generator, blocks: int = BLOCKS,
               dim_first: bool = False) -> SimpleNamespace:
    def rnd(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    # vLLM's default "SD" conv layout is [blocks, width, dim], viewed (dim, width) by the
    # layer; "DS" (VLLM_SSM_CONV_STATE_LAYOUT=DS) stores [blocks, dim, width].
    if dim_first:
        conv = rnd(blocks, C, W, dtype=torch.bfloat16)
    else:
        conv = rnd(blocks, W, C, dtype=torch.bfloat16)
    records = (torch.zeros(SCRATCH_ROWS, H, S + 1, D),
               torch.zeros(SCRATCH_ROWS, H, S + 1, 2 * D, dtype=torch.bfloat16))
    return SimpleNamespace(
        kv_cache=(conv, rnd(blocks, H, D, D, scale=0.1)),
        recovery_records=lambda: records,
        A_log=torch.nn.Parameter(rnd(1, 1, H, 1, scale=0.5)),
        dt_bias=torch.nn.Parameter(rnd(H * D, scale=0.5)),
        local_num_heads=H, head_dim=D, kda_lower_bound=LOWER, conv_size=KC,
        conv_state_dim_first_view=(lambda c: c) if dim_first else (
            lambda c: c.transpose(-1, -2)),
    )


def spec_step(layers: dict[str, Any], slots: list[int], gen: torch.Generator) -> dict[str, Any]:
    """Run conv update + recovery verify of S+1 tokens per row, as the layer does."""
    from vllm_recoverssm.vllm_plugin.worker.state_layout import dim_first_conv, to_ops_slots

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
        corrections, kg = m.recovery_records()
        ops.verify_recovery(q, k, v, g, b, a_log, dt, m.kv_cache[1], idx, qsl, corrections,
                            kg, lower_bound=LOWER,
                            record_indices=torch.arange(n, dtype=torch.int32))
        inputs[name] = (q, k, v, g, b, a_log.detach(), dt.detach())
    return inputs


def expected_state(m: Any, inp: Any, slot: int, row: int, n: int, s0: torch.Tensor) -> Any:
    q, k, v, g, b, a_log, dt = inp
    s = s0.clone()
    for t in range(row * (S + 1), row * (S + 1) + n):
        _, s, _ = ref.kda_step(s, q[t], k[t], v[t], g[t], b[t], a_log, dt, LOWER)
    return s


def postprocess_step(state: Any, meta: Any, num_sampled: torch.Tensor,
                     capture: Callable[[Any], None] | None = None,
                     num_computed_tokens: torch.Tensor | None = None) -> None:
    """What runner V2 does around sampling: the model state records the step's metadata,
    then runs its postprocess (commit, then capture hooks) with ``capture`` registered."""
    from vllm_recoverssm.vllm_plugin.worker import model_state as ms

    if capture is not None:
        ms.register_boundary_capture(capture)
    try:
        state.recoverssm.record_step({n: meta for n in NAMES},
                                     [[SimpleNamespace(layer_names=NAMES)]], for_capture=False)
        rows = torch.arange(num_sampled.numel(), dtype=torch.int32)
        state.postprocess_state(rows, num_sampled, num_computed_tokens)
    finally:
        if capture is not None:
            ms.unregister_boundary_capture(capture)


@pytest.fixture
def state_and_layers(build_config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.model_states import mamba_hybrid

    from vllm_recoverssm.vllm_plugin.attention.recover_kda import (
        RecoverKDAMetadata,
    )
    from vllm_recoverssm.vllm_plugin.worker import model_state as ms
    from vllm_recoverssm.vllm_plugin.worker.commit_context import RecoveryCommitContext

    monkeypatch.setattr(mamba_hybrid, "_scatter_num_accepted_kernel", _ScatterAccepted())
    cfg = build_config(*MTP3)
    # the recovery model state sets vLLM's derived flag on the (shared) config
    monkeypatch.setattr(cfg.cache_config, "use_kda_recoverssm", False)
    gen = torch.Generator().manual_seed(7)
    layers = {name: make_layer(gen) for name in NAMES}

    def make(recovery: bool) -> tuple[Any, RecoverKDAMetadata]:
        mode_cfg = cfg if recovery else with_recovery_mode(cfg, "off")
        with set_current_vllm_config(mode_cfg), (on_gpu() if recovery else _Null()):
            state = ms.RecoverMambaHybridModelState(mode_cfg, torch.nn.Module(), None,
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


def fused_step(state_and_layers: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """A recovery model state whose group defers its commits (the fused commit), after
    the verify of slots 3, 0 (null) and 5: ``(state, meta, context, layers, states before
    the verify, the verify's inputs)``."""
    from vllm_recoverssm.vllm_plugin.worker.commit import register_commit_context
    from vllm_recoverssm.vllm_plugin.worker.deferred_commit import DeferredCommits

    make, layers, gen = state_and_layers
    state, meta = make(recovery=True)
    context = meta.commit_context
    context.deferred = DeferredCommits(4, torch.device("cpu"))
    # the model state finds the recovery groups through vLLM's layer table
    monkeypatch.setattr(state.vllm_config.compilation_config, "static_forward_context",
                        context.forward_context)
    register_commit_context(context)
    pre = {n: m.kv_cache[1].clone() for n, m in layers.items()}
    inputs = spec_step(layers, [3, 0, 5], gen)
    return state, meta, context, layers, pre, inputs


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_commit_runs_before_capture_and_capture_sees_the_committed_state(
    state_and_layers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:

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

    num_sampled = torch.tensor([2, 4, 4], dtype=torch.int32)
    postprocess_step(state, meta, num_sampled, capture)

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


def test_a_capture_under_the_fused_commit_sees_the_pending_records_committed(
    state_and_layers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused commit: the step's commit only defers its records, so before a capture hook
    reads the state the model state commits every pending record."""
    state, meta, context, layers, pre, inputs = fused_step(state_and_layers, monkeypatch)
    captured: list[dict[str, torch.Tensor]] = []

    def capture(step: Any) -> None:
        captured.append({n: m.kv_cache[1].clone() for n, m in layers.items()})

    num_sampled = torch.tensor([2, 4, 4], dtype=torch.int32)
    postprocess_step(state, meta, num_sampled, capture)
    assert context.deferred.deferred_steps == 1  # the step's commit was deferred ...
    for name, m in layers.items():  # ... and committed before the capture read the state
        for row, slot in ((0, 3), (2, 5)):
            want = expected_state(m, inputs[name], slot, row, int(num_sampled[row]),
                                  pre[name][slot])
            torch.testing.assert_close(captured[0][name][slot], want, atol=1e-5, rtol=0)


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


class _PostprocessAlign:
    """CPU stand-in for vLLM's ``_postprocess_recoverssm_align_kernel[grid](...)``: records
    its arguments and applies its documented effect (running column of the last committed
    token, neutral accepted count)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __getitem__(self, grid: Any) -> Any:
        def run(idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                request_indices: torch.Tensor, num_computed: torch.Tensor,
                state_idx: torch.Tensor, num_accepted: torch.Tensor, *,
                MAMBA_BLOCK_SIZE: int, BLOCK_TABLE_WIDTH: int) -> None:
            self.calls.append(dict(grid=grid, request_indices=request_indices.tolist(),
                                   num_computed=num_computed.tolist(),
                                   block_size=MAMBA_BLOCK_SIZE, width=BLOCK_TABLE_WIDTH))
            for spec_row in range(grid[0]):
                row = int(request_indices[spec_row])
                req = int(idx_mapping[row])
                if req < 0:
                    continue
                col = max(int(num_computed[row]) + int(num_sampled[row]) - 1, 0)
                state_idx[req] = min(col // MAMBA_BLOCK_SIZE, BLOCK_TABLE_WIDTH - 1)
                num_accepted[req] = 1
        return run


ALIGN_B = 4
# vLLM block ids per request (0 = null block); B = 4 tokens per state block, S + 1 = 4.
ALIGN_TABLE = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]]
ALIGN_NC = [5, 6, 4, 4]          # tokens committed before the step
ALIGN_SAMPLED = [2, 4, 4, 3]     # accepted drafts + 1
# verify read/wrote the block of the last scheduled token, (nc + S) // B
ALIGN_VERIFY = [3, 6, 8, 0]
# (final slot, boundary slot, boundary length) per row, from the align rules:
#   row 0: 5 + 2 = 7 tokens stay in block 1 -> slot 2, no boundary (next boundary 8)
#   row 1: 6 + 4 = 10 crosses 8 -> boundary slot 5 after 2 tokens, final slot 6
#   row 2: 4 + 4 = 8 ends on the boundary -> slot 8 holds both, after 4 tokens
ALIGN_EXPECT = [(2, None, 0), (6, 5, 2), (8, 8, 4), (None, None, 0)]


@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
def test_align_mode_commits_into_prefix_cache_blocks(
    build_config: Any, monkeypatch: pytest.MonkeyPatch, dim_first: bool
) -> None:
    """Prefix caching: commit writes the final and boundary blocks, then vLLM moves its
    running column, then the capture runs."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.model_states import mamba_hybrid
    from vllm.v1.worker.gpu.model_states import recoverssm as vllm_recoverssm

    from tests.support.vllm_configs import with_prefix_caching
    from vllm_recoverssm.vllm_plugin.attention.recover_kda import (
        AlignCommitInfo,
        RecoverKDAMetadata,
    )
    from vllm_recoverssm.vllm_plugin.worker import model_state as ms
    from vllm_recoverssm.vllm_plugin.worker.commit_context import RecoveryCommitContext

    monkeypatch.setattr(mamba_hybrid, "_scatter_num_accepted_kernel", _ScatterAccepted())
    postprocess = _PostprocessAlign()
    monkeypatch.setattr(vllm_recoverssm, "_postprocess_recoverssm_align_kernel", postprocess)
    cfg = with_prefix_caching(build_config(*MTP3), block_size=ALIGN_B)
    monkeypatch.setattr(cfg.cache_config, "use_kda_recoverssm", False)
    gen = torch.Generator().manual_seed(11)
    layers = {name: make_layer(gen, blocks=10, dim_first=dim_first) for name in NAMES}
    with set_current_vllm_config(cfg), on_gpu():
        state = ms.RecoverMambaHybridModelState(cfg, torch.nn.Module(), None,
                                                torch.device("cpu"))
    assert state.use_recovery and state._align_mode
    n = len(ALIGN_VERIFY)
    meta = RecoverKDAMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=n, num_spec_decode_tokens=n * (S + 1),
        num_actual_tokens=n * (S + 1),
        spec_query_start_loc=torch.arange(0, n * (S + 1) + 1, S + 1, dtype=torch.int32),
        spec_state_indices_tensor=torch.tensor(ALIGN_VERIFY, dtype=torch.int32)[:, None],
        spec_sequence_masks=torch.ones(n, dtype=torch.bool),
        num_accepted_tokens=torch.ones(n, dtype=torch.int32),
        commit_context=RecoveryCommitContext(NAMES, layers),
        spec_request_rows=torch.arange(n),
        align=AlignCommitInfo(block_table=torch.tensor(ALIGN_TABLE, dtype=torch.int32),
                              num_computed_tokens=torch.tensor(ALIGN_NC, dtype=torch.int32),
                              block_size=ALIGN_B),
    )
    pre = {k: (m.kv_cache[1].clone(), m.kv_cache[0].clone()) for k, m in layers.items()}
    inputs = spec_step(layers, ALIGN_VERIFY, gen)
    after_verify = {k: m.conv_state_dim_first_view(m.kv_cache[0]).clone()
                    for k, m in layers.items()}
    captured: list[Any] = []

    def capture(step: Any) -> None:
        captured.append({k: (m.kv_cache[1].clone(),
                             m.conv_state_dim_first_view(m.kv_cache[0]).clone())
                         for k, m in layers.items()})
        assert len(postprocess.calls) == 1  # vLLM moved its running column first

    sampled = torch.tensor(ALIGN_SAMPLED, dtype=torch.int32)
    postprocess_step(state, meta, sampled, capture,
                     torch.tensor(ALIGN_NC, dtype=torch.int32) + sampled)

    call = postprocess.calls[0]
    assert call["grid"] == (n,) and call["request_indices"] == list(range(n))
    assert call["num_computed"] == ALIGN_NC and call["block_size"] == ALIGN_B
    # the running column is the block of the last committed token; the next step is neutral
    assert state._mamba_state_idx_gpu[:3].tolist() == [1, 2, 1]
    assert state.num_accepted_tokens_gpu[:3].tolist() == [1, 1, 1]
    hist = KC - 1
    seen = captured[0]
    for name, m in layers.items():
        states, conv = seen[name]
        for row, (final, bslot, blen) in enumerate(ALIGN_EXPECT):
            src = ALIGN_VERIFY[row]
            if final is None:
                continue
            count = ALIGN_SAMPLED[row]
            want = expected_state(m, inputs[name], src, row, count, pre[name][0][src])
            torch.testing.assert_close(states[final], want, atol=1e-5, rtol=0)
            window = after_verify[name][src]
            torch.testing.assert_close(conv[final][:, :hist],
                                       window[:, count - 1 : count - 1 + hist])
            if bslot is not None:
                want_b = expected_state(m, inputs[name], src, row, blen, pre[name][0][src])
                torch.testing.assert_close(states[bslot], want_b, atol=1e-5, rtol=0)
                torch.testing.assert_close(conv[bslot][:, :hist],
                                           window[:, blen - 1 : blen - 1 + hist])
        # row 1's boundary block held other bytes before: the boundary state was written
        assert not torch.allclose(states[5], pre[name][0][5])
        # the null row and blocks no plan names are untouched
        for block in (0, 1, 4, 7):
            torch.testing.assert_close(states[block], pre[name][0][block])


def test_requests_that_left_the_batch_commit_before_vllms_preprocess(
    state_and_layers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused commit: a request that finished may leave records pending on a state block
    that vLLM hands to another request and, in align mode, copies a state into in its
    ``preprocess_state``. So the model state commits the records of every request that
    left the batch before vLLM's preprocess runs; the others stay pending."""
    from vllm.v1.worker.gpu.model_states import mamba_hybrid

    state, meta, context, layers, pre, inputs = fused_step(state_and_layers, monkeypatch)
    context.see_step(["a", "pad", "b"])
    meta.spec_request_rows_cpu = [0, 1, 2]
    num_sampled = torch.tensor([2, 4, 4], dtype=torch.int32)
    postprocess_step(state, meta, num_sampled)  # the step's records wait
    assert context.deferred.deferred_steps == 1

    seen: list[dict[str, torch.Tensor]] = []
    monkeypatch.setattr(mamba_hybrid.MambaHybridModelState, "preprocess_state",
                        lambda self, *a, **k: seen.append(
                            {n: m.kv_cache[1].clone() for n, m in layers.items()}))
    state.preprocess_state(SimpleNamespace(req_ids=["b", "c"]), (), None, None)
    assert len(seen) == 1
    for name, m in layers.items():
        # "a" left the batch: committed before vLLM's preprocess read or wrote any block
        want = expected_state(m, inputs[name], 3, 0, 2, pre[name][3])
        torch.testing.assert_close(seen[0][name][3], want, atol=1e-5, rtol=0)
        # "b" runs again: its records still wait for its fused verify
        torch.testing.assert_close(seen[0][name][5], pre[name][5])
    assert context.deferred.pending_lens is not None
    assert context.deferred.pending_lens[[3, 5]].tolist() == [0, 4]
    assert context.deferred.settles == 1
