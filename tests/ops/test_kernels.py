"""The kernels against the float64 reference.

The same checks run in several environments: ``interp`` (CPU tensors, tiny shapes, needs
``TRITON_INTERPRET=1``; runs in CI: the Triton window verify for bounded gates, the
serial one for softplus gates) and ``interp-serial`` (the serial verify everywhere, with
the tile that holds K as two chunks, which it picks for K >= 32), then ``gpu`` (CUDA
tensors at GLM-5.3 TP2 shapes: H=32, K=V=128, the kernels a GPU picks: the CUDA window
verify where it applies) and ``gpu-triton`` (the Triton window verify on the GPU); the
GPU ones are marked ``gpu``. Both commit with the Triton commit (the kernels' choice); the
CUDA commit, opt-in, is checked against it in the ``gpu`` environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from tests.support.kda_batches import SpecBatch, make_batch, make_state
from vllm_recoverssm import ops
from vllm_recoverssm.ops import backends, tuning

F64 = torch.float64
STATE_TOL = 1e-6  # committed state vs float64, and commit(n) vs full-state column n


def _fp32_out_ok(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32 outputs within 1e-7 at the GPU shapes, where |o| stays below about 0.05
    (q^ is scaled by K**-0.5). The tiny interpreter heads have larger outputs, so the
    bound grows in proportion to the largest output there."""
    tol = 1e-7 * max(1.0, float(want.abs().max()) / 0.05)
    return float((got.double() - want).abs().max()) <= tol


@dataclass(frozen=True)
class Env:
    """Where and at what size a kernel test runs."""

    device: str
    H: int
    K: int
    V: int
    batches: tuple[int, ...]
    tile: tuple[int, int, int] | None = None
    """``KernelTuning.serial_tile`` for the test (None: the kernels' own choice)."""
    kernel: str | None = None
    """``KernelTuning.verify_kernel`` for bounded gates (None: the kernels' choice)."""
    commit: str | None = None
    """``KernelTuning.commit_kernel`` (None: the kernels' choice)."""


INTERP = Env("cpu", 2, 16, 16, (3, 5))
INTERP_2CHUNK = Env("cpu", 2, 16, 16, (3, 5), tile=(8, 1, 2), kernel="serial")
GPU = Env("cuda", 32, 128, 128, (1, 37, 256))
GPU_TRITON = Env("cuda", 32, 128, 128, (1, 37, 256), kernel="window", commit="triton")


def _available(env: Env) -> bool:
    if env.device == "cuda":
        return torch.cuda.is_available()
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(params=[pytest.param(INTERP, id="interp"),
                        pytest.param(INTERP_2CHUNK, id="interp-serial"),
                        pytest.param(GPU, id="gpu", marks=pytest.mark.gpu),
                        pytest.param(GPU_TRITON, id="gpu-triton", marks=pytest.mark.gpu)])
def env(request: pytest.FixtureRequest) -> Env:
    e: Env = request.param
    if not _available(e):
        pytest.skip("needs CUDA" if e.device == "cuda" else "needs TRITON_INTERPRET=1")
    # a test may change more knobs: the finalizer puts back what was in force before it
    previous = tuning.set_tuning(tuning.KernelTuning(), serial_tile=e.tile,
                                 verify_kernel=e.kernel, commit_kernel=e.commit)
    request.addfinalizer(lambda: tuning.set_tuning(previous))
    return e


def _kernel_for(env: Env, lb: float | None) -> None:
    """Softplus gates always take the serial verify (the window ones need a bounded gate)."""
    if lb is None:
        if env.kernel == "window" and env.device == "cuda":
            pytest.skip("the serial verify on the GPU runs in the 'gpu' environment")
        tuning.set_tuning(verify_kernel="serial" if env.kernel else None)


def _lens(batch: int, S: int, gen: torch.Generator) -> list[int]:
    """Mixed query lengths: mostly S+1, some shorter decode rows."""
    lens = torch.randint(1, S + 2, (batch,), generator=gen).tolist()
    lens[0] = S + 1
    return lens


def _scattered_slots(n: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    """Non-contiguous, non-monotonic slot ids."""
    return torch.randperm(slots, generator=gen)[:n].to(torch.int32)


def _f64(b: SpecBatch) -> tuple[torch.Tensor, ...]:
    return (*(t.to(F64) for t in b.tokens()[:5]), b.A_log.double(), b.dt_bias.double())


def _bf16_ok(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one bf16 ulp of the exact value (plus a tiny absolute floor)."""
    tol = want.abs() * 2.0**-7 + 1e-6
    return bool(((got.double() - want).abs() <= tol).all())


def _run_step(env: Env, S: int, batch: int, lb: float | None, act: torch.dtype, seed: int,
              accept: list[int] | None = None, gate_shift: float = 0.0,
              state_pool: torch.Tensor | None = None):
    gen = torch.Generator().manual_seed(seed)
    lens = _lens(batch, S, gen)
    b = make_batch(lens, env.H, env.K, env.V, device=env.device, act_dtype=act, seed=seed,
                   gate_shift=gate_shift)
    slots = 2 * batch + 3
    if state_pool is None:
        state_pool = make_state(slots, env.H, env.V, env.K, device=env.device, seed=seed)
    idx = _scattered_slots(batch, state_pool.shape[0], gen)
    idx[batch // 2] = -1 if batch > 2 else idx[batch // 2]  # one null row
    idx = idx.to(env.device)
    W = S + 1
    corr = torch.zeros(batch, env.H, W, env.V, device=env.device)
    kg = torch.zeros(batch, env.H, W, 2 * env.K, dtype=act, device=env.device)
    if accept is None:
        accept = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lens]
    return b, lens, state_pool, idx, corr, kg, accept


@pytest.mark.parametrize("S", [1, 3, 7])
@pytest.mark.parametrize("lb", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_and_commit_match_float64(env: Env, S: int, lb: float | None, act: torch.dtype):
    _kernel_for(env, lb)
    for batch in env.batches:
        b, lens, pool, idx, corr, kg, accept = _run_step(env, S, batch, lb, act, seed=S + batch)
        ref_pool = pool.double()
        ref_corr = corr.double()
        ref_kg = kg.double()
        before = pool.clone()
        out = ops.verify_recovery(*b.tokens(), pool, idx, b.query_start_loc.to(env.device),
                                  corr, kg, lower_bound=lb, backend="triton")
        assert torch.equal(pool, before), "verify must not write the checkpoint"
        ref_out = ops.verify_recovery(*_f64(b), ref_pool, idx, b.query_start_loc.to(env.device),
                                      ref_corr, ref_kg, lower_bound=lb, backend="reference")
        if act == torch.float32:
            assert _fp32_out_ok(out, ref_out)
        else:
            assert _bf16_ok(out, ref_out)
        plan = ops.CommitPlan(idx, torch.tensor(accept, dtype=torch.int32, device=env.device))
        ops.commit(pool, corr, kg, b.A_log, b.dt_bias, plan, lower_bound=lb, backend="triton")
        ops.commit(ref_pool, ref_corr, ref_kg, b.A_log.double(), b.dt_bias.double(), plan,
                   lower_bound=lb, backend="reference")
        assert (pool.double() - ref_pool).abs().max() <= STATE_TOL


@pytest.mark.parametrize("S", [1, 3, 7])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_row_layouts_give_the_same_bits(env: Env, S: int, act: torch.dtype):
    """The CUDA verify at 16 and 32 rows per warp (4 token slots for S <= 3, else 8): the
    same outputs, records and full-state columns bit for bit, since the layouts choose by
    batch and a step's recovery and full-state calls may take different ones."""
    if env.device != "cuda" or env.kernel is not None:
        pytest.skip("the CUDA window kernel runs in the 'gpu' environment")
    b, lens, pool, idx, corr, kg, _ = _run_step(env, S, env.batches[1], -5.0, act, seed=60 + S)
    qsl = b.query_start_loc.to(env.device)
    W = S + 1
    base = make_state(len(lens) * W + 4, env.H, env.V, env.K, device=env.device, seed=S)
    cols = torch.randperm(base.shape[0])[: len(lens) * W].view(len(lens), W)
    cols = cols.to(torch.int32).to(env.device)
    n_prev = torch.ones(len(lens), dtype=torch.int32, device=env.device)
    got = []
    for rows in (16, 32):
        tuning.set_tuning(cuda_rows=rows)
        c, k = corr.clone(), kg.clone()
        out = ops.verify_recovery(*b.tokens(), pool, idx, qsl, c, k, lower_bound=-5.0,
                                  backend="triton")
        full_pool = base.clone()
        out_full = ops.verify_full(*b.tokens(), full_pool, cols, n_prev, qsl,
                                   lower_bound=-5.0, backend="triton")
        got.append((out, c, k, out_full, full_pool))
    assert backends.verify_kernel(-5.0, W, pool, b.tokens()[0]) == "cuda"
    for x, y in zip(*got, strict=True):
        assert torch.equal(x, y)


def test_wrong_accept_count_fails_the_commit_check(env: Env):
    """Negative control: committing one token too many is caught by the same check."""
    b, lens, pool, idx, corr, kg, _ = _run_step(env, 3, env.batches[0], -5.0, torch.float32,
                                                seed=11, accept=None)
    accept = [max(n - 1, 0) for n in lens]
    wrong = [a + 1 for a in accept]
    qsl = b.query_start_loc.to(env.device)
    ref_pool = pool.double()
    ref_corr, ref_kg = corr.double(), kg.double()
    ops.verify_recovery(*b.tokens(), pool, idx, qsl, corr, kg, lower_bound=-5.0, backend="triton")
    ops.verify_recovery(*_f64(b), ref_pool, idx, qsl, ref_corr, ref_kg, lower_bound=-5.0,
                        backend="reference")
    dev = env.device
    ops.commit(pool, corr, kg, b.A_log, b.dt_bias,
               ops.CommitPlan(idx, torch.tensor(wrong, dtype=torch.int32, device=dev)),
               lower_bound=-5.0, backend="triton")
    ops.commit(ref_pool, ref_corr, ref_kg, b.A_log.double(), b.dt_bias.double(),
               ops.CommitPlan(idx, torch.tensor(accept, dtype=torch.int32, device=dev)),
               lower_bound=-5.0, backend="reference")
    assert (pool.double() - ref_pool).abs().max() > 100 * STATE_TOL


@pytest.mark.parametrize("S", [1, 3, 7])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_commit_n_equals_full_state_column_n(env: Env, S: int, act: torch.dtype):
    batch = env.batches[-1]
    gen = torch.Generator().manual_seed(100 + S)
    lens = _lens(batch, S, gen)
    W = S + 1
    b = make_batch(lens, env.H, env.K, env.V, device=env.device, act_dtype=act, seed=S)
    dev = env.device
    qsl = b.query_start_loc.to(dev)
    base = make_state(batch, env.H, env.V, env.K, device=dev, seed=S)
    n_prev = torch.randint(1, W + 1, (batch,), generator=gen)
    cols = torch.randperm(batch * W + 4, generator=gen)[: batch * W].view(batch, W)
    pool = torch.zeros(batch * W + 4, env.H, env.V, env.K, device=dev)
    for i in range(batch):
        pool[cols[i, n_prev[i] - 1]] = base[i]
    cols_d = cols.to(torch.int32).to(dev)
    out_full = ops.verify_full(*b.tokens(), pool, cols_d, n_prev.to(torch.int32).to(dev), qsl,
                               lower_bound=-5.0, backend="triton")
    ref_pool = torch.zeros_like(pool, dtype=F64)
    for i in range(batch):
        ref_pool[cols[i, n_prev[i] - 1]] = base[i].double()
    ref_out = ops.verify_full(*_f64(b), ref_pool, cols_d, n_prev.to(torch.int32).to(dev), qsl,
                              lower_bound=-5.0, backend="reference")
    if act == torch.float32:
        assert _fp32_out_ok(out_full, ref_out)
    else:
        assert _bf16_ok(out_full, ref_out)
    idx = torch.arange(batch, dtype=torch.int32, device=dev)
    corr = torch.zeros(batch, env.H, W, env.V, device=dev)
    kg = torch.zeros(batch, env.H, W, 2 * env.K, dtype=act, device=dev)
    out_rec = ops.verify_recovery(*b.tokens(), base, idx, qsl, corr, kg, lower_bound=-5.0,
                                  backend="triton")
    assert torch.equal(out_rec, out_full)
    for n in range(1, W + 1):
        committed = base.clone()
        accept = torch.tensor([min(n, x) for x in lens], dtype=torch.int32, device=dev)
        ops.commit(committed, corr, kg, b.A_log, b.dt_bias, ops.CommitPlan(idx, accept),
                   lower_bound=-5.0, backend="triton")
        for i in range(batch):
            col = cols[i, int(accept[i]) - 1]
            assert (committed[i] - pool[col]).abs().max() <= STATE_TOL
            if env.device == "cuda":  # same tiles, same rounding steps: bit for bit
                assert torch.equal(committed[i], pool[col])
            assert (pool[col].double() - ref_pool[col]).abs().max() <= STATE_TOL


@pytest.mark.slow
def test_drift_over_16_windows_with_weak_decay(env: Env):
    """16 consecutive spec windows (verify + commit of a random count) stay on the oracle."""
    S, batch = 3, env.batches[0]
    pool = make_state(2 * batch + 3, env.H, env.V, env.K, device=env.device, seed=5)
    ref_pool = pool.double()
    gen = torch.Generator().manual_seed(9)
    idx = _scattered_slots(batch, pool.shape[0], gen).to(env.device)
    for window in range(16):
        lens = _lens(batch, S, gen)
        b = make_batch(lens, env.H, env.K, env.V, device=env.device, seed=1000 + window,
                       gate_shift=-8.0)
        qsl = b.query_start_loc.to(env.device)
        W = S + 1
        corr = torch.zeros(batch, env.H, W, env.V, device=env.device)
        kg = torch.zeros(batch, env.H, W, 2 * env.K, device=env.device)
        rc, rk = corr.double(), kg.double()
        ops.verify_recovery(*b.tokens(), pool, idx, qsl, corr, kg, lower_bound=-5.0,
                            backend="triton")
        ops.verify_recovery(*_f64(b), ref_pool, idx, qsl, rc, rk, lower_bound=-5.0,
                            backend="reference")
        accept = torch.tensor([int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens],
                              dtype=torch.int32, device=env.device)
        plan = ops.CommitPlan(idx, accept)
        ops.commit(pool, corr, kg, b.A_log, b.dt_bias, plan, lower_bound=-5.0, backend="triton")
        ops.commit(ref_pool, rc, rk, b.A_log.double(), b.dt_bias.double(), plan,
                   lower_bound=-5.0, backend="reference")
    assert (pool.double() - ref_pool).abs().max() <= STATE_TOL


def test_multi_layer_commit_with_paged_layout_and_boundaries(env: Env):
    """One launch over several layers whose pools are strided views of bigger pages,
    with records addressed inside pages, final slots elsewhere and align boundaries."""
    L, S, batch = 3, 3, env.batches[0]
    H, K, V, W = env.H, env.K, env.V, S + 1
    dev = env.device
    slots = 3 * batch + 2
    gen = torch.Generator().manual_seed(21)
    pages = [torch.randn(slots, H * V * K + 64, generator=gen).mul_(0.1).to(dev)
             for _ in range(L)]
    states = [p[:, : H * V * K].view(slots, H, V, K) for p in pages]
    corrs = [torch.randn(slots, H, W, V, generator=gen).to(dev) for _ in range(L)]
    kgs = [torch.randn(slots, H, W, 2 * K, generator=gen).to(dev) for _ in range(L)]
    A_log = torch.randn(L, H, generator=gen).mul_(0.5).to(dev)
    dt_bias = torch.randn(L, H, K, generator=gen).mul_(0.5).to(dev)
    perm = torch.randperm(slots, generator=gen)
    src = perm[:batch].to(torch.int32)
    final = perm[batch: 2 * batch].to(torch.int32)
    bound = perm[2 * batch: 3 * batch].to(torch.int32)
    clen = torch.randint(0, W + 1, (batch,), generator=gen).to(torch.int32)
    blen = torch.clamp(clen - 1, min=1).to(torch.int32)
    bound = torch.where(clen >= 1, bound, torch.full_like(bound, -1))
    bound[0] = -1
    plan = ops.CommitPlan(src.to(dev), clen.to(dev), final.to(dev), bound.to(dev), blen.to(dev))
    ridx = src.to(dev)  # records inside the source page (vLLM's layout)
    ref_states = [s.double() for s in states]
    ops.commit(states, corrs, kgs, A_log, dt_bias, plan, lower_bound=-5.0,
               record_indices=ridx, backend="triton")
    ops.commit(ref_states, [c.double() for c in corrs], [k.double() for k in kgs],
               A_log.double(), dt_bias.double(), plan, lower_bound=-5.0, record_indices=ridx,
               backend="reference")
    for s, r in zip(states, ref_states, strict=True):
        assert (s.double() - r).abs().max() <= STATE_TOL
    for p in pages:  # the page padding is never touched
        assert torch.isfinite(p[:, H * V * K:]).all()


@pytest.mark.parametrize("S", [1, 3, 7])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_update_and_compaction_match_reference(env: Env, S: int, act: torch.dtype):
    Kc = 4
    C = 3 * env.H * env.K if env.device == "cuda" else 40
    batch = env.batches[-1]
    gen = torch.Generator().manual_seed(S)
    lens = _lens(batch, S, gen)
    T = sum(lens)
    dev = env.device
    x = torch.randn(T, C, generator=gen).to(act).to(dev)
    w = torch.randn(C, Kc, generator=gen).to(act).to(dev)
    bias = torch.randn(C, generator=gen).to(act).to(dev)
    conv = torch.randn(2 * batch + 1, C, Kc - 1 + S, generator=gen).to(act).to(dev)
    idx = _scattered_slots(batch, conv.shape[0], gen)
    idx[-1] = -1
    idx = idx.to(dev)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=dev)
    offs = torch.randint(0, S + 1, (batch,), generator=gen).to(torch.int32).to(dev)
    c1, c2 = conv.clone(), conv.clone()
    y1 = ops.conv_update(x, c1, w, bias, idx, qsl, conv_offsets=offs, backend="triton")
    y2 = ops.conv_update(x, c2, w, bias, idx, qsl, conv_offsets=offs, backend="reference")
    if act == torch.float32:
        assert (y1 - y2).abs().max() <= 1e-5
    else:
        assert _bf16_ok(y1, y2.double())
    assert torch.equal(c1, c2)
    accept = torch.tensor([int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens],
                          dtype=torch.int32, device=dev)
    final = torch.randperm(conv.shape[0], generator=gen)[:batch].to(torch.int32).to(dev)
    plan = ops.CommitPlan(idx, accept, final_indices=torch.where(idx >= 0, idx, final))
    ops.conv_compact([c1, c1.clone()], plan, kernel_width=Kc, backend="triton")
    ops.conv_compact(c2, plan, kernel_width=Kc, backend="reference")
    assert torch.equal(c1, c2)


@pytest.mark.parametrize("lb", [-5.0, None], ids=["bounded", "softplus"])
def test_commit_token_loops_give_the_same_bits(env: Env, lb: float | None):
    """The commit's token loops (a runtime loop, unrolled with masked loads, a runtime
    loop that loads ahead) give the same bits, boundary states and skipped rows
    included, and stay within the tolerance of the float64 reference."""
    S, batch, dev = 3, env.batches[-1], env.device
    H, K, V, W = env.H, env.K, env.V, S + 1
    gen = torch.Generator().manual_seed(31)
    slots = 3 * batch + 2
    pool = make_state(slots, H, V, K, device=dev, seed=31)
    corr = torch.randn(slots, H, W, V, generator=gen).to(dev)
    kg = torch.randn(slots, H, W, 2 * K, generator=gen).to(dev)
    A_log = torch.randn(H, generator=gen).mul_(0.5).to(dev)
    dt_bias = torch.randn(H, K, generator=gen).mul_(0.5).to(dev)
    perm = torch.randperm(slots, generator=gen).to(torch.int32)
    src, final, bound = perm[:batch], perm[batch: 2 * batch], perm[2 * batch: 3 * batch]
    clen = torch.randint(0, W + 1, (batch,), generator=gen).to(torch.int32)
    clen[0] = W
    blen = torch.clamp(clen - 1, min=1).to(torch.int32)
    bound = torch.where(clen >= 1, bound, torch.full_like(bound, -1))
    src[-1] = -1  # a null row
    plan = ops.CommitPlan(src.to(dev), clen.to(dev), final.to(dev), bound.to(dev),
                          blen.to(dev))
    ridx = torch.randperm(slots, generator=gen)[:batch].to(torch.int32).to(dev)
    got = []
    for loop in tuning.COMMIT_LOOPS:
        tuning.set_tuning(commit_loop=loop)
        out = pool.clone()
        ops.commit(out, corr, kg, A_log, dt_bias, plan, lower_bound=lb, record_indices=ridx,
                   backend="triton")
        got.append(out)
    assert all(torch.equal(got[0], g) for g in got[1:])
    ref = pool.double()
    ops.commit(ref, corr.double(), kg.double(), A_log.double(), dt_bias.double(), plan,
               lower_bound=lb, record_indices=ridx, backend="reference")
    assert (got[0].double() - ref).abs().max() <= STATE_TOL
    assert not torch.equal(got[0], pool)


@pytest.mark.parametrize("S", [1, 3, 7])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_and_triton_commits_give_the_same_bits(env: Env, S: int, act: torch.dtype):
    """The CUDA commit at each block size against the Triton commit, bit for bit, over
    several layers whose pools are strided views of bigger pages: records addressed
    elsewhere, final slots, align boundaries, null rows and rows with nothing accepted."""
    from vllm_recoverssm.ops import cuda_commit

    if env.device != "cuda" or env.commit is not None:
        pytest.skip("the CUDA commit runs in the 'gpu' environment")
    L, batch, dev = 2, env.batches[1], env.device
    H, K, V, W = env.H, env.K, env.V, S + 1
    gen = torch.Generator().manual_seed(70 + S)
    slots = 3 * batch + 2
    pages = [torch.randn(slots, H * V * K + 64, generator=gen).mul_(0.1).to(dev)
             for _ in range(L)]
    corrs = [torch.randn(slots, H, W, V, generator=gen).to(dev) for _ in range(L)]
    kgs = [torch.randn(slots, H, W, 2 * K, generator=gen).to(act).to(dev) for _ in range(L)]
    A_log = torch.randn(L, H, generator=gen).mul_(0.5).to(dev)
    dt_bias = torch.randn(L, H, K, generator=gen).mul_(0.5).to(dev)
    perm = torch.randperm(slots, generator=gen).to(torch.int32)
    src, final, bound = perm[:batch], perm[batch: 2 * batch], perm[2 * batch: 3 * batch]
    clen = torch.randint(0, W + 1, (batch,), generator=gen).to(torch.int32)
    clen[0] = W
    blen = torch.randint(1, W + 1, (batch,), generator=gen).to(torch.int32)
    blen = torch.minimum(blen, clen.clamp(min=1))
    bound = torch.where(clen >= 1, bound, torch.full_like(bound, -1))
    final[1] = -1  # a boundary state only
    src[-1] = -1  # a null row
    plan = ops.CommitPlan(src.to(dev), clen.to(dev), final.to(dev), bound.to(dev),
                          blen.to(dev))
    ridx = torch.randperm(slots, generator=gen)[:batch].to(torch.int32).to(dev)

    def run(kernel: str, rows: int | None) -> list[torch.Tensor]:
        tuning.set_tuning(commit_kernel=kernel)
        tuning.set_tuning(cuda_commit_rows=rows)
        out = [p.clone() for p in pages]
        states = [p[:, : H * V * K].view(slots, H, V, K) for p in out]
        tables = ops.commit_tables(states, corrs, kgs)
        assert backends.commit_kernel(tables, plan, -5.0, ridx) == kernel
        ops.commit(states, corrs, kgs, A_log, dt_bias, plan, lower_bound=-5.0,
                   record_indices=ridx, backend="triton", tables=tables)
        return out

    want = run("triton", None)
    assert not all(torch.equal(w, p) for w, p in zip(want, pages, strict=True))
    for rows in cuda_commit.ROWS_PER_BLOCK:
        got = run("cuda", rows)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"{rows} rows per block"


def test_commit_kernel_choice_and_its_checks(env: Env):
    """The Triton commit is the kernels' own choice for short windows and few programs,
    the CUDA one (on CUDA only) for long windows over many; it is taken when asked for
    where it applies (never off CUDA, nor with a softplus gate or int64 indices), and a
    forced choice that cannot run is refused by name."""
    from vllm_recoverssm.ops import cuda_commit

    b, lens, pool, idx, corr, kg, accept = _run_step(env, 3, env.batches[0], -5.0,
                                                      torch.float32, seed=5)
    plan = ops.CommitPlan(idx, torch.tensor(accept, dtype=torch.int32, device=env.device))
    tables = ops.commit_tables(pool, corr, kg)
    tuning.set_tuning(commit_kernel=None)
    assert backends.commit_kernel(tables, plan, None, None) == "triton"
    assert backends.commit_kernel(tables, plan, -5.0, None) == "triton"
    tuning.set_tuning(commit_kernel="cuda")
    wide = ops.CommitPlan(idx.long(), plan.commit_lens)  # int64 indices: Triton only
    for bad_plan, bound in ((plan, None), (wide, -5.0)):
        with pytest.raises(ValueError, match="the CUDA commit does not apply"):
            backends.commit_kernel(tables, bad_plan, bound, None)
    if env.device == "cuda":
        assert backends.commit_kernel(tables, plan, -5.0, None) == "cuda"
    else:
        with pytest.raises(ValueError, match="the CUDA commit does not apply"):
            backends.commit_kernel(tables, plan, -5.0, None)
    with pytest.raises(ValueError, match="'commit_kernel': expected one of"):
        tuning.set_tuning(commit_kernel="cutlass")
    with pytest.raises(ValueError, match="'commit_kernels': not a kernel tuning knob"):
        tuning.set_tuning(commit_kernels="cuda")
    assert tuning.current().commit_kernel == "cuda"  # a refused change changes nothing
    for rows in (1, 8, 128, 256, 4096):
        assert cuda_commit.rows_per_block(rows, 34 * 32) in cuda_commit.ROWS_PER_BLOCK

    tuning.set_tuning(commit_kernel=None)
    many = -(-cuda_commit.MIN_PROGRAMS // env.H)  # requests that reach MIN_PROGRAMS
    for W, N, fast in ((cuda_commit.MIN_COLUMNS, many, True),
                       (cuda_commit.MIN_COLUMNS, many - 1, False),
                       (cuda_commit.MIN_COLUMNS - 1, many, False)):
        assert cuda_commit.preferred(W, N * env.H) is fast
        states = torch.zeros(N, env.H, env.V, env.K, device=env.device)
        window = ops.commit_tables(states, torch.zeros(N, env.H, W, env.V, device=env.device),
                                   torch.zeros(N, env.H, W, 2 * env.K, device=env.device))
        rows = torch.arange(N, dtype=torch.int32, device=env.device)
        lens = torch.full((N,), W, dtype=torch.int32, device=env.device)
        want = "cuda" if fast and env.device == "cuda" else "triton"
        assert backends.commit_kernel(window, ops.CommitPlan(rows, lens), -5.0, None) == want
        assert backends.commit_kernel(window, ops.CommitPlan(rows, lens), None, None) \
            == "triton"


def test_prebuilt_tables_are_used_and_checked(env: Env):
    b, lens, pool, idx, corr, kg, accept = _run_step(env, 3, env.batches[0], -5.0,
                                                      torch.float32, seed=4)
    qsl = b.query_start_loc.to(env.device)
    ops.verify_recovery(*b.tokens(), pool, idx, qsl, corr, kg, lower_bound=-5.0,
                        backend="triton")
    plan = ops.CommitPlan(idx, torch.tensor(accept, dtype=torch.int32, device=env.device))
    a, c = pool.clone(), pool.clone()
    ops.commit(a, corr, kg, b.A_log, b.dt_bias, plan, lower_bound=-5.0, backend="triton")
    tables = ops.commit_tables(c, corr, kg)
    ops.commit(c, corr, kg, b.A_log, b.dt_bias, plan, lower_bound=-5.0, backend="triton",
               tables=tables)
    assert torch.equal(a, c)
    with pytest.raises(ValueError, match="'tables': built for other pools"):
        ops.commit(a, corr, kg, b.A_log, b.dt_bias, plan, lower_bound=-5.0, backend="triton",
                   tables=tables)


def _two_windows(env: Env, S: int, act: torch.dtype, seed: int):
    """A first window verified into scratch rows 0..N-1, accepted counts, a second window."""
    batch = env.batches[-1]
    gen = torch.Generator().manual_seed(seed)
    b1, lens1, pool, idx, _, _, accept = _run_step(env, S, batch, -5.0, act, seed=seed)
    W, dev = S + 1, env.device
    corr = torch.zeros(2 * batch, env.H, W, env.V, device=dev)
    kg = torch.zeros(2 * batch, env.H, W, 2 * env.K, dtype=act, device=dev)
    first = torch.arange(batch, dtype=torch.int32, device=dev)
    ops.verify_recovery(*b1.tokens(), pool, idx, b1.query_start_loc.to(dev), corr, kg,
                        lower_bound=-5.0, record_indices=first, backend="triton")
    lens2 = _lens(batch, S, gen)
    b2 = make_batch(lens2, env.H, env.K, env.V, device=dev, act_dtype=act, seed=seed + 1)
    b2.A_log, b2.dt_bias = b1.A_log, b1.dt_bias  # the same layer
    acc = torch.tensor(accept, dtype=torch.int32, device=dev)
    return b2, pool, idx, corr, kg, first, acc


@pytest.mark.parametrize("S", [3, 7])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_verify_is_commit_then_verify(env: Env, S: int, act: torch.dtype):
    """verify_fused commits the previous records (the state bit for bit as commit) and then
    verifies from that state (outputs and records bit for bit as verify_recovery), and the
    result stays on the float64 oracle."""
    if env.kernel == "serial" and env.device == "cpu" and S == 7:
        pytest.skip("interpreted serial kernel: S = 3 covers it (CI time)")
    b2, pool, idx, corr, kg, first, acc = _two_windows(env, S, act, seed=30 + S)
    dev, batch = env.device, first.shape[0]
    second = first + batch
    qsl = b2.query_start_loc.to(dev)
    ref_pool, ref_corr, ref_kg = pool.double(), corr.double(), kg.double()

    fused = pool.clone()
    f_corr, f_kg = corr.clone(), kg.clone()
    out_f = ops.verify_fused(*b2.tokens(), fused, idx, qsl, f_corr, f_kg, acc, lower_bound=-5.0,
                             record_indices=second, prev_record_indices=first, backend="triton")
    sep = pool.clone()
    s_corr, s_kg = corr.clone(), kg.clone()
    ops.commit(sep, s_corr, s_kg, b2.A_log, b2.dt_bias, ops.CommitPlan(idx, acc),
               lower_bound=-5.0, record_indices=first, backend="triton")
    out_s = ops.verify_recovery(*b2.tokens(), sep, idx, qsl, s_corr, s_kg, lower_bound=-5.0,
                                record_indices=second, backend="triton")
    assert torch.equal(fused, sep)
    assert torch.equal(out_f, out_s)
    assert torch.equal(f_corr, s_corr) and torch.equal(f_kg, s_kg)

    out_r = ops.verify_fused(*_f64(b2), ref_pool, idx, qsl, ref_corr, ref_kg, acc,
                             lower_bound=-5.0, record_indices=second, prev_record_indices=first,
                             backend="reference")
    assert (fused.double() - ref_pool).abs().max() <= STATE_TOL
    if act == torch.float32:
        assert _fp32_out_ok(out_f, out_r)
    else:
        assert _bf16_ok(out_f, out_r)


@pytest.mark.parametrize("S", [3, 7])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_fused_row_layouts_give_the_same_bits(env: Env, S: int, act: torch.dtype):
    """The CUDA fused verify at 16 and 32 rows per warp: the same committed state, outputs
    and records bit for bit (its layout is chosen by batch and window width, and the 16-row
    half-width blocks run four to an SM under their own register bound)."""
    if env.device != "cuda" or env.kernel is not None:
        pytest.skip("the CUDA window kernel runs in the 'gpu' environment")
    b2, pool, idx, corr, kg, first, acc = _two_windows(env, S, act, seed=70 + S)
    second = first + first.shape[0]
    qsl = b2.query_start_loc.to(env.device)
    got = []
    for rows in (16, 32):
        tuning.set_tuning(cuda_rows=rows)
        st, c, k = pool.clone(), corr.clone(), kg.clone()
        out = ops.verify_fused(*b2.tokens(), st, idx, qsl, c, k, acc, lower_bound=-5.0,
                               record_indices=second, prev_record_indices=first,
                               backend="triton")
        got.append((out, st, c, k))
    assert backends.verify_kernel(-5.0, S + 1, pool, b2.tokens()[0]) == "cuda"
    for x, y in zip(*got, strict=True):
        assert torch.equal(x, y)


def test_fused_verify_with_a_wrong_pending_count_fails_the_check(env: Env):
    """Negative control: one pending token too many is caught by the same float64 check."""
    b2, pool, idx, corr, kg, first, acc = _two_windows(env, 3, torch.float32, seed=41)
    dev, batch = env.device, first.shape[0]
    qsl = b2.query_start_loc.to(dev)
    ref_pool, ref_corr, ref_kg = pool.double(), corr.double(), kg.double()
    wrong = torch.clamp(acc + 1, max=4)
    ops.verify_fused(*b2.tokens(), pool, idx, qsl, corr, kg, wrong, lower_bound=-5.0,
                     record_indices=first + batch, prev_record_indices=first, backend="triton")
    ops.verify_fused(*_f64(b2), ref_pool, idx, qsl, ref_corr, ref_kg, acc, lower_bound=-5.0,
                     record_indices=first + batch, prev_record_indices=first,
                     backend="reference")
    assert (pool.double() - ref_pool).abs().max() > 100 * STATE_TOL


def test_fused_drift_over_16_windows_with_weak_decay(env: Env):
    """16 steps of the fused path (each verify commits the previous window's accepted
    records; a standalone commit after the last) stay on the float64 oracle."""
    if env.kernel == "serial" and env.device == "cpu":
        pytest.skip("interpreted serial kernel: the one-window fused test covers it (CI time)")
    S, batch, W = 7, env.batches[0], 8
    dev = env.device
    pool = make_state(2 * batch + 3, env.H, env.V, env.K, device=dev, seed=6)
    ref_pool = pool.double()
    gen = torch.Generator().manual_seed(10)
    idx = _scattered_slots(batch, pool.shape[0], gen).to(dev)
    corr = torch.zeros(2 * batch, env.H, W, env.V, device=dev)
    kg = torch.zeros(2 * batch, env.H, W, 2 * env.K, device=dev)
    rc, rk = corr.double(), kg.double()
    rows = torch.arange(batch, dtype=torch.int32, device=dev)
    prev = torch.zeros(batch, dtype=torch.int32, device=dev)
    for window in range(16):
        lens = _lens(batch, S, gen)
        b = make_batch(lens, env.H, env.K, env.V, device=dev, seed=2000 + window,
                       gate_shift=-8.0)
        qsl = b.query_start_loc.to(dev)
        new, old = rows + (window % 2) * batch, rows + ((window + 1) % 2) * batch
        ops.verify_fused(*b.tokens(), pool, idx, qsl, corr, kg, prev, lower_bound=-5.0,
                         record_indices=new, prev_record_indices=old, backend="triton")
        ops.verify_fused(*_f64(b), ref_pool, idx, qsl, rc, rk, prev, lower_bound=-5.0,
                         record_indices=new, prev_record_indices=old, backend="reference")
        prev = torch.tensor([int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens],
                            dtype=torch.int32, device=dev)
        A_log, dt_bias = b.A_log, b.dt_bias
    last = rows + (15 % 2) * batch
    ops.commit(pool, corr, kg, A_log, dt_bias, ops.CommitPlan(idx, prev), lower_bound=-5.0,
               record_indices=last, backend="triton")
    ops.commit(ref_pool, rc, rk, A_log.double(), dt_bias.double(), ops.CommitPlan(idx, prev),
               lower_bound=-5.0, record_indices=last, backend="reference")
    assert (pool.double() - ref_pool).abs().max() <= STATE_TOL


def test_cuda_rows_per_warp_follows_the_measured_layouts():
    """Half-width windows (S <= 3) take 16-row warps in the recovery verify at every batch
    and in the fused verify up to batch 4 and from 16 to 63 (at 32 heads); longer windows
    and the full-state verify go to 32 rows as the batch grows."""
    from vllm_recoverssm.ops import triton_kda
    from vllm_recoverssm.ops import triton_window as win

    for batch in (1, 8, 32, 256):
        assert triton_kda.cuda_rows_per_warp(batch, 32, win.RECOVERY, 4) == 16
    for batch in (1, 4, 16, 32, 63):
        assert triton_kda.cuda_rows_per_warp(batch, 32, win.FUSED, 4) == 16
    for batch in (5, 8, 15, 64, 128, 256):
        assert triton_kda.cuda_rows_per_warp(batch, 32, win.FUSED, 4) == 32
    assert triton_kda.cuda_rows_per_warp(4, 32, win.FUSED, 8) == 16
    assert triton_kda.cuda_rows_per_warp(256, 32, win.FUSED, 8) == 32
    assert triton_kda.cuda_rows_per_warp(256, 32, win.FULL, 4) == 32
    assert triton_kda.cuda_rows_per_warp(256, 32, win.RECOVERY, 8) == 32
