"""Timing: CUDA-graph replays after an L2 flush (GPU), or eager calls (CPU smoke).

GPU method, per measured op:

1. warm-up calls on a side stream (Triton compiles, the caching allocator settles), as
   CUDA-graph capture requires;
2. one CUDA graph captures the whole op (for a layer stack: every layer's launches);
3. every replay is preceded by an L2 flush of a 256 MiB buffer, enqueued on the same
   stream *outside* the graph. Stream order makes the op start only after the flush has
   finished, so it finds none of its own data in L2. The flush writes the buffer by
   default (``write``): L2 is then full of the buffer's dirty lines, and the op's first
   reads pay for writing up to an L2's worth of them back to memory, about 50 MiB on an
   H100 or H200. ``read`` sums the buffer as float32 instead, so L2 holds clean lines, as
   after a decode step's projections, which read weights: the op then pays no write-back
   of lines it did not write. (In either mode the op's own last writes may still sit in
   L2 when it ends.) The sum takes about as long as the write and leaves fla-core's times
   as the write does; a sum into int64 was several times slower and slowed the op that
   followed (docs/results.md, "L2 flush: write against read").
4. CUDA events recorded right before and right after each replay bracket the op alone:
   the flush is not inside the interval, so no flush time has to be estimated and
   subtracted (which a flush inside the graph would need). The host enqueues the next
   replay while the GPU still runs the flush, so host launch
   latency is hidden too; what remains is the GPU's own graph launch, as in a serving
   engine's graph.
5. warm-up replays, then the median over ``reps`` replays (all events read after one
   synchronisation at the end, so timing adds no host round trip per replay).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

Op = Callable[[], object]

FLUSH_MODES = ("write", "read")
"""How the L2 flush evicts: ``write`` leaves the flush buffer's dirty lines in L2, ``read``
clean ones (module docstring, point 3)."""


@dataclass(frozen=True)
class Timing:
    """Replay times of one op in milliseconds."""

    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        """Median replay time."""
        return float(statistics.median(self.samples_ms))

    @property
    def min_ms(self) -> float:
        """Fastest replay."""
        return float(min(self.samples_ms))

    @property
    def max_ms(self) -> float:
        """Slowest replay."""
        return float(max(self.samples_ms))

    def as_dict(self) -> dict[str, float | int]:
        """Summary for the JSON report."""
        return {"ms": self.median_ms, "ms_min": self.min_ms, "ms_max": self.max_ms,
                "reps": len(self.samples_ms)}


class Timer:
    """Measures an op; see the module docstring for the method."""

    method_text: str = "{flush}"
    """The method line of the report, with ``{flush}`` for the flush's verb."""

    def __init__(self, device: torch.device, flush_bytes: int, warmup: int, reps: int,
                 flush_mode: str = "write") -> None:
        if flush_mode not in FLUSH_MODES:
            raise ValueError(f"argument 'flush_mode': expected one of {FLUSH_MODES}, "
                             f"got {flush_mode!r}")
        self.device = device
        self.warmup = warmup
        self.reps = reps
        self.flush_mode = flush_mode
        # int32 so that fill_ with the repetition number writes every byte each time
        self.flush_buf = torch.empty(max(flush_bytes // 4, 1), dtype=torch.int32, device=device)
        self.flush_buf.fill_(0)  # a read flush reads defined values (zeros as float32 too)
        self._flush_sum = torch.zeros((), dtype=torch.float32, device=device)

    def flush(self, i: int) -> None:
        """Evict the op's data from the last-level cache: overwrite the flush buffer
        (``write``), or sum it (``read``), which leaves only clean lines behind."""
        if self.flush_mode == "write":
            self.flush_buf.fill_(i & 0x7FFFFFFF)
        else:
            # float32, the buffer's own width (an int64 sum was slow: module docstring)
            torch.sum(self.flush_buf.view(torch.float32), dim=0, out=self._flush_sum)

    @property
    def method(self) -> str:
        """How this timer measures, in words (the report's method line)."""
        return self.method_text.format(flush="writes" if self.flush_mode == "write" else "reads")

    def measure(self, op: Op) -> Timing:
        """Time ``op``; subclasses implement the method."""
        raise NotImplementedError


class GraphTimer(Timer):
    """CUDA-graph replays with an L2 flush before each, timed by CUDA events."""

    method_text = ("median of CUDA-graph replays, each preceded (outside the graph, same "
                   "stream) by an L2 flush that {flush} the flush buffer; CUDA events around "
                   "the replay only")

    def measure(self, op: Op) -> Timing:
        """Capture ``op`` in one graph and time its replays."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                op()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op()
        torch.cuda.synchronize(self.device)
        for i in range(self.warmup):
            self.flush(i)
            graph.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            self.flush(i)
            starts[i].record()
            graph.replay()
            ends[i].record()
        torch.cuda.synchronize(self.device)
        samples = tuple(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        del graph
        return Timing(samples)


class EagerTimer(Timer):
    """Eager calls timed by the host clock (the CPU smoke mode; no graphs, no events)."""

    method_text = ("median of eager calls (host clock), each preceded by a flush that {flush} "
                   "the flush buffer")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, op: Op) -> Timing:
        """Call ``op`` ``warmup`` times, then time ``reps`` calls."""
        for i in range(self.warmup):
            self.flush(i)
            op()
        samples = []
        for i in range(self.reps):
            self.flush(i)
            self._sync()
            t0 = time.perf_counter()
            op()
            self._sync()
            samples.append((time.perf_counter() - t0) * 1e3)
        return Timing(tuple(samples))


def make_timer(device: torch.device, smoke: bool, flush_bytes: int, warmup: int,
               reps: int, flush_mode: str = "write") -> Timer:
    """Graph timing on CUDA, eager timing in smoke mode."""
    cls: type[Timer] = EagerTimer if smoke or device.type != "cuda" else GraphTimer
    return cls(device, flush_bytes, warmup, reps, flush_mode)


def measure_roof(timer: Timer, copy_bytes: int) -> tuple[int, Timing]:
    """Time a device-to-device copy of ``copy_bytes``; returns (bytes moved, timing).

    Bytes moved counts the read and the write, ``2 * copy_bytes``. Two copies are timed
    and the faster one is the roof: ``copy_`` (inside a CUDA graph it becomes a memcpy
    node) and an element-wise kernel writing
    ``src * 1`` (a plain streaming kernel on the SMs, like the ops measured here).
    """
    n = max(copy_bytes // 4, 1)
    src = torch.ones(n, dtype=torch.float32, device=timer.device)
    dst = torch.empty_like(src)
    by_memcpy = timer.measure(lambda: dst.copy_(src))
    by_kernel = timer.measure(lambda: torch.mul(src, 1.0, out=dst))
    timing = min(by_memcpy, by_kernel, key=lambda t: t.median_ms)
    return 2 * src.numel() * src.element_size(), timing
