"""The kernel-backend choice (a pure function; no GPU or vLLM needed)."""

from __future__ import annotations

import dataclasses
import importlib.util
from types import ModuleType

import pytest

from vllm_recoverssm.ops.b12x_kda import B12X_REQUIRED_CAPS_FIELDS
from vllm_recoverssm.ops.backends import (
    B12X_REQUIRED_API,
    b12x_has_recovery_api,
    choose_kernel_backend,
)


def run_kda(binding: object, *, lower_bound: float = -5.0,
            apply_output_norm: bool = True) -> None:
    """Stands in for b12x's ``run_kda`` (1.5: takes ``apply_output_norm``)."""


def old_run_kda(binding: object, *, lower_bound: float = -5.0) -> None:
    """A ``run_kda`` from before recovery mode (always applies the output norm)."""


def fake_b12x(*names: str, caps_fields: tuple[str, ...] = B12X_REQUIRED_CAPS_FIELDS,
              run: object = run_kda) -> ModuleType:
    attrs: dict[str, object] = {name: object() for name in names}
    if "Caps" in attrs:
        attrs["Caps"] = dataclasses.make_dataclass("Caps", [("device", str), *caps_fields])
    if "run_kda" in attrs:
        attrs["run_kda"] = run
    module = ModuleType("b12x.sequence.gdn_decode")
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


FULL = fake_b12x(*B12X_REQUIRED_API)
NO_COMMIT = fake_b12x(*(n for n in B12X_REQUIRED_API if n != "bind_kda_commit"))
NO_RECOVERY_CAPS = fake_b12x(*B12X_REQUIRED_API, caps_fields=tuple(
    f for f in B12X_REQUIRED_CAPS_FIELDS if f != "recover_speculative_state"))
NORMED_ONLY = fake_b12x(*B12X_REQUIRED_API, run=old_run_kda)


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
        ((12, 0), NO_RECOVERY_CAPS, "triton"),  # verify cannot keep records
        ((12, 0), NORMED_ONLY, "triton"),  # verify cannot return the pre-norm output
    ],
)
def test_choose_kernel_backend(capability: tuple[int, int] | None, b12x: ModuleType | None,
                               expected: str | None) -> None:
    assert choose_kernel_backend(capability, b12x) == expected


def test_b12x_api_check() -> None:
    assert b12x_has_recovery_api(FULL)
    assert not b12x_has_recovery_api(NO_COMMIT)
    assert not b12x_has_recovery_api(NO_RECOVERY_CAPS)
    assert not b12x_has_recovery_api(NORMED_ONLY)
    assert not b12x_has_recovery_api(fake_b12x(*B12X_REQUIRED_API[1:]))  # no Caps
    assert not b12x_has_recovery_api(None)


def test_installed_b12x_passes_the_api_check() -> None:
    module = pytest.importorskip("b12x.sequence.gdn_decode", reason="needs b12x")
    assert b12x_has_recovery_api(module)
    assert choose_kernel_backend((12, 0), module) == "b12x"
    assert choose_kernel_backend((12, 0)) == "b12x"  # "detect" imports the same module


def test_detect_without_b12x_installed_falls_back_to_triton() -> None:
    if importlib.util.find_spec("b12x") is not None:
        pytest.skip("b12x is installed here")
    assert choose_kernel_backend((12, 0)) == "triton"  # "detect" imports nothing usable


def test_the_plugin_runs_triton_where_b12x_would_be_picked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SM12x with a usable b12x: the plugin's rows run Triton, said once in the plugin's
    log (b12x's adapter refuses the plugin's row-indexed records: tests/vllm_plugin/models/
    glm5next/test_kda.py::test_b12x_adapter_refuses_the_plugins_record_scratch)."""
    from vllm_recoverssm.vllm_plugin import kernels

    monkeypatch.setattr(kernels, "choose_kernel_backend", lambda cap: choose_kernel_backend(
        cap, FULL))
    monkeypatch.setattr(kernels, "_said", [])
    said: list[str] = []
    assert [kernels.plugin_kernel_backend(c, said.append)
            for c in ((12, 0), (12, 1), (9, 0), None)] == ["triton", "triton", "triton", None]
    assert said == [kernels.B12X_NOT_USED]
