"""The kernel-backend choice (a pure function; no GPU or vLLM needed)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest

from vllm_recoverssm.vllm_plugin.kernels import (
    B12X_REQUIRED_API,
    b12x_has_recovery_api,
    choose_kernel_backend,
)


def fake_b12x(*names: str) -> ModuleType:
    module = ModuleType("b12x.sequence.gdn_decode")
    for name in names:
        setattr(module, name, object())
    return module


FULL = fake_b12x(*B12X_REQUIRED_API)
NO_COMMIT = fake_b12x(*(n for n in B12X_REQUIRED_API if n != "bind_kda_commit"))


@pytest.mark.parametrize(
    ("capability", "b12x", "expected"),
    [
        (None, FULL, None),  # no CUDA GPU
        ((7, 5), FULL, None),  # Turing: below SM80
        ((8, 0), None, "triton"),
        ((8, 6), FULL, "triton"),  # b12x is for SM12x only
        ((9, 0), FULL, "triton"),
        ((10, 0), FULL, "triton"),
        ((12, 0), FULL, "b12x"),
        ((12, 1), FULL, "b12x"),
        ((12, 0), None, "triton"),  # not installed
        ((12, 0), NO_COMMIT, "triton"),  # installed without the commit API
    ],
)
def test_choose_kernel_backend(capability: tuple[int, int] | None, b12x: ModuleType | None,
                               expected: str | None) -> None:
    assert choose_kernel_backend(capability, b12x) == expected


def test_b12x_api_check() -> None:
    assert b12x_has_recovery_api(FULL)
    assert not b12x_has_recovery_api(NO_COMMIT)
    assert not b12x_has_recovery_api(None)


def test_detect_without_b12x_installed_falls_back_to_triton() -> None:
    if importlib.util.find_spec("b12x") is not None:
        pytest.skip("b12x is installed here")
    assert choose_kernel_backend((12, 0)) == "triton"  # "detect" imports nothing usable
