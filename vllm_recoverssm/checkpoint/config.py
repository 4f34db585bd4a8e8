"""Settings of a checkpoint store, checked when the store is built."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MiB = 2**20
MIN_GRACE_S = 60
"""No leftover is collected younger than this, whatever is asked (a floor for file systems
where the in-flight markers' locks are not honoured)."""
DEFAULT_GRACE_S = 3600
MAX_FILES_LIMIT = 100_000_000


class CheckpointConfig(BaseModel):
    """Where bundles go and how much memory the store may use.

    ``backend="ram"`` keeps bundles in LMCache's CPU memory (lost when the process ends);
    ``backend="disk"`` writes them through LMCache's ``fs://`` backend under ``path`` so that
    a fresh process finds them. ``ram_bytes`` is the LMCache CPU pool: the whole RAM store,
    or the staging buffer of the disk store. Bundles are cut into chunks of ``chunk_bytes``.

    Disk stores only: ``gc_on_start`` removes leftovers of interrupted and lost writes older
    than ``gc_grace_s`` seconds when the store is built, scanning at most ``gc_max_files``
    directory entries (:func:`vllm_recoverssm.checkpoint.gc.collect_garbage`).

    ``hmac_key_env`` (the name of an environment variable) or ``hmac_key_file`` (a file) holds
    a secret key of at least 32 bytes: the store then signs every manifest with HMAC-SHA256
    and restores only bundles signed with that key. Use it when others can write the
    checkpoint directory; the checksums alone only catch accidental damage.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["ram", "disk"]
    path: Path | None = None
    ram_bytes: int = Field(default=256 * MiB, ge=MiB)
    chunk_bytes: int = Field(default=8 * MiB, ge=4096)
    timeout_s: int = Field(default=30, ge=1)
    gc_on_start: bool = True
    gc_grace_s: int = Field(default=DEFAULT_GRACE_S, ge=MIN_GRACE_S)
    gc_max_files: int = Field(default=100_000, ge=1, le=MAX_FILES_LIMIT)
    hmac_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
    hmac_key_file: Path | None = None

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        if self.backend == "disk":
            if self.path is None:
                raise ValueError("backend 'disk' needs a path (the checkpoint directory)")
            if not self.path.is_absolute():
                raise ValueError(f"path {str(self.path)!r} must be absolute")
        elif self.path is not None:
            raise ValueError("backend 'ram' takes no path; use backend 'disk' to write files")
        if self.gc_grace_s <= self.timeout_s:
            raise ValueError(
                f"gc_grace_s ({self.gc_grace_s}) must exceed timeout_s ({self.timeout_s}): "
                "a write may take that long"
            )
        if self.hmac_key_env is not None and self.hmac_key_file is not None:
            raise ValueError("give hmac_key_env or hmac_key_file, not both")
        if self.hmac_key_file is not None and not self.hmac_key_file.is_absolute():
            raise ValueError(f"hmac_key_file {str(self.hmac_key_file)!r} must be absolute")
        if 2 * self.chunk_bytes > self.ram_bytes:
            raise ValueError(
                f"chunk_bytes ({self.chunk_bytes}) must be at most half of ram_bytes "
                f"({self.ram_bytes}): a chunk is staged in LMCache's CPU pool"
            )
        return self
