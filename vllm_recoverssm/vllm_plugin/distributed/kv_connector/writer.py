"""One background thread that stores a worker's bundles, so no engine step waits on I/O.

A bundle is handed over as CPU copies (the pages it came from may be reused the next
step), stored with :meth:`CheckpointStore.store` (parts first, manifest last) and, for a
disk store, listed in the start-up index (:mod:`.index`). Results are picked up by the
worker each step and reported to the scheduler: a bundle counts as published only once the
store has it complete. Closing drains the queue within a bounded time, so a graceful stop
of ``vllm serve`` leaves complete bundles only (an interrupted write leaves parts no
manifest names, which are never read).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ....checkpoint import CheckpointStore, RequestCheckpoint
from .keys import LOGGER, BundleKey

logger = logging.getLogger(LOGGER)

DRAIN_SECONDS = 60.0
"""How long closing waits for queued bundles."""


@dataclass(frozen=True)
class WriteResult:
    """What became of one bundle."""

    key: BundleKey
    published: bool
    reason: str
    nbytes: int
    seconds: float


class BundleWriter:
    """Stores bundles in submission order on one daemon thread."""

    def __init__(self, store: CheckpointStore,
                 after_publish: Callable[[BundleKey], None] | None = None) -> None:
        self._store = store
        self._after_publish = after_publish
        self._queue: queue.Queue[tuple[BundleKey, RequestCheckpoint] | None] = queue.Queue()
        self._results: list[WriteResult] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="recoverssm-ckpt-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, key: BundleKey, checkpoint: RequestCheckpoint) -> None:
        """Queue ``checkpoint`` (its tensors must not alias live pages)."""
        if self._closed:
            raise RuntimeError("the checkpoint writer is closed")
        self._queue.put((key, checkpoint))

    def results(self) -> list[WriteResult]:
        """Results since the last call."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def pending(self) -> int:
        """Bundles queued or being written."""
        return self._queue.unfinished_tasks

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued bundle is written (True) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, key: BundleKey, checkpoint: RequestCheckpoint) -> None:
        t0 = time.perf_counter()
        try:
            result = self._store.store(checkpoint)
            published = result.stored or result.reason == "exists"
            reason = result.reason
            nbytes = result.nbytes
            if published and self._after_publish is not None:
                self._after_publish(key)
        except Exception as exc:  # a failed export is a future miss, never a failed step
            logger.warning("checkpoint of %d tokens not stored: %s", key.num_tokens, exc)
            published, reason, nbytes = False, f"error: {exc}", 0
        with self._lock:
            self._results.append(
                WriteResult(key, published, reason, nbytes, time.perf_counter() - t0))

    def close(self, timeout: float = DRAIN_SECONDS) -> None:
        """Write what is queued (up to ``timeout``), then stop the thread."""
        if self._closed:
            return
        self._closed = True
        if not self.wait_idle(timeout):
            logger.warning("checkpoint writer: %d bundle(s) not written at shutdown",
                           self._queue.unfinished_tasks)
        self._queue.put(None)
        self._thread.join(timeout=5)
