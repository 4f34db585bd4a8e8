"""``recoverssm kernel-resources``: what nvcc gives each CUDA kernel, without a GPU.

Compiles the CUDA verify and commit (``vllm_recoverssm/ops/csrc/``) for one architecture
with the flags of the library's own build and prints, per kernel instantiation, its
registers, spilled bytes, stack, static shared memory and the blocks of one SM they leave
room for. Needs nvcc (``$NVCC``, ``PATH`` or ``$CUDA_HOME``), not a GPU. Exit codes: 0
printed, 1 no nvcc or a source that does not compile, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ..ops import cuda_resources, cuda_window
from .args import Choice, OutputFile, Validator, flag_error
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
    p.add_argument("--define", type=TuningDefine(), action="append", default=[],
                   metavar="NAME=VALUE",
                   help="build a tuning variant: a launch bound or the recovery row depth "
                        "(repeatable; names: " + ", ".join(cuda_window.TUNING_DEFINES) + ")")
    p.add_argument("--no-progress", action="store_true", help="do not report each compile")
    p.set_defaults(func=run)


class TuningDefine(Validator):
    """One ``NAME=VALUE`` override of :data:`.cuda_window.TUNING_DEFINES`."""

    expected = "NAME=VALUE, a name of the tuning overrides with an integer in its range"

    def parse(self, text: str) -> tuple[str, int]:
        try:
            pairs = cuda_window.parse_defines(text, source="--define")
        except ValueError as exc:
            raise self.fail(text, str(exc).partition(": ")[2]) from None
        if len(pairs) != 1:
            raise self.fail(text, "one override per --define")
        return pairs[0]

    def samples(self) -> list[str]:
        """Each name at its bounds and past them, and malformed pairs."""
        out = []
        for name, (lo, hi) in cuda_window.TUNING_DEFINES.items():
            out += [f"{name}={lo}", f"{name}={hi}", f"{name}={lo - 1}", f"{name}={hi + 1}"]
        return out + ["RECOVERY_DEPTH", "NOPE=1", "RECOVERY_DEPTH=x",
                      "RECOVERY_DEPTH=2,FULL_BLOCKS_16=2"] + super().samples()


def validate(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """The --define pairs, checked together (a name given twice is a ``UsageError``)."""
    text = ",".join(f"{name}={value}" for name, value in args.define)
    try:
        return cuda_window.parse_defines(text, source="--define")
    except ValueError as exc:
        raise flag_error("--define", str(exc).partition(": ")[2]) from None


def run(args: argparse.Namespace) -> int:
    """Compile, print the table (and the JSON file); 1 when nvcc is missing or fails."""
    def progress(msg: str) -> None:
        print(f"kernel-resources: {msg}", file=sys.stderr, flush=True)

    defines = validate(args)
    try:
        found = cuda_resources.compile_report(
            args.arch, defines=defines, progress=None if args.no_progress else progress)
    except (FileNotFoundError, RuntimeError) as exc:
        print(f"recoverssm kernel-resources: {exc}", file=sys.stderr)
        return 1
    rows = []
    for res in found:
        role = res.describe()
        rows.append((role.op, role.mode or "-", role.rows_per_warp, role.token_slots or "-",
                     role.act_dtype, res.registers, res.spill_bytes, res.stack_bytes,
                     res.smem_bytes / 1024, cuda_resources.blocks_per_sm(res, args.arch)))
    variant = ", ".join(f"{n}={v}" for n, v in defines) or "the default build"
    print(f"CUDA kernels compiled for {args.arch} (128 threads per block; {variant})")
    print("\n".join(table(COLUMNS, rows)))
    if args.json is not None:
        doc = {"arch": args.arch, "defines": dict(defines),
               "kernels": [{**asdict(r), "role": asdict(r.describe()),
                            "blocks_per_sm": cuda_resources.blocks_per_sm(r, args.arch)}
                           for r in found]}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
