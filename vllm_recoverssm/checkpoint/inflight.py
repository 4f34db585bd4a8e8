"""Markers of bundle writes in flight, visible to a collector in any process.

A writer creates ``recoverssm-writing-<bundle id>.lock`` before its first part and holds an
exclusive ``flock`` on it until the manifest is published and checked. The collector skips the
parts of every bundle whose marker is locked, whatever their age, so a slow write is never
collected under its own feet. A writer that dies releases its lock with its descriptor; its
marker is then stale and is removed with the write's other leftovers once the grace period
has passed. Where ``flock`` is not honoured (some network file systems), the grace period is
what protects a write.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .files import FILE_MODE, WRITE_FLAGS, open_regular
from .names import marker_name


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
