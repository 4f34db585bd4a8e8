"""Byte accounting against hand counts: published peer figures and the tensors themselves."""

from __future__ import annotations

import pytest
import torch

from vllm_recoverssm.bench import accounting as acc
from vllm_recoverssm.bench import workload as wl

MIB = 1 << 20
# GLM-5.3 TP2, bf16 activations: per head the FP32 state is 128 * 128 * 4 = 64 KiB.
GLM = dict(heads=32, k=128, v=128, act_bytes=2)


@pytest.mark.parametrize(
    ("T", "full", "verify", "commit_all", "commit_2"),
    # MiB per step at batch 256, one layer, as tabulated for the H200 peer runs
    [(4, 2600, 584, 1056, 1040), (8, 4688, 656, 1088, 1040)],
)
def test_glm_bytes_match_the_peer_table(T: int, full: int, verify: int, commit_all: int,
                                        commit_2: int) -> None:
    s = acc.OpShape(num_spec=T - 1, **GLM)
    assert round(acc.full_verify_bytes(s, 256) / MIB) == full
    assert round(acc.recovery_verify_bytes(s, 256) / MIB) == verify
    assert round(acc.commit_bytes(s, 256, T) / MIB) == commit_all
    assert round(acc.commit_bytes(s, 256, 2) / MIB) == commit_2


def test_per_head_bytes_by_hand() -> None:
    s = acc.OpShape(num_spec=3, **GLM)  # T = 4
    state = 128 * 128 * 4
    io = 4 * ((3 * 128 + 128 + 1) * 2 + 128 * 2)
    rec = 4 * (128 * 4 + 2 * 128 * 2)
    params = 32 * 4 + 32 * 128 * 4
    assert acc.full_verify_bytes(s, 1) == 32 * (5 * state + io) + params + (4 + 1 + 2) * 4
    assert acc.recovery_verify_bytes(s, 1) == 32 * (state + io + rec) + params + 3 * 4
    assert acc.commit_bytes(s, 1, 4) == 32 * (2 * state + rec) + params + 2 * 4
    # a stack multiplies the per-layer bytes; the one commit launch reads its indices once
    assert acc.recovery_verify_bytes(s, 8, 34) == 34 * acc.recovery_verify_bytes(s, 8)
    assert acc.commit_bytes(s, 8, 2, 34) == 34 * (acc.commit_bytes(s, 8, 2) - 16 * 4) + 16 * 4


def test_memory_per_request_glm() -> None:
    s3, s7 = acc.OpShape(num_spec=3, **GLM), acc.OpShape(num_spec=7, **GLM)
    assert acc.full_state_bytes_per_request(s3) == 8 * MIB  # 4 states of 2 MiB
    assert acc.full_state_bytes_per_request(s7, 34) == 34 * 16 * MIB
    # one 2 MiB checkpoint plus (S+1) records of 32 heads x 1 KiB
    assert acc.recovery_state_bytes_per_request(s3) == 2 * MIB + 4 * 32 * 1024
    assert acc.recovery_state_bytes_per_request(s7, 34) == 34 * (2 * MIB + 8 * 32 * 1024)


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("num_spec", [1, 3, 7])
def test_formulas_match_the_allocated_tensors(num_spec: int) -> None:
    B, L = 3, 2
    s = acc.OpShape(heads=2, k=16, v=32, num_spec=num_spec, act_bytes=2)
    step = wl.make_step(s, B, L, torch.bfloat16, torch.device("cpu"), "reference", 0)
    x = step.inputs[0]
    token_in = _nbytes(x.q, x.k, x.v, x.raw_g, x.raw_beta)
    out = _nbytes(x.v)  # the output has v's shape and dtype
    params = _nbytes(step.A_log[0], step.dt_bias[0])
    full = wl.make_full_pools(step, L, 0)
    slot = _nbytes(full.pools[0][0])
    idx_full = _nbytes(full.state_indices, full.num_accepted, step.query_start_loc)
    want_full = B * (1 + s.tokens) * slot + token_in + out + params + idx_full
    assert acc.full_verify_bytes(s, B) == want_full
    assert acc.full_verify_bytes(s, B, L) == L * want_full

    rec = wl.make_recovery_pools(step, 0)
    records = _nbytes(rec.corrections[0], rec.kg[0])
    idx_rec = _nbytes(rec.state_indices, step.query_start_loc)
    assert acc.recovery_verify_bytes(s, B) == B * slot + token_in + out + records + params \
        + idx_rec
    idx_commit = _nbytes(rec.plan_all.state_indices, rec.plan_all.commit_lens)
    assert acc.commit_bytes(s, B, s.tokens, L) == L * (2 * B * slot + records + params) \
        + idx_commit
    two = records * 2 // s.tokens
    assert acc.commit_bytes(s, B, 2) == 2 * B * slot + two + params + idx_commit

    assert full.bytes_per_request(B, L) == acc.full_state_bytes_per_request(s, L)
    assert rec.bytes_per_request(B, L) == acc.recovery_state_bytes_per_request(s, L)


def test_commit_bytes_rejects_bad_accepted() -> None:
    s = acc.OpShape(heads=2, k=16, v=16, num_spec=3, act_bytes=2)
    with pytest.raises(ValueError, match="accepted"):
        acc.commit_bytes(s, 1, 5)


def test_gbps() -> None:
    assert acc.gbps(2_000_000_000, 1000.0) == pytest.approx(2.0)
    assert acc.gbps(10, 0.0) != acc.gbps(10, 0.0)  # NaN for a zero time
