"""Engine-test helpers: prompts, the oracle file, and a pair of engines (recovery on/off).

Each engine is vLLM's real ``LLM`` in a process of its own
(:func:`vllm_recoverssm.harness.run_engine.run_in_subprocess`): one engine per
process is a limit of vLLM's CPU platform.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vllm_recoverssm.harness import runner_v2
from vllm_recoverssm.harness.oracle_drafter import write_oracle
from vllm_recoverssm.harness.run_engine import (
    MODULE,
    EngineReport,
    EngineRun,
    run_in_subprocess,
)

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
PROMPT_LENGTHS = (5, 90, 17, 41, 3, 64)
"""Two prompts longer than a 32-token chunk, one shorter than any window."""
MAX_TOKENS = 24
CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=4)
"""Four rows at a time and 32-token chunks: prompt chunks and verify rows share steps."""
FUSED_LINE = "commit: fused into the next verify"
"""What the plugin logs when the default commit fuses into the next verify."""


def tiny_layer_page(num_spec: int) -> int:
    """Bytes of one KDA layer's page of the tiny GLM-5.3 (``write_tiny_glm53``): a bf16
    conv history of 3 x 512 channels and ``Kc - 1 + S`` columns, and an FP32 state of 4
    heads of 128 x 128. A state block of vLLM holds its three layers' pages."""
    return 3 * 512 * (3 + num_spec) * 2 + 4 * 128 * 128 * 4


def prompts(seed: int = 0, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """Random token-id prompts (the tiny model's vocabulary is 512)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 511) for _ in range(n)] for n in lengths]


def environment() -> dict[str, str]:
    """This checkout first on the engine process's path; under pytest-xdist, the engine's
    OpenMP bound to a core of this worker's own (one each while there are enough cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])
    return env


def run_engine(spec: EngineRun, workdir: Path, env: dict[str, str] | None = None,
               module: str = MODULE) -> EngineReport:
    """One engine, in a fresh process (``env``: more environment for it; ``module``: the
    entry point that runs it, see ``run_in_subprocess``)."""
    return run_in_subprocess(spec, workdir, env={**environment(), **(env or {})},
                             module=module)


def run_v2(spec: EngineRun, workdir: Path, *, align: bool = False,
           asynchronous: bool = False, env: dict[str, str] | None = None) -> EngineReport:
    """One engine under model runner V2 (:mod:`vllm_recoverssm.harness.runner_v2`), in a
    fresh process.

    ``align``: with ``PYTHONOPTIMIZE``, because vLLM's align-mode state-index step asserts
    that its input lives on a CUDA device before it launches its Triton kernel
    (``MambaStateContext.compute_aligned_state_indices``); the kernel itself runs in the
    interpreter on CPU tensors like every other. ``asynchronous``: with vLLM's
    asynchronous scheduling, as on a GPU. ``env``: more environment (e.g. the core of
    :func:`side_by_side`).
    """
    more = {**(env or {}), **runner_v2.ENVIRONMENT}
    if align:
        more["PYTHONOPTIMIZE"] = "1"
    if asynchronous:
        more[runner_v2.ASYNC_SCHEDULING] = "1"
    report = run_engine(spec, workdir, more, module=runner_v2.MODULE)
    assert report.async_scheduling is asynchronous
    return report


def side_by_side(jobs: Sequence[Callable[[dict[str, str]], T]]) -> list[T]:
    """Run ``jobs`` at once, each told the core its engine's OpenMP binds to, when this
    machine gives us a core per job; one after the other otherwise."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(jobs):
        return [job({}) for job in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(job, {"VLLM_CPU_OMP_THREADS_BIND": str(cores[i])})
                   for i, job in enumerate(jobs)]
        return [f.result() for f in futures]


@dataclass
class Pair:
    """The same run with recovery forced on and turned off."""

    on: EngineReport
    off: EngineReport


def run_pair(workdir: Path, **spec: Any) -> Pair:
    """Run ``EngineRun(**spec)`` with ``mode`` on and off, side by side where there is a
    core for each."""
    on, off = side_by_side([
        lambda env: run_engine(EngineRun(mode="on", **spec), workdir, env),
        lambda env: run_engine(EngineRun(mode="off", **spec), workdir, env),
    ])
    return Pair(on=on, off=off)


def oracle_file(path: Path, prompt_list: list[list[int]], continuations: list[list[int]],
                corrupt: float) -> str:
    """An oracle file drafting ``continuations`` with a share ``corrupt`` of wrong drafts."""
    return str(write_oracle(path, [(p + c, corrupt) for p, c in zip(prompt_list,
                                                                   continuations, strict=True)]))


class ColdRun:
    """The shared first engine: full states, every draft wrong (no oracle file)."""

    def __init__(self, model: str, workdir: Path) -> None:
        self.model = model
        self.workdir = workdir
        self.spec = dict(model=model, num_spec=3, prompts=prompts(), max_tokens=MAX_TOKENS,
                         engine=CHUNKED)
        self.report = run_engine(EngineRun(mode="off", **self.spec), workdir)

    @property
    def continuations(self) -> list[list[int]]:
        """The model's greedy continuations of :func:`prompts`."""
        return self.report.outputs
