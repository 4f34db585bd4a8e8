"""File primitives for a checkpoint directory that other processes, or an attacker, may write.

Anyone who can write the directory can plant names in it: a symbolic link where a temporary
file will be created, a FIFO where a part is expected, a huge file. These helpers never follow
a link inside the directory, never open anything that is not a regular file (a FIFO would block
the reader forever, a device could hand out endless bytes) and never read more than the caller
allows. Writes go to a fresh, unpredictable name created exclusively in the same directory and
are renamed over the final name, so a reader sees the old object or the whole new one.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
"""Create a new file, failing if anything (a file, a link, a FIFO) already has the name."""
READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC
"""Open without following a link and without waiting for a FIFO's writer."""
FILE_MODE = 0o644
TEMP_SUFFIX = ".tmp"
TEMP_NAME_RE = re.compile(r"^(?P<final>.+)\.(?P<nonce>[0-9a-f]{16})\.tmp$")
"""Temporary files of :func:`write_atomic`: ``<final name>.<16 hex digits>.tmp``."""
_NAME_ATTEMPTS = 8


def temp_name(final_name: str) -> str:
    """A fresh temporary name for ``final_name``: 64 random bits nobody can predict."""
    return f"{final_name}.{secrets.token_hex(8)}{TEMP_SUFFIX}"


def _check_name(name: str) -> None:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"file name {name!r}: expected one path component")


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_atomic(
    directory: Path,
    final_name: str,
    pieces: Sequence[bytes | bytearray | memoryview],
    before_rename: Callable[[], None] | None = None,
) -> None:
    """Write ``pieces`` one after another as ``directory / final_name``, atomically.

    The bytes go to a new file under a unique temporary name in the same directory, created
    with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a planted link or file under that name makes the
    open fail instead of being written through), which is then renamed over the final name.
    The rename replaces a link at the final name instead of following it. On any failure the
    temporary file is removed and the error is raised (``OSError`` for I/O problems).
    ``before_rename`` runs after the last byte is written and may raise to abandon the write
    (the caller gave up waiting: a write it reported as failed must never appear later).
    """
    _check_name(final_name)
    fd = -1
    tmp = directory
    for _ in range(_NAME_ATTEMPTS):
        tmp = directory / temp_name(final_name)
        try:
            fd = os.open(tmp, WRITE_FLAGS, FILE_MODE)
            break
        except FileExistsError:
            continue  # a name we drew is taken (planted or a collision): draw another
    if fd < 0:
        raise OSError(f"could not create a temporary file for {final_name} in {directory}")
    try:
        try:
            for piece in pieces:
                _write_all(fd, piece)
        finally:
            os.close(fd)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, directory / final_name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def regular_file_size(path: Path) -> int | None:
    """The size of ``path`` if it is a regular file (not followed if a link), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class RegularFile:
    """A regular file opened for reading without following links or blocking; a context manager.

    ``open_regular`` returns None for anything else, so a FIFO, a device or a link planted in
    the directory is never read from.
    """

    def __init__(self, fd: int, size: int, mtime: float) -> None:
        self.fd = fd
        self.size = size
        self.mtime = mtime

    def read_into(self, buffer: memoryview, offset: int) -> bool:
        """Fill ``buffer`` with the bytes at ``offset``; False if the file is shorter."""
        done = 0
        while done < len(buffer):
            n = os.preadv(self.fd, [buffer[done:]], offset + done)
            if n <= 0:
                return False
            done += n
        return True

    def read(self, offset: int, length: int) -> bytes | None:
        """``length`` bytes at ``offset``, or None if the file is shorter."""
        buf = bytearray(length)
        return bytes(buf) if self.read_into(memoryview(buf), offset) else None

    def close(self) -> None:
        """Close the file; safe to call twice."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RegularFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_regular(path: Path) -> RegularFile | None:
    """Open ``path`` for reading if, and only if, it is a regular file; None otherwise.

    ``lstat`` first, so nothing that is not a regular file is ever opened (opening some
    devices has side effects); then ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat`` on the open
    descriptor, so a name swapped between the two calls is caught too.
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return RegularFile(fd, st.st_size, st.st_mtime)


def read_regular(path: Path, max_bytes: int) -> bytes | None:
    """The whole content of the regular file ``path`` if it holds at most ``max_bytes``."""
    f = open_regular(path)
    if f is None:
        return None
    with f:
        if f.size > max_bytes:
            return None
        return f.read(0, f.size)
