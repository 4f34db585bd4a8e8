"""``CheckpointStore``: atomic request-boundary bundles in LMCache, looked up by prefix.

Writing a bundle stores every payload chunk first (under a fresh bundle id) and the manifest
last; the manifest is what a reader looks for, so a bundle becomes visible only once all its
parts are stored. If any part fails, the parts already written are removed and nothing is
published. After publishing, the writer reads the manifest back: a store that reports
``stored=True`` has seen its own manifest in place and every one of its parts present. When
another writer (another replica on a shared disk) published the same prefix in between, its
bundle stands, this writer removes its own parts and reports ``exists``. On disk, writers
publish one at a time under a lock on the directory (:func:`.inflight.publish_lock`), so a
confirmed bundle is not replaced by a racing writer of the same prefix.

Reading checks the manifest, every chunk's size and checksum and the token prefix before any
tensor is handed out: a bundle is restored whole or not at all, and a corrupt, incomplete,
forged or foreign bundle is a miss with a warning -- whatever exception decoding it raises, a
bad file never fails a request. A bundle that decodes but does not fit (its tensors differ
from those of the checkpoint being stored for the same prefix, or a caller ``reject``ed it)
is replaced by the next store of that prefix.

A disk store also marks each write in flight for the collector (:mod:`.gc`), which it runs
once when it is built, and signs its manifests when an HMAC key is configured.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import ValidationError

from .bundle import RequestCheckpoint
from .config import CheckpointConfig
from .errors import BundleFormatError, CheckpointConfigError
from .gc import GcReport, collect_garbage
from .identity import LayoutIdentity, check_tokens, prefix_digest, prefix_digests
from .inflight import WriteMarker, publish_lock
from .integrity import load_key
from .lmcache_objects import LMCacheObjects, ObjectKey
from .wire import (
    Manifest,
    decode,
    encode,
    manifest_from_bytes,
    manifest_to_bytes,
    tensor_layout,
)

logger = logging.getLogger(__name__)

PUBLISH_ATTEMPTS = 3
"""How often a writer publishes again when its manifest was replaced by nothing readable."""


@dataclass(frozen=True)
class StoreResult:
    """Outcome of ``CheckpointStore.store``; ``reason`` says why nothing was stored."""

    stored: bool
    reason: str
    num_tokens: int
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Hit:
    """A restored checkpoint: the state after the first ``num_tokens`` request tokens.

    ``bundle_id`` names the stored bundle, for :meth:`CheckpointStore.reject`.
    """

    checkpoint: RequestCheckpoint
    num_tokens: int
    exact: bool
    seconds: float
    bundle_id: str = ""


@dataclass
class CheckpointStats:
    """Counters of one store (this process only)."""

    stored: int = 0
    already_stored: int = 0
    skipped_images: int = 0
    store_failures: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    rejected: int = 0
    restored_tokens: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    replaced: int = 0
    lost_races: int = 0


class CheckpointStore:
    """Request-boundary checkpoints for one layout, in LMCache RAM or on disk.

    Building the store checks the whole LMCache set-up (and raises ``CheckpointConfigError``
    if it cannot work), so a request never meets a configuration problem.
    """

    def __init__(self, config: CheckpointConfig, identity: LayoutIdentity) -> None:
        if not isinstance(config, CheckpointConfig):
            raise CheckpointConfigError(
                f"config: expected a CheckpointConfig, got {type(config).__name__}"
            )
        if not isinstance(identity, LayoutIdentity):
            raise CheckpointConfigError(
                f"identity: expected a LayoutIdentity, got {type(identity).__name__}"
            )
        self.config = config
        self.identity = identity
        self._namespace = identity.digest()
        self._hmac_key = load_key(config.hmac_key_env, config.hmac_key_file)
        self._objects = LMCacheObjects(config)
        self._lock = threading.Lock()
        self._rejected: set[str] = set()  # bundle ids found unusable: a rewrite replaces them
        self.stats = CheckpointStats()
        self.startup_gc: GcReport | None = None
        """What the collection at start-up removed (disk stores with ``gc_on_start``)."""
        if config.backend == "disk" and config.gc_on_start:
            self.startup_gc = self._collect_at_start()

    def _collect_at_start(self) -> GcReport | None:
        assert self.config.path is not None
        try:
            report = collect_garbage(
                self.config.path, self.config.gc_grace_s, self.config.gc_max_files
            )
        except (OSError, ValueError) as exc:
            # Clean-up is housekeeping: a directory it cannot scan still stores and restores.
            logger.warning("checkpoint clean-up at start-up skipped: %s", exc)
            return None
        if report.removed or report.damaged_manifests or report.left_alone:
            logger.info("checkpoint clean-up of %s: %s", self.config.path, report.summary())
        return report

    # -- keys ---------------------------------------------------------------------------
    def _manifest_key(self, num_tokens: int, digest: str) -> ObjectKey:
        return ObjectKey(
            self._namespace,
            self.identity.tp_size,
            self.identity.tp_rank,
            digest,
            num_tokens,
            "manifest",
        )

    def _chunk_key(self, num_tokens: int, digest: str, bundle_id: str, index: int) -> ObjectKey:
        return ObjectKey(
            self._namespace,
            self.identity.tp_size,
            self.identity.tp_rank,
            digest,
            num_tokens,
            "chunk",
            bundle_id,
            index,
        )

    # -- writing ------------------------------------------------------------------------
    def store(self, ck: RequestCheckpoint) -> StoreResult:
        """Export ``ck`` as one bundle; all parts first, the manifest last.

        Requests that carried images are never exported. A prefix that already has a
        complete bundle that fits ``ck`` (same tensors, dtypes and shapes) is left as it is;
        one that does not fit, or that was rejected, is replaced. A failed write leaves
        nothing visible and is reported in the result (and logged), not raised: the request
        goes on without it. ``stored=True`` means the bundle was read back in place.
        """
        if not isinstance(ck, RequestCheckpoint):
            raise ValueError(f"store: expected a RequestCheckpoint, got {type(ck).__name__}")
        with self._lock:
            if ck.has_images:
                self.stats.skipped_images += 1
                return StoreResult(False, "has_images", ck.num_tokens)
            t0 = time.perf_counter()
            digest = prefix_digest(ck.tokens)
            mkey = self._manifest_key(ck.num_tokens, digest)
            layout = tensor_layout(ck)
            old = self._current(mkey)
            if old is not None:
                if self._fits(old, layout, ck.num_tokens, digest):
                    self.stats.already_stored += 1
                    return StoreResult(False, "exists", ck.num_tokens)
                logger.info(
                    "checkpoint bundle of a %d-token prefix is replaced: %s", ck.num_tokens,
                    "it was rejected" if old.bundle_id in self._rejected else
                    "its tensors differ from the checkpoint's, or parts are missing",
                )
            bundle_id = secrets.token_hex(16)
            try:
                manifest, chunks = encode(
                    ck, self.identity, digest, bundle_id, self.config.chunk_bytes
                )
                head = manifest_to_bytes(manifest, self._hmac_key)
            except (ValueError, ValidationError) as exc:
                self.stats.store_failures += 1
                logger.warning("checkpoint of %d tokens cannot be stored: %s", ck.num_tokens, exc)
                return StoreResult(False, f"not storable: {exc}", ck.num_tokens)
            n = ck.num_tokens
            keys = [self._chunk_key(n, digest, bundle_id, i) for i in range(len(chunks))]
            written: list[ObjectKey] = []
            marker: WriteMarker | None = None
            try:
                directory = self._objects.directory
                if directory is not None:
                    marker = WriteMarker(directory, bundle_id)
                for key, chunk in zip(keys, chunks, strict=True):
                    written.append(key)
                    self._objects.put(key, chunk, hold=True)
                outcome = self._publish(mkey, head, manifest, keys)
            except BaseException as exc:
                for key in written:
                    self._objects.remove(key)
                if not isinstance(exc, OSError):
                    raise
                self.stats.store_failures += 1
                logger.warning("checkpoint of %d tokens not stored: %s", ck.num_tokens, exc)
                return StoreResult(False, f"write failed: {exc}", ck.num_tokens)
            finally:
                for key in written:
                    self._objects.release(key)
                if marker is not None:
                    marker.release()
            if outcome == "lost":
                # Another writer's bundle for this prefix stands; ours is unreachable.
                for key in keys:
                    self._objects.remove(key)
                self.stats.lost_races += 1
                self.stats.already_stored += 1
                return StoreResult(False, "exists", ck.num_tokens)
            if old is not None and old.bundle_id != bundle_id:
                # the replaced bundle's chunks are unreachable now
                self.stats.replaced += 1
                for i in range(len(old.chunks)):
                    self._objects.remove(self._chunk_key(ck.num_tokens, digest, old.bundle_id, i))
            nbytes = manifest.total_bytes + len(head)
            self.stats.stored += 1
            self.stats.bytes_written += nbytes
            return StoreResult(True, "stored", ck.num_tokens, nbytes, time.perf_counter() - t0)

    def _publish(
        self, mkey: ObjectKey, head: bytes, manifest: Manifest, keys: list[ObjectKey]
    ) -> Literal["stored", "lost"]:
        """Write the manifest and read it back: ``stored`` (ours is in place with all its
        parts) or ``lost`` (another complete bundle that fits took the name meanwhile).
        On disk this runs under the directory's publish lock (other processes wait)."""
        directory = self._objects.directory
        if directory is None:  # RAM: one process, and ``self._lock`` is held
            return self._publish_unlocked(mkey, head, manifest, keys)
        with publish_lock(directory, self.config.timeout_s):
            return self._publish_unlocked(mkey, head, manifest, keys)

    def _publish_unlocked(
        self, mkey: ObjectKey, head: bytes, manifest: Manifest, keys: list[ObjectKey]
    ) -> Literal["stored", "lost"]:
        data = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        layout = manifest.tensor_layout()
        for _ in range(PUBLISH_ATTEMPTS):
            # Another writer may have published while our parts were written: then its
            # bundle stands and ours is dropped before it replaces (and orphans) that one.
            current = self._current(mkey)
            if current is not None and self._fits(
                current, layout, mkey.num_tokens, mkey.prefix_digest
            ):
                return "lost"
            self._objects.put(mkey, data)
            current = self._current(mkey)
            if current is not None and current.bundle_id == manifest.bundle_id:
                if not all(self._objects.contains(k) for k in keys):
                    raise OSError("parts of the bundle vanished while it was published")
                return "stored"
            if current is not None and self._fits(
                current, layout, mkey.num_tokens, mkey.prefix_digest
            ):
                return "lost"
            # Nothing readable in place (removed or damaged meanwhile): publish again.
        raise OSError(
            f"the manifest was replaced {PUBLISH_ATTEMPTS} times by something unreadable"
        )

    def _fits(
        self,
        manifest: Manifest,
        layout: list[tuple[str | None, str, str, tuple[int, ...]]],
        num_tokens: int,
        digest: str,
    ) -> bool:
        """Whether a published bundle can stand for a checkpoint with ``layout``: not
        rejected, the same tensors, dtypes and shapes, and every part present."""
        if manifest.bundle_id in self._rejected:
            return False
        if manifest.tensor_layout() != layout:
            return False
        return all(
            self._objects.contains(self._chunk_key(num_tokens, digest, manifest.bundle_id, i))
            for i in range(len(manifest.chunks))
        )

    def reject(self, hit: Hit) -> None:
        """Mark a restored bundle as unusable (it passed the store's checks but not the
        caller's): the next :meth:`store` of its prefix replaces it."""
        if not isinstance(hit, Hit):
            raise ValueError(f"reject: expected a Hit, got {type(hit).__name__}")
        with self._lock:
            if hit.bundle_id:
                self._rejected.add(hit.bundle_id)

    # -- reading ------------------------------------------------------------------------
    def _current(self, mkey: ObjectKey) -> Manifest | None:
        """The manifest published under ``mkey`` if it is valid for this store, else None."""
        try:
            if not self._objects.contains(mkey):
                return None
            raw = self._objects.get(mkey)
            if raw is None:
                return None
            manifest = manifest_from_bytes(raw.numpy().tobytes(), self._hmac_key)
        except Exception:  # anything unreadable is simply not a usable bundle here
            return None
        if (manifest.identity_digest, manifest.prefix_digest, manifest.num_tokens) != (
            self._namespace,
            mkey.prefix_digest,
            mkey.num_tokens,
        ):
            return None
        return manifest

    def _load(self, tokens: tuple[int, ...], digest: str) -> tuple[RequestCheckpoint, str] | None:
        n = len(tokens)
        mkey = self._manifest_key(n, digest)
        manifest: Manifest | None = None
        raw: torch.Tensor | None = None
        try:
            raw = self._objects.get(mkey)
            if raw is None:
                # listed but unreadable: LMCache refuses a short or malformed object
                raise BundleFormatError("the manifest is listed but cannot be read")
            manifest = manifest_from_bytes(raw.numpy().tobytes(), self._hmac_key)
            if manifest.identity_digest != self._namespace:
                raise BundleFormatError(
                    f"bundle is for another layout ({manifest.identity.model} "
                    f"{manifest.identity.mode}, S={manifest.identity.num_speculative_tokens}, "
                    f"digest {manifest.identity_digest[:12]}), not {self._namespace[:12]}"
                )
            if manifest.num_tokens != n or manifest.prefix_digest != digest:
                raise BundleFormatError("bundle is for another token prefix")
            chunks = []
            for i in range(len(manifest.chunks)):
                c = self._objects.get(self._chunk_key(n, digest, manifest.bundle_id, i))
                if c is None:
                    raise BundleFormatError(
                        f"part {i} of {len(manifest.chunks)} is missing or unreadable"
                    )
                chunks.append(c)
            ck = decode(manifest, chunks)
            if ck.tokens != tokens:
                raise BundleFormatError("stored token ids differ from the request's prefix")
        except Exception as exc:  # a bad file on disk never fails a request
            reason = (
                str(exc)
                if isinstance(exc, BundleFormatError)
                else f"it could not be decoded ({type(exc).__name__}: {exc})"
            )
            self.stats.rejected += 1
            if manifest is not None:
                self._rejected.add(manifest.bundle_id)
            logger.warning(
                "checkpoint bundle for a %d-token prefix ignored (%s store): %s",
                n,
                self.config.backend,
                reason[:500],
            )
            if self.config.backend == "ram":
                # RAM bundles lose parts to eviction; drop the rest so it is not retried.
                self._drop(n, digest, manifest)
            return None
        self.stats.bytes_read += len(raw) + manifest.total_bytes
        return ck, manifest.bundle_id

    def _drop(self, n: int, digest: str, manifest: Manifest | None) -> None:
        self._objects.remove(self._manifest_key(n, digest))
        if manifest is not None:
            for i in range(len(manifest.chunks)):
                self._objects.remove(self._chunk_key(n, digest, manifest.bundle_id, i))

    def lookup(self, tokens: Sequence[int], min_tokens: int = 1) -> Hit | None:
        """The checkpoint of the longest stored prefix of ``tokens`` (at least ``min_tokens``).

        Bundles that fail validation are skipped with a warning and the next shorter prefix
        is tried. Returns None when no stored prefix is usable.
        """
        toks = check_tokens(tokens)
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        with self._lock:
            t0 = time.perf_counter()
            self.stats.lookups += 1
            digests = prefix_digests(toks)
            for n in range(len(toks), min_tokens - 1, -1):
                planted = self._objects.not_regular_seen()
                try:
                    listed = self._objects.contains(self._manifest_key(n, digests[n - 1]))
                except Exception as exc:  # the backend failing on one name is a miss
                    logger.warning("checkpoint lookup of a %d-token prefix failed: %s", n, exc)
                    continue
                if not listed:
                    # the backend's lookup saw a link, FIFO or device at the name
                    if self._objects.not_regular_seen() > planted:
                        self.stats.rejected += 1
                        logger.warning(
                            "checkpoint bundle for a %d-token prefix ignored (%s store): its "
                            "manifest is not a regular file", n, self.config.backend)
                    continue
                loaded = self._load(toks[:n], digests[n - 1])
                if loaded is not None:
                    ck, bundle_id = loaded
                    self.stats.hits += 1
                    self.stats.restored_tokens += n
                    return Hit(ck, n, n == len(toks), time.perf_counter() - t0, bundle_id)
            self.stats.misses += 1
            return None

    def contains(self, tokens: Sequence[int]) -> bool:
        """Whether a bundle is published for exactly ``tokens`` (not validated)."""
        toks = check_tokens(tokens)
        if not toks:
            return False
        with self._lock:
            return self._objects.contains(self._manifest_key(len(toks), prefix_digest(toks)))

    def close(self) -> None:
        """Release LMCache's backends; the store cannot be used afterwards."""
        self._objects.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
