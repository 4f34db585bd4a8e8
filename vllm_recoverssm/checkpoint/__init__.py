"""Atomic request-boundary checkpoints stored through LMCache (CPU RAM or disk).

``RequestCheckpoint`` is a request's complete state at a request boundary (recurrent state and
conv history of every linear layer, attention KV of the prefix, last-token logits).
``CheckpointStore`` writes it as one bundle -- checksummed raw-byte parts plus a manifest
written last -- through LMCache's ``LocalCPUBackend`` (RAM) or its ``fs://`` backend (disk,
survives a restart), and finds the longest stored prefix of a new request. LMCache is imported
only when a store is built.

A disk directory is treated as writable by others: files are created exclusively under
unique names and renamed into place, only regular files are read, every manifest field is
bounded, and anything wrong with a stored bundle is a miss with a warning. ``collect_garbage``
(also run when a disk store is built, and as ``recoverssm checkpoints gc``) removes leftovers
of interrupted and lost writes; an HMAC key (``CheckpointConfig.hmac_key_env`` /
``hmac_key_file``) makes a store restore only bundles it signed.
"""

from .bundle import RequestCheckpoint
from .config import CheckpointConfig
from .errors import BundleFormatError, CheckpointConfigError, CheckpointError
from .gc import GcReport, collect_garbage
from .identity import LayoutIdentity, prefix_digest
from .store import CheckpointStats, CheckpointStore, Hit, StoreResult

__all__ = [
    "BundleFormatError",
    "CheckpointConfig",
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointStats",
    "CheckpointStore",
    "GcReport",
    "Hit",
    "LayoutIdentity",
    "RequestCheckpoint",
    "StoreResult",
    "collect_garbage",
    "prefix_digest",
]
