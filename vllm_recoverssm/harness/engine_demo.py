"""``recoverssm demo --engine vllm``: the tiny GLM-5.3 through vLLM's own engine, both modes.

Three engine processes (vLLM's ``LLM``, on whatever platform vLLM runs here; on a CPU the
plugin's KDA layer runs the project's PyTorch ops): one with full states and every draft
wrong, which yields the model's greedy continuations, then recovery and full states with
the oracle drafter corrupting drafts to reach the asked acceptance. It reports tokens/s,
draft acceptance from vLLM's counters, the state bytes each request holds as vLLM
allocated them (beside the planner's figure), vLLM's maximum concurrency for the same
KV-cache bytes, and whether the two outputs are identical.

With ``checkpoint`` (``ram`` or ``disk``) every engine also runs a second wave: each
request's follow-up turn (its prompt, its answer, new tokens). Each mode then runs again
with the request-boundary checkpoint connector: with ``ram`` both waves in one engine,
with ``disk`` wave 1 in a fresh engine process that reads the store the first one wrote.
The report compares wave 2's prefill work and time, computed cold against restored, and
its tokens.
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
from ..config.state_mode import StateMode
from ..state.planner import PlanConfig, plan
from ..vllm_plugin.distributed.kv_connector.settings import CONNECTOR_NAME
from . import runner_v2
from .oracle_drafter import write_oracle
from .run_engine import (
    COMMIT_MARK,
    EngineReport,
    EngineRun,
    FollowUp,
    WaveReport,
    run_in_subprocess,
)
from .tiny_model import tiny_glm53_config, write_tiny_glm53

RecoveryFlag = Literal["on", "off"]
MODES: dict[StateMode, RecoveryFlag] = {StateMode.RECOVERY: "on", StateMode.FULL_STATE: "off"}


class EngineDemoOptions(BaseModel):
    """What the vLLM-engine demo runs."""

    num_requests: int = Field(default=8, ge=1, le=64)
    max_new_tokens: int = Field(default=32, ge=1, le=512)
    num_spec: int = Field(default=3, ge=1, le=7)
    acceptance: float = Field(default=0.7, ge=0.0, le=1.0)
    seed: int = Field(default=0, ge=0, le=2**31)
    max_num_seqs: int = Field(default=4, ge=1, le=64)
    kv_cache_bytes: int = Field(default=64 << 20, ge=1 << 20, le=1 << 34)
    checkpoint: Literal["ram", "disk"] | None = None
    checkpoint_dir: str | None = Field(
        default=None, description="with checkpoint 'disk': the store (default: a temporary "
                                  "directory)")
    follow_up_tokens: int = Field(default=8, ge=1, le=512)
    fused_commit: bool = Field(
        default=True, description="recovery commits as the plugin does by default (no "
                                  "recoverssm_commit: inside the next verify where that "
                                  "applies); False: right after sampling ('eager')")

    gpu_defaults: bool = Field(
        default=False, description="run every engine as vLLM does on a GPU: model runner V2, "
                                   "asynchronous scheduling, prefix caching in align mode "
                                   "(on a CPU: runner V2's Triton kernels in Triton's "
                                   "interpreter)")

    def model_post_init(self, _context: Any) -> None:
        """A store directory only makes sense for the disk backend."""
        if self.checkpoint_dir is not None and self.checkpoint != "disk":
            raise ValueError("checkpoint_dir needs checkpoint 'disk'")


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
class WaveTwo:
    """Wave 2 (the follow-up turns) of one mode: computed cold and restored."""

    backend: str
    cold: WaveReport
    restored: WaveReport
    connector: dict[str, Any]
    flushed: bool
    fused_steps: int = 0
    """Steps whose commit the engine(s) with the connector fused into the next verify."""
    export_settles: int = 0
    """Their commits of finished requests' last records before the export."""

    @property
    def restored_tokens(self) -> int:
        """Prompt tokens the connector restored (vLLM's external cached tokens)."""
        return sum(self.restored.num_cached_tokens)

    @property
    def computed_cold(self) -> int:
        """Prompt tokens computed without the connector."""
        return self.cold.prompt_tokens - sum(self.cold.num_cached_tokens)

    @property
    def computed_restored(self) -> int:
        """Prompt tokens computed with the connector."""
        return self.restored.prompt_tokens - self.restored_tokens

    @property
    def outputs_identical(self) -> bool:
        """Restored and cold wave-2 outputs equal token for token."""
        return self.restored.outputs == self.cold.outputs

    @property
    def every_request_restored(self) -> bool:
        """Each follow-up turn restored part of its prompt."""
        return all(n > 0 for n in self.restored.num_cached_tokens)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {"backend": self.backend, "prompt_tokens": self.cold.prompt_tokens,
                "computed_cold": self.computed_cold,
                "computed_restored": self.computed_restored,
                "restored_tokens": self.restored_tokens,
                "restored_per_request": self.restored.num_cached_tokens,
                "cold_seconds": self.cold.seconds, "restored_seconds": self.restored.seconds,
                "outputs_identical": self.outputs_identical,
                "every_request_restored": self.every_request_restored,
                "exports_flushed": self.flushed, "connector": self.connector,
                "fused_steps": self.fused_steps, "export_settles": self.export_settles}


@dataclass
class EngineDemoReport:
    """Both modes' engine reports and the figures compared."""

    options: EngineDemoOptions
    prompt_lengths: list[int]
    corruption: float
    modes: dict[str, EngineReport]
    planner_bytes: dict[str, int]
    wall_seconds: float
    checkpoints: dict[str, WaveTwo] | None = None

    @property
    def commit(self) -> str:
        """How the recovery engine committed, as the plugin logged it."""
        lines = self.modes[StateMode.RECOVERY].commit_lines
        if lines:
            return lines[0].removeprefix(COMMIT_MARK).strip()
        return "eager, right after sampling"

    @property
    def scratch_rows(self) -> int:
        """Record scratch rows the recovery engine allocated (two halves when fused)."""
        fused = self.modes[StateMode.RECOVERY].deferred_commit_steps > 0
        return (2 if fused else 1) * self.options.max_num_seqs

    @property
    def outputs_identical(self) -> bool:
        """Recovery and full-state outputs equal token for token."""
        return self.modes[StateMode.RECOVERY].outputs == self.modes[StateMode.FULL_STATE].outputs

    @property
    def bytes_match_planner(self) -> bool:
        """vLLM's allocation per request equals the planner's page reserve in both modes."""
        return all(self.modes[m].kv.state_bytes_per_request == self.planner_bytes[m]
                   for m in MODES)

    @property
    def checkpoints_ok(self) -> bool:
        """With checkpoints: wave 2 restored every request, identically, in both modes."""
        return all(c.outputs_identical and c.every_request_restored and c.flushed
                   for c in (self.checkpoints or {}).values())

    @property
    def ok(self) -> bool:
        """Identical outputs and the planner's figures (and the checkpoints' verdict)."""
        return self.outputs_identical and self.bytes_match_planner and self.checkpoints_ok

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "engine": "vllm", "vllm_version": self.modes[StateMode.RECOVERY].vllm_version,
            "options": self.options.model_dump(), "prompt_lengths": self.prompt_lengths,
            "corruption": self.corruption, "outputs_identical": self.outputs_identical,
            "bytes_match_planner": self.bytes_match_planner, "wall_seconds": self.wall_seconds,
            "commit": self.commit, "scratch_rows": self.scratch_rows,
            "modes": {m: {"recovery": r.recovery, "tokens_per_s": r.tokens_per_s,
                          "acceptance": r.acceptance, "kv": r.kv.model_dump(),
                          "planner_state_bytes_per_request": self.planner_bytes[m],
                          "decision": r.decision,
                          "deferred_commit_steps": r.deferred_commit_steps}
                      for m, r in self.modes.items()},
            "checkpoints": None if self.checkpoints is None else
            {m: c.to_dict() for m, c in self.checkpoints.items()},
        }


Progress = Callable[[str], None]


def checkpoint_config(backend: str, path: Path | None) -> dict[str, Any]:
    """The ``kv_transfer_config`` of the request-boundary checkpoint connector."""
    extra: dict[str, Any] = {"request_boundary_checkpoints": True, "backend": backend}
    if path is not None:
        extra["path"] = str(path)
    return {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def _wave_of(report: EngineReport, prompts: list[list[int]]) -> WaveReport:
    """A one-wave run as a wave report (its connector hits are its cached tokens)."""
    cached = sum(report.num_cached_tokens)
    return WaveReport(prompts=prompts, outputs=report.outputs,
                      num_cached_tokens=report.num_cached_tokens, seconds=report.seconds,
                      prompt_tokens=sum(len(p) for p in prompts), local_hits=0,
                      external_hits=cached, cached_by_source={})


def run_engine_demo(options: EngineDemoOptions, progress: Progress | None = None,
                    workdir: Path | None = None) -> EngineDemoReport:
    """Run the engines (see the module docstring) and compare the two modes."""
    say = progress or (lambda _msg: None)
    start = time.monotonic()
    rng = random.Random(options.seed)
    config = tiny_glm53_config()
    vocab = int(config["vocab_size"])
    lengths = [rng.randrange(3, 97) for _ in range(options.num_requests)]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
    follow_ups: list[list[list[int] | FollowUp]] = []
    if options.checkpoint is not None:
        follow_ups = [[FollowUp(after=(0, i), extra=[rng.randrange(1, vocab) for _ in
                                                     range(options.follow_up_tokens)])
                       for i in range(options.num_requests)]]
    engine: dict[str, Any] = dict(enable_chunked_prefill=True, max_num_batched_tokens=32,
                                  max_num_seqs=options.max_num_seqs,
                                  kv_cache_memory_bytes=options.kv_cache_bytes)
    if options.gpu_defaults:
        engine["enable_prefix_caching"] = True

    def launch(run: EngineRun, runs: Path) -> EngineReport:
        if not options.gpu_defaults:
            return run_in_subprocess(run, runs)
        return run_in_subprocess(run, runs, env=runner_v2.GPU_DEFAULTS,
                                 module=runner_v2.MODULE)

    checkpoints: dict[str, WaveTwo] | None = None
    with tempfile.TemporaryDirectory(prefix="recoverssm-demo-") as tmp:
        root = Path(tmp) if workdir is None else workdir
        model = str(write_tiny_glm53(root / "tiny-glm53"))

        commit = None if options.fused_commit else "eager"

        def spec(mode: RecoveryFlag, oracle: str | None, **more: Any) -> EngineRun:
            fields: dict[str, Any] = dict(prompts=prompts, waves=follow_ups)
            if mode == "on":
                fields["commit"] = commit
            fields.update(more)
            return EngineRun(model=model, mode=mode, num_spec=options.num_spec,
                             oracle=oracle, max_tokens=options.max_new_tokens, engine=engine,
                             **fields)

        say("greedy continuations (full states, every draft wrong)")
        cold = launch(spec("off", None), root / "runs")
        q = corruption_for(options.acceptance, options.num_spec)
        asked = [(p, o) for w in cold.waves for p, o in zip(w.prompts, w.outputs, strict=True)]
        if not asked:
            asked = list(zip(prompts, cold.outputs, strict=True))
        oracle = str(write_oracle(root / "oracle.json", [(p + c, q) for p, c in asked]))
        modes: dict[str, EngineReport] = {}
        for name, mode in MODES.items():
            say(f"{StateMode(name).label} (recoverssm={mode})")
            modes[name] = launch(spec(mode, oracle), root / "runs")
        if options.checkpoint is not None:
            store = (Path(options.checkpoint_dir) if options.checkpoint_dir is not None
                     else root / "checkpoints")
            checkpoints = {name: _restored_wave(options.checkpoint, store, name, modes[name],
                                                oracle, spec, say, root / "runs", launch)
                           for name in MODES}
    align = modes[StateMode.RECOVERY].kv.align_block_size
    p = plan(PlanConfig(model=model_spec_from_hf_config(config), tp=1,
                        num_spec=options.num_spec, max_num_seqs=options.max_num_seqs,
                        cache_mode="none" if align is None else "align", block_size=align))
    planner = {"recovery": p.layout("recovery_scratch").reserve_bytes_per_request,
               StateMode.FULL_STATE: p.layout("full").reserve_bytes_per_request}
    return EngineDemoReport(options=options, prompt_lengths=lengths, corruption=q,
                            modes=modes, planner_bytes=planner,
                            wall_seconds=time.monotonic() - start, checkpoints=checkpoints)


def _restored_wave(backend: str, store: Path, name: str, cold: EngineReport, oracle: str,
                   spec: Callable[..., EngineRun], say: Progress, runs: Path,
                   launch: Callable[[EngineRun, Path], EngineReport]) -> WaveTwo:
    """One mode's engine(s) with the connector; wave 2 against the same mode's cold one."""
    mode = MODES[StateMode(name)]
    if backend == "ram":
        say(f"{StateMode(name).label} with RAM checkpoints, both waves in one engine")
        kv = checkpoint_config("ram", None)
        both = launch(spec(mode, oracle, kv_transfer_config=kv), runs)
        return WaveTwo(backend, cold.waves[1], both.waves[1], both.connector or {},
                       bool(both.checkpoints_flushed), both.deferred_commit_steps,
                       both.export_settles)
    kv = checkpoint_config("disk", store)
    say(f"{StateMode(name).label} with disk checkpoints, wave 1 (exports)")
    first = launch(spec(mode, oracle, waves=[], kv_transfer_config=kv), runs)
    second_prompts = cold.waves[1].prompts
    say(f"{StateMode(name).label} with disk checkpoints, wave 2 in a fresh engine process "
        "(restores)")
    second = launch(spec(mode, oracle, prompts=second_prompts, waves=[],
                         kv_transfer_config=kv), runs)
    stats = dict(second.connector or {})
    stats["exported_by_first_engine"] = (first.connector or {}).get("exported", {})
    return WaveTwo(backend, cold.waves[1], _wave_of(second, second_prompts), stats,
                   bool(first.checkpoints_flushed) and bool(second.checkpoints_flushed),
                   first.deferred_commit_steps + second.deferred_commit_steps,
                   first.export_settles + second.export_settles)


def engine_count(options: EngineDemoOptions) -> int:
    """Engine processes the demo starts."""
    return 3 + {None: 0, "ram": 2, "disk": 4}[options.checkpoint]
