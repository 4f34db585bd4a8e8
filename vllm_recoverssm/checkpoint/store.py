"""``CheckpointStore``: atomic request-boundary bundles in LMCache, looked up by prefix.

Writing a bundle stores every payload chunk first (under a fresh bundle id) and the manifest
last; the manifest is what a reader looks for, so a bundle becomes visible only once all its
parts are stored. If any part fails, the parts already written are removed and nothing is
published. Reading checks the manifest, every chunk's size and checksum and the token prefix
before any tensor is handed out: a bundle is restored whole or not at all, and a corrupt,
incomplete or foreign bundle is a miss with a warning.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .bundle import RequestCheckpoint
from .config import CheckpointConfig
from .errors import BundleFormatError, CheckpointConfigError
from .identity import LayoutIdentity, check_tokens, prefix_digest, prefix_digests
from .lmcache_objects import LMCacheObjects, ObjectKey
from .wire import Manifest, decode, encode, manifest_from_bytes, manifest_to_bytes

logger = logging.getLogger(__name__)


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
    """A restored checkpoint: the state after the first ``num_tokens`` request tokens."""

    checkpoint: RequestCheckpoint
    num_tokens: int
    exact: bool
    seconds: float


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
        self._objects = LMCacheObjects(config)
        self._lock = threading.Lock()
        self._rejected: set[str] = set()  # bundle ids found corrupt: a rewrite replaces them
        self.stats = CheckpointStats()

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
        complete bundle is left as it is. A failed write leaves nothing visible and is
        reported in the result (and logged), not raised: the request goes on without it.
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
            old = self._read_manifest(mkey)
            if (
                old is not None
                and old.bundle_id not in self._rejected
                and all(
                    self._objects.contains(self._chunk_key(ck.num_tokens, digest, old.bundle_id, i))
                    for i in range(len(old.chunks))
                )
            ):
                self.stats.already_stored += 1
                return StoreResult(False, "exists", ck.num_tokens)
            bundle_id = secrets.token_hex(16)
            manifest, chunks = encode(ck, self.identity, digest, bundle_id, self.config.chunk_bytes)
            written: list[ObjectKey] = []
            try:
                for i, chunk in enumerate(chunks):
                    key = self._chunk_key(ck.num_tokens, digest, bundle_id, i)
                    written.append(key)
                    self._objects.put(key, chunk, hold=True)
                head = manifest_to_bytes(manifest)
                self._objects.put(mkey, torch.frombuffer(bytearray(head), dtype=torch.uint8))
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
            if old is not None:
                # the replaced bundle's chunks are unreachable now
                for i in range(len(old.chunks)):
                    self._objects.remove(self._chunk_key(ck.num_tokens, digest, old.bundle_id, i))
            nbytes = manifest.total_bytes + len(head)
            self.stats.stored += 1
            self.stats.bytes_written += nbytes
            return StoreResult(True, "stored", ck.num_tokens, nbytes, time.perf_counter() - t0)

    # -- reading ------------------------------------------------------------------------
    def _read_manifest(self, mkey: ObjectKey) -> Manifest | None:
        if not self._objects.contains(mkey):
            return None
        raw = self._objects.get(mkey)
        if raw is None:
            return None
        try:
            manifest = manifest_from_bytes(raw.numpy().tobytes())
        except BundleFormatError:
            return None
        if (manifest.identity_digest, manifest.prefix_digest, manifest.num_tokens) != (
            self._namespace,
            mkey.prefix_digest,
            mkey.num_tokens,
        ):
            return None
        return manifest

    def _load(self, tokens: tuple[int, ...], digest: str) -> RequestCheckpoint | None:
        n = len(tokens)
        mkey = self._manifest_key(n, digest)
        raw = self._objects.get(mkey)
        manifest: Manifest | None = None
        try:
            if raw is None:
                # listed but unreadable: LMCache refuses a short or malformed object
                raise BundleFormatError("the manifest is listed but cannot be read")
            manifest = manifest_from_bytes(raw.numpy().tobytes())
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
        except BundleFormatError as exc:
            self.stats.rejected += 1
            if manifest is not None:
                self._rejected.add(manifest.bundle_id)
            logger.warning(
                "checkpoint bundle for a %d-token prefix ignored (%s store): %s",
                n,
                self.config.backend,
                exc,
            )
            if self.config.backend == "ram":
                # RAM bundles lose parts to eviction; drop the rest so it is not retried.
                self._drop(n, digest, manifest)
            return None
        assert manifest is not None and raw is not None  # set before anything could succeed
        self.stats.bytes_read += len(raw) + manifest.total_bytes
        return ck

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
                if not self._objects.contains(self._manifest_key(n, digests[n - 1])):
                    continue
                ck = self._load(toks[:n], digests[n - 1])
                if ck is not None:
                    self.stats.hits += 1
                    self.stats.restored_tokens += n
                    return Hit(ck, n, n == len(toks), time.perf_counter() - t0)
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
