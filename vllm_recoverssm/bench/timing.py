"""Timing: CUDA-graph replays after an L2 flush (GPU), or eager calls (CPU smoke).

GPU method, per measured op:

1. warm-up calls on a side stream (Triton compiles, the caching allocator settles), as
   CUDA-graph capture requires;
2. one CUDA graph captures the whole op (for a layer stack: every layer's launches);
3. every replay is preceded by an L2 flush: a write of a 256 MiB buffer, enqueued on the
   same stream *outside* the graph. Stream order makes the op start only after the flush
   has finished, so it finds none of its own data in L2 (the flush leaves L2 full of the
   flush buffer's dirty lines, as a preceding layer would).
4. CUDA events recorded right before and right after each replay bracket the op alone:
   the flush is not inside the interval, so no flush time has to be estimated and
   subtracted (which a flush inside the graph would need). The host enqueues the next
   replay while the GPU still runs the ~60 us flush, so host launch latency is hidden
   too; what remains is the GPU's own graph launch, as in a serving engine's graph.
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

    method: str = ""

    def __init__(self, device: torch.device, flush_bytes: int, warmup: int, reps: int) -> None:
        self.device = device
        self.warmup = warmup
        self.reps = reps
        # int32 so that fill_ with the repetition number writes every byte each time
        self.flush_buf = torch.empty(max(flush_bytes // 4, 1), dtype=torch.int32, device=device)

    def flush(self, i: int) -> None:
        """Overwrite the flush buffer (evicts the op's data from the last-level cache)."""
        self.flush_buf.fill_(i & 0x7FFFFFFF)

    def measure(self, op: Op) -> Timing:
        """Time ``op``; subclasses implement the method."""
        raise NotImplementedError


class GraphTimer(Timer):
    """CUDA-graph replays with an L2 flush before each, timed by CUDA events."""

    method = ("median of CUDA-graph replays, each preceded (outside the graph, same stream) "
              "by an L2 flush that writes the flush buffer; CUDA events around the replay only")

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

    method = "median of eager calls (host clock), each preceded by a write of the flush buffer"

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
               reps: int) -> Timer:
    """Graph timing on CUDA, eager timing in smoke mode."""
    cls: type[Timer] = EagerTimer if smoke or device.type != "cuda" else GraphTimer
    return cls(device, flush_bytes, warmup, reps)


def measure_roof(timer: Timer, copy_bytes: int) -> tuple[int, Timing]:
    """Time a device-to-device copy of ``copy_bytes``; returns (bytes moved, timing).

    Bytes moved counts the read and the write, ``2 * copy_bytes``. Two copies are timed
    and the faster one is the roof: ``copy_`` (inside a CUDA graph it becomes a memcpy
    node, which on an H200 ran at about 2.8 TB/s) and an element-wise kernel writing
    ``src * 1`` (a plain streaming kernel on the SMs, like the ops measured here).
    """
    n = max(copy_bytes // 4, 1)
    src = torch.ones(n, dtype=torch.float32, device=timer.device)
    dst = torch.empty_like(src)
    by_memcpy = timer.measure(lambda: dst.copy_(src))
    by_kernel = timer.measure(lambda: torch.mul(src, 1.0, out=dst))
    timing = min(by_memcpy, by_kernel, key=lambda t: t.median_ms)
    return 2 * src.numel() * src.element_size(), timing
