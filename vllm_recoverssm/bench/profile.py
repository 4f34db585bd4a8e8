"""``python -m vllm_recoverssm.bench.profile``: one call of chosen ops inside a profiler range.

The bench's workload (GLM-5.3 TP2 shapes, one layer, bf16 activations, FP32 state) for one
(S, batch), warmed up, then one call of each op between ``cudaProfilerStart`` and
``cudaProfilerStop``, so that a profiler started with ``--profile-from-start off`` sees
those calls alone. With Nsight Compute::

    ncu --profile-from-start off -k regex:window_kernel --section SourceCounters \\
        --section WarpStateStats -o REPORT \\
        python -m vllm_recoverssm.bench.profile --kernel cuda --rows 32 --num-spec 7 \\
        --batch 256
    ncu -i REPORT --page source --csv --print-source sass > page.csv
    python -m vllm_recoverssm.bench.ncu_phases page.csv

``--kernel`` and ``--rows`` pin the verify kernel and the CUDA kernel's rows per warp, as
``bench.tune``'s variants do; by default the library chooses, as in serving.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .runner import OPS as BENCH_OPS
from .tune import build_op, make_step, overrides

OPS = tuple(op for op in BENCH_OPS if op != "fla_full")
"""The ops a call can profile: the bench's own columns (fla-core's is the peer's kernel)."""
KERNELS = ("auto", "cuda", "window", "serial")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vllm_recoverssm.bench.profile",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-spec", type=int, default=7, help="draft tokens S, 1..7 (default 7)")
    p.add_argument("--batch", type=int, default=256, help="requests (default 256)")
    p.add_argument("--heads", type=int, default=32, help="KDA heads (default 32)")
    p.add_argument("--ops", default="verify", help=f"comma-separated, of: {', '.join(OPS)}")
    p.add_argument("--kernel", choices=KERNELS, default="auto", help="the verify kernel")
    p.add_argument("--rows", type=int, choices=(16, 32), default=None,
                   help="the CUDA verify's rows per warp (default: its own choice)")
    p.add_argument("--warmup", type=int, default=3, help="calls of each op before (default 3)")
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> tuple[str, ...]:
    """The ops asked for; ``ValueError`` names the first argument out of range."""
    if not 1 <= args.num_spec <= 7:
        raise ValueError(f"--num-spec expected 1..7, got {args.num_spec}")
    if args.batch < 1 or args.heads < 1 or args.warmup < 0:
        raise ValueError("--batch and --heads must be positive and --warmup not negative, got "
                         f"{args.batch}, {args.heads}, {args.warmup}")
    ops = tuple(x.strip() for x in args.ops.split(",") if x.strip())
    unknown = [x for x in ops if x not in OPS]
    if not ops or unknown:
        raise ValueError(f"--ops expected some of {', '.join(OPS)}, got {args.ops!r}")
    if args.rows is not None and args.kernel != "cuda":
        raise ValueError("--rows pins the CUDA kernel's layout: it needs --kernel cuda")
    return ops


def main(argv: list[str] | None = None) -> int:
    """Run the warm-up, then one profiled call of each op; 2 on bad arguments or no GPU."""
    args = _parse(argv)
    try:
        ops = _check(args)
    except ValueError as exc:
        print(f"profile: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    over: dict[str, object] = {}
    if args.kernel != "auto":
        over["verify_kernel"] = args.kernel
    if args.rows is not None:
        over["cuda_rows"] = args.rows
    dev = torch.device("cuda")
    with overrides(over):
        step = make_step(args.num_spec, args.batch, args.heads, dev)
        calls = {op: build_op(op, step) for op in ops}
        for op in ops:
            for _ in range(args.warmup):
                calls[op]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for op in ops:
            calls[op]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one call each of {', '.join(ops)} (S={args.num_spec}, batch {args.batch}, "
          f"{args.heads} heads, kernel {args.kernel}, rows {args.rows or 'auto'}) on "
          f"{torch.cuda.get_device_name(dev)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
