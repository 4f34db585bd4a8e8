"""Shared fixtures: stores over the real LMCache backends (built per test: cheap once imported)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.checkpoint_stores import make_identity, open_store
from vllm_recoverssm.checkpoint import CheckpointStore, LayoutIdentity


@pytest.fixture
def identity() -> LayoutIdentity:
    """The default test layout."""
    return make_identity()


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
