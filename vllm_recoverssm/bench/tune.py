"""``python -m vllm_recoverssm.bench.tune``: time each kernel variant on one GPU.

Every verify kernel (the CUDA window kernel at 16 and 32 rows per warp, the Triton window
kernel at a few tiles, the serial Triton kernel), the Triton commit at a few tiles and
loops, the CUDA commit at each block size and the fused verify, at GLM-5.3 TP2 shapes and
one layer, with the bench's method (CUDA-graph replays after an L2 flush, medians). Each
variant is a set of :class:`vllm_recoverssm.ops.tuning.KernelTuning` knobs; the kernel
choices of :mod:`vllm_recoverssm.ops.backends` and the tile heuristics of
:mod:`vllm_recoverssm.ops.triton_kda` are read off this table. It prints one line per
(variant, S, batch) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from ..ops import cuda_commit, cuda_window, tuning
from . import accounting as acc
from . import workload as wl
from .grid import GIB, MIB
from .timing import GraphTimer, measure_roof

WINDOW_TILES = ((32, 1, 4, 1), (64, 2, 4, 2))
COMMIT_TILES = ((16, 1, 2), (16, 1, 1), (32, 2, 2), (32, 1, 2))


def _variants() -> list[tuple[str, str, dict[str, object]]]:
    """(op, label, tuning knobs) for every variant timed."""
    out: list[tuple[str, str, dict[str, object]]] = []
    for rows in (16, 32):
        over: dict[str, object] = {"verify_kernel": "cuda", "cuda_rows": rows}
        out += [("verify", f"cuda/{rows}", over), ("fused_all", f"cuda/{rows}", over),
                ("fused_2", f"cuda/{rows}", over), ("ours_full", f"cuda/{rows}", over)]
    for tile in WINDOW_TILES:
        over = {"verify_kernel": "window", "window_tile": tile}
        out += [("verify", "triton-window/" + "x".join(map(str, tile)), over)]
    out += [("verify", "triton-serial", {"verify_kernel": "serial"})]
    for ctile in COMMIT_TILES:
        for loop in tuning.COMMIT_LOOPS:
            over = {"commit_kernel": "triton", "commit_tile": ctile, "commit_loop": loop}
            label = f"commit-{loop}/" + "x".join(map(str, ctile))
            out += [("commit_all", label, over), ("commit_2", label, over)]
    for rows in cuda_commit.ROWS_PER_BLOCK:
        over = {"commit_kernel": "cuda", "cuda_commit_rows": rows}
        out += [("commit_all", f"commit-cuda/{rows}", over),
                ("commit_2", f"commit-cuda/{rows}", over)]
    return out


def _bytes(op: str, shape: acc.OpShape, batch: int) -> int:
    if op == "verify":
        return acc.recovery_verify_bytes(shape, batch)
    if op == "ours_full":
        return acc.full_verify_bytes(shape, batch)
    accepted = shape.tokens if op.endswith("_all") else 2
    if op.startswith("fused"):
        return acc.fused_verify_bytes(shape, batch, accepted)
    return acc.commit_bytes(shape, batch, accepted)


def run(num_spec: tuple[int, ...], batches: tuple[int, ...], heads: int, reps: int,
        out: Callable[[str], None], only: tuple[str, ...] = (),
        match: str = "") -> dict[str, Any]:
    """Time every variant at every (S, batch); returns the rows and the roof."""
    dev = torch.device("cuda")
    timer = GraphTimer(dev, 256 * MIB, warmup=5, reps=reps)
    moved, roof_t = measure_roof(timer, 2 * GIB)
    roof = acc.gbps(moved, roof_t.median_ms)
    out(f"roof {roof:.0f} GB/s on {torch.cuda.get_device_name(dev)}")
    # a tuning variant of the CUDA library (cuda_window.DEFINES_ENV) is part of the result
    defines = dict(cuda_window.parse_defines(os.environ.get(cuda_window.DEFINES_ENV, "")))
    out("CUDA library: " + (", ".join(f"{k}={v}" for k, v in defines.items())
                            or "the default build"))
    rows: list[dict[str, Any]] = []
    for S in num_spec:
        for B in batches:
            step = make_step(S, B, heads, dev)
            for op, label, over in _variants():
                if only and op not in only:
                    continue
                if match and match not in label:
                    continue
                try:
                    with overrides(over):
                        fn = build_op(op, step)
                        t = timer.measure(fn)
                except Exception as exc:  # noqa: BLE001 - a failing variant is a row
                    rows.append({"op": op, "variant": label, "num_spec": S, "batch": B,
                                 "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    out(f"S={S} B={B:>3} {op:<10} {label:<24} ERROR {exc}")
                    continue
                gb = acc.gbps(_bytes(op, step.shape, B), t.median_ms)
                rows.append({"op": op, "variant": label, "num_spec": S, "batch": B,
                             "ms": t.median_ms, "gbps": gb, "roof_frac": gb / roof})
                out(f"S={S} B={B:>3} {op:<10} {label:<24} {t.median_ms:9.4f} ms "
                    f"{gb:7.0f} GB/s {100 * gb / roof:4.0f}%")
            torch.cuda.empty_cache()
    return {"roof_gbps": roof, "device": torch.cuda.get_device_name(dev),
            "cuda_defines": defines, "rows": rows}


def overrides(over: dict[str, object]) -> AbstractContextManager[tuning.KernelTuning]:
    """These :class:`~vllm_recoverssm.ops.tuning.KernelTuning` knobs (field names) in force
    for the block."""
    return tuning.tuned(**over)


def make_step(num_spec: int, batch: int, heads: int, device: torch.device) -> wl.Step:
    """The tuning workload: GLM-5.3 TP2 head shapes, one layer, bf16 activations."""
    return wl.make_step(acc.OpShape(heads, 128, 128, num_spec, 2), batch, 1, torch.bfloat16,
                        device, "auto", 0)


def build_op(op: str, step: wl.Step) -> wl.Op:
    """One bench op (``ours_full`` or a recovery op) on pools of its own."""
    if op == "ours_full":
        full = wl.make_full_pools(step, 1, 0)
        return wl.full_ops(step, full, None)["ours_full"]
    rec = wl.make_recovery_pools(step, 0)
    return wl.recovery_ops(step, rec)[op]


def main(argv: list[str] | None = None) -> int:
    """Parse the options, time the variants, print them and write ``--json``."""
    p = argparse.ArgumentParser(prog="python -m vllm_recoverssm.bench.tune",
                                description=__doc__)
    p.add_argument("--num-spec", default="3,7")
    p.add_argument("--batch", default="1,8,32,128,256")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--ops", default="", help="only these ops, e.g. verify,fused_all")
    p.add_argument("--variants", default="", help="only variants whose label holds this")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        specs = tuple(int(x) for x in args.num_spec.split(","))
        batches = tuple(int(x) for x in args.batch.split(","))
    except ValueError:
        print("tune: --num-spec and --batch take comma-separated integers", file=sys.stderr)
        return 2
    only = tuple(x for x in args.ops.split(",") if x)
    result = run(specs, batches, args.heads, args.reps, lambda s: print(s, flush=True), only,
                 args.variants)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
