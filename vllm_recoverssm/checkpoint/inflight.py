"""Markers of bundle writes in flight, visible to a collector in any process.

A writer creates ``recoverssm-writing-<bundle id>.lock`` before its first part and holds an
exclusive ``flock`` on it until the manifest is published and checked. The collector skips the
parts of every bundle whose marker is locked, whatever their age, so a slow write is never
collected under its own feet. A writer that dies releases its lock with its descriptor; its
marker is then stale and is removed with the write's other leftovers once the grace period
has passed. Where ``flock`` is not honoured (some network file systems), the grace period is
what protects a write.

Publishing a manifest (check what stands, write ours, read it back) runs under an exclusive
``flock`` on the directory itself (:func:`publish_lock`), so writers in other processes
publish one after another: the second finds the first's bundle and drops its own parts. The
lock leaves no file behind. Without it, a writer that checked before another's manifest
appeared could replace that manifest after its writer had confirmed it. Nothing
acknowledged is lost that way, since the replacement stands for the same prefix, but the
confirmed bundle's parts become orphans that only the collector removes.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .files import FILE_MODE, WRITE_FLAGS, open_regular
from .names import marker_name

logger = logging.getLogger(__name__)

_POLL_S = 0.001


class WriteMarker:
    """The marker of one bundle write; ``release()`` removes it (also as a context manager)."""

    def __init__(self, directory: Path, bundle_id: str) -> None:
        self.path = directory / marker_name(bundle_id)
        self._fd = os.open(self.path, WRITE_FLAGS, FILE_MODE)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            os.unlink(self.path)
            raise

    def release(self) -> None:
        """Remove the marker, then drop the lock; safe to call twice."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> WriteMarker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def write_in_flight(directory: Path, bundle_id: str) -> bool:
    """True while a live writer holds the marker of ``bundle_id``; False if none or stale."""
    f = open_regular(directory / marker_name(bundle_id))
    if f is None:
        return False
    with f:
        try:
            fcntl.flock(f.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False  # no lock support here: the grace period decides
        fcntl.flock(f.fd, fcntl.LOCK_UN)
        return False


@contextmanager
def publish_lock(directory: Path, timeout_s: float) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``directory`` for one publish; yields whether it is held.

    Waits at most ``timeout_s`` for a writer in another process. Where the lock cannot be
    had (no ``flock`` support, or the wait ran out), the publish goes ahead unlocked: its
    read-back still decides, and an orphan it may leave is the collector's.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except OSError as exc:
        logger.debug("publish lock: cannot open %s: %s", directory, exc)
        yield False
        return
    try:
        held = False
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    logger.debug("publish lock unsupported on %s: %s", directory, exc)
                    break
                if time.monotonic() > deadline:
                    logger.info("publish lock on %s not had within %s s; publishing unlocked",
                                directory, timeout_s)
                    break
                time.sleep(_POLL_S)
        yield held
    finally:
        os.close(fd)  # drops the lock with the descriptor
