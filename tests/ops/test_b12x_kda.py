"""b12x's KDA recovery backend: b12x's oracle against ours, the adapter's data path and checks.

CPU (needs the b12x package; ``pip install --no-deps b12x`` is enough, its CUTLASS DSL
dependencies are needed only for its kernels): b12x's PyTorch oracle against our reference
(and our Triton kernels under ``TRITON_INTERPRET=1``), the plan b12x derives from our
tensors, the adapter's staging and its argument checks (these need no b12x at all).
``gpu`` (an SM12x GPU with b12x and its dependencies): b12x's kernels against ours.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch

from vllm_recoverssm import ops
from vllm_recoverssm.ops.b12x_kda import (
    NULL_INDEX,
    B12xKdaRecovery,
    b12x_recovery_api,
    stage_slots,
)

D = 128
LB = -5.0
BF16 = torch.bfloat16
EPS = 1e-6
I32 = torch.int32
Tensors7 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor, torch.Tensor]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def close_states(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 states a few ulps apart."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@dataclass
class Step:
    """One step's token inputs (activations ~ N(0, 1)) for requests of ``query_lens``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    raw_g: torch.Tensor
    raw_beta: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens: list[int]

    def tokens(self) -> Tensors7:
        """(q, k, v, raw_g, raw_beta, A_log, dt_bias), the leading arguments of verify."""
        return self.q, self.k, self.v, self.raw_g, self.raw_beta, self.A_log, self.dt_bias


def make_step(query_lens: list[int], H: int, *, K: int = D, act: torch.dtype = BF16,
              device: str = "cpu", seed: int = 0) -> Step:
    """Random inputs; ``A_log`` and ``dt_bias`` stay float32."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(query_lens)

    def rnd(*shape: int, dtype: torch.dtype = act, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=I32)
    return Step(rnd(T, H, K), rnd(T, H, K), rnd(T, H, K), rnd(T, H, K), rnd(T, H),
                rnd(H, dtype=torch.float32, scale=0.5),
                rnd(H, K, dtype=torch.float32, scale=0.5), qsl.to(device), list(query_lens))


def _gdn() -> ModuleType:
    return pytest.importorskip("b12x.sequence.gdn_decode",
                               reason="needs b12x (pip install --no-deps b12x)")


def paged_pools(slots: int, H: int, W: int, device: str = "cpu",
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """State, corrections and kg as views into one byte page per slot (vLLM's layout:
    conv history first, then the checkpoint and the two record tensors)."""
    sizes = [256, H * D * D * 4, H * W * D * 4, H * W * 2 * D * 2]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    pages = torch.zeros(slots, sum(sizes), dtype=torch.uint8, device=device)

    def part(i: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return pages[:, offs[i]: offs[i] + sizes[i]].view(dtype).unflatten(1, shape)

    state = part(1, torch.float32, (H, D, D))
    gen = torch.Generator().manual_seed(seed)
    state.copy_(torch.randn(state.shape, generator=gen) * 0.1)
    return state, part(2, torch.float32, (H, W, D)), part(3, BF16, (H, W, 2 * D))


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vLLM's gated RMSNorm (sigmoid gate) of a BF16 attention output, as b12x's oracle
    applies it after the recurrence."""
    x = o.to(BF16).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    return (x * weight.float() * torch.sigmoid(z.float())).to(BF16)


class Scene:
    """One speculative step for N requests: b12x's full-state oracle and its inputs.

    Row ``null_row`` has a null checkpoint. ``cols[i, t]`` is the slot b12x's oracle
    writes the state after token ``t`` of request ``i`` into; ``cols[i, 0]`` holds the
    initial state and is the slot recovery verify reads and writes records at.
    """

    def __init__(self, lens: list[int], H: int = 2, S: int = 3, seed: int = 0,
                 spare: int = 4, accepted: list[int] | None = None) -> None:
        self.lens, self.H, self.W, self.N = lens, H, S + 1, len(lens)
        self.T = sum(lens)
        self.b = make_step(lens, H, seed=seed)
        # Near-zero keys and queries make the L2-normalisation epsilon matter.
        self.b.k[0].mul_(1e-3)
        self.b.q[1].mul_(1e-3)
        gen = torch.Generator().manual_seed(seed + 1)
        self.z = torch.randn(self.T, H, D, generator=gen).to(BF16)
        self.norm_weight = (torch.rand(D, generator=gen) + 0.5).to(BF16)
        self.slots = self.N * self.W + spare
        perm = torch.randperm(self.slots, generator=gen).to(torch.int32)
        self.cols = perm[: self.N * self.W].view(self.N, self.W).clone()
        self.spare = perm[self.N * self.W:].tolist()
        self.null_row = self.N - 1
        self.cols[self.null_row] = NULL_INDEX
        self.accepted = torch.tensor(accepted or [1] * self.N, dtype=torch.int32)
        self.pool = torch.zeros(self.slots, H, D, D)
        init = torch.randn(self.N, H, D, D, generator=gen) * 0.1
        for i in range(self.N):
            src = int(self.cols[i, int(self.accepted[i]) - 1])
            if src >= 0:
                self.pool[src] = init[i]

    def src(self) -> torch.Tensor:
        """The checkpoint slot of each request (column 0; null row -1)."""
        return self.cols[:, 0].contiguous()

    def oracle(self, gdn: ModuleType) -> tuple[torch.Tensor, torch.Tensor]:
        """b12x's PyTorch oracle fed from the adapter's staging (as its kernels would be):
        returns (gated outputs [T, H, D], pool with every checkpoint column written)."""
        stage = B12xKdaRecovery(num_heads=self.H, num_spec=self.W - 1,
                                max_seqs=self.N).staging("cpu")
        b = self.b
        t = stage.load_verify(b.q, b.k, b.v, b.raw_g, b.raw_beta, self.src(),
                              b.query_start_loc)
        assert t == self.T
        pool = self.pool.clone()
        out = gdn.reference.decode_kda(
            stage.mixed_qkv[:t], stage.raw_g[:t], stage.raw_beta[:t], self.z, b.A_log,
            b.dt_bias, self.norm_weight, pool, stage.query_start_loc[: self.N + 1],
            self.accepted, self.cols, self.N, self.T, heads=self.H, lower_bound=LB,
            null_state_index=NULL_INDEX,
        )
        return out[: self.T], pool


# -- b12x's oracle against ours (CPU) ------------------------------------------------------

def test_full_state_verify_matches_b12x_oracle() -> None:
    """Same checkpoints in every column and the same outputs, starting from a column other
    than 0 for one row; the null row stays zero."""
    gdn = _gdn()
    sc = Scene([4, 2, 3, 3], accepted=[1, 2, 1, 1])
    b_out, b_pool = sc.oracle(gdn)
    pool = sc.pool.clone()
    out = ops.verify_full(*sc.b.tokens(), pool, sc.cols, sc.accepted, sc.b.query_start_loc,
                          lower_bound=LB, backend="reference")
    assert not torch.equal(b_pool, sc.pool)
    close_states(pool, b_pool)
    torch.testing.assert_close(gated_norm(out, sc.z, sc.norm_weight), b_out)
    null = slice(int(sc.b.query_start_loc[sc.null_row]), sc.T)
    assert not b_out[null].any() and not out[null].any()


def _triton_ok() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("backend", [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(not _triton_ok(),
                                                    reason="needs TRITON_INTERPRET=1")),
])
def test_recovery_records_replay_b12x_checkpoints(backend: str) -> None:
    """Our records (what b12x's docstring says its kernel stores: FP32 corrections, the raw
    key and raw gate in BF16, at the checkpoint slot) replayed by our commit give b12x's
    checkpoints: final slots, align boundaries and in-place rows alike."""
    gdn = _gdn()
    sc = Scene([4, 2, 3, 3])
    b_out, b_pool = sc.oracle(gdn)
    pool = sc.pool.clone()
    src = sc.src()
    corr = torch.zeros(sc.slots, sc.H, sc.W, D)
    kg = torch.zeros(sc.slots, sc.H, sc.W, 2 * D, dtype=BF16)
    out = ops.verify_recovery(*sc.b.tokens(), pool, src, sc.b.query_start_loc, corr, kg,
                              lower_bound=LB, record_indices=src, backend=backend)
    assert torch.equal(pool, sc.pool), "verify must not write the checkpoint"
    torch.testing.assert_close(gated_norm(out, sc.z, sc.norm_weight), b_out)
    qsl = sc.b.query_start_loc.tolist()
    for i in range(sc.N - 1):
        rows = slice(qsl[i], qsl[i + 1])
        n = sc.lens[i]
        assert torch.equal(kg[src[i], :, :n, :D], sc.b.k[rows].transpose(0, 1))
        assert torch.equal(kg[src[i], :, :n, D:], sc.b.raw_g[rows].transpose(0, 1))

    a, b, c, d = sc.spare
    plan = ops.CommitPlan(
        state_indices=src,
        commit_lens=torch.tensor([3, 2, 1, 0], dtype=I32),
        final_indices=torch.tensor([a, int(src[1]), c, -1], dtype=I32),
        boundary_indices=torch.tensor([b, -1, d, -1], dtype=I32),
        boundary_lens=torch.tensor([2, 0, 1, 0], dtype=I32),
    )
    ops.commit(pool, corr, kg, sc.b.A_log, sc.b.dt_bias, plan, lower_bound=LB,
               record_indices=src, backend=backend)
    col = sc.cols
    for slot, (row, t) in {a: (0, 2), b: (0, 1), int(src[1]): (1, 1), c: (2, 0),
                           d: (2, 0)}.items():
        close_states(pool[slot], b_pool[col[row, t]])
    for row in (0, 2):  # moved to another final slot: the source stays as it was
        assert torch.equal(pool[src[row]], sc.pool[src[row]])


# -- what b12x derives from our tensors (CPU) --------------------------------------------

def test_b12x_exposes_the_recovery_api() -> None:
    from vllm_recoverssm.ops.backends import choose_kernel_backend

    gdn = _gdn()
    assert b12x_recovery_api(gdn)
    assert choose_kernel_backend((12, 0), gdn) == "b12x"


def test_b12x_plans_our_paged_layout() -> None:
    """b12x accepts the plan declared from vLLM-style paged pools and keeps their slot
    stride (no compaction); its own query and config validation runs on CPU."""
    gdn = _gdn()
    H, S, slots, max_seqs = 4, 3, 9, 5
    state, corr, kg = paged_pools(slots, H, S + 1)
    assert state.stride(0) > H * D * D  # really paged
    adapter = B12xKdaRecovery(num_heads=H, num_spec=S, max_seqs=max_seqs, module=gdn)
    _, _, plan = adapter.declare(state, corr, kg, torch.zeros(H), torch.zeros(H, D),
                                 device="cuda:0")
    q = plan.query
    assert q.recover_speculative_state and q.null_state_index == NULL_INDEX
    assert (q.state_index_columns, q.max_state_slots) == (S + 1, slots)
    assert (q.max_seqs, q.max_tokens) == (max_seqs, max_seqs * (S + 1))
    assert (q.key_heads, q.value_heads) == (H, H)
    assert q.kda_strides[6:9] == state.stride()[:3]
    assert (q.a_log_dtype, q.dt_bias_dtype, q.state_indices_dtype) == (
        "float32", "float32", "int32")
    assert plan.memory_requirements().scratch  # b12x's validate_query/validate_config


def test_vllm_record_shapes_are_b12x_records() -> None:
    """vLLM's recovery record shapes and dtypes are those b12x's recovery mode binds:
    ``[slot, head, S+1, 128]`` FP32 and ``[slot, head, S+1, 256]`` BF16."""
    gdn = _gdn()
    mu = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
    H, S, slots = 2, 3, 6
    shapes = mu.MambaStateShapeCalculator.append_kda_recoverssm_record(
        ((1, 1), (1, 1, 1)), 2 * H, D, 2, S + 1)
    dtypes = mu.MambaStateDtypeCalculator.append_kda_recoverssm_record(
        (BF16, torch.float32), torch.bfloat16)
    assert tuple(shapes[2]) == (H, S + 1, D) and tuple(shapes[3]) == (H, S + 1, 2 * D)
    assert tuple(dtypes[2:]) == (torch.float32, BF16)
    corr = torch.zeros(slots, *shapes[2], dtype=dtypes[2])
    kg = torch.zeros(slots, *shapes[3], dtype=dtypes[3])
    state = torch.zeros(slots, H, D, D)
    adapter = B12xKdaRecovery(num_heads=H, num_spec=S, max_seqs=2, module=gdn)
    _, _, plan = adapter.declare(state, corr, kg, torch.zeros(H), torch.zeros(H, D),
                                 device="cuda:0")
    assert plan.query.state_index_columns == corr.shape[2]
    b = make_step([S + 1, 2], H)
    idx = torch.tensor([1, 4], dtype=I32)
    q, k, v, g, beta, A_log, dt_bias = b.tokens()
    with pytest.raises(ValueError, match="need CUDA tensors"):  # every layout check passed
        adapter.verify(q, k, v, g, beta, A_log, dt_bias, state, idx, b.query_start_loc, corr,
                       kg, lower_bound=LB, record_indices=idx)


# -- staging (CPU, no b12x needed) ----------------------------------------------------------

def test_stage_slots_maps_every_negative_to_b12x_null() -> None:
    out = torch.empty(5, dtype=torch.int32)
    stage_slots(out, torch.tensor([-3, 5, -1, 0, -100], dtype=torch.int64))
    assert out.tolist() == [NULL_INDEX, 5, NULL_INDEX, 0, NULL_INDEX]


def test_staged_verify_inputs_pack_q_k_v_and_clip_to_capacity() -> None:
    H, S, N = 2, 1, 2
    stage = B12xKdaRecovery(num_heads=H, num_spec=S, max_seqs=3).staging("cpu")
    stage.output.fill_(7)
    b = make_step([2, 2, 1], H, seed=3)  # 5 tokens, N*W = 4 fit
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    t = stage.load_verify(b.q, b.k, b.v, b.raw_g, b.raw_beta,
                          torch.tensor([3, -2], dtype=torch.int32), qsl)
    assert t == N * (S + 1)
    packed = stage.mixed_qkv[:t].view(t, 3, H, D)
    for j, x in enumerate((b.q, b.k, b.v)):
        assert torch.equal(packed[:, j], x[:t])
    assert torch.equal(stage.raw_g[:t], b.raw_g[:t])
    assert torch.equal(stage.raw_beta[:t], b.raw_beta[:t])
    assert stage.query_start_loc[: N + 1].tolist() == [0, 2, 4]
    assert stage.state_indices[:N].tolist() == [3, NULL_INDEX]
    assert not stage.output[:t].any()
    state = torch.zeros(4, H, D, D)
    views = stage.verify_tensors(N, state, torch.zeros(4, H, S + 1, D),
                                 torch.zeros(4, H, S + 1, 2 * D, dtype=BF16), b.A_log,
                                 b.dt_bias)
    assert tuple(views["state_indices"].shape) == (N, 1)
    assert views["mixed_qkv"].shape[0] == t
    assert torch.equal(views["z"], b.q[:t])  # z is the unused gate input: a view of q


def test_staged_commit_plan_defaults_to_in_place_without_boundary() -> None:
    stage = B12xKdaRecovery(num_heads=2, num_spec=3, max_seqs=4).staging("cpu")
    stage.commit_boundary.fill_(9)
    stage.load_commit(ops.CommitPlan(torch.tensor([4, -7, 2], dtype=I32),
                                     torch.tensor([3, 0, 1], dtype=I32)))
    assert stage.commit_src[:3].tolist() == [4, NULL_INDEX, 2]
    assert stage.commit_final[:3].tolist() == [4, NULL_INDEX, 2]
    assert stage.commit_lens[:3].tolist() == [3, 0, 1]
    assert stage.commit_boundary[:3].tolist() == [NULL_INDEX] * 3
    assert stage.commit_boundary_lens[:3].tolist() == [0, 0, 0]
    stage.load_commit(ops.CommitPlan(
        torch.tensor([4, 2], dtype=I32), torch.tensor([3, 2], dtype=I32),
        final_indices=torch.tensor([5, 2], dtype=I32),
        boundary_indices=torch.tensor([6, -5], dtype=I32),
        boundary_lens=torch.tensor([2, 0], dtype=I32)))
    assert stage.commit_final[:2].tolist() == [5, 2]
    assert stage.commit_boundary[:2].tolist() == [6, NULL_INDEX]
    assert stage.commit_boundary_lens[:2].tolist() == [2, 0]


# -- argument checks (CPU, no b12x needed) ------------------------------------------------

def _verify_args(H: int = 2, S: int = 3, K: int = D, act: torch.dtype = BF16,
                 slots: int = 8) -> dict[str, Any]:
    b = make_step([S + 1, 2, 1], H, K=K, act=act, seed=4)
    idx = torch.tensor([5, -1, 2], dtype=torch.int32)
    return dict(
        q=b.q, k=b.k, v=b.v, raw_g=b.raw_g, raw_beta=b.raw_beta, A_log=b.A_log,
        dt_bias=b.dt_bias, state=torch.zeros(slots, H, K, K), state_indices=idx,
        query_start_loc=b.query_start_loc, corrections=torch.zeros(slots, H, S + 1, K),
        kg=torch.zeros(slots, H, S + 1, 2 * K, dtype=act), lower_bound=LB,
        record_indices=idx,
    )


def _adapter(**kw: Any) -> B12xKdaRecovery:
    return B12xKdaRecovery(**{"num_heads": 2, "num_spec": 3, "max_seqs": 4, **kw})


def _with(args: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {**args, **over}


BASE = _verify_args()


@pytest.mark.parametrize(("adapter_kw", "args", "error", "pattern"), [
    ({}, BASE, ValueError, "argument 'state': b12x's kernels need CUDA"),
    ({}, _with(BASE, record_indices=torch.tensor([5, 0, 2], dtype=torch.int32)),
     ValueError, "need CUDA"),  # a null row's record index is never used
    ({}, _with(BASE, lower_bound=None), NotImplementedError, "'lower_bound'"),
    ({}, _with(BASE, lower_bound=0.5), ValueError, "'lower_bound'"),
    ({}, _with(BASE, record_indices=None), NotImplementedError, "'record_indices'"),
    ({}, _with(BASE, record_indices=torch.tensor([4, -1, 2], dtype=torch.int32)),
     NotImplementedError, r"'record_indices'.*rows \[0\]"),
    ({}, _with(BASE, corrections=torch.zeros(9, 2, 4, D),
               kg=torch.zeros(9, 2, 4, 2 * D, dtype=BF16)), NotImplementedError,
     "'corrections'.*8 rows"),
    ({}, _with(BASE, corrections=torch.zeros(8, 2, 3, D)), ValueError, "'corrections'"),
    ({}, _with(BASE, kg=torch.zeros(8, 2, 4, 2 * D)), ValueError, "'kg'"),
    ({}, _verify_args(act=torch.float32), ValueError, "'q'.*bfloat16"),
    ({}, _verify_args(K=64), ValueError, "'q'.*128-wide"),
    ({}, _with(BASE, state=torch.zeros(8, 2, D, D, dtype=torch.float64)), ValueError,
     "'state'"),
    ({}, _with(BASE, A_log=BASE["A_log"].double()), ValueError, "'A_log'"),
    ({"num_heads": 4}, BASE, ValueError, "4 heads"),
    ({"max_seqs": 2}, BASE, ValueError, "'state_indices'.*max_seqs"),
    ({}, _with(BASE, query_start_loc=torch.tensor([0, 5, 6, 7], dtype=torch.int32)),
     ValueError, "'query_start_loc'"),
])
def test_bad_verify_argument_is_named(adapter_kw: dict[str, Any], args: dict[str, Any],
                                      error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        _adapter(**adapter_kw).verify(**args)


def test_unvalidated_verify_still_checks_layout_but_trusts_device_values() -> None:
    bad_rows = _with(BASE, record_indices=torch.tensor([4, -1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="need CUDA"):
        _adapter().verify(**bad_rows, validate=False)
    with pytest.raises(NotImplementedError, match="'corrections'"):
        _adapter().verify(**_with(BASE, corrections=torch.zeros(9, 2, 4, D),
                                  kg=torch.zeros(9, 2, 4, 2 * D, dtype=BF16)),
                          validate=False)


def _commit_args(L: int = 2, **plan_fields: Any) -> dict[str, Any]:
    H, W, slots = 2, 4, 8
    src = torch.tensor([5, -1, 2], dtype=I32)
    fields = dict(state_indices=src, commit_lens=torch.tensor([3, 0, 1], dtype=I32))
    fields.update(plan_fields)
    return dict(
        states=[torch.zeros(slots, H, D, D) for _ in range(L)],
        corrections=[torch.zeros(slots, H, W, D) for _ in range(L)],
        kg=[torch.zeros(slots, H, W, 2 * D, dtype=BF16) for _ in range(L)],
        A_log=torch.zeros(L, H), dt_bias=torch.zeros(L, H, D),
        plan=ops.CommitPlan(**fields), lower_bound=LB, record_indices=src,
    )


@pytest.mark.parametrize(("args", "error", "pattern"), [
    (_commit_args(), ValueError, "argument 'states': b12x's kernels need CUDA"),
    (_commit_args(final_indices=torch.tensor([6, -1, 2], dtype=I32),
                  boundary_indices=torch.tensor([7, -1, -1], dtype=I32),
                  boundary_lens=torch.tensor([2, 0, 0], dtype=I32)), ValueError, "need CUDA"),
    (_with(_commit_args(), record_indices=None), NotImplementedError, "'record_indices'"),
    (_with(_commit_args(), record_indices=torch.tensor([5, -1, 3], dtype=I32)),
     NotImplementedError, r"'record_indices'.*rows \[2\]"),
    (_commit_args(commit_lens=torch.tensor([3, 0, 0], dtype=I32),
                  final_indices=torch.tensor([5, -1, 6], dtype=I32)),
     NotImplementedError, r"'plan.commit_lens'.*rows \[2\]"),
    (_commit_args(final_indices=torch.tensor([-1, -1, 2], dtype=I32),
                  boundary_indices=torch.tensor([7, -1, -1], dtype=I32),
                  boundary_lens=torch.tensor([2, 0, 0], dtype=I32)),
     NotImplementedError, r"'plan.final_indices'.*rows \[0\]"),
    (_commit_args(commit_lens=torch.tensor([5, 0, 1], dtype=I32)), ValueError,
     "'plan.commit_lens'"),
    (_with(_commit_args(), A_log=torch.zeros(2, 2, dtype=torch.float64)), ValueError,
     "'A_log'"),
    (_with(_commit_args(), dt_bias=torch.zeros(1, 2, D)), ValueError, "'dt_bias'"),
    (_with(_commit_args(), lower_bound=None), NotImplementedError, "'lower_bound'"),
    (_with(_commit_args(), kg=[torch.zeros(8, 2, 4, 2 * D, dtype=BF16)]), ValueError,
     "2 layers"),
])
def test_bad_commit_argument_is_named(args: dict[str, Any], error: type[Exception],
                                      pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        _adapter().commit(**args)


@pytest.mark.parametrize(("kw", "pattern"), [
    (dict(num_spec=0), "'num_spec'"), (dict(num_spec=8), "'num_spec'"),
    (dict(num_heads=0), "'num_heads'"), (dict(max_seqs=True), "'max_seqs'"),
    (dict(module=ModuleType("b12x.sequence.gdn_decode")), "'module'"),
])
def test_bad_constructor_argument_is_named(kw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _adapter(**kw)


# -- b12x's kernels against ours (SM12x GPU) ------------------------------------------------

@pytest.fixture
def sm12x() -> ModuleType:
    gdn = _gdn()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 12:
        pytest.skip("needs an SM12x GPU")
    if not gdn.is_supported():
        pytest.skip("needs b12x's CUTLASS DSL dependencies")
    return gdn


def _gpu_rows(S: int, N: int, slots: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """Query lengths 1..S+1 and distinct checkpoint slots (one null row) for N requests."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, S + 2, (N,), generator=gen).tolist()
    idx = torch.randperm(slots, generator=gen)[:N].to(I32)
    idx[N // 2] = NULL_INDEX
    return lens, idx.cuda()


@pytest.mark.gpu
def test_gpu_verify_and_commit_match_ours_and_records_interchange(sm12x: ModuleType) -> None:
    """b12x's verify vs our Triton verify (outputs, records, checkpoint untouched), then
    both commits over two paged layers with align boundaries, each also on the other's
    records: the record format is shared."""
    H, S, N, L = 32, 3, 37, 2
    W, slots = S + 1, 3 * N + 2
    adapter = B12xKdaRecovery(num_heads=H, num_spec=S, max_seqs=64, module=sm12x)
    pools = [paged_pools(slots, H, W, "cuda", seed=layer) for layer in range(L)]
    ours = [tuple(t.clone() for t in p) for p in pools]
    lens, idx = _gpu_rows(S, N, slots, seed=10)
    steps = [make_step(lens, H, device="cuda", seed=10 + layer) for layer in range(L)]
    A_log = torch.stack([b.A_log for b in steps]).contiguous()
    dt_bias = torch.stack([b.dt_bias for b in steps]).contiguous()
    for layer, b in enumerate(steps):
        state, corr, kg = pools[layer]
        before = state.clone()
        q, k, v, g, beta, _, _ = b.tokens()
        out = adapter.verify(q, k, v, g, beta, A_log[layer], dt_bias[layer], state, idx,
                             b.query_start_loc, corr, kg, lower_bound=LB, record_indices=idx)
        assert torch.equal(state, before)
        o_state, o_corr, o_kg = ours[layer]
        want = ops.verify_recovery(q, k, v, g, beta, A_log[layer], dt_bias[layer], o_state,
                                   idx, b.query_start_loc, o_corr, o_kg, lower_bound=LB,
                                   record_indices=idx, backend="triton")
        torch.testing.assert_close(out, want, rtol=2.0**-7, atol=1e-5)
        live = idx[idx >= 0].long()
        assert torch.equal(kg[live], o_kg[live])
        close_states(corr[live], o_corr[live])

    gen = torch.Generator().manual_seed(3)
    clen = torch.minimum(torch.randint(0, W + 1, (N,), generator=gen, dtype=I32),
                         torch.tensor(lens, dtype=I32))
    free = [s for s in range(slots) if s not in set(idx.tolist())]
    final = torch.tensor(free[:N], dtype=torch.int32)
    final = torch.where(clen > 0, final, idx.cpu())
    bound = torch.where(clen > 1, torch.tensor(free[N: 2 * N], dtype=torch.int32), -1)
    blen = torch.where(bound >= 0, clen - 1, 0).to(torch.int32)
    null = idx.cpu() < 0
    clen, final = torch.where(null, 0, clen), torch.where(null, -1, final)
    bound = torch.where(null, -1, bound)
    plan = ops.CommitPlan(idx, clen.cuda(), final.to(torch.int32).cuda(),
                          bound.to(torch.int32).cuda(), blen.cuda())

    def run(commit_b12x: bool,
            records: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        states = [p[0].clone() for p in pools]
        corrs, kgs = [r[1] for r in records], [r[2] for r in records]
        if commit_b12x:
            adapter.commit(states, corrs, kgs, A_log, dt_bias, plan, lower_bound=LB,
                           record_indices=idx)
        else:
            ops.commit(states, corrs, kgs, A_log, dt_bias, plan, lower_bound=LB,
                       record_indices=idx, backend="triton")
        return states

    b_b, t_t = run(True, pools), run(False, ours)
    t_b, b_t = run(False, pools), run(True, ours)
    for layer in range(L):
        assert not torch.equal(b_b[layer], pools[layer][0])
        close_states(b_b[layer], t_t[layer])
        close_states(t_b[layer], b_b[layer])
        close_states(b_t[layer], t_t[layer])


@pytest.mark.gpu
def test_gpu_bindings_are_reused_and_replay_in_a_cuda_graph(sm12x: ModuleType) -> None:
    """A second step reuses the bindings, and a captured verify replays on new inputs
    exactly as an eager call does."""
    H, S, N = 8, 3, 5
    W, slots = S + 1, 2 * N + 1
    adapter = B12xKdaRecovery(num_heads=H, num_spec=S, max_seqs=8, module=sm12x)
    state, corr, kg = paged_pools(slots, H, W, "cuda")
    lens, idx = _gpu_rows(S, N, slots, seed=1)
    b = make_step(lens, H, device="cuda", seed=1)

    def verify(acts: Sequence[torch.Tensor], validate: bool = True) -> torch.Tensor:
        q, k, v, g, beta = acts  # the layer's A_log / dt_bias stay the same tensors
        return adapter.verify(q, k, v, g, beta, b.A_log, b.dt_bias, state, idx,
                              b.query_start_loc, corr, kg, lower_bound=LB, record_indices=idx,
                              validate=validate)

    verify(b.tokens()[:5])
    count = adapter.binding_count
    new = make_step(b.query_lens, H, device="cuda", seed=2).tokens()[:5]
    eager = verify(new)
    eager_corr = corr.clone()
    assert adapter.binding_count == count

    static = [t.clone() for t in b.tokens()[:5]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        verify(static, validate=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = verify(static, validate=False)
    for dst, src in zip(static, new, strict=True):
        dst.copy_(src)
    corr.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, eager)
    assert torch.equal(corr, eager_corr)
    assert adapter.binding_count == count
