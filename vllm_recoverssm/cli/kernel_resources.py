"""``recoverssm kernel-resources``: what nvcc gives each CUDA kernel, without a GPU.

Compiles the CUDA verify and commit (``csrc/``) for one architecture with the flags of the
library's own build and prints, per kernel instantiation, its registers, spilled bytes,
stack, static shared memory and the blocks of one SM they leave room for. Needs nvcc
(``$NVCC``, ``PATH`` or ``$CUDA_HOME``), not a GPU. Exit codes: 0 printed, 1 no nvcc or a
source that does not compile, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..ops import cuda_resources
from .args import Choice, OutputFile
from .text import table

DEFAULT_ARCH = "sm_90"

COLUMNS = (
    ("op", "<7"), ("mode", "<9"), ("rows/warp", ">9"), ("slots", ">5"), ("dtype", "<9"),
    ("regs", ">4"), ("spill B", ">7"), ("stack B", ">7"), ("smem KiB", ">8.1f"),
    ("blocks/SM", ">9"),
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``kernel-resources`` sub-command."""
    p = sub.add_parser(
        "kernel-resources",
        help="registers, spills and blocks per SM of the CUDA kernels (nvcc, no GPU)",
        description=__doc__,
    )
    p.add_argument("--arch", type=Choice(cuda_resources.ARCHES), default=DEFAULT_ARCH,
                   help=f"GPU architecture (default {DEFAULT_ARCH}; one of "
                        f"{', '.join(cuda_resources.ARCHES)})")
    p.add_argument("--json", type=OutputFile("the JSON report"), default=None, metavar="PATH",
                   help="also write the report as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="do not report each compile")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Compile, print the table (and the JSON file); 1 when nvcc is missing or fails."""
    def progress(msg: str) -> None:
        print(f"kernel-resources: {msg}", file=sys.stderr, flush=True)

    try:
        found = cuda_resources.compile_report(
            args.arch, progress=None if args.no_progress else progress)
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"recoverssm kernel-resources: {exc}", file=sys.stderr)
        return 1
    rows = []
    for res in found:
        role = res.describe()
        rows.append((role.op, role.mode or "-", role.rows_per_warp, role.token_slots or "-",
                     role.act_dtype, res.registers, res.spill_bytes, res.stack_bytes,
                     res.smem_bytes / 1024, cuda_resources.blocks_per_sm(res, args.arch)))
    print(f"CUDA kernels compiled for {args.arch} (128 threads per block)")
    print("\n".join(table(COLUMNS, rows)))
    if args.json is not None:
        doc = {"arch": args.arch,
               "kernels": [{**asdict(r), "role": asdict(r.describe()),
                            "blocks_per_sm": cuda_resources.blocks_per_sm(r, args.arch)}
                           for r in found]}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
