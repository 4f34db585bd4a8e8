"""Checkpoint objects in LMCache's own storage backends.

This module is the only one that talks to LMCache. It stores flat byte objects (payload chunks
and manifests) under ``CacheEngineKey``s and offers put / get / contains / remove:

* ``ram``: LMCache's ``LocalCPUBackend``. Objects live in LMCache's CPU pool of this process.
* ``disk``: LMCache's ``RemoteBackend`` with an fs connector, staged through a
  ``LocalCPUBackend``. It is chosen over ``LocalDiskBackend`` because that backend keeps its
  index only in process memory (a fresh process finds nothing), writes files in place with a
  plain ``open`` (a crash leaves a half-written file under the real name) and stores no shape
  or dtype. The connector is LMCache's ``FSConnector`` hardened by :mod:`.fs_connector`
  (loaded through LMCache's remote-storage plugin hook): each object is written under a unique
  temporary name created exclusively and renamed over the final name (atomic on POSIX file
  systems), prefixed with LMCache's header (length, format, dtype, shape); reads open regular
  files only and check the header against the file before allocating; ``exists`` is answered
  from the file system, so objects written by one process are found by the next. Nothing is
  fsynced: a machine crash (not a process crash) can leave a short file behind, which the
  checksums in the manifest turn into a miss.

LMCache is imported when a store is built, never at package import, and every way that
building can fail (LMCache missing or of another version, an unusable directory, a backend
that silently stores nothing) is a ``CheckpointConfigError`` at that moment, checked by
writing, reading back and removing a probe object.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import secrets
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch

from .config import CheckpointConfig
from .errors import CheckpointConfigError

SUPPORTED_LMCACHE = "0.5."
INSTALL_HINT = "install it with `make install-lmcache` (requirements/lmcache.txt)"
GiB = 2**30
KEY_MODEL_PREFIX = "recoverssm-"
FS_PLUGIN = "recoverssm_fs"  # fs_connector.PLUGIN_NAME; that module imports LMCache
FS_CONNECTOR_MODULE = "vllm_recoverssm.checkpoint.fs_connector"
FS_CONNECTOR_CLASS = "SafeFSConnector"
WAIT_MARGIN_S = 1.0
"""How much longer than a write's deadline the caller waits for its answer."""


@dataclass(frozen=True)
class ObjectKey:
    """Names one stored object of a bundle.

    ``namespace`` is the layout identity digest; ``kind`` is ``manifest`` (one per prefix) or
    ``chunk`` (``index`` within the bundle ``bundle_id``). Fresh bundle ids for every write
    keep a rewrite from ever mixing chunks of two bundles.
    """

    namespace: str
    tp_size: int
    tp_rank: int
    prefix_digest: str
    num_tokens: int
    kind: Literal["manifest", "chunk", "probe"]
    bundle_id: str = ""
    index: int = 0


def import_lmcache() -> SimpleNamespace:
    """Import the LMCache pieces the store uses, or raise a clear start-up error."""
    try:
        version = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointConfigError(f"LMCache is not installed; {INSTALL_HINT}") from None
    if not version.startswith(SUPPORTED_LMCACHE):
        raise CheckpointConfigError(
            f"LMCache {version} is installed; checkpoints need LMCache {SUPPORTED_LMCACHE}x "
            f"({INSTALL_HINT})"
        )
    # LMCache logs every backend it creates (INFO) and harmless set-up notes (WARNING) on
    # stdout; keep them out of the demo's output unless the user asked for a level.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    try:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend
    except ImportError as exc:
        raise CheckpointConfigError(
            f"LMCache {version} cannot be imported ({exc}); {INSTALL_HINT}"
        ) from None
    return SimpleNamespace(
        CacheEngineKey=CacheEngineKey,
        LMCacheEngineConfig=LMCacheEngineConfig,
        MemoryFormat=MemoryFormat,
        LMCacheMetadata=LMCacheMetadata,
        LocalCPUBackend=LocalCPUBackend,
        RemoteBackend=RemoteBackend,
    )


def _staging_backend_class(local_cpu_backend: type) -> type:
    """A ``LocalCPUBackend`` that never waits for memory.

    LMCache's allocator waits in a loop for other requests to free memory when the pool is
    full and nothing can be evicted. A staging buffer has nothing to evict, and a corrupt
    header on disk may ask for any size, so an allocation that does not fit must fail at
    once (the read becomes a miss) instead of waiting forever.
    """

    class StagingCPUBackend(local_cpu_backend):  # type: ignore[misc, valid-type]
        def allocate(
            self,
            shapes: Any,
            dtypes: Any,
            fmt: Any = None,
            eviction: bool = True,
            busy_loop: bool = True,
        ) -> Any:
            return super().allocate(shapes, dtypes, fmt, eviction=eviction, busy_loop=False)

    return StagingCPUBackend


class LMCacheObjects:
    """Flat uint8 objects in an LMCache backend (``ram`` or ``disk``), keyed by ``ObjectKey``."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self._lm = import_lmcache()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._remote: Any = None
        self._fs: Any = None
        self._closed = False
        self._held: dict[ObjectKey, Any] = {}
        lm = self._lm
        meta = lm.LMCacheMetadata(
            model_name="vllm-recoverssm",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=(1, 1, 1, 1, 1),
            chunk_size=1,
        )
        try:
            if config.backend == "ram":
                cfg = lm.LMCacheEngineConfig.from_defaults(
                    chunk_size=1,
                    local_cpu=True,
                    max_local_cpu_size=config.ram_bytes / GiB,
                )
                self._cpu = lm.LocalCPUBackend(cfg, meta, dst_device="cpu")
            else:
                assert config.path is not None  # the config validator guarantees it
                self._check_dir(config.path)
                plugin = f"remote_storage_plugin.{FS_PLUGIN}"
                cfg = lm.LMCacheEngineConfig.from_defaults(
                    chunk_size=1,
                    local_cpu=False,
                    max_local_cpu_size=config.ram_bytes / GiB,
                    remote_storage_plugins=[FS_PLUGIN],
                    remote_serde="naive",
                    blocking_timeout_secs=config.timeout_s,
                    extra_config={
                        # LMCache's own plugin hook loads our hardened fs connector
                        f"{plugin}.module_path": FS_CONNECTOR_MODULE,
                        f"{plugin}.class_name": FS_CONNECTOR_CLASS,
                        f"{plugin}.base_path": str(config.path),
                        # a read never allocates more than the staging pool holds
                        "recoverssm.max_object_bytes": config.ram_bytes,
                        # answer contains() with a plain stat, not a hop to the I/O loop
                        "use_exists_sync": True,
                    },
                )
                self._cpu = _staging_backend_class(lm.LocalCPUBackend)(cfg, meta, dst_device="cpu")
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="recoverssm-ckpt-io", daemon=True
                )
                self._thread.start()
                self._remote = lm.RemoteBackend(
                    cfg, meta, self._loop, self._cpu, "cpu", plugin_name=FS_PLUGIN
                )
                if self._remote.connection is None:
                    raise CheckpointConfigError(
                        f"LMCache's fs backend could not open {config.path} (see LMCache's "
                        f"log above; a missing 'aiofiles' package also causes this; "
                        f"{INSTALL_HINT})"
                    )
                self._fs = self._remote.connection.getWrappedConnector()
                if type(self._fs).__name__ != FS_CONNECTOR_CLASS:
                    raise CheckpointConfigError(
                        f"LMCache built a {type(self._fs).__name__} for the checkpoint "
                        f"directory instead of {FS_CONNECTOR_CLASS}"
                    )
            self._probe()
        except CheckpointConfigError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise CheckpointConfigError(
                f"LMCache {config.backend} backend could not be set up: {exc}"
            ) from exc

    @staticmethod
    def _check_dir(path: os.PathLike[str]) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise CheckpointConfigError(f"checkpoint directory {path}: {exc.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise CheckpointConfigError(f"checkpoint directory {path} is not writable")

    def _probe(self) -> None:
        """Write, read back and remove one object: a backend that stores nothing fails here."""
        key = ObjectKey("probe", 1, 0, secrets.token_hex(32), 1, "probe")
        data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        try:
            self.put(key, data)
            back = self.get(key)
        finally:
            self.remove(key)
        if back is None or not torch.equal(back, data):
            raise CheckpointConfigError(
                f"LMCache {self.config.backend} backend did not return what was written to it"
                + (f" under {self.config.path}" if self.config.path else "")
            )

    def _key(self, key: ObjectKey) -> Any:
        tags = {"lmcache.tag.kind": key.kind, "lmcache.tag.ntok": str(key.num_tokens)}
        if key.kind == "chunk":
            tags["lmcache.tag.bundle"] = key.bundle_id
            tags["lmcache.tag.part"] = str(key.index)
        return self._lm.CacheEngineKey(
            model_name=KEY_MODEL_PREFIX + key.namespace[:32],
            world_size=key.tp_size,
            worker_id=key.tp_rank,
            chunk_hash=int(key.prefix_digest[:16], 16),
            dtype=torch.uint8,
            request_configs=tags,
        )

    def put(self, key: ObjectKey, data: torch.Tensor, hold: bool = False) -> None:
        """Store ``data`` (flat uint8) under ``key``; returns once it is stored.

        ``hold`` keeps a RAM object from eviction until ``release(key)`` (LMCache evicts only
        objects nobody else references). Raises ``OSError`` when the object cannot be stored
        (no memory, a failed write).
        """
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() == 0:
            raise ValueError("put: data must be a non-empty flat uint8 tensor")
        lkey = self._key(key)
        mo = self._cpu.allocate(
            torch.Size([1, 1, 1, data.numel()]),
            torch.uint8,
            self._lm.MemoryFormat.KV_2LTD,
            busy_loop=False,
        )
        if mo is None:
            raise OSError(f"LMCache's CPU pool has no room for {data.numel()} bytes")
        try:
            mo.tensor.view(-1).copy_(data)
            if self._remote is None:
                self._cpu.remove(lkey)  # a rewrite replaces the old object
                self._cpu.submit_put_task(lkey, mo)
                if not self._cpu.contains(lkey):
                    raise OSError("LMCache's CPU backend did not keep the object")
                if hold:
                    mo.ref_count_up()
                    self._held[key] = mo
            else:
                # A write that is not renamed into place by the deadline is discarded, so one
                # reported as failed (timed out) never becomes visible later.
                self._wait_for_earlier_put(lkey)
                self._fs.set_deadline(lkey, time.monotonic() + self.config.timeout_s)
                future = self._remote.submit_put_task(lkey, mo)
                try:
                    future.result(timeout=self.config.timeout_s + WAIT_MARGIN_S)
                except FutureTimeout:
                    raise OSError(f"write timed out after {self.config.timeout_s} s") from None
                except Exception as exc:
                    raise OSError(f"write failed: {exc}") from exc
        finally:
            mo.ref_count_down()

    def _wait_for_earlier_put(self, lkey: Any) -> None:
        # LMCache's RemoteBackend answers a put of a key it still lists as in flight with an
        # immediate success and writes nothing. Its list is cleared by a callback that may run
        # just after our wait for the previous put of the same key returned.
        deadline = time.monotonic() + WAIT_MARGIN_S
        while self._remote.exists_in_put_tasks(lkey) and time.monotonic() < deadline:
            time.sleep(0.001)
        if self._remote.exists_in_put_tasks(lkey):
            raise OSError("an earlier write of the same object is still in flight")

    @property
    def directory(self) -> Path | None:
        """The disk store's directory (None for RAM)."""
        return self.config.path if self._remote is not None else None

    def get(self, key: ObjectKey) -> torch.Tensor | None:
        """A copy of the object under ``key`` as flat uint8, or None when there is none."""
        lkey = self._key(key)
        backend = self._cpu if self._remote is None else self._remote
        mo = backend.get_blocking(lkey)
        if mo is None:
            return None
        try:
            t = mo.tensor
            if t is None or t.dtype != torch.uint8:
                return None
            return t.reshape(-1).clone()
        finally:
            mo.ref_count_down()

    def contains(self, key: ObjectKey) -> bool:
        """Whether an object is stored under ``key``."""
        backend = self._cpu if self._remote is None else self._remote
        return bool(backend.contains(self._key(key)))

    def not_regular_seen(self) -> int:
        """How often the disk store met a name holding something that is not a stored
        object (a link, a FIFO, a device, a directory); 0 for RAM."""
        return int(self._fs.not_regular_seen) if self._fs is not None else 0

    def remove(self, key: ObjectKey) -> None:
        """Remove the object under ``key`` if there is one (best effort)."""
        lkey = self._key(key)
        if self._remote is None:
            self._cpu.remove(lkey)
        elif self._remote.contains(lkey):
            self._remote.remove(lkey)

    def release(self, key: ObjectKey) -> None:
        """Let an object stored with ``hold=True`` be evicted again (no-op otherwise)."""
        mo = self._held.pop(key, None)
        if mo is not None:
            mo.ref_count_down()

    def close(self) -> None:
        """Release the backends and stop the I/O thread; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for key in list(self._held):
            self.release(key)
        if self._remote is not None:
            self._remote.close()
        cpu = getattr(self, "_cpu", None)
        if cpu is not None:
            cpu.close()
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._loop.is_running():
                self._loop.close()
