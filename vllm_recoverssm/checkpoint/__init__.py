"""Atomic request-boundary checkpoints stored through LMCache (CPU RAM or disk).

``RequestCheckpoint`` is a request's complete state at a request boundary (recurrent state and
conv history of every linear layer, attention KV of the prefix, last-token logits).
``CheckpointStore`` writes it as one bundle -- checksummed raw-byte parts plus a manifest
written last -- through LMCache's ``LocalCPUBackend`` (RAM) or its ``fs://`` backend (disk,
survives a restart), and finds the longest stored prefix of a new request. LMCache is imported
only when a store is built.
"""

from .bundle import RequestCheckpoint
from .config import CheckpointConfig
from .errors import BundleFormatError, CheckpointConfigError, CheckpointError
from .identity import LayoutIdentity, prefix_digest
from .store import CheckpointStats, CheckpointStore, Hit, StoreResult

__all__ = [
    "BundleFormatError",
    "CheckpointConfig",
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointStats",
    "CheckpointStore",
    "Hit",
    "LayoutIdentity",
    "RequestCheckpoint",
    "StoreResult",
    "prefix_digest",
]
