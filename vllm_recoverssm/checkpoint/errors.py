"""Errors raised by the checkpoint layer.

Two kinds of failure are kept apart on purpose: a misconfigured store is a
``CheckpointConfigError`` raised when the store is built (start-up), while anything wrong with a
stored bundle is a ``BundleFormatError`` that the store turns into a miss with a warning, so a
bad file on disk never fails a request.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error of the checkpoint layer."""


class CheckpointConfigError(CheckpointError, ValueError):
    """The store cannot work as configured (LMCache missing, bad path, bad sizes)."""


class BundleFormatError(CheckpointError, ValueError):
    """A stored bundle is corrupt, incomplete or for another layout; never restored."""
