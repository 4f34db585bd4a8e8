"""Keyed integrity of manifests (HMAC-SHA256) for checkpoint directories that others can write.

The SHA-256 checksums of a bundle catch accidental damage (a torn write, a bad disk, a stray
copy) but not a forgery: whoever can write the directory can write a manifest and parts with
matching checksums. With a secret key, a store signs every manifest it writes and restores only
manifests whose signature checks out; the manifest lists every part's SHA-256, so the whole
bundle is covered. The key comes from an environment variable or a file, never from the
checkpoint directory itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from .errors import CheckpointConfigError

KEY_MIN_BYTES = 32
KEY_MAX_BYTES = 4096
TAG_BYTES = 32


def _read_key_file(path: Path) -> bytes:
    # Links are followed here on purpose: secret mounts (e.g. Kubernetes) are links. The
    # checks that matter are a regular file, a bounded size and no blocking open.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointConfigError(f"hmac_key_file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointConfigError(f"hmac_key_file {path}: not a regular file")
        if st.st_size > KEY_MAX_BYTES:
            raise CheckpointConfigError(
                f"hmac_key_file {path}: {st.st_size} bytes, at most {KEY_MAX_BYTES} expected"
            )
        return os.read(fd, KEY_MAX_BYTES + 1)
    finally:
        os.close(fd)


def load_key(env: str | None, path: Path | None) -> bytes | None:
    """The HMAC key named by the config (an environment variable or a file), or None.

    Trailing newlines are dropped (a key file written with ``echo``). Raises
    ``CheckpointConfigError`` when the source is missing, unreadable or the key is shorter
    than ``KEY_MIN_BYTES``.
    """
    if env is not None and path is not None:
        raise CheckpointConfigError("give hmac_key_env or hmac_key_file, not both")
    if env is not None:
        value = os.environ.get(env)
        if not value:
            raise CheckpointConfigError(f"hmac_key_env: environment variable {env} is not set")
        key, where = value.encode(), f"environment variable {env}"
    elif path is not None:
        key, where = _read_key_file(path), f"hmac_key_file {path}"
    else:
        return None
    key = key.rstrip(b"\r\n")
    if not KEY_MIN_BYTES <= len(key) <= KEY_MAX_BYTES:
        raise CheckpointConfigError(
            f"{where}: the key is {len(key)} bytes, expected {KEY_MIN_BYTES}..{KEY_MAX_BYTES} "
            "(for example 64 hex digits from `openssl rand -hex 32`)"
        )
    return key


def sign(key: bytes, data: bytes) -> bytes:
    """The HMAC-SHA256 tag of ``data`` under ``key``."""
    return hmac.new(key, data, hashlib.sha256).digest()


def verify(key: bytes, data: bytes, tag: bytes) -> bool:
    """Whether ``tag`` is the HMAC-SHA256 of ``data`` under ``key`` (constant time)."""
    return hmac.compare_digest(sign(key, data), tag)
