"""``python -m vllm_recoverssm.bench.profile``: its arguments are checked before any GPU work."""

from __future__ import annotations

import pytest
import torch

from vllm_recoverssm.bench import profile


@pytest.mark.parametrize("argv, why", [
    (["--num-spec", "8"], "--num-spec expected 1..7, got 8"),
    (["--batch", "0"], "--batch and --heads must be positive"),
    (["--ops", "verify,nope"], "--ops expected some of"),
    (["--ops", ","], "--ops expected some of"),
    (["--ops", "fla_full"], "--ops expected some of"),
    (["--rows", "32"], "--rows pins the CUDA kernel's layout: it needs --kernel cuda"),
])
def test_bad_arguments_are_named(argv: list[str], why: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert profile.main(argv) == 2
    assert why in capsys.readouterr().err


def test_every_bench_column_but_the_peer_can_be_profiled() -> None:
    assert "verify" in profile.OPS and "fused_all" in profile.OPS
    assert "ours_full" in profile.OPS and "fla_full" not in profile.OPS


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert profile.main(["--kernel", "cuda", "--rows", "16", "--ops", "verify,ours_full"]) == 2
    assert "profile: needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_one_profiled_call_runs_on_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert profile.main(["--num-spec", "3", "--batch", "4", "--ops", "verify,fused_2,ours_full",
                         "--warmup", "1"]) == 0
    assert "profiled one call each of verify, fused_2, ours_full" in capsys.readouterr().out
