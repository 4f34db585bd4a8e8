"""Runs the grid: roof copy first, then every (S, layers, batch) point, into one report dict."""

from __future__ import annotations

import gc
import platform
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

from . import accounting as acc
from . import workload as wl
from .grid import GIB, LOWER_BOUND, METHOD_MIN_REPS, MIB, BenchConfig
from .peer import load_peer
from .progress import Progress
from .timing import Op, Timer, Timing, make_timer, measure_roof

# Column order of every table and plot.
OPS: tuple[str, ...] = ("fla_full", "ours_full", "verify", "commit_all", "commit_2",
                        "total_all", "total_2", "fused_all", "fused_2")
OP_TITLES = {
    "fla_full": "fla-core full-state verify (peer)",
    "ours_full": "our full-state verify",
    "verify": "recovery verify",
    "commit_all": "commit, all S+1 accepted",
    "commit_2": "commit, 2 accepted",
    "total_all": "recovery verify + commit (all accepted)",
    "total_2": "recovery verify + commit (2 accepted)",
    "fused_all": "fused verify: the previous step's S+1 accepted committed inside it",
    "fused_2": "fused verify: the previous step's 2 accepted committed inside it",
}
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("total_all/fla", "total_all", "fla_full"),
    ("total_2/fla", "total_2", "fla_full"),
    ("total_all/ours_full", "total_all", "ours_full"),
    ("total_2/ours_full", "total_2", "ours_full"),
    ("fused_all/fla", "fused_all", "fla_full"),
    ("fused_2/fla", "fused_2", "fla_full"),
)
AUTO_BUDGET_FRACTION = 0.8  # of the free device memory at start: pools of one mode at a time
CPU_BUDGET_BYTES = 1 * GIB
SCHEMA = "recoverssm-bench/2"
FIDELITY_BATCH = 8


def op_bytes(name: str, shape: acc.OpShape, batch: int, layers: int) -> int:
    """Unique bytes of one measured op (see :mod:`accounting`)."""
    if name in ("fla_full", "ours_full"):
        return acc.full_verify_bytes(shape, batch, layers)
    if name.startswith("fused"):
        return acc.fused_verify_bytes(shape, batch, shape.tokens if name.endswith("_all") else 2,
                                      layers)
    verify = acc.recovery_verify_bytes(shape, batch, layers)
    if name == "verify":
        return verify
    accepted = shape.tokens if name.endswith("_all") else 2
    commit = acc.commit_bytes(shape, batch, accepted, layers)
    return commit if name.startswith("commit") else verify + commit


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _budget(cfg: BenchConfig, device: torch.device) -> int:
    if cfg.mem_budget_gib is not None:
        return int(cfg.mem_budget_gib * GIB)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * AUTO_BUDGET_FRACTION)
    return CPU_BUDGET_BYTES


def machine_info(device: torch.device, peer_version: str | None) -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"CPU ({platform.processor() or platform.machine()})"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "fla_core": peer_version,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["sm_count"] = props.multi_processor_count
        info["memory_gib"] = round(props.total_memory / GIB, 1)
    return info


def _entry(name: str, timing: Timing, shape: acc.OpShape, batch: int, layers: int,
           roof_gbps: float) -> dict[str, Any]:
    nbytes = op_bytes(name, shape, batch, layers)
    bw = acc.gbps(nbytes, timing.median_ms)
    return {**timing.as_dict(), "bytes": nbytes, "gbps": bw, "roof_frac": bw / roof_gbps}


def _ratios(ops: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, num, den in RATIOS:
        if num in ops and den in ops:
            out[key] = ops[num]["ms"] / ops[den]["ms"]
        else:
            out[key] = None
    return out


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _measure_mode(row: dict[str, Any], names: list[str], label: str, progress: Progress,
                  timer: Timer, build: Callable[[], dict[str, Op]],
                  entry: Callable[[str, Timing], dict[str, Any]]) -> None:
    """Build one mode's ops, then time each; an error skips the op (or the mode), noted."""
    try:
        fns = build()
    except Exception as exc:  # noqa: BLE001 - report it in the row, keep measuring the rest
        for n in names:
            progress.step(f"{label} {n} (failed)")
            row["skipped"][n] = _why(exc)
        return
    for n in names:
        progress.step(f"{label} {n}")
        try:
            row["ops"][n] = entry(n, timer.measure(fns[n]))
        except Exception as exc:  # noqa: BLE001 - same: one failing op is a skipped cell
            row["skipped"][n] = _why(exc)


def _point(cfg: BenchConfig, timer: Timer, S: int, B: int, L: int, budget: int,
           roof_gbps: float, fla: Any, progress: Progress,
           check_peer: bool) -> dict[str, Any]:
    dev = timer.device
    shape = acc.OpShape(cfg.heads, cfg.head_dim, cfg.head_dim, S,
                        torch.empty(0, dtype=cfg.act_dtype).element_size())
    step = wl.make_step(shape, B, L, cfg.act_dtype, dev, cfg.backend, cfg.seed)
    pool_budget = budget - step.input_bytes
    row: dict[str, Any] = {"num_spec": S, "batch": B, "layers": L, "ops": {}, "skipped": {},
                           "notes": []}
    label = f"S={S} B={B} L={L}"
    mem: dict[str, int | None] = {"full_alloc": None, "recovery_alloc": None}

    def entry(name: str, timing: Timing) -> dict[str, Any]:
        return _entry(name, timing, shape, B, L, roof_gbps)

    # full-state mode: ours and the peer share the pools (the same layout and contract)
    full_names = [n for n in ("fla_full", "ours_full") if n != "fla_full" or fla is not None]
    num_full = wl.distinct_pools(wl.full_pool_bytes(shape, B), L, pool_budget)
    row["distinct_pools"] = {"full": num_full, "recovery": L}
    if num_full == 0:
        for n in full_names:
            row["skipped"][n] = "one full-state pool exceeds the memory budget"
            progress.step(f"{label} {n} (skipped)")
    else:
        if num_full < L:
            row["notes"].append(
                f"full-state: {L} layers take turns over {num_full} distinct pools of "
                f"{wl.full_pool_bytes(shape, B) / GIB:.2f} GiB (memory budget)")

        def build_full() -> dict[str, Op]:
            full = wl.make_full_pools(step, num_full, cfg.seed)
            mem["full_alloc"] = full.bytes_per_request(B, L)
            if check_peer and fla is not None:
                try:
                    row["peer_check"] = wl.peer_agreement(step, full, fla)
                except Exception as exc:  # noqa: BLE001 - the timing may still work
                    row["notes"].append(f"peer check failed: {_why(exc)}")
            return wl.full_ops(step, full, fla)

        _measure_mode(row, full_names, label, progress, timer, build_full, entry)
        _free(dev)

    # recovery mode: distinct pools for every layer (the commit updates all in one launch)
    rec_names = ["verify", "commit_all", "commit_2", "total_all", "total_2", "fused_all",
                 "fused_2"]
    if wl.recovery_pool_bytes(shape, B) * L > pool_budget:
        row["distinct_pools"]["recovery"] = 0
        for n in rec_names:
            row["skipped"][n] = "recovery pools of every layer exceed the memory budget"
            progress.step(f"{label} {n} (skipped)")
    else:
        def build_recovery() -> dict[str, Op]:
            rec = wl.make_recovery_pools(step, cfg.seed)
            mem["recovery_alloc"] = rec.bytes_per_request(B, L)
            return wl.recovery_ops(step, rec)

        _measure_mode(row, rec_names, label, progress, timer, build_recovery, entry)
        _free(dev)
    row["memory"] = {
        **mem,
        "full_design": acc.full_state_bytes_per_request(shape, L),
        "recovery_design": acc.recovery_state_bytes_per_request(shape, L),
    }
    row["ratios"] = _ratios(row["ops"])
    return row


def run(cfg: BenchConfig, progress_enabled: bool = True) -> dict[str, Any]:
    """Measure the whole grid; returns the report (see :mod:`report` for its fields)."""
    dev = torch.device(cfg.device)
    peer = load_peer(dev, cfg.peer)
    timer = make_timer(dev, cfg.smoke, int(cfg.flush_mib * MIB), cfg.warmup, cfg.reps,
                       cfg.flush_mode)
    budget = _budget(cfg, dev)
    grid = cfg.grid()
    per_point = 8 + (1 if peer.available else 0)
    total = 1 + per_point * len(grid) + (len(cfg.num_spec) if cfg.fidelity else 0)
    progress = Progress(total, enabled=progress_enabled, stream=sys.stderr)
    notes: list[str] = []
    if not cfg.smoke and cfg.reps < METHOD_MIN_REPS:
        notes.append(f"reps = {cfg.reps}, below the method's {METHOD_MIN_REPS}")
    if not peer.available:
        notes.append(f"fla-core peer column skipped: {peer.reason}")

    progress.step("roof copy")
    moved, roof_t = measure_roof(timer, int(cfg.roof_gib * GIB))
    roof_gbps = acc.gbps(moved, roof_t.median_ms)
    _free(dev)

    rows = []
    # one wiring check of the peer per S: the largest batch up to 32, one layer
    check_batch = max((b for b in cfg.batch if b <= 32), default=min(cfg.batch))
    for S, B, L in grid:
        check = peer.available and B == check_batch and L == cfg.layers[0]
        rows.append(_point(cfg, timer, S, B, L, budget, roof_gbps, peer.fwd, progress, check))
        _free(dev)  # the point's inputs and pools are gone: return their memory
    fid_rows = []
    if cfg.fidelity:
        from . import fidelity

        for S in cfg.num_spec:
            progress.step(f"fidelity S={S}")
            try:
                fid_rows.append(fidelity.measure(
                    dev, cfg.heads, cfg.head_dim, cfg.act_dtype, S,
                    2 if cfg.smoke else FIDELITY_BATCH, cfg.backend, peer.fwd, seed=cfg.seed,
                    windows=3 if cfg.smoke else fidelity.WINDOWS))
            except Exception as exc:  # noqa: BLE001 - a failed check is a note, not a crash
                notes.append(f"fidelity S={S} failed: {_why(exc)}")
            _free(dev)
    progress.close()
    return {
        "schema": SCHEMA,
        "command": cfg.command_line(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "smoke" if cfg.smoke else "gpu",
        "machine": machine_info(dev, peer.version),
        "shape": {"heads": cfg.heads, "head_dim_k": cfg.head_dim, "head_dim_v": cfg.head_dim,
                  "act_dtype": cfg.dtype, "state_dtype": "float32",
                  "lower_bound": LOWER_BOUND, "backend": cfg.backend},
        "method": {"timing": timer.method, "warmup": cfg.warmup, "reps": cfg.reps,
                   "flush_bytes": timer.flush_buf.numel() * 4,
                   "flush_mode": timer.flush_mode,
                   "memory_budget_bytes": budget,
                   "bytes": "unique bytes per op (vllm_recoverssm.bench.accounting)",
                   "gbps": "unique bytes / median time, 1e9 bytes per second"},
        "roof": {"bytes": moved, **roof_t.as_dict(), "gbps": roof_gbps},
        "peer": {"available": peer.available, "reason": peer.reason},
        "rows": rows,
        "fidelity": fid_rows,
        "notes": notes,
    }
