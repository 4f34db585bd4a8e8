"""Run one engine under vLLM's model runner V2 on the CPU: ``python -m`` this module.

Runner V2 is what vLLM picks on a CUDA GPU, and the only runner whose model state commits
(and whose align mode serves prefix caching) for hybrid models. vLLM's CPU platform has a
V2 runner too (``v1/worker/cpu/model_runner.py``, vLLM's GPU runner on CPU tensors), but
enables it only with a Triton that has a CPU backend: its input preparation, sampling and
n-gram drafting are Triton kernels. The CPU build's Triton has none, so this launcher

* sets ``TRITON_INTERPRET=1``: Triton then runs every kernel in its interpreter, on CPU
  tensors (as our own kernel tests do);
* names a ``cpu`` entry in Triton's backend table, which is what vLLM's CPU build checks
  before it turns Triton on (``vllm/triton_utils/importing.py``). The entry is never
  compiled for: the interpreter runs kernels without a backend;
* drafts from the oracle file in place of V2's n-gram speculator, because V2 has no
  ``custom_class`` drafter (``VllmConfig._get_v2_model_runner_unsupported_features``).
  The engine gets ``method="ngram"`` (``"ngram_gpu"``, the same speculator, with
  asynchronous scheduling); the oracle then writes the draft tensor the n-gram
  kernels would have written, for the same rows;
* with ``ASYNC_SCHEDULING`` set to ``1`` in its environment, turns asynchronous scheduling
  back on after vLLM's CPU platform turned it off (``platforms/cpu.py``: "not required on
  CPU"). On a GPU vLLM schedules asynchronously by default with MTP, EAGLE or DFlash
  drafting: it plans each step before the previous step's sampled tokens are known, so the
  runner's host-side sequence lengths are upper bounds that count every draft in flight as
  accepted. The scheduler (``AsyncScheduler`` with vLLM's batch queue) and the runner's
  bounds are vLLM's own; none of that depends on the platform.

Everything else (scheduler, runner V2, its model state and commit, the plugin) is vLLM's
and ours, unchanged. It runs in a fresh process: the fork server has imported vLLM before
any of this could apply. The tests and ``recoverssm demo --engine vllm --gpu-defaults``
launch engines through it (:data:`GPU_DEFAULTS` is that demo's environment).
"""

from __future__ import annotations

import os
import sys
from typing import Any

MODULE = "vllm_recoverssm.harness.runner_v2"
ENVIRONMENT = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
ASYNC_SCHEDULING = "RECOVERSSM_TEST_ASYNC_SCHEDULING"
"""Environment variable: ``1`` runs the engine with asynchronous scheduling (docstring)."""
ASYNC_LINE = "recoverssm tests: asynchronous scheduling turned on"
"""Printed to stderr whenever the launchers set vLLM's config to schedule asynchronously."""
GPU_DEFAULTS = {**ENVIRONMENT, ASYNC_SCHEDULING: "1", "PYTHONOPTIMIZE": "1"}
"""Runner V2 with asynchronous scheduling, for engines with prefix caching in align mode:
``PYTHONOPTIMIZE`` because vLLM's align-mode state-index step asserts that its input lives
on a CUDA device before it launches its Triton kernel, which runs in the interpreter on
CPU tensors like every other."""


def _name_a_cpu_backend() -> None:
    import triton.backends as backends

    class _Driver:
        @staticmethod
        def is_active() -> bool:
            return False

    backends.backends.setdefault("cpu", backends.Backend(compiler=None, driver=_Driver))


def _schedule_asynchronously() -> None:
    """Undo the CPU platform's ``async_scheduling = False`` (module docstring), saying so
    (``ASYNC_LINE``)."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True
        print(ASYNC_LINE, file=sys.stderr, flush=True)

    CpuPlatform.check_and_update_config = classmethod(  # type: ignore[method-assign,assignment]
        check_and_update_config)


def _oracle_drafts() -> None:
    """Draft from the oracle file in V2's n-gram speculator (module docstring)."""
    import torch
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    from vllm_recoverssm.harness.oracle_drafter import OracleProposer

    original_init = NgramGPUSpeculator.__init__

    def init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, vllm_config, *args, **kwargs)
        self.oracle = OracleProposer(vllm_config)

    @torch.inference_mode()
    def propose(self: Any, input_batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        num_reqs = input_batch.num_reqs
        if kwargs.get("dummy_run"):
            return self.drafts[:num_reqs]
        num_sampled = kwargs["num_sampled"] if "num_sampled" in kwargs else args[4]
        states = self.req_states
        rows = input_batch.idx_mapping.tolist()
        lengths = states.total_len.gpu.tolist()
        self.drafts[:num_reqs].zero_()
        for b, row in enumerate(rows):
            if int(num_sampled[b]) <= 0:
                continue
            history = states.all_token_ids.gpu[row, : lengths[row]].tolist()
            drafted = self.oracle.draft_for(history)
            if drafted:
                self.drafts[b, : len(drafted)] = torch.tensor(drafted, dtype=self.drafts.dtype)
        return self.drafts[:num_reqs]

    NgramGPUSpeculator.__init__ = init  # type: ignore[method-assign]
    NgramGPUSpeculator.propose = propose  # type: ignore[method-assign]


def oracle_speculative_config(num_spec: int, *, asynchronous: bool) -> dict[str, Any]:
    """The speculative config an engine under this launcher gets for the oracle drafting:
    V2's n-gram speculator, whose drafts :func:`_oracle_drafts` replaces. ``"ngram_gpu"``,
    the name vLLM accepts with asynchronous scheduling, is the same speculator under V2."""
    return {"method": "ngram_gpu" if asynchronous else "ngram",
            "num_speculative_tokens": num_spec, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _oracle_as_ngram() -> None:
    from vllm_recoverssm.harness import run_engine
    from vllm_recoverssm.harness.oracle_drafter import CLASS_PATH

    original = run_engine.llm_kwargs

    def llm_kwargs(run: Any) -> dict[str, Any]:
        kwargs = original(run)
        spec = kwargs["speculative_config"]
        if spec.get("model") == CLASS_PATH:
            kwargs["speculative_config"] = oracle_speculative_config(
                int(spec["num_speculative_tokens"]),
                asynchronous=os.environ.get(ASYNC_SCHEDULING) == "1")
        return kwargs

    run_engine.llm_kwargs = llm_kwargs  # type: ignore[assignment]


def prepare(asynchronous: bool) -> None:
    """Make this process run runner V2 on the CPU with the oracle drafting, scheduling
    asynchronously when ``asynchronous`` (module docstring); the engine's own arguments
    stay the caller's."""
    os.environ.update(ENVIRONMENT)
    _name_a_cpu_backend()
    if asynchronous:
        _schedule_asynchronously()
    _oracle_drafts()


def main(argv: list[str]) -> int:
    """``python -m vllm_recoverssm.harness.runner_v2 SPEC REPORT`` (see ``run_engine.main``)."""
    prepare(asynchronous=os.environ.get(ASYNC_SCHEDULING) == "1")
    _oracle_as_ngram()
    from vllm_recoverssm.harness.run_engine import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
