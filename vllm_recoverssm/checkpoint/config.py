"""Settings of a checkpoint store, checked when the store is built."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MiB = 2**20


class CheckpointConfig(BaseModel):
    """Where bundles go and how much memory the store may use.

    ``backend="ram"`` keeps bundles in LMCache's CPU memory (lost when the process ends);
    ``backend="disk"`` writes them through LMCache's ``fs://`` backend under ``path`` so that
    a fresh process finds them. ``ram_bytes`` is the LMCache CPU pool: the whole RAM store,
    or the staging buffer of the disk store. Bundles are cut into chunks of ``chunk_bytes``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["ram", "disk"]
    path: Path | None = None
    ram_bytes: int = Field(default=256 * MiB, ge=MiB)
    chunk_bytes: int = Field(default=8 * MiB, ge=4096)
    timeout_s: int = Field(default=30, ge=1)

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        if self.backend == "disk":
            if self.path is None:
                raise ValueError("backend 'disk' needs a path (the checkpoint directory)")
            if not self.path.is_absolute():
                raise ValueError(f"path {str(self.path)!r} must be absolute")
        elif self.path is not None:
            raise ValueError("backend 'ram' takes no path; use backend 'disk' to write files")
        if 2 * self.chunk_bytes > self.ram_bytes:
            raise ValueError(
                f"chunk_bytes ({self.chunk_bytes}) must be at most half of ram_bytes "
                f"({self.ram_bytes}): a chunk is staged in LMCache's CPU pool"
            )
        return self
