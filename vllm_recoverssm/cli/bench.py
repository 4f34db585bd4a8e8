"""``recoverssm bench``: decode-step timings of recovery vs full-state verify on a GPU.

The options are strings to argparse and are checked by :data:`DEFERRED_CHECKS` after parsing:
``python -m vllm_recoverssm.cli.bench`` parses them with a plain argparse parser and reports a
bad value (a ``ValueError``) as one line itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..bench import grid
from ..bench.timing import FLUSH_MODES
from ..ops import BACKENDS
from .args import (
    Choice,
    Float,
    Int,
    IntList,
    OutputFile,
    PowerOfTwo,
    Validator,
    check_value,
    flag_error,
)

MAX_BATCH = 4096
MAX_LAYERS = 256
MAX_HEADS = 256
SMOKE_MAX_BYTES = 1 << 30
GPU_MAX_BYTES = 64 << 30
STEP_BYTES_PER_ELEMENT = 32
"""Bytes per (request, head, head-dim element, window token) of one step's inputs and
records, rounded up: q, k, v, raw g (activations), corrections (FP32), raw k/g records."""

DEFERRED_CHECKS: dict[str, Validator] = {
    "--num-spec": IntList(grid.MIN_NUM_SPEC, grid.MAX_NUM_SPEC, 7),
    "--batch": IntList(1, MAX_BATCH, 16),
    "--layers": IntList(1, MAX_LAYERS, 8),
    "--reps": Int(1, 100_000),
    "--warmup": Int(0, 10_000),
    "--heads": Int(1, MAX_HEADS),
    "--head-dim": PowerOfTwo(16, 256),
    "--dtype": Choice(grid.DTYPES),
    "--backend": Choice(BACKENDS),
    "--device": Choice(("auto", "cuda", "cpu")),
    "--flush-mib": Float(0.0, 16384.0, lo_open=True),
    "--flush-mode": Choice(FLUSH_MODES),
    "--roof-gib": Float(0.0, 64.0, lo_open=True),
    "--mem-budget-gib": Float(0.0, 65536.0, lo_open=True),
    "--seed": Int(0, 2**63 - 1),
    "--json": OutputFile("the JSON report"),
    "--plot": OutputFile("the PNG plot"),
}
"""Every option that takes a value, and how it is checked."""


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
    p.add_argument("--flush-mode", default="write", metavar="MODE",
                   help="write: the flush leaves dirty lines in L2, whose write-back the "
                        "timed op pays (default); read: it sums the buffer and leaves clean "
                        "lines, as a decode step's weight reads do")
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


def _value(args: argparse.Namespace, flag: str) -> Any:
    return check_value(flag, DEFERRED_CHECKS[flag], getattr(args, flag[2:].replace("-", "_")))


def config_from_args(args: argparse.Namespace) -> grid.BenchConfig:
    """Validate the options into a :class:`grid.BenchConfig` (UsageError on bad input)."""
    d = grid.SMOKE_DEFAULTS if args.smoke else grid.GPU_DEFAULTS

    def pick(flag: str) -> Any:
        value = _value(args, flag)
        return d[flag[2:].replace("-", "_")] if value is None else value

    backend = _value(args, "--backend")
    if backend == "reference" and not args.smoke:
        raise flag_error("--backend", "the reference backend syncs with the host and cannot "
                                      "be captured in a CUDA graph; use it with --smoke")
    try:
        device = grid.resolve_device(_value(args, "--device"), args.smoke)
    except ValueError as exc:
        raise flag_error("--device", str(exc).removeprefix("argument --device: ")) from None
    cfg = grid.BenchConfig(
        smoke=args.smoke,
        device=device,
        num_spec=tuple(pick("--num-spec")),
        batch=tuple(pick("--batch")),
        layers=tuple(pick("--layers")),
        heads=int(pick("--heads")),
        head_dim=int(pick("--head-dim")),
        dtype=_value(args, "--dtype"),
        reps=int(pick("--reps")),
        warmup=int(pick("--warmup")),
        flush_mib=float(pick("--flush-mib")),
        flush_mode=_value(args, "--flush-mode"),
        roof_gib=float(pick("--roof-gib")),
        backend=backend,
        peer=not args.no_peer,
        fidelity=not args.no_fidelity,
        mem_budget_gib=_value(args, "--mem-budget-gib"),
        seed=int(_value(args, "--seed")),
    )
    _check_sizes(cfg)
    return cfg


def _check_sizes(cfg: grid.BenchConfig) -> None:
    """Refuse runs whose buffers outgrow the machine before anything is allocated."""
    limit = SMOKE_MAX_BYTES if cfg.smoke else GPU_MAX_BYTES
    where = "--smoke (CPU) allows" if cfg.smoke else "one GPU run allows"
    if cfg.flush_mib * grid.MIB > limit:
        raise flag_error("--flush-mib", f"{cfg.flush_mib:g} MiB is more than {where} "
                                        f"({limit / grid.GIB:g} GiB)")
    if 2 * cfg.roof_gib * grid.GIB > limit:
        raise flag_error("--roof-gib", f"two copies of {cfg.roof_gib:g} GiB are more than "
                                       f"{where} ({limit / grid.GIB:g} GiB)")
    elements = max(cfg.batch) * cfg.heads * cfg.head_dim * (max(cfg.num_spec) + 1)
    need = elements * STEP_BYTES_PER_ELEMENT
    if need > limit:
        raise flag_error(
            ("--batch", "--heads", "--head-dim", "--num-spec"),
            f"one step's inputs and records need about {need / grid.GIB:.1f} GiB, more than "
            f"{where} ({limit / grid.GIB:g} GiB)",
        )


def validate(args: argparse.Namespace) -> tuple[grid.BenchConfig, Path | None, Path | None]:
    """Check every option without measuring anything: the config and the output paths."""
    cfg = config_from_args(args)
    json_path = _value(args, "--json")
    plot_path = _value(args, "--plot")
    if plot_path is not None:
        from ..bench import plot

        if not plot.matplotlib_available():
            raise flag_error("--plot", "needs matplotlib (pip install 'vllm-recoverssm[bench]')")
    return cfg, json_path, plot_path


def run(args: argparse.Namespace) -> int:
    """Check the options, measure the grid, print the tables, write JSON and PNG."""
    from ..bench import plot, report, runner

    cfg, json_path, plot_path = validate(args)
    result = runner.run(cfg, progress_enabled=not args.no_progress)
    sys.stdout.write(report.format_text(result))
    if json_path is not None:
        report.write_json(result, json_path)
    if plot_path is not None:
        plot.write_plot(result, plot_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_recoverssm.cli.bench``: the sub-command without the others (a GPU
    machine may have only torch and triton); bad input is one line and exit code 2."""
    parser = argparse.ArgumentParser(prog="recoverssm")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"recoverssm bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
