"""``python -m vllm_recoverssm.bench.ncu_phases``: where a kernel's time goes, by phase.

Reads the per-instruction table Nsight Compute writes for one profiled kernel
(``ncu -i REPORT --page source --csv --print-source sass``, the report taken with
``--section SourceCounters --section WarpStateStats``) and prints three tables:

- the kernel's phases, split after each block barrier (``BAR``) in SASS order, with each
  phase's share of the executed instructions, of the warp stall samples, and its top
  stall reasons;
- the opcodes by executed instructions and by samples;
- the stall reasons over the whole kernel.

A CUDA kernel with block barriers is a chain of such phases; the table says which one
waits, and on what; docs/results.md links its latest output for the window verify.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = "Source"
EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
STALL_PREFIX = "stall_"
NOT_ISSUED = "(Not Issued)"
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclass(frozen=True)
class SassLine:
    """One SASS instruction: its text, how often warps executed it, and its samples."""

    source: str
    executed: float
    samples: float
    stalls: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Phase:
    """The instructions between two block barriers (the barrier ends its phase)."""

    index: int
    instr_share: float
    sample_share: float
    top_stalls: list[tuple[str, float]]
    first: str


def _number(text: str, what: str, row: int) -> float:
    text = text.strip().replace(",", "")
    if text in ("", "-"):
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"row {row}: {what} is not a number: {text!r}") from None


def parse_source_csv(text: str) -> tuple[str, list[SassLine]]:
    """The kernel's name and its instructions from ncu's source-page CSV.

    ``ValueError`` names what is missing: the kernel-name line, a column of the
    SourceCounters / WarpStateStats sections, or a number.
    """
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) < 2 or not rows[0] or rows[0][0] != "Kernel Name" or len(rows[0]) < 2:
        raise ValueError("not an ncu source page: expected a first line 'Kernel Name',<name> "
                         "(ncu -i REPORT --page source --csv --print-source sass)")
    header = rows[1]
    missing = [c for c in (SOURCE, EXECUTED, SAMPLES) if c not in header]
    if missing:
        raise ValueError(f"columns missing from the source page: {', '.join(missing)} "
                         "(profile with --section SourceCounters --section WarpStateStats)")
    stall_cols = [c for c in header if c.startswith(STALL_PREFIX) and NOT_ISSUED not in c]
    col = {name: i for i, name in enumerate(header)}
    lines = []
    for n, row in enumerate(rows[2:], start=3):
        if len(row) < len(header) or not row[col[SOURCE]].strip():
            continue  # a row without an instruction
        lines.append(SassLine(
            source=row[col[SOURCE]].strip(),
            executed=_number(row[col[EXECUTED]], EXECUTED, n),
            samples=_number(row[col[SAMPLES]], SAMPLES, n),
            stalls={c[len(STALL_PREFIX):]: _number(row[col[c]], c, n) for c in stall_cols}))
    if not lines:
        raise ValueError("the source page lists no instructions")
    return rows[0][1], lines


def opcode(source: str) -> str:
    """The mnemonic of one SASS line, without its predicate and modifiers."""
    text = _PREDICATE.sub("", source.strip())
    return text.split(" ", 1)[0].split(".", 1)[0]


def _total(lines: list[SassLine], attr: str) -> float:
    return sum(getattr(x, attr) for x in lines) or 1.0


def _stall_sums(lines: Iterable[SassLine]) -> list[tuple[str, float]]:
    """Each stall reason's samples over ``lines``, largest first (ties: column order)."""
    total: dict[str, float] = defaultdict(float)
    for line in lines:
        for reason, n in line.stalls.items():
            total[reason] += n
    return sorted(total.items(), key=lambda kv: -kv[1])


def phases(lines: list[SassLine], top: int = 4) -> list[Phase]:
    """The phases, each ending at a ``BAR`` instruction (the last one at the kernel's end)."""
    total_i, total_s = _total(lines, "executed"), _total(lines, "samples")
    groups: list[list[SassLine]] = [[]]
    for line in lines:
        groups[-1].append(line)
        if opcode(line.source) == "BAR":
            groups.append([])
    out = []
    for i, group in enumerate(g for g in groups if g):
        samples = sum(x.samples for x in group)
        ranked = [(k, v / samples) for k, v in _stall_sums(group)[:top] if v > 0] if samples else []
        out.append(Phase(i, sum(x.executed for x in group) / total_i, samples / total_s,
                         ranked, group[0].source))
    return out


def opcode_mix(lines: list[SassLine]) -> list[tuple[str, float, float]]:
    """(opcode, share of executed instructions, share of samples), most executed first."""
    total_i, total_s = _total(lines, "executed"), _total(lines, "samples")
    executed: dict[str, float] = defaultdict(float)
    samples: dict[str, float] = defaultdict(float)
    for line in lines:
        executed[opcode(line.source)] += line.executed
        samples[opcode(line.source)] += line.samples
    ranked = sorted(executed.items(), key=lambda kv: -kv[1])
    return [(op, n / total_i, samples[op] / total_s) for op, n in ranked]


def stall_mix(lines: list[SassLine]) -> list[tuple[str, float]]:
    """(stall reason, share of all samples), largest first."""
    all_samples = _total(lines, "samples")
    return [(k, v / all_samples) for k, v in _stall_sums(lines) if v > 0]


def render(name: str, lines: list[SassLine], opcodes: int = 20) -> str:
    """The three tables as text."""
    out = [f"{name}: {sum(x.executed for x in lines):.0f} warp instructions executed, "
           f"{sum(x.samples for x in lines):.0f} stall samples, {len(lines)} SASS lines",
           f"{'phase':>5} {'instr%':>7} {'samples%':>8}  "
           f"{'top stalls (share of the phase)':60} first"]
    for ph in phases(lines):
        top = ", ".join(f"{k} {100 * v:.0f}%" for k, v in ph.top_stalls)
        out.append(f"{ph.index:>5} {100 * ph.instr_share:7.1f} {100 * ph.sample_share:8.1f}  "
                   f"{top:60} {ph.first[:40]}")
    out.append(f"{'opcode':10} {'instr%':>7} {'samples%':>8}")
    for op, share_i, share_s in opcode_mix(lines)[:opcodes]:
        out.append(f"{op:10} {100 * share_i:7.1f} {100 * share_s:8.1f}")
    out.append("stalls: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in stall_mix(lines)[:10]))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the tables of each CSV file named."""
    p = argparse.ArgumentParser(prog="python -m vllm_recoverssm.bench.ncu_phases",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", type=Path, help="ncu --page source --csv output")
    p.add_argument("--opcodes", type=int, default=20, help="opcodes listed (default 20)")
    args = p.parse_args(argv)
    for path in args.csv:
        try:
            name, lines = parse_source_csv(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"ncu_phases: {path}: {exc}", file=sys.stderr)
            return 2
        print(render(name, lines, args.opcodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
