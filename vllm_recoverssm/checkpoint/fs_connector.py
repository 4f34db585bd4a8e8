"""LMCache's fs connector, hardened for a checkpoint directory that others may write.

LMCache 0.5.6's ``FSConnector`` writes every object to ``<final name>.tmp`` with a plain
``open(..., "wb")`` and renames it: two processes writing one key share that temporary file
(one renames the other's half-written bytes, the other's rename fails), and a symbolic link
planted at the temporary name makes the server overwrite whatever the link points to. Its
reads open whatever has the key's name, so a FIFO blocks a reader thread forever (and with it
the process's exit), and the size in the header is trusted when memory is allocated.

``SafeFSConnector`` keeps LMCache's file names and header format (so LMCache and this project
read each other's files) and replaces the three file operations with :mod:`.files`: writes
under a unique name created exclusively, reads of regular files only, sizes checked against
the file and a bound before any allocation. All I/O runs synchronously on the store's own
I/O thread (a daemon), never in a worker pool that the interpreter waits for at exit.

LMCache loads this class through its remote-storage plugin hooks
(``remote_storage_plugin.<name>.module_path`` / ``class_name``); this module imports LMCache,
so only :mod:`.lmcache_objects` names it, and only when a disk store is built.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1 import protocol
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector.fs_connector import FSConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from .files import RegularFile, open_regular, regular_file_size, write_atomic

logger = logging.getLogger(__name__)

PLUGIN_NAME = "recoverssm_fs"
"""The remote-storage plugin name the store configures LMCache with."""
MAX_OBJECT_BYTES_KEY = "recoverssm.max_object_bytes"
"""``extra_config`` key: the largest object a read may allocate (the staging pool's size)."""
_MAX_WARNED = 1024


class WriteAbandoned(OSError):
    """The caller stopped waiting for this write; it was discarded before the rename."""


class SafeFSConnector(FSConnector):
    """``FSConnector`` with exclusive unique temporary files and regular-file-only reads."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: LocalCPUBackend,
        config: LMCacheEngineConfig | None,
        plugin_name: str | None = None,
        base_paths_str: str | None = None,
    ) -> None:
        super().__init__(
            loop, local_cpu_backend, config, plugin_name or PLUGIN_NAME, base_paths_str
        )
        if len(self.base_paths) != 1 or self.relative_tmp_dir is not None or self.use_odirect:
            raise ValueError("SafeFSConnector takes one base path, no tmp dir and no O_DIRECT")
        if not self.save_chunk_meta:
            raise ValueError("SafeFSConnector needs save_chunk_meta (the size header)")
        self.root = Path(self.base_paths[0])
        limit = None if config is None else config.get_extra_config_value(MAX_OBJECT_BYTES_KEY)
        self.max_object_bytes = int(limit) if limit is not None else 2**30
        self._deadlines: dict[str, float] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.not_regular_seen = 0
        """Times a name was found holding something other than a regular file."""

    # -- names --------------------------------------------------------------------------
    def file_name(self, key: CacheEngineKey) -> str:
        """The object's file name inside the directory (LMCache's naming)."""
        return self._get_file_name(key)

    def set_deadline(self, key: CacheEngineKey, deadline: float) -> None:
        """Discard the next write of ``key`` if it would be renamed into place after
        ``deadline`` (``time.monotonic()``): the caller reports such a write as failed."""
        with self._lock:
            self._deadlines[self.file_name(key)] = deadline

    def _warn_not_regular(self, name: str) -> None:
        with self._lock:
            self.not_regular_seen += 1
            if name in self._warned or len(self._warned) >= _MAX_WARNED:
                return
            self._warned.add(name)
        logger.warning("checkpoint directory entry %s is not a regular file; ignored", name)

    # -- writes -------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Write header + bytes under a unique temporary name, then rename into place."""
        name = self.file_name(key)
        with self._lock:
            deadline = self._deadlines.pop(name, None)
        buffer = memory_obj.byte_array
        header = RemoteMetadata(
            len(buffer),
            memory_obj.get_shapes(),
            memory_obj.get_dtypes(),
            memory_obj.get_memory_format(),
        ).serialize()

        def check_deadline() -> None:
            if deadline is not None and time.monotonic() > deadline:
                raise WriteAbandoned(f"write of {name} finished after its caller gave up")

        write_atomic(self.root, name, (header, buffer), before_rename=check_deadline)

    # -- reads --------------------------------------------------------------------------
    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The object under ``key``, or None if it is absent, not a regular file or malformed."""
        name = self.file_name(key)
        f = open_regular(self.root / name)
        if f is None:
            if os.path.lexists(self.root / name):
                self._warn_not_regular(name)
            return None
        with f:
            return self._read(f, name)

    def _read(self, f: RegularFile, name: str) -> MemoryObj | None:
        head = self.remote_metadata_bytes
        meta = _checked_header(f, head, self.max_object_bytes, name)
        if meta is None:
            return None
        length = f.size - head
        obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if obj is None:
            return None
        ok = False
        try:
            view = memoryview(obj.byte_array).cast("B")
            ok = len(view) == length and f.read_into(view, head)
        finally:
            if not ok:
                obj.ref_count_down()
        return obj if ok else None

    async def exists(self, key: CacheEngineKey) -> bool:
        """Whether a regular file holds ``key`` (links, FIFOs and devices do not count)."""
        return self.exists_sync(key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        """Whether a regular file holds ``key``, answered with one ``lstat``."""
        name = self.file_name(key)
        if regular_file_size(self.root / name) is not None:
            return True
        if os.path.lexists(self.root / name):
            self._warn_not_regular(name)
        return False

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Remove the object's name (a link is removed, never its target)."""
        try:
            os.remove(self.root / self.file_name(key))
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.warning("could not remove %s: %s", self.file_name(key), exc)
            return False


def _checked_header(f: RegularFile, head: int, max_bytes: int, name: str) -> Any | None:
    """LMCache's header of the object in ``f`` if it describes exactly the rest of the file.

    The store only ever writes flat uint8 objects viewed as ``[1, 1, 1, n]`` KV_2LTD, so any
    other header is damage (or a forgery) and the object is not read.
    """
    length = f.size - head
    if length <= 0 or length > max_bytes:
        logger.debug("%s: %d bytes, outside 1..%d", name, length, max_bytes)
        return None
    raw = f.read(0, head)
    try:
        meta = RemoteMetadata.deserialize(raw) if raw is not None else None
    except Exception:  # an unknown format or dtype code in a damaged header
        meta = None
    if meta is None or not (
        meta.length == length
        and meta.fmt == MemoryFormat.KV_2LTD
        and list(meta.dtypes) == [torch.uint8]
        and [list(s) for s in meta.shapes] == [[1, 1, 1, length]]
    ):
        logger.debug("%s: header does not describe a flat %d-byte object", name, length)
        return None
    return meta


def header_bytes() -> int:
    """Bytes of LMCache's header in front of each object (one group, as the store writes)."""
    if protocol.REMOTE_METADATA_BYTES is None:
        protocol.init_remote_metadata_info(1)
    return int(protocol.get_remote_metadata_bytes())


def read_object(path: Path, max_bytes: int) -> bytes | None:
    """The payload of the object file ``path`` (header checked, then dropped), or None.

    For readers outside a store (the collector): the same checks as a store's read, without
    LMCache's memory pool.
    """
    f = open_regular(path)
    if f is None:
        return None
    with f:
        head = header_bytes()
        if _checked_header(f, head, max_bytes, path.name) is None:
            return None
        return f.read(head, f.size - head)
