"""The backend registry's per-call choice and the tuning knobs' setter."""

from __future__ import annotations

import pytest
import torch

from vllm_recoverssm.bench import tune
from vllm_recoverssm.ops import backends, tuning


def test_use_kernels_by_backend_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert backends.use_kernels("auto", gpu) and not backends.use_kernels("auto", cpu)
    assert not backends.use_kernels("auto", gpu, kernels_serve=False)
    assert not backends.use_kernels("reference", gpu)
    assert backends.use_kernels("triton", gpu, kernels_serve=False)  # forced: kernels refuse
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton' on cpu tensors needs TRITON_INTERPRET=1"):
        backends.use_kernels("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.use_kernels("triton", cpu)
    with pytest.raises(ValueError, match="argument 'backend': expected one of"):
        backends.use_kernels("cuda", gpu)


def test_tuned_puts_the_knobs_back() -> None:
    before = tuning.current()
    with tuning.tuned(verify_kernel="serial", cuda_rows=16) as knobs:
        assert knobs is tuning.current()
        assert (knobs.verify_kernel, knobs.cuda_rows) == ("serial", 16)
        with tune.overrides({"commit_loop": "prefetch"}):
            assert tuning.current().commit_loop == "prefetch"
            assert tuning.current().verify_kernel == "serial"
        assert tuning.current().commit_loop is None
    assert tuning.current() is before


def test_bad_knobs_are_refused_by_name() -> None:
    before = tuning.current()
    with pytest.raises(ValueError, match="'cuda_rows': expected one of"):
        tuning.set_tuning(cuda_rows=24)
    with pytest.raises(ValueError, match="'tile': not a kernel tuning knob"):
        tuning.set_tuning(tile=(16, 1, 2))
    assert tuning.current() is before


def test_every_tune_variant_is_a_valid_tuning() -> None:
    for _, _, over in tune._variants():
        tuning.KernelTuning(**over)  # type: ignore[arg-type]


def test_a_forced_verify_kernel_is_honoured_and_checked() -> None:
    state = torch.zeros(2, 2, 16, 16)
    with tuning.tuned(verify_kernel="serial"):
        assert backends.verify_kernel(-5.0, 4, state) == "serial"
    with tuning.tuned(verify_kernel="window"), \
            pytest.raises(ValueError, match="'lower_bound': the window kernels need a bounded"):
        backends.verify_kernel(None, 4, state)
    assert backends.verify_kernel(None, 4, state) == "serial"
