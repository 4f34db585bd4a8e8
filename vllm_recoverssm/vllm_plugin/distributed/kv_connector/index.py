"""A listing of published bundles next to a disk store, so a restarted scheduler finds them.

The scheduler side never reads bundles, and the store answers "is this exact prefix
stored?" but not "which prefixes are stored?". After a bundle is published (its manifest is
in place), the worker adds an empty file ``<dir>/recoverssm-index/<identity digest>/<k>-<prefix
digest>``; a fresh scheduler lists those names once at start-up. An entry is only a hint:
the worker validates the bundle itself when it loads it, and a listed bundle that turns out
missing or damaged is a failed load (a cold compute), never a wrong restore. The store's
clean-up leaves this directory alone (it touches only names the store writes).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from .keys import LOGGER, BundleKey

INDEX_DIR = "recoverssm-index"
LAYOUT_FILE = "layout.json"
"""Beside one identity's entries: the layout it names (what a store's reader shows)."""
MAX_LAYOUT_BYTES = 64 << 10
MAX_IDENTITIES = 256
"""At most this many other identities' layouts are read at start-up."""
MAX_ENTRIES = 1_000_000
"""At most this many entries are read per identity at start-up."""
_ENTRY = re.compile(r"^(?P<k>[1-9][0-9]{0,11})-(?P<digest>[0-9a-f]{64})$")
_IDENTITY = re.compile(r"^[0-9a-f]{64}$")

logger = logging.getLogger(LOGGER)


def identity_dir(root: Path, identity_digest: str) -> Path:
    """Where the entries of one layout identity (one rank's bundles) live."""
    if not _IDENTITY.match(identity_digest):
        raise ValueError(f"identity digest {identity_digest!r}: expected 64 hex digits")
    return root / INDEX_DIR / identity_digest


def add_entry(root: Path, identity_digest: str, key: BundleKey) -> None:
    """Record that ``key`` is published for this identity (idempotent)."""
    folder = identity_dir(root, identity_digest)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key.num_tokens}-{key.digest}"
    # An empty file is complete the moment it exists; O_NOFOLLOW keeps a planted link
    # from redirecting the create.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    os.close(fd)


def write_layout(root: Path, identity_digest: str, layout: dict[str, Any]) -> None:
    """Record the layout one identity's entries belong to (written once, atomically)."""
    folder = identity_dir(root, identity_digest)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LAYOUT_FILE
    if path.exists():
        return
    tmp = folder / f".{LAYOUT_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(layout, sort_keys=True))
    os.replace(tmp, path)


def other_layouts(root: Path, own: set[str]) -> list[dict[str, Any]]:
    """The recorded layouts of the identities in the store other than ``own`` (at most
    :data:`MAX_IDENTITIES`); unreadable or oversized ones are skipped."""
    out: list[dict[str, Any]] = []
    try:
        with os.scandir(root / INDEX_DIR) as it:
            for entry in it:
                if len(out) >= MAX_IDENTITIES:
                    break
                if entry.name in own or not _IDENTITY.match(entry.name):
                    continue
                layout = _read_layout(Path(entry.path) / LAYOUT_FILE)
                if layout is not None:
                    out.append(layout)
    except FileNotFoundError:
        pass
    return out


def _read_layout(path: Path) -> dict[str, Any] | None:
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > MAX_LAYOUT_BYTES:
            return None
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def remove_entry(root: Path, identity_digest: str, key: BundleKey) -> None:
    """Forget ``key`` (best effort): its bundle turned out unusable."""
    try:
        (identity_dir(root, identity_digest) / f"{key.num_tokens}-{key.digest}").unlink()
    except OSError:
        pass


def read_entries(root: Path, identity_digest: str) -> set[BundleKey]:
    """Every well-formed entry of one identity; other names are ignored."""
    folder = identity_dir(root, identity_digest)
    out: set[BundleKey] = set()
    try:
        with os.scandir(folder) as it:
            for n, entry in enumerate(it):
                if n >= MAX_ENTRIES:
                    logger.warning("checkpoint index %s: read the first %d entries only",
                                   folder, MAX_ENTRIES)
                    break
                m = _ENTRY.match(entry.name)
                if m is not None and entry.is_file(follow_symlinks=False):
                    out.add(BundleKey(int(m.group("k")), m.group("digest")))
    except FileNotFoundError:
        return out
    return out
