"""``recoverssm kernel-check``: verify, commit and conv against the float64 oracle.

Runs one speculative step per configuration on the fastest backend available (Triton on a
CUDA GPU, the Triton interpreter when ``TRITON_INTERPRET=1``, else the float32 PyTorch
reference) and prints, per operation, the largest deviation from the float64 reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

from vllm_recoverssm import ops

from .args import Int, PowerOfTwo, flag_error

STATE_TOL = 1e-6
CONV_TOL = 1e-5
MAX_BATCH = 1024
MAX_HEADS = 128
MAX_HEAD_DIM = 256
MAX_STEP_BYTES = 4 * 2**30
# A check holds 2*batch states of H*D*D elements: on the device (4 B), the host copy (4 B)
# and the float64 oracle (8 B), i.e. 32 B per element of one state per request.
STEP_BYTES_PER_STATE_ELEMENT = 32


@dataclass
class CheckResult:
    """One verified quantity."""

    op: str
    detail: str
    max_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        """Whether the error is within tolerance."""
        return self.max_error <= self.tolerance


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``kernel-check`` sub-command."""
    p = sub.add_parser(
        "kernel-check",
        help="check verify/commit/conv against the float64 reference",
        description=__doc__,
    )
    p.add_argument("--num-spec", type=Int(1, 7), default=3, help="draft tokens S (1..7)")
    p.add_argument("--batch", type=Int(1, MAX_BATCH), default=4,
                   help=f"requests in the step (1..{MAX_BATCH})")
    p.add_argument("--heads", type=Int(1, MAX_HEADS), default=None,
                   help=f"heads (default: 32 GPU, 2 CPU; at most {MAX_HEADS})")
    p.add_argument("--head-dim", type=PowerOfTwo(16, MAX_HEAD_DIM), default=None,
                   help=f"K = V, a power of two in 16..{MAX_HEAD_DIM} (default: 128 GPU, 16 CPU)")
    p.add_argument("--seed", type=Int(0, 2**63 - 1), default=0, help="random seed (default 0)")
    p.set_defaults(func=run)


def shape_from_args(args: argparse.Namespace, on_gpu: bool) -> tuple[int, int]:
    """``(heads, head_dim)`` after defaults, refusing a step too large to check here."""
    H = args.heads if args.heads is not None else (32 if on_gpu else 2)
    D = args.head_dim if args.head_dim is not None else (128 if on_gpu else 16)
    need = STEP_BYTES_PER_STATE_ELEMENT * args.batch * H * D * D
    if need > MAX_STEP_BYTES:
        raise flag_error(
            ("--batch", "--heads", "--head-dim"),
            f"batch {args.batch} x {H} heads x head dim {D} needs about {need / 2**30:.1f} GiB "
            f"of states, at most {MAX_STEP_BYTES / 2**30:.0f} GiB; make one of them smaller",
        )
    return H, D


def validate(args: argparse.Namespace) -> object:
    """Check the flags and the size they add up to (no tensor is made)."""
    return shape_from_args(args, torch.cuda.is_available())


def _backend_and_device() -> tuple[str, str]:
    if torch.cuda.is_available():
        return "triton", "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "triton", "cpu"
    return "reference", "cpu"


def check_step(num_spec: int, batch: int, H: int, D: int, seed: int, backend: str,
               device: str) -> list[CheckResult]:
    """Run one verify + commit + conv step and compare it with float64."""
    if not 1 <= num_spec <= 7:
        raise ValueError(f"argument '--num-spec': expected 1..7, got {num_spec}")
    if batch < 1:
        raise ValueError(f"argument '--batch': expected >= 1, got {batch}")
    if H < 1 or D < 1:
        raise ValueError(f"argument '--heads'/'--head-dim': expected >= 1, got {H} and {D}")
    gen = torch.Generator().manual_seed(seed)
    W = num_spec + 1
    lens = torch.randint(1, W + 1, (batch,), generator=gen)
    T = int(lens.sum())
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q, k, v, g = rnd(T, H, D), rnd(T, H, D), rnd(T, H, D), rnd(T, H, D)
    beta, A_log, dt_bias = rnd(T, H), rnd(H) * 0.5, rnd(H, D) * 0.5
    state = rnd(2 * batch, H, D, D) * 0.1
    slots = torch.randperm(2 * batch, generator=gen)[:batch].to(torch.int32)
    accept = torch.tensor([int(torch.randint(0, int(n) + 1, (1,), generator=gen)) for n in lens],
                          dtype=torch.int32)
    dev = torch.device(device)
    results: list[CheckResult] = []

    def to_dev(*ts: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        # copies even on the CPU: the kernels write in place, the reference needs the inputs
        return [t.to(dev, dtype=dtype, copy=True) for t in ts]

    qd, kd, vd, gd, bd = to_dev(q, k, v, g, beta, dtype=torch.bfloat16)
    Ad, dtd, sd = to_dev(A_log, dt_bias, state)
    sid, qsld, accd = to_dev(slots, qsl, accept)
    corr = torch.zeros(batch, H, W, D, device=dev)
    kg = torch.zeros(batch, H, W, 2 * D, device=dev, dtype=torch.bfloat16)
    out = ops.verify_recovery(qd, kd, vd, gd, bd, Ad, dtd, sd, sid, qsld, corr, kg,
                              lower_bound=-5.0, backend=backend)
    ops.commit(sd, corr, kg, Ad, dtd, ops.CommitPlan(sid, accd), lower_bound=-5.0,
               backend=backend)

    f64 = torch.float64
    s64 = state.to(f64)
    c64 = torch.zeros(batch, H, W, D, dtype=f64)
    k64 = torch.zeros(batch, H, W, 2 * D, dtype=f64)
    q64, k_64, v64, g64, b64 = (t.to(torch.bfloat16).to(f64) for t in (q, k, v, g, beta))
    o64 = ops.verify_recovery(q64, k_64, v64, g64, b64, A_log.to(f64), dt_bias.to(f64), s64,
                              slots, qsl, c64, k64, lower_bound=-5.0, backend="reference")
    ops.commit(s64, c64, k64, A_log.to(f64), dt_bias.to(f64), ops.CommitPlan(slots, accept),
               lower_bound=-5.0, backend="reference")
    out_err = float((out.cpu().to(f64) - o64).abs().max())
    out_tol = float(o64.abs().max()) * 2.0**-7 + 1e-6  # one bf16 ulp
    results.append(CheckResult("verify", "bf16 outputs vs float64", out_err, out_tol))
    results.append(CheckResult("commit", "committed FP32 state vs float64",
                               float((sd.cpu().to(f64) - s64).abs().max()), STATE_TOL))

    C, Kc = 3 * H * D, 4
    x = rnd(T, C)
    w = rnd(C, Kc)
    conv = rnd(2 * batch, C, Kc - 1 + num_spec)
    cd = conv.to(dev, copy=True)
    y = ops.conv_update(x.to(dev), cd, w.to(dev), None, sid, qsld, backend=backend)
    ops.conv_compact(cd, ops.CommitPlan(sid, torch.clamp(accd, min=1)), kernel_width=Kc,
                     backend=backend)
    c64v = conv.to(f64)
    y64 = ops.conv_update(x.to(f64), c64v, w.to(f64), None, slots, qsl, backend="reference")
    ops.conv_compact(c64v, ops.CommitPlan(slots, torch.clamp(accept, min=1)), kernel_width=Kc,
                     backend="reference")
    results.append(CheckResult("conv_update", "fp32 outputs vs float64",
                               float((y.cpu().to(f64) - y64).abs().max()), CONV_TOL))
    results.append(CheckResult("conv_compact", "window after compaction vs float64",
                               float((cd.cpu().to(f64) - c64v).abs().max()), CONV_TOL))
    return results


def run(args: argparse.Namespace) -> int:
    """Run the check and print one line per verified quantity; exit 1 on any failure."""
    backend, device = _backend_and_device()
    on_gpu = device == "cuda"
    H, D = shape_from_args(args, on_gpu)
    where = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"kernel-check: backend={backend} device={where} S={args.num_spec} "
          f"batch={args.batch} heads={H} head_dim={D}")
    results = check_step(args.num_spec, args.batch, H, D, args.seed, backend, device)
    width = max(len(r.op) for r in results)
    for r in results:
        status = "ok" if r.ok else "FAIL"
        print(f"  {r.op:<{width}}  {r.detail:<36} max err {r.max_error:.2e}  "
              f"(tol {r.tolerance:.1e})  {status}")
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"kernel-check: {len(failed)} check(s) failed", file=sys.stderr)
        return 1
    print("kernel-check: all checks passed")
    return 0
