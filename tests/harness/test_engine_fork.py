"""Engines forked from the preloaded server report what a fresh ``python -m`` reports."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.engine import CHUNKED, environment, prompts, run_engine
from vllm_recoverssm.harness import engine_fork
from vllm_recoverssm.harness.run_engine import MODULE, EngineRun, engine_environment
from vllm_recoverssm.harness.tiny_model import write_tiny_glm53

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAIN = f"{MODULE}:main"
TIMING = {"seconds", "waves"}
LOGGED = {"warnings"}
"""Warning lines carry each process's id and clock."""


def test_a_forked_engine_reports_what_a_fresh_process_reports(tmp_path: Path) -> None:
    """Same outputs, drafts, decision and allocation; the fork takes the run's environment
    (here a KV-cache size that vLLM's CPU platform reads from it at engine start)."""
    model = write_tiny_glm53(tmp_path / "glm")
    spec = EngineRun(mode="on", model=str(model), num_spec=3, prompts=prompts(),
                     max_tokens=8, engine=CHUNKED)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    # the server starts (if no test here started it yet) under the plain environment
    plain = engine_environment(environment())
    assert engine_fork.run_forked(MAIN, [], plain, tmp_path / "usage.log", timeout=120) == 2
    fresh = run_engine(spec, tmp_path, {**env, engine_fork.DISABLE_ENV: "0"})
    forked = run_engine(spec, tmp_path, env)
    assert list(tmp_path.glob("run-*.log")), "the second run went through the fork server"
    assert forked.kv.num_blocks == fresh.kv.num_blocks
    assert forked.kv.allocated_bytes > 512 << 20  # 1 GiB, not the run's own 64 MiB
    assert forked.model_dump(exclude=TIMING | LOGGED) == fresh.model_dump(exclude=TIMING | LOGGED)


def test_a_failing_engine_gives_its_exit_code_and_log(tmp_path: Path) -> None:
    spec = EngineRun(mode="on", model=str(tmp_path / "no-such-model"), num_spec=3,
                     prompts=prompts(), max_tokens=4)
    with pytest.raises(RuntimeError, match=r"engine run failed \(exit 1\)") as err:
        run_engine(spec, tmp_path)
    assert "no-such-model" in str(err.value)
    assert list(tmp_path.glob("run-*.log"))


def test_a_hung_engine_is_killed_at_its_timeout(tmp_path: Path) -> None:
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)  # reading a FIFO nobody writes blocks: the engine never starts
    env = engine_environment(environment())
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        engine_fork.run_forked(MAIN, [str(fifo), str(tmp_path / "r.json")], env,
                               tmp_path / "hung.log", timeout=5)
    assert time.monotonic() - start < 60
    # the server still serves: the next request is answered
    code = engine_fork.run_forked(MAIN, [], env, tmp_path / "usage.log", timeout=120)
    assert code == 2 and "usage:" in (tmp_path / "usage.log").read_text()


def test_the_fork_calls_the_function_the_request_names(tmp_path: Path) -> None:
    """Any ``module:function`` runs in the fork; its return value is the exit code."""
    env = engine_environment(environment())
    assert engine_fork.run_forked("builtins:len", ["a", "b", "c"], env,
                                  tmp_path / "len.log", timeout=120) == 3


def test_a_different_import_time_environment_starts_a_fresh_process() -> None:
    env = engine_environment(environment())
    other = "0" if env.get("TRITON_INTERPRET") == "1" else "1"
    assert engine_fork.run_forked(MAIN, [], {**env, "TRITON_INTERPRET": other},
                                  Path(os.devnull), timeout=1) is None
    assert engine_fork.run_forked(MAIN, [], {**env, engine_fork.DISABLE_ENV: "0"},
                                  Path(os.devnull), timeout=1) is None


def test_a_server_that_dies_at_start_leaves_the_run_to_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that cannot start forks nothing: the run falls back to ``python -m``,
    whose error names the cause (here an interpreter setting Python refuses)."""
    monkeypatch.setattr(engine_fork, "_clients", [])  # a server of this test's own
    spec = EngineRun(mode="on", model=str(tmp_path / "glm"), num_spec=3, prompts=prompts(),
                     max_tokens=4)
    with pytest.raises(RuntimeError, match="PYTHONHASHSEED"):
        run_engine(spec, tmp_path, {"PYTHONHASHSEED": "not-a-seed"})
    assert not list(tmp_path.glob("run-*.log"))  # nothing was forked
    assert not engine_fork._clients[0].alive
