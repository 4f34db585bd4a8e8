"""The CUDA sources ship inside the package, and an install without them says so once."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from vllm_recoverssm.ops import cuda_window as cw

ROOT = Path(__file__).resolve().parents[2]


def test_sources_are_found_from_the_package() -> None:
    assert cw.CSRC == Path(cw.__file__).resolve().parent / "csrc"
    assert all((cw.CSRC / name).is_file() for name in cw.SOURCES)
    assert (cw.CSRC / "kda_window.cuh").is_file() and (cw.CSRC / "kda_math.cuh").is_file()


def test_wheel_holds_the_cuda_sources(tmp_path: Path) -> None:
    """A wheel built from the project carries every ``.cu`` / ``.cuh`` under
    ``vllm_recoverssm/ops/csrc/`` (built from a copy, offline, with the installed
    setuptools, so the working tree gets no build output)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "vllm_recoverssm", src / "vllm_recoverssm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheel"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-index",
         "--no-build-isolation", "-q", "-w", str(out)],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = out.glob("vllm_recoverssm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"vllm_recoverssm/ops/csrc/{p.name}" for p in cw.CSRC.iterdir()
                if p.suffix in (".cu", ".cuh")}
    assert len(expected) == 7
    assert expected <= names, sorted(expected - names)


def test_missing_sources_warn_once_and_name_triton(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """On a CUDA machine whose install lacks ``ops/csrc``, the first call to the library
    logs one warning saying which sources are missing and that Triton runs instead; later
    calls give the cached answer without a word."""
    monkeypatch.setattr(cw, "_state", {})
    monkeypatch.setattr(cw, "CSRC", tmp_path / "csrc")  # an empty install
    monkeypatch.delenv(cw.DISABLE_ENV, raising=False)
    monkeypatch.delenv(cw.DEFINES_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))

    def no_build(defines: object) -> None:
        raise AssertionError("nothing may be built without the sources")

    monkeypatch.setattr(cw, "_build", no_build)
    with caplog.at_level(logging.WARNING, logger=cw.__name__):
        assert cw.library() is None
        assert cw.library() is None
    warned = [r for r in caplog.records if r.name == cw.__name__]
    assert len(warned) == 1
    text = warned[0].getMessage()
    assert "Triton" in text and "kda_window_entry.cu" in text and str(tmp_path) in text
    assert "kda_window_entry.cu" in str(cw.unavailable_reason())


def test_a_failed_build_warns_once_and_names_triton(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cw, "_state", {})
    monkeypatch.delenv(cw.DISABLE_ENV, raising=False)
    monkeypatch.delenv(cw.DEFINES_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))

    def failing_build(defines: object) -> None:
        raise OSError("nvcc not found")

    monkeypatch.setattr(cw, "_build", failing_build)
    with caplog.at_level(logging.WARNING, logger=cw.__name__):
        for _ in range(3):
            assert cw.library() is None
    warned = [r.getMessage() for r in caplog.records if r.name == cw.__name__]
    assert len(warned) == 1
    assert "Triton" in warned[0] and "build failed (OSError: nvcc not found)" in warned[0]
