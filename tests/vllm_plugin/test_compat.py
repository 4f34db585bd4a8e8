"""The compatibility module: supported versions, the V1 commit hook, host independence."""

from __future__ import annotations

import inspect
from typing import Any
from unittest import mock

import pytest
import torch

from tests.support.vllm_configs import BASE_ARGS, MTP3
from vllm_recoverssm.vllm_plugin.patch import v1_runner


def test_supported_range_and_one_clear_error_outside_it(vllm_module: Any) -> None:
    from vllm_recoverssm.vllm_plugin import compat

    assert compat.check_supported_version("0.32.0+cpu") == (0, 32)
    assert compat.check_supported_version("0.33.1") == (0, 33)
    assert compat.check_supported_version() in compat.SUPPORTED_VLLM  # the installed one
    for bad in ("0.31.2", "0.34.0", "1.0.0", "nightly"):
        with pytest.raises(compat.UnsupportedVllmError) as info:
            compat.check_supported_version(bad)
        assert f"vLLM {bad} is installed" in str(info.value)
        assert "supports vLLM 0.32 to 0.33" in str(info.value)


def test_plugin_load_refuses_an_unsupported_vllm(vllm_module: Any) -> None:
    import vllm_recoverssm.vllm_plugin as plugin
    from vllm_recoverssm.vllm_plugin import compat

    with mock.patch.object(plugin, "_registered", False), \
            mock.patch.object(compat, "vllm_version", lambda: "0.35.0"), \
            pytest.raises(compat.UnsupportedVllmError, match="vLLM 0.35.0 is installed"):
        plugin.register()


def test_v1_commit_hook_runs_after_vllms_update_and_installs_once(vllm_module: Any) -> None:
    from vllm.v1.worker import gpu_model_runner

    from vllm_recoverssm.vllm_plugin import compat

    runner_cls = gpu_model_runner.GPUModelRunner
    saved = vars(runner_cls)[v1_runner.V1_HOOK]
    seen: list[str] = []

    def original(self: Any, output_token_ids: Any, scheduler_output: Any) -> str:
        seen.append("vllm")
        return "result"

    def hook(runner: Any, sampled: Any) -> None:
        seen.append(f"commit {sampled}")

    try:
        setattr(runner_cls, v1_runner.V1_HOOK, original)
        v1_runner.install_v1_commit_hook(hook)
        v1_runner.install_v1_commit_hook(hook)  # idempotent
        wrapped = getattr(runner_cls, v1_runner.V1_HOOK)
        assert wrapped(object(), "ids", None) == "result"
        assert seen == ["vllm", "commit ids"]
        # a method vLLM reshaped is refused at install time, not mid-request
        setattr(runner_cls, v1_runner.V1_HOOK, lambda self, tokens: None)
        with pytest.raises(compat.UnsupportedVllmError, match="cannot hook it"):
            v1_runner.install_v1_commit_hook(hook)
    finally:
        setattr(runner_cls, v1_runner.V1_HOOK, saved)
    params = list(inspect.signature(saved).parameters)
    assert params[:3] == ["self", "output_token_ids", "scheduler_output"]


def test_sampled_counts_read_vllms_padding(vllm_module: Any) -> None:
    from vllm_recoverssm.vllm_plugin.worker.commit import sampled_counts

    ids = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [1, 2, 3, 4]])
    assert sampled_counts(ids).tolist() == [2, 1, 4]


@pytest.mark.parametrize("bf16_cpu", [True, False], ids=["avx512-bf16", "no-avx512-bf16"])
def test_the_decision_does_not_depend_on_the_hosts_instruction_set(
    vllm_module: Any, tiny_glm: Any, bf16_cpu: bool
) -> None:
    """vLLM's CPU platform rewrites the SSM cache dtype on AVX512-BF16 hosts only; the
    deployment the plugin decides on is the same on both kinds of host."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_recoverssm.vllm_plugin.config import (
        decide_for_vllm_config,
        deployment_from_vllm_config,
    )

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(tiny_glm), *BASE_ARGS, *MTP3])
    with mock.patch.object(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_cpu):
        cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.cache_config.mamba_ssm_cache_dtype == ("float32" if bf16_cpu else "auto")
    d = deployment_from_vllm_config(cfg, gpu_capability=(9, 0))
    assert d.state_dtype == "float32"
    assert decide_for_vllm_config(cfg, gpu_capability=(9, 0)).use_recovery
