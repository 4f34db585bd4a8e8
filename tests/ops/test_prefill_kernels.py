"""The prompt-row kernels (sequential KDA and short conv) against the float64 reference.

``interp`` runs the Triton kernels on CPU tensors at tiny shapes (needs
``TRITON_INTERPRET=1``, as CI sets); ``gpu`` runs them at GLM-5.3 TP2 shapes (H = 32,
K = V = 128) and is marked ``gpu``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from tests.support.kda_batches import make_batch, make_state
from vllm_recoverssm import ops
from vllm_recoverssm.ops import reference as ref

F64 = torch.float64
STATE_TOL = 2e-6  # final state after a prompt row, fp32 kernel vs float64


@dataclass(frozen=True)
class Env:
    """Where and at what size a test runs."""

    device: str
    H: int
    K: int
    V: int
    lens: tuple[int, ...]
    """Prompt row lengths; a zero-length row is included on purpose."""


INTERP = Env("cpu", 2, 16, 16, (5, 0, 1, 9))
GPU = Env("cuda", 32, 128, 128, (64, 0, 1, 37, 8, 200))


@pytest.fixture(params=[pytest.param(INTERP, id="interp"),
                        pytest.param(GPU, id="gpu", marks=pytest.mark.gpu)])
def env(request: pytest.FixtureRequest) -> Env:
    e: Env = request.param
    if e.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if e.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    return e


def _slots(env: Env, null_row: int) -> torch.Tensor:
    n = len(env.lens)
    idx = torch.arange(n, dtype=torch.int32).flip(0) + 1  # rows do not sit in their own slot
    idx[null_row] = -1
    return idx.to(env.device)


def _out_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max error relative to the largest output (the tiny heads have larger outputs)."""
    return float((got.double() - want).abs().max()) / max(1e-3, float(want.abs().max()))


@pytest.mark.parametrize("lb", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_matches_float64(env: Env, lb: float | None, act: torch.dtype) -> None:
    n = len(env.lens)
    b = make_batch(list(env.lens), env.H, env.K, env.V, device=env.device, act_dtype=act)
    state = make_state(n + 1, env.H, env.K, env.V, device=env.device)
    idx = _slots(env, null_row=2)
    got_state = state.clone()
    got = ops.prefill(*b.tokens(), got_state, idx, b.query_start_loc, lb, out_dtype=act,
                      backend="triton")
    want_state = state.double()
    want = ref.prefill(*b.to(F64).tokens()[:5], b.A_log.double(), b.dt_bias.double(),
                       want_state, idx, b.query_start_loc, lb)
    assert got.dtype == act and got.shape == b.v.shape
    tol = 2e-6 if act == torch.float32 else 1e-2  # bf16 outputs carry 8 bits
    assert _out_err(got, want) <= tol
    assert float((got_state.double() - want_state).abs().max()) <= STATE_TOL
    # slots of no row, of the null row and of the empty row keep their values
    used = {int(i) for i, L in zip(idx.tolist(), env.lens, strict=True) if i >= 0 and L}
    untouched = [s for s in range(n + 1) if s not in used]
    assert len(untouched) == 3
    assert torch.equal(got_state[untouched], state[untouched])
    start, end = int(b.query_start_loc[2]), int(b.query_start_loc[3])
    assert not got[start:end].any()


def test_prefill_in_segments_gives_the_same_bits(env: Env) -> None:
    """A row split at any token (the state taps do this) continues bit for bit."""
    L = max(env.lens)
    b = make_batch([L], env.H, env.K, env.V, device=env.device, act_dtype=torch.bfloat16)
    state = make_state(1, env.H, env.K, env.V, device=env.device)
    idx = torch.zeros(1, dtype=torch.int32, device=env.device)
    whole_state = state.clone()
    whole = ops.prefill(*b.tokens(), whole_state, idx, b.query_start_loc, -5.0,
                        backend="triton")
    cut = L // 3
    parts_state = state.clone()
    pieces = []
    for lo, hi in ((0, cut), (cut, L)):
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32, device=env.device)
        toks = [t[lo:hi].contiguous() for t in b.tokens()[:5]]
        pieces.append(ops.prefill(*toks, b.A_log, b.dt_bias, parts_state, idx, qsl, -5.0,
                                  backend="triton"))
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(parts_state, whole_state)


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_prefill_matches_reference(env: Env, width: int, act: torch.dtype) -> None:
    n = len(env.lens)
    C = 3 * env.H * env.K
    T = sum(env.lens)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, C, generator=gen).to(act).to(env.device)
    weight = (torch.randn(C, width, generator=gen) * 0.5).to(act).to(env.device)
    bias = (torch.randn(C, generator=gen) * 0.1).to(act).to(env.device)
    conv = torch.randn(n + 1, C, width - 1 + 3, generator=gen).to(act).to(env.device)
    qsl = torch.tensor([0, *torch.tensor(env.lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=env.device)
    idx = _slots(env, null_row=0)
    got_conv = conv.clone()
    got = ops.conv_prefill(x, got_conv, weight, bias, idx, qsl, backend="triton")
    want_conv = conv.clone()
    want = ref.conv_prefill(x, want_conv, weight, bias, idx, qsl)
    # fp32: the sums' order may differ; bf16: one rounding of the output apart (2^-8)
    rel = 1e-6 if act == torch.float32 else 2.0**-7
    err = (got.float() - want.float()).abs() - rel * want.float().abs()
    assert float(err.max()) <= 1e-6
    # the history is copied, not computed: exact (a 1-token row keeps part of the old one)
    assert torch.equal(got_conv, want_conv)


def test_triton_backend_refuses_what_the_kernels_do_not_take(env: Env) -> None:
    b = make_batch([3], env.H, env.K, env.V, device=env.device)
    idx = torch.zeros(1, dtype=torch.int32, device=env.device)
    s64 = make_state(1, env.H, env.K, env.V, device=env.device).double()
    with pytest.raises(ValueError, match="float32 state"):
        ops.prefill(*b.to(F64).tokens()[:5], b.A_log.double(), b.dt_bias.double(), s64, idx,
                    b.query_start_loc, -5.0, backend="triton")
    # auto on the same input takes the reference instead (on CPU tensors it always does)
    ops.prefill(*b.to(F64).tokens()[:5], b.A_log.double(), b.dt_bias.double(), s64, idx,
                b.query_start_loc, -5.0)
    C = 3 * env.H * env.K
    x = torch.zeros(3, C, device=env.device)
    conv = torch.zeros(1, C, 8, device=env.device)
    wide = torch.zeros(C, 5, device=env.device)
    with pytest.raises(ValueError, match="widths up to 4"):
        ops.conv_prefill(x, conv, wide, None, idx, b.query_start_loc, backend="triton")


def test_prefill_names_a_bad_argument() -> None:
    b = make_batch([3, 2], 2, 16, 16)
    state = make_state(2, 2, 16, 16)
    with pytest.raises(ValueError, match="state_indices"):
        ops.prefill(*b.tokens(), state, torch.tensor([0, 5], dtype=torch.int32),
                    b.query_start_loc, -5.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.prefill(*b.tokens(), state, torch.tensor([0, 1], dtype=torch.int32),
                    torch.tensor([0, 4, 3], dtype=torch.int32), -5.0)
    with pytest.raises(ValueError, match="lower_bound"):
        ops.prefill(*b.tokens(), state, torch.tensor([0, 1], dtype=torch.int32),
                    b.query_start_loc, 2.0)
