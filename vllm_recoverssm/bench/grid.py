"""What one benchmark run measures: the grid, the shapes and the timing method's knobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_NUM_SPEC, MAX_NUM_SPEC = 1, 7
GIB = 1 << 30
MIB = 1 << 20

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# GLM-5.3 at TP2: 32 KDA heads per rank, head dim 128, 34 KDA layers, bounded gate.
GPU_DEFAULTS = dict(
    num_spec=(3, 7), batch=(1, 8, 32, 128, 256), layers=(1, 34), heads=32, head_dim=128,
    reps=100, warmup=10, flush_mib=256.0, roof_gib=2.0,
)
# CPU smoke: the same code paths at tiny shapes, eager timing, few repetitions.
SMOKE_DEFAULTS = dict(
    num_spec=(3, 7), batch=(1, 2), layers=(1, 2), heads=2, head_dim=16,
    reps=3, warmup=1, flush_mib=1.0, roof_gib=1.0 / 64,
)
LOWER_BOUND = -5.0
METHOD_MIN_REPS = 50  # the method asks for the median of at least 50 repetitions


@dataclass(frozen=True)
class BenchConfig:
    """A validated benchmark run."""

    smoke: bool
    device: str
    num_spec: tuple[int, ...]
    batch: tuple[int, ...]
    layers: tuple[int, ...]
    heads: int
    head_dim: int
    dtype: str
    reps: int
    warmup: int
    flush_mib: float
    roof_gib: float
    backend: str
    peer: bool
    mem_budget_gib: float | None
    seed: int = 0
    fidelity: bool = True
    flush_mode: str = "write"

    @property
    def act_dtype(self) -> torch.dtype:
        """Activation dtype of q, k, v, raw_g, raw_beta and the kg records."""
        return DTYPES[self.dtype]

    def command_line(self) -> str:
        """The options that reproduce this run's measurements (output paths left out)."""
        def join(xs: tuple[int, ...]) -> str:
            return ",".join(map(str, xs))

        parts = ["recoverssm bench"] + (["--smoke"] if self.smoke else [])
        parts += [f"--num-spec {join(self.num_spec)}", f"--batch {join(self.batch)}",
                  f"--layers {join(self.layers)}", f"--reps {self.reps}",
                  f"--warmup {self.warmup}", f"--heads {self.heads}",
                  f"--head-dim {self.head_dim}", f"--dtype {self.dtype}",
                  f"--backend {self.backend}", f"--device {self.device}",
                  f"--flush-mib {self.flush_mib:g}", f"--roof-gib {self.roof_gib:g}"]
        if self.flush_mode != "write":
            parts.append(f"--flush-mode {self.flush_mode}")
        if self.mem_budget_gib is not None:
            parts.append(f"--mem-budget-gib {self.mem_budget_gib:g}")
        if not self.peer:
            parts.append("--no-peer")
        if not self.fidelity:
            parts.append("--no-fidelity")
        if self.seed:
            parts.append(f"--seed {self.seed}")
        return " ".join(parts)

    def grid(self) -> list[tuple[int, int, int]]:
        """Every (S, batch, layers) point, in run order: S, then layers, then batch."""
        return [(s, b, L) for s in self.num_spec for L in self.layers for b in self.batch]


def parse_int_list(name: str, text: str, lo: int, hi: int | None = None) -> tuple[int, ...]:
    """Parse ``"1,8,32"`` into sorted unique ints within ``lo..hi``; ValueError otherwise."""
    want = f"comma-separated integers >= {lo}" if hi is None else f"integers in {lo}..{hi}"
    items = [s.strip() for s in text.split(",")]
    try:
        values = [int(s) for s in items]
    except ValueError:
        raise ValueError(f"argument --{name}: expected {want}, got {text!r}") from None
    bad = [v for v in values if v < lo or (hi is not None and v > hi)]
    if not values or bad:
        raise ValueError(f"argument --{name}: expected {want}, got {text!r}")
    return tuple(sorted(set(values)))


def parse_positive(name: str, text: str | None, default: float, integer: bool,
                   allow_zero: bool = False) -> float:
    """Parse one number option (``None`` = default); ValueError names the option."""
    if text is None:
        return default
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        value = -1
    ok = value >= 0 if allow_zero else value > 0
    if not ok or value != value:  # NaN
        kind = "an integer" if integer else "a number"
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"argument --{name}: expected {kind} {bound}, got {text!r}")
    return value


def resolve_device(requested: str, smoke: bool) -> str:
    """``auto`` is CUDA when present (CPU in smoke mode); a full run needs CUDA."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"argument --device: expected auto, cpu or cuda, got {requested!r}")
    has_cuda = torch.cuda.is_available()
    device = requested
    if requested == "auto":
        device = "cuda" if has_cuda and not smoke else "cpu"
    if device == "cuda" and not has_cuda:
        raise ValueError("argument --device: CUDA was asked for but no CUDA device is visible")
    if device == "cpu" and not smoke:
        raise ValueError(
            "the benchmark times CUDA-graph replays on a GPU; run with --smoke on a CPU"
        )
    return device
