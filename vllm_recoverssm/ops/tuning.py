"""Tuning knobs of the kernels: overrides of the measured choices, for sweeps and tests.

Each knob is None by default, which leaves the choice to the heuristics of
:mod:`.backends` (which kernel) and :mod:`.triton_kda` (tiles, loops, rows per warp).
``python -m vllm_recoverssm.bench.tune`` times every variant by setting them; tests pin a
kernel the same way. The knobs are one process-wide :class:`KernelTuning`, replaced
(never mutated) through :func:`set_tuning` or, for a block, :func:`tuned`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["COMMIT_KERNELS", "COMMIT_LOOPS", "CUDA_COMMIT_ROWS", "CUDA_ROWS", "VERIFY_KERNELS",
           "KernelTuning", "current", "set_tuning", "tuned"]

VERIFY_KERNELS = ("cuda", "window", "serial")
"""The verify kernels: the CUDA window kernel, the Triton window kernel, the serial one."""
COMMIT_KERNELS = ("cuda", "triton")
COMMIT_LOOPS = ("runtime", "unrolled", "prefetch")
"""The Triton commit's token loops (:func:`.triton_kda.commit_loop` says what each does)."""
CUDA_ROWS = (16, 32)
"""Rows per warp the CUDA window kernel is built for."""
CUDA_COMMIT_ROWS = (16, 32, 64)
"""State rows one block of the CUDA commit replays."""


@dataclass(frozen=True)
class KernelTuning:
    """Overrides of the kernels' own choices; None leaves a choice to its heuristic."""

    serial_tile: tuple[int, int, int] | None = None
    """Serial verify: (block_v, num_warps, K chunks of 1 or 2)."""
    window_tile: tuple[int, int, int, int] | None = None
    """Triton window verify: (block_v, chunks per program, num_warps, num_stages)."""
    commit_tile: tuple[int, int, int] | None = None
    """Triton commit: (block_v, num_warps, K chunks of 1 or 2)."""
    commit_loop: str | None = None
    """Triton commit: one of :data:`COMMIT_LOOPS`."""
    verify_kernel: str | None = None
    """One of :data:`VERIFY_KERNELS` instead of :func:`.backends.verify_kernel`'s choice."""
    cuda_rows: int | None = None
    """CUDA window verify: rows per warp, one of :data:`CUDA_ROWS`."""
    commit_kernel: str | None = None
    """One of :data:`COMMIT_KERNELS` instead of :func:`.backends.commit_kernel`'s choice."""
    cuda_commit_rows: int | None = None
    """CUDA commit: rows per block, one of :data:`CUDA_COMMIT_ROWS`."""

    def __post_init__(self) -> None:
        for name, allowed in (("commit_loop", COMMIT_LOOPS), ("verify_kernel", VERIFY_KERNELS),
                              ("cuda_rows", CUDA_ROWS), ("commit_kernel", COMMIT_KERNELS),
                              ("cuda_commit_rows", CUDA_COMMIT_ROWS)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"argument '{name}': expected one of {allowed} or None, "
                                 f"got {value!r}")


_current = KernelTuning()


def current() -> KernelTuning:
    """The knobs in force."""
    return _current


def set_tuning(tuning: KernelTuning | None = None, /, **changes: object) -> KernelTuning:
    """Put ``tuning`` (default: the knobs in force) with ``changes`` in force; returns the
    knobs it replaced, to be put back with another call. ``changes`` name fields of
    :class:`KernelTuning`; an unknown name or a value outside its choices raises
    ``ValueError`` and changes nothing."""
    global _current
    base = _current if tuning is None else tuning
    fields = {f.name for f in dataclasses.fields(KernelTuning)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ValueError(f"argument '{unknown[0]}': not a kernel tuning knob, expected one of "
                         f"{', '.join(sorted(fields))}")
    new = dataclasses.replace(base, **changes) if changes else base  # type: ignore[arg-type]
    previous, _current = _current, new
    return previous


@contextmanager
def tuned(**changes: object) -> Iterator[KernelTuning]:
    """The knobs in force with ``changes`` for the block, put back afterwards."""
    previous = set_tuning(**changes)
    try:
        yield _current
    finally:
        set_tuning(previous)
