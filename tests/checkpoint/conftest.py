"""Shared fixtures: stores over the real LMCache backends (built per test: cheap once imported)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointStore, LayoutIdentity

from .helpers import make_identity

MiB = 2**20


@pytest.fixture
def identity() -> LayoutIdentity:
    """The default test layout."""
    return make_identity()


def open_store(
    backend: str, path: Path | None, identity: LayoutIdentity, **cfg: int
) -> CheckpointStore:
    """A store with small pools and 4 KiB chunks, so test bundles span several parts."""
    settings: dict[str, object] = {"ram_bytes": 16 * MiB, "chunk_bytes": 4096}
    settings.update(cfg)
    config = CheckpointConfig(
        backend=backend,  # type: ignore[arg-type]
        path=path if backend == "disk" else None,
        **settings,  # type: ignore[arg-type]
    )
    return CheckpointStore(config, identity)


@pytest.fixture(params=["ram", "disk"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, identity: LayoutIdentity
) -> Iterator[CheckpointStore]:
    """A store on each backend."""
    s = open_store(request.param, tmp_path / "ckpt", identity)
    yield s
    s.close()


@pytest.fixture
def disk_store(tmp_path: Path, identity: LayoutIdentity) -> Iterator[CheckpointStore]:
    """A disk store under ``tmp_path / "ckpt"``."""
    s = open_store("disk", tmp_path / "ckpt", identity)
    yield s
    s.close()
