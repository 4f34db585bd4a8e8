"""``recoverssm demo --engine vllm``: the tiny GLM-5.3 through vLLM's own engine, both modes.

Three engine processes (vLLM's ``LLM``, on whatever platform vLLM runs here; on a CPU the
plugin's KDA layer runs the project's PyTorch ops): one with full states and every draft
wrong, which yields the model's greedy continuations, then recovery and full states with
the oracle drafter corrupting drafts to reach the asked acceptance. It reports tokens/s,
draft acceptance from vLLM's counters, the state bytes each request holds as vLLM
allocated them (beside the planner's figure), vLLM's maximum concurrency for the same
KV-cache bytes, and whether the two outputs are identical.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..config.models import model_spec_from_hf_config
from ..state.planner import PlanConfig, plan
from .run_engine import EngineReport, EngineRun, run_in_subprocess
from .spec_decode.oracle import write_oracle
from .tiny_model import tiny_glm53_config, write_tiny_glm53

RecoveryFlag = Literal["on", "off"]
MODES: dict[str, RecoveryFlag] = {"recovery": "on", "full_state": "off"}
TITLES = {"recovery": "recovery", "full_state": "full-state"}


class EngineDemoOptions(BaseModel):
    """What the vLLM-engine demo runs."""

    num_requests: int = Field(default=8, ge=1, le=64)
    max_new_tokens: int = Field(default=32, ge=1, le=512)
    num_spec: int = Field(default=3, ge=1, le=7)
    acceptance: float = Field(default=0.7, ge=0.0, le=1.0)
    seed: int = Field(default=0, ge=0, le=2**31)
    max_num_seqs: int = Field(default=4, ge=1, le=64)
    kv_cache_bytes: int = Field(default=64 << 20, ge=1 << 20, le=1 << 34)


def corruption_for(acceptance: float, num_spec: int) -> float:
    """The per-draft corruption rate giving ``acceptance`` (accepted / drafted tokens).

    A window accepts drafts up to the first wrong one: with each draft wrong with
    probability ``q`` the expected share accepted is ``sum((1-q)**k, k=1..S) / S``.
    """
    def share(q: float) -> float:
        return sum((1 - q) ** k for k in range(1, num_spec + 1)) / num_spec

    lo, hi = 0.0, 1.0
    for _ in range(60):  # share() falls as q rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) > acceptance else (lo, mid)
    return (lo + hi) / 2


@dataclass
class EngineDemoReport:
    """Both modes' engine reports and the figures compared."""

    options: EngineDemoOptions
    prompt_lengths: list[int]
    corruption: float
    modes: dict[str, EngineReport]
    planner_bytes: dict[str, int]
    wall_seconds: float

    @property
    def outputs_identical(self) -> bool:
        """Recovery and full-state outputs equal token for token."""
        return self.modes["recovery"].outputs == self.modes["full_state"].outputs

    @property
    def bytes_match_planner(self) -> bool:
        """vLLM's allocation per request equals the planner's page reserve in both modes."""
        return all(self.modes[m].kv.state_bytes_per_request == self.planner_bytes[m]
                   for m in MODES)

    @property
    def ok(self) -> bool:
        """Identical outputs and the planner's figures."""
        return self.outputs_identical and self.bytes_match_planner

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "engine": "vllm", "vllm_version": self.modes["recovery"].vllm_version,
            "options": self.options.model_dump(), "prompt_lengths": self.prompt_lengths,
            "corruption": self.corruption, "outputs_identical": self.outputs_identical,
            "bytes_match_planner": self.bytes_match_planner, "wall_seconds": self.wall_seconds,
            "modes": {m: {"recovery": r.recovery, "tokens_per_s": r.tokens_per_s,
                          "acceptance": r.acceptance, "kv": r.kv.model_dump(),
                          "planner_state_bytes_per_request": self.planner_bytes[m],
                          "decision": r.decision} for m, r in self.modes.items()},
        }


Progress = Callable[[str], None]


def run_engine_demo(options: EngineDemoOptions, progress: Progress | None = None,
                    workdir: Path | None = None) -> EngineDemoReport:
    """Run the three engines (see the module docstring) and compare the two modes."""
    say = progress or (lambda _msg: None)
    start = time.monotonic()
    rng = random.Random(options.seed)
    config = tiny_glm53_config()
    vocab = int(config["vocab_size"])
    lengths = [rng.randrange(3, 97) for _ in range(options.num_requests)]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
    engine = dict(enable_chunked_prefill=True, max_num_batched_tokens=32,
                  max_num_seqs=options.max_num_seqs,
                  kv_cache_memory_bytes=options.kv_cache_bytes)
    with tempfile.TemporaryDirectory(prefix="recoverssm-demo-") as tmp:
        root = Path(tmp) if workdir is None else workdir
        model = str(write_tiny_glm53(root / "tiny-glm53"))

        def spec(mode: RecoveryFlag, oracle: str | None) -> EngineRun:
            return EngineRun(model=model, mode=mode, num_spec=options.num_spec,
                             oracle=oracle, prompts=prompts,
                             max_tokens=options.max_new_tokens, engine=engine)

        say("greedy continuations (full states, every draft wrong)")
        cold = run_in_subprocess(spec("off", None), root / "runs")
        q = corruption_for(options.acceptance, options.num_spec)
        oracle = write_oracle(root / "oracle.json",
                              [(p + c, q) for p, c in zip(prompts, cold.outputs, strict=True)])
        modes: dict[str, EngineReport] = {}
        for name, mode in MODES.items():
            say(f"{TITLES[name]} (recoverssm={mode})")
            modes[name] = run_in_subprocess(spec(mode, str(oracle)), root / "runs")
    p = plan(PlanConfig(model=model_spec_from_hf_config(config), tp=1,
                        num_spec=options.num_spec, max_num_seqs=options.max_num_seqs))
    planner = {"recovery": p.layout("recovery_scratch").reserve_bytes_per_request,
               "full_state": p.layout("full").reserve_bytes_per_request}
    return EngineDemoReport(options=options, prompt_lengths=lengths, corruption=q,
                            modes=modes, planner_bytes=planner,
                            wall_seconds=time.monotonic() - start)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def format_engine_report(report: EngineDemoReport) -> str:
    """The human-readable table."""
    o = report.options
    rec, full = report.modes["recovery"], report.modes["full_state"]
    lines = [
        "recoverssm demo --engine vllm: the tiny GLM-5.3 (all-KDA, random weights) through "
        f"vLLM {rec.vllm_version}'s LLM engine",
        f"  batch    {o.num_requests} prompts of {min(report.prompt_lengths)}.."
        f"{max(report.prompt_lengths)} tokens, {o.max_new_tokens} new tokens each, S = "
        f"{o.num_spec}, {o.max_num_seqs} rows at a time, 32-token prompt chunks",
        f"  drafter  oracle (greedy continuation, {report.corruption:.0%} of drafts corrupted)",
        f"  cache    {o.kv_cache_bytes / (1 << 20):.0f} MiB of KV cache "
        f"(--kv-cache-memory-bytes)",
        "",
    ]
    header = (f"{'mode':<11} {'tokens/s':>9} {'accepted':>9} {'blocks':>7} "
              f"{'blocks/req':>10} {'state/request':>14} {'planner':>12} {'max conc.':>10}")
    lines += [header, "-" * len(header)]
    for name, r in report.modes.items():
        lines.append(
            f"{TITLES[name]:<11} {r.tokens_per_s:>9.1f} {r.acceptance:>9.1%} "
            f"{r.kv.num_blocks:>7} {r.kv.blocks_per_request:>10} "
            f"{_mib(r.kv.state_bytes_per_request):>14} "
            f"{_mib(report.planner_bytes[name]):>12} {r.kv.max_concurrency:>10.2f}")
    ratio = full.kv.state_bytes_per_request / max(rec.kv.state_bytes_per_request, 1)
    total = sum(len(x) for x in rec.outputs)
    lines += [
        "",
        f"state per request (vLLM's allocation): recovery {rec.kv.state_bytes_per_request:,} B"
        f" vs full state {full.kv.state_bytes_per_request:,} B ({ratio:.2f}x less), "
        f"{'==' if report.bytes_match_planner else '!='} planner; recovery adds a record "
        f"scratch of {rec.kv.scratch_bytes:,} B for {o.max_num_seqs} rows",
        f"outputs identical (recovery vs full-state): "
        f"{'yes' if report.outputs_identical else 'NO'} ({total} tokens)",
        f"decision logged: {rec.decision[0].splitlines()[0] if rec.decision else 'none'}",
        f"wall time {report.wall_seconds:.1f} s (3 engine start-ups included)",
    ]
    return "\n".join(lines)
