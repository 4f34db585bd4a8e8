"""``recoverssm bench``: decode-step timings of recovery vs full-state verify on a GPU."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..bench import grid


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``bench`` sub-command."""
    p = sub.add_parser(
        "bench",
        help="time recovery and full-state speculative verify / commit against a copy roof",
        description=(
            "Decode-step timings at GLM-5.3 TP2 shapes (32 heads per rank, K = V = 128): "
            "full-state verify (ours and fla-core's, when installed), recovery verify, "
            "commit and verify + commit, with unique bytes, achieved GB/s against a "
            "device-to-device copy, and state bytes per request. Needs a CUDA GPU; "
            "--smoke runs the same code paths on a CPU at tiny shapes."
        ),
    )
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, eager timing, few reps (CPU; for tests)")
    p.add_argument("--num-spec", metavar="LIST", help="S values, e.g. 3,7 (1..7)")
    p.add_argument("--batch", metavar="LIST", help="batch sizes, e.g. 1,8,32,128,256")
    p.add_argument("--layers", metavar="LIST", help="stack depths, e.g. 1,34")
    p.add_argument("--reps", metavar="N", help="timed repetitions per op (default 100)")
    p.add_argument("--warmup", metavar="N", help="untimed replays before timing (default 10)")
    p.add_argument("--heads", metavar="N", help="KDA heads per rank (default 32)")
    p.add_argument("--head-dim", metavar="N", help="K = V head dim, a power of two (default 128)")
    p.add_argument("--dtype", default="bfloat16", metavar="NAME",
                   help="activation dtype: bfloat16, float16 or float32 (default bfloat16)")
    p.add_argument("--backend", default="auto", metavar="NAME",
                   help="ops backend: auto, triton or reference (default auto)")
    p.add_argument("--device", default="auto", metavar="NAME", help="auto, cuda or cpu")
    p.add_argument("--flush-mib", metavar="MIB", help="L2 flush buffer size (default 256)")
    p.add_argument("--roof-gib", metavar="GIB", help="roof copy size (default 2)")
    p.add_argument("--mem-budget-gib", metavar="GIB",
                   help="memory for one mode's state pools (default 80%% of free memory)")
    p.add_argument("--no-peer", action="store_true", help="skip fla-core's column")
    p.add_argument("--no-fidelity", action="store_true",
                   help="skip the committed-state fidelity runs against float64")
    p.add_argument("--seed", default="0", metavar="N", help="random seed (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    p.set_defaults(func=run)


def _output_path(name: str, text: str | None) -> Path | None:
    if text is None:
        return None
    path = Path(text)
    if not path.parent.is_dir():
        raise ValueError(f"argument --{name}: directory {str(path.parent)!r} does not exist")
    return path


def config_from_args(args: argparse.Namespace) -> grid.BenchConfig:
    """Validate the options into a :class:`grid.BenchConfig` (ValueError on bad input)."""
    d = grid.SMOKE_DEFAULTS if args.smoke else grid.GPU_DEFAULTS

    def ints(name: str, text: str | None, lo: int, hi: int | None = None) -> tuple[int, ...]:
        if text is None:
            return tuple(d[name.replace("-", "_")])  # type: ignore[arg-type]
        return grid.parse_int_list(name, text, lo, hi)

    def num(name: str, integer: bool, zero: bool = False) -> float:
        key = name.replace("-", "_")
        return grid.parse_positive(name, getattr(args, key), d[key], integer,  # type: ignore[arg-type]
                                   allow_zero=zero)

    if args.dtype not in grid.DTYPES:
        raise ValueError(f"argument --dtype: expected one of {', '.join(grid.DTYPES)}, "
                         f"got {args.dtype!r}")
    from ..ops import BACKENDS

    if args.backend not in BACKENDS:
        raise ValueError(f"argument --backend: expected one of {', '.join(BACKENDS)}, "
                         f"got {args.backend!r}")
    if args.backend == "reference" and not args.smoke:
        raise ValueError("argument --backend: the reference backend syncs with the host and "
                         "cannot be captured in a CUDA graph; use it with --smoke")
    head_dim = int(num("head-dim", True))
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"argument --head-dim: expected a power of two >= 16, got {head_dim}")
    budget = None
    if args.mem_budget_gib is not None:
        budget = grid.parse_positive("mem-budget-gib", args.mem_budget_gib, 0.0, False)
    seed = int(grid.parse_positive("seed", args.seed, 0, True, allow_zero=True))
    return grid.BenchConfig(
        smoke=args.smoke,
        device=grid.resolve_device(args.device, args.smoke),
        num_spec=ints("num-spec", args.num_spec, grid.MIN_NUM_SPEC, grid.MAX_NUM_SPEC),
        batch=ints("batch", args.batch, 1),
        layers=ints("layers", args.layers, 1),
        heads=int(num("heads", True)),
        head_dim=head_dim,
        dtype=args.dtype,
        reps=int(num("reps", True)),
        warmup=int(num("warmup", True, zero=True)),
        flush_mib=num("flush-mib", False),
        roof_gib=num("roof-gib", False),
        backend=args.backend,
        peer=not args.no_peer,
        fidelity=not args.no_fidelity,
        mem_budget_gib=budget,
        seed=seed,
    )


def run(args: argparse.Namespace) -> int:
    """Check the options, measure the grid, print the tables, write JSON and PNG."""
    from ..bench import plot, report, runner

    cfg = config_from_args(args)
    json_path = _output_path("json", args.json)
    plot_path = _output_path("plot", args.plot)
    if plot_path is not None and not plot.matplotlib_available():
        raise ValueError("argument --plot: needs matplotlib (pip install 'vllm-recoverssm[bench]')")
    result = runner.run(cfg, progress_enabled=not args.no_progress)
    sys.stdout.write(report.format_text(result))
    if json_path is not None:
        report.write_json(result, json_path)
    if plot_path is not None:
        plot.write_plot(result, plot_path)
    return 0
