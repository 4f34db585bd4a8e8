"""LMCache missing or misconfigured is a clear error when the store is built, never later."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.support.checkpoint_stores import make_identity
from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointConfigError, CheckpointStore

pytestmark = pytest.mark.lmcache


def test_lmcache_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "lmcache":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(CheckpointConfigError, match="LMCache is not installed.*install-lmcache"):
        CheckpointStore(CheckpointConfig(backend="ram"), make_identity())


def test_lmcache_of_another_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.9")
    with pytest.raises(CheckpointConfigError, match="LMCache 0.3.9 is installed.*0.5.x"):
        CheckpointStore(CheckpointConfig(backend="ram"), make_identity())


def test_lmcache_that_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lmcache.v1.storage_backend.remote_backend", None)
    with pytest.raises(CheckpointConfigError, match="cannot be imported"):
        CheckpointStore(CheckpointConfig(backend="ram"), make_identity())


def test_fs_backend_without_aiofiles_fails_at_start_up(tmp_path: Path) -> None:
    # Without aiofiles LMCache's fs connector is never created and would store nothing.
    code = (
        "import sys; sys.modules['aiofiles'] = None; from pathlib import Path\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from tests.support.checkpoint_stores import make_identity\n"
        "from vllm_recoverssm.checkpoint import *\n"
        "try:\n"
        f"    CheckpointStore(CheckpointConfig(backend='disk', path=Path({str(tmp_path)!r})),"
        " make_identity())\n"
        "except CheckpointConfigError as e:\n"
        "    print('ERROR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "aiofiles" in out.stdout, out.stdout


@pytest.mark.parametrize("kind", ["file", "under a file"])
def test_unusable_directory(tmp_path: Path, kind: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    path = blocker if kind == "file" else blocker / "ckpt"
    with pytest.raises(CheckpointConfigError, match="checkpoint directory .*blocker"):
        CheckpointStore(CheckpointConfig(backend="disk", path=path), make_identity())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"backend": "disk"}, "needs a path"),
        ({"backend": "disk", "path": Path("relative/dir")}, "must be absolute"),
        ({"backend": "ram", "path": Path("/x")}, "takes no path"),
        ({"backend": "ram", "ram_bytes": 2**20, "chunk_bytes": 2**20}, "at most half"),
        ({"backend": "tape"}, "backend"),
        ({"backend": "ram", "ram_bytes": 10}, "ram_bytes"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CheckpointConfig(**settings)


def test_store_needs_a_config_and_an_identity() -> None:
    with pytest.raises(CheckpointConfigError, match="config"):
        CheckpointStore({"backend": "ram"}, make_identity())  # type: ignore[arg-type]
    with pytest.raises(CheckpointConfigError, match="identity"):
        CheckpointStore(CheckpointConfig(backend="ram"), {"model": "x"})  # type: ignore[arg-type]
