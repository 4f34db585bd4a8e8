"""Fixtures for the vLLM plugin tests: real ``VllmConfig`` objects for a tiny GLM-5.3.

Every test here needs the vLLM package (the CPU build is enough) and is marked ``vllm``;
they are skipped when vLLM is not importable. Configs are built through vLLM's own
``EngineArgs`` (so the plugin is loaded through its entry point, as in ``vllm serve``)
and cached per session: each build takes seconds.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.tiny_glm import write_tiny_glm53
from tests.support.vllm_configs import BASE_ARGS, MTP3

# vLLM (CPU build) must not spawn engine processes from these tests.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``vllm``."""
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def tiny_glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-5.3 checkpoint directory (config.json only)."""
    return write_tiny_glm53(tmp_path_factory.mktemp("glm53"))


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


@pytest.fixture(scope="session")
def cold_run(vllm_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny all-KDA GLM-5.3 and its greedy continuations from vLLM's engine (one
    engine run, shared by the engine tests)."""
    from tests.support.engine import ColdRun
    from vllm_recoverssm.harness.tiny_model import write_tiny_glm53

    model = write_tiny_glm53(tmp_path_factory.mktemp("tiny-glm53"))
    return ColdRun(str(model), tmp_path_factory.mktemp("engine-runs"))


@pytest.fixture(scope="module")
def distributed(build_config: Any) -> None:
    """A one-process gloo group: vLLM's parallel layers ask for the TP size."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(build_config(*MTP3)):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                        distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        backend="gloo")
        ps.initialize_model_parallel(1, 1)
