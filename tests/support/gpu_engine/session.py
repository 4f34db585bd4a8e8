"""Run the GPU engine tests' cases: ``python -m tests.support.gpu_engine.session OUT CASES BUDGET``.

Each case builds three of vLLM's real offline engines (``vllm.LLM``) on a CUDA GPU, one
after the other in this process, with the tiny all-KDA GLM-5.3
(:func:`vllm_recoverssm.harness.tiny_model.write_tiny_glm53`, random bf16 weights):

* ``cold``: recovery off (full speculative states), no oracle file, so every draft is
  wrong. Its greedy output is the continuation the oracle drafts; comparing it with ``off``
  shows whether the full-state output of a request depends on the draft pattern at all;
* ``on`` and ``off``: recovery on, and recovery off (the reference), with the same oracle
  drafts of ``cold``'s continuation, :data:`CORRUPT` of the drafted tokens corrupted
  (:mod:`vllm_recoverssm.harness.oracle_drafter`).

Every engine is one :func:`vllm_recoverssm.harness.run_engine.run` (its kwargs from
``llm_kwargs``, plus :func:`case_kwargs`), asks for the :data:`LOGPROBS` best tokens'
log-probabilities, and writes ``OUT/CASE/MODE.json`` (the harness's ``EngineReport`` plus
the runner class, CUDA-graph mode and start-up time). One process holds them all: vLLM's
import and the Triton kernels' first compilation are paid once. ``OUT/env.json`` records the
platform checks (:func:`environment_checks`); a case that raised writes
``OUT/CASE/error.txt``, one left out for the time budget ``OUT/CASE/skipped.txt``.

A case name is ``RUNNER-spec{K}[-graphs][-async][-prefix]``: ``v1`` (vLLM's V1 GPU runner:
the oracle is a ``custom_class`` drafter, which V2 does not take) or ``v2`` (runner V2,
vLLM's GPU default: its n-gram speculator, whose drafts the oracle writes, as
``vllm_recoverssm/harness/runner_v2.py`` does on the CPU); ``graphs``: CUDA graphs (vLLM's default
compilation, not ``enforce_eager``); ``async``: asynchronous scheduling; ``prefix``: prefix
caching (align mode), with a second wave repeating every prompt.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROMPT_LENGTHS = (5, 90, 17, 41, 3, 64)
"""Token-id prompts: one shorter than a draft, two over a 32-token prefill chunk."""
MAX_TOKENS = 24
CORRUPT = 0.3
LOGPROBS = 2
"""Best tokens whose log-probabilities each engine reports (the sampled one comes too)."""
ENGINE = dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=4)
"""32-token prefill chunks, 4 sequences: several chunks per prompt, mixed batches."""
CASES = ("v1-spec3", "v2-spec3", "v2-spec7-prefix", "v2-spec3-graphs-async", "v1-spec7")
MIN_CASE_S = 60.0
"""A case is not started with less of the budget left."""


@dataclass(frozen=True)
class Case:
    name: str
    runner: str
    num_spec: int
    graphs: bool
    asynchronous: bool
    prefix: bool


def parse_case(name: str) -> Case:
    parts = name.split("-")
    if parts[0] not in ("v1", "v2") or len(parts) < 2 or not parts[1].startswith("spec"):
        raise ValueError(f"bad case name {name!r}: RUNNER-spec{{K}}[-graphs][-async][-prefix]")
    unknown = set(parts[2:]) - {"graphs", "async", "prefix"}
    if unknown:
        raise ValueError(f"bad case name {name!r}: unknown {sorted(unknown)}")
    return Case(name=name, runner=parts[0], num_spec=int(parts[1].removeprefix("spec")),
                graphs="graphs" in parts, asynchronous="async" in parts, prefix="prefix" in parts)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 511) for _ in range(n)] for n in PROMPT_LENGTHS]


def case_kwargs(case: Case) -> dict[str, Any]:
    """What a case adds to the harness's ``llm_kwargs`` (``additional_config`` is merged)."""
    from vllm_recoverssm.harness import runner_v2

    kwargs: dict[str, Any] = dict(
        # vLLM's PyTorch forms of norms and activations (the stand-ins do not compute those)
        compilation_config={"custom_ops": ["none"]},
        enforce_eager=not case.graphs, enable_prefix_caching=case.prefix,
        async_scheduling=case.asynchronous,
        # the Triton chunked prefill: FlashKDA's compiled extension does not travel
        additional_config={"kda_prefill_backend": "triton"},
    )
    if case.runner == "v2":
        kwargs["speculative_config"] = runner_v2.oracle_speculative_config(
            case.num_spec, asynchronous=case.asynchronous)
    return kwargs


# ---------------------------------------------------------------- checks and engines
def environment_checks() -> dict[str, Any]:
    """The platform plumbing the cases rely on: CUDA platform, plugins found, stand-ins."""
    import importlib.metadata as md

    import torch
    import vllm
    import vllm._custom_ops  # noqa: F401 - registers the stand-in ops
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(x)
    torch.ops._C.rms_norm(o, x, w, 1e-6)
    ref = torch.nn.functional.rms_norm(x.float(), (64,), w.float(), 1e-6)
    host = torch.arange(10, dtype=torch.int32).pin_memory()
    view = get_accelerator_view_from_cpu_tensor(host)
    host[3] = 99
    torch.cuda.synchronize()
    return dict(
        torch=torch.__version__, cuda=torch.version.cuda, device=torch.cuda.get_device_name(0),
        vllm=vllm.__version__, vllm_metadata=md.version("vllm"),
        platform=type(current_platform).__name__, is_cuda=bool(current_platform.is_cuda()),
        plugins=sorted(e.name for e in md.entry_points(group="vllm.general_plugins")),
        rms_norm_max_err=float((o.float() - ref).abs().max()),
        uva_view_sees_host_writes=bool(view.device.type == "cuda" and int(view[3]) == 99),
    )


_LAST: list[Any] = []
_CASE: list[Case] = []


def _install_hooks() -> None:
    """Keep each ``LLM`` this process builds (to release it) and add the current case's
    kwargs to the harness's; draft from the oracle in runner V2's n-gram speculator."""
    import vllm

    from vllm_recoverssm.harness import run_engine, runner_v2

    base = vllm.LLM

    class KeptLLM(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _LAST.append(self)

    vllm.LLM = KeptLLM  # type: ignore[misc]
    original = run_engine.llm_kwargs

    def llm_kwargs(run: Any) -> dict[str, Any]:
        kwargs = original(run)
        extra = case_kwargs(_CASE[-1])
        kwargs["additional_config"] = {**kwargs["additional_config"],
                                       **extra.pop("additional_config")}
        kwargs.update(extra)
        print(f"[gpu-engine] LLM kwargs: {kwargs}", flush=True)
        return kwargs

    run_engine.llm_kwargs = llm_kwargs  # type: ignore[assignment]
    runner_v2._oracle_drafts()  # patches only V2's n-gram speculator; V1 never builds it


def _release(llm: Any) -> None:
    import torch
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the next engine needs the memory
        pass
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()


def _release_all() -> None:
    """After a failed engine: free what it left (a built LLM, the distributed state)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    while _LAST:
        _release(_LAST.pop())
    gc.collect()
    cleanup_dist_env_and_memory()


def _engine(case: Case, mode: str, model: str, oracle: str | None) -> dict[str, Any]:
    from vllm_recoverssm.harness import run_engine, vllm_engine
    from vllm_recoverssm.harness.run_engine import EngineRun
    from vllm_recoverssm.vllm_plugin import compat

    ps = prompts()
    spec = EngineRun(mode=mode, num_spec=case.num_spec, model=model, oracle=oracle,  # type: ignore[arg-type]
                     prompts=ps, max_tokens=MAX_TOKENS, engine=dict(ENGINE), logprobs=LOGPROBS,
                     waves=[list(ps)] if case.prefix else [])
    t0 = time.perf_counter()
    report = run_engine.run(spec)
    total = time.perf_counter() - t0
    llm = _LAST.pop()
    out = report.model_dump(mode="json")
    cfg = llm.llm_engine.vllm_config
    try:
        runner = vllm_engine.in_process_model_runner(compat.in_process_engine_core(llm))
        out["runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
    except Exception as exc:  # noqa: BLE001 - reported, not needed
        out["runner"] = f"n/a ({type(exc).__name__})"
    out["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
    out["mamba_cache_mode"] = str(getattr(cfg.cache_config, "mamba_cache_mode", None))
    out["total_s"] = round(total, 1)
    _release(llm)
    return out


def run_case(case: Case, model: str, out: Path) -> None:
    from vllm_recoverssm.harness.oracle_drafter import write_oracle

    out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if case.runner == "v2" else "0"
    # vLLM caches its environment settings once an engine core has started
    # (``envs.enable_envs_cache``); the runner choice of this case must be read afresh
    from vllm import envs

    getattr(envs, "disable_envs_cache", lambda: None)()
    _CASE.append(case)
    cold = _engine(case, "off", model, None)
    (out / "cold.json").write_text(json.dumps(cold))
    oracle = write_oracle(out / "oracle.json", [(p + c, CORRUPT) for p, c in
                                                zip(prompts(), cold["outputs"], strict=True)])
    for mode in ("on", "off"):
        (out / f"{mode}.json").write_text(json.dumps(_engine(case, mode, model, str(oracle))))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    start = time.perf_counter()
    out, names, budget = Path(argv[0]), argv[1].split(","), float(argv[2])
    cases = [parse_case(n) for n in names]
    out.mkdir(parents=True, exist_ok=True)
    from vllm_recoverssm.harness.run_engine import engine_environment

    for key, value in engine_environment().items():
        os.environ.setdefault(key, value)
    from vllm_recoverssm.harness.random_loader import register_loader
    from vllm_recoverssm.harness.tiny_model import write_tiny_glm53

    register_loader()
    try:
        checks = environment_checks()
    except Exception:  # noqa: BLE001 - the platform test reports it; the cases still run
        checks = {"error": traceback.format_exc()}
        traceback.print_exc()
    (out / "env.json").write_text(json.dumps(checks))
    _install_hooks()
    model = str(write_tiny_glm53(out / "tiny-glm53"))
    for case in cases:
        left = budget - (time.perf_counter() - start)
        where = out / case.name
        where.mkdir(parents=True, exist_ok=True)
        if left < MIN_CASE_S:
            (where / "skipped.txt").write_text(f"{left:.0f} s of the budget left")
            print(f"[gpu-engine] {case.name}: skipped ({left:.0f} s left)", flush=True)
            continue
        print(f"[gpu-engine] {case.name}: {asdict(case)} ({left:.0f} s left)", flush=True)
        t = time.perf_counter()
        try:
            run_case(case, model, where)
        except Exception:  # noqa: BLE001 - reported to the test; the next case still runs
            (where / "error.txt").write_text(traceback.format_exc())
            traceback.print_exc()
            _release_all()
        print(f"[gpu-engine] {case.name}: done in {time.perf_counter() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
