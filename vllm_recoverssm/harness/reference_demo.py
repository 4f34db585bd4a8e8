"""The main job: one batch of prompts decoded speculatively in recovery and full-state mode.

Both runs use the same model, prompts and drafter. The job reports throughput, acceptance,
the linear-state bytes each request held (measured from the allocated pools, beside the
memory planner's figure) and whether the two modes produced identical tokens. With the
oracle drafter it also checks both against plain greedy decoding without speculation. With
``checkpoint`` set, a second wave of follow-up turns and repeated prompts is restored from
LMCache and timed against a cold run (:mod:`.demo_checkpoint`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..reference.accounting import measured_state_bytes, planned_state_bytes
from ..reference.drafters import Drafter, MTPDrafter, OracleDrafter, corruption_for_acceptance
from ..reference.greedy import greedy_continuations
from ..reference.model import HybridModel, build_model
from ..reference.model_config import (
    CPU_MODEL,
    DTYPES,
    GLM_TP2_MODEL,
    GPU_MODEL,
    TEST_MODEL,
    ModelConfig,
)
from ..reference.runtime import SpecRuntime
from ..reference.runtime_config import RuntimeConfig
from ..reference.step_inputs import FULL_STATE, MODES, RECOVERY
from .reference_demo_checkpoint import (
    BACKENDS,
    FOLLOW_UP_TOKENS,
    CheckpointPlace,
    CheckpointReport,
    run_second_wave,
    second_wave_prompts,
)

MODEL_PRESETS: dict[str, ModelConfig] = {
    "cpu": CPU_MODEL, "gpu": GPU_MODEL, "glm-tp2": GLM_TP2_MODEL, "test": TEST_MODEL,
}
DRAFTERS = ("oracle", "mtp")
MAX_REPEAT = 25
GPU_PREFILL_TOKENS = 4096

ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done_tokens, total_tokens)``; totals cover every phase of the job."""


@dataclass(frozen=True)
class DemoOptions:
    """What the job runs; ``None`` fields take the device's default."""

    device: str = "auto"
    model: str = "auto"
    dtype: str = "auto"
    """Activation dtype; ``auto`` keeps the model preset's (bfloat16 on a GPU)."""
    num_requests: int | None = None
    max_new_tokens: int | None = None
    num_spec: int = 3
    drafter: str = "oracle"
    acceptance: float = 0.7
    prefix_caching: bool = False
    block_size: int | None = None
    """Tokens per cached state block with prefix caching; default max(16, S+1)."""
    cuda_graph: bool | None = None
    seed: int = 0
    checkpoint: str | None = None
    checkpoint_dir: str | None = None
    fused_commit: bool = True
    max_prefill_tokens: int | None = None
    """Prompt tokens one step may prefill; default: 64 on a CPU, and on a GPU enough for
    the whole batch's prompts in one step (4096), so that its decode steps run the whole
    batch as one, as a serving engine's token budget lets them."""
    repeat: int = 1
    """Timed runs per mode, in alternating mode order; tokens/s are their medians."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(
                f"argument '--device': expected auto, cpu or cuda, got {self.device!r}"
            )
        if self.model not in ("auto", *MODEL_PRESETS):
            raise ValueError(
                f"argument '--model': expected auto or one of {sorted(MODEL_PRESETS)}, got "
                f"{self.model!r}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"argument '--dtype': expected auto or one of {sorted(DTYPES)}, got "
                f"{self.dtype!r}"
            )
        if self.drafter not in DRAFTERS:
            raise ValueError(f"argument '--drafter': expected one of {DRAFTERS}, got "
                             f"{self.drafter!r}")
        if not 1 <= self.num_spec <= 7:
            raise ValueError(f"argument '--num-spec': expected 1..7, got {self.num_spec}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"argument '--acceptance': expected 0..1, got {self.acceptance}")
        if self.checkpoint is not None and self.checkpoint not in BACKENDS:
            raise ValueError(f"argument '--checkpoint': expected one of {BACKENDS}, got "
                             f"{self.checkpoint!r}")
        if self.checkpoint_dir is not None and self.checkpoint != "disk":
            raise ValueError("argument '--checkpoint-dir': only --checkpoint disk writes files")
        for name in ("num_requests", "max_new_tokens", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"argument '--{name.replace('_', '-')}': expected >= 1, got "
                                 f"{value}")
        if self.block_size is not None:
            if not self.prefix_caching:
                raise ValueError("argument '--block-size': applies only with --prefix-caching")
            if self.block_size < self.num_spec + 1:
                raise ValueError(
                    f"argument '--block-size': expected >= S+1 = {self.num_spec + 1} (one "
                    f"step crosses at most one block's end), got {self.block_size}"
                )
        if isinstance(self.repeat, bool) or not isinstance(self.repeat, int) or not (
            1 <= self.repeat <= MAX_REPEAT
        ):
            raise ValueError(f"argument '--repeat': expected 1..{MAX_REPEAT}, got "
                             f"{self.repeat!r}")
        if self.repeat > 1 and self.checkpoint is not None:
            # a second run would find the first run's exports and restore from them
            raise ValueError("argument '--repeat': times plain runs; it cannot be combined "
                             "with --checkpoint")


@dataclass
class ModeReport:
    """One mode's run."""

    mode: str
    seconds: float
    generated_tokens: int
    tokens_per_second: float
    """Median over the runs."""
    decode_tokens_per_second: float
    """Tokens/s of the steps without prompt rows (verify-only steps); median over the
    runs."""
    steps: int
    acceptance_rate: float
    accept_histogram: list[int]
    state_bytes_per_request: int
    planner_state_bytes_per_request: int
    state_pool_bytes: int
    prefix_cache_hits: int
    prefix_cache_hit_tokens: int
    graph_steps: int
    deferred_rows: int = 0
    """Fused commit: decode rows whose records waited for the next verify (one run)."""
    decode_runs: list[float] = field(default_factory=list)
    """Decode tokens/s of each timed run, in run order."""
    run_seconds: list[float] = field(default_factory=list)
    """Wall time of each timed run."""

    def add_run(self, other: ModeReport) -> None:
        """Fold in a repeated run of the same mode; tokens/s become the runs' medians."""
        self.decode_runs += other.decode_runs
        self.run_seconds += other.run_seconds
        self.decode_tokens_per_second = statistics.median(self.decode_runs)
        self.seconds = statistics.median(self.run_seconds)
        self.tokens_per_second = self.generated_tokens / self.seconds if self.seconds else 0.0


@dataclass
class DemoReport:
    """Everything the job measured."""

    device: str
    model: dict[str, Any]
    model_summary: str
    num_spec: int
    drafter: str
    corruption: float | None
    prompt_lengths: list[int]
    max_new_tokens: int
    modes: dict[str, ModeReport] = field(default_factory=dict)
    greedy_seconds: float | None = None
    matches_greedy: bool | None = None
    outputs_identical: bool = False
    """Recovery equals full state, and every repeated run equals the first."""
    repeat: int = 1
    max_prefill_tokens: int = 0
    bytes_match_planner: bool = False
    wall_seconds: float = 0.0
    threads: int = 1
    checkpoint: str | None = None
    checkpoints: dict[str, CheckpointReport] = field(default_factory=dict)
    commit: str = ""
    block_size: int | None = None
    """Tokens per cached state block (None: no prefix caching)."""

    @property
    def ok(self) -> bool:
        """Identical outputs, measured bytes equal to the planner's, restores equal to cold."""
        restores_ok = all(c.outputs_identical for c in self.checkpoints.values())
        return self.outputs_identical and self.bytes_match_planner and restores_ok

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the checkpoint fields only when checkpoints were asked for)."""
        out = asdict(self)
        if self.checkpoint is None:
            del out["checkpoint"], out["checkpoints"]
        out["ok"] = self.ok
        return out


def resolve_device(choice: str) -> torch.device:
    """``auto`` picks CUDA when a GPU is present, else the CPU."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("argument '--device': cuda was asked for but no CUDA GPU is visible")
    return torch.device(choice)


def demo_prompts(
    count: int, vocab: int, seed: int, longest: int, shared_prefix: int = 0
) -> list[list[int]]:
    """``count`` seeded random prompts with lengths spread from 8 to ``longest`` tokens.

    With ``shared_prefix`` > 0 every prompt starts with the same that many tokens (a
    system prompt), which prefix caching can reuse.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = [8 + (longest - 8) * i // max(count - 1, 1) for i in range(count)]
    order = torch.randperm(count, generator=gen).tolist()  # mix long and short prompts
    shared = torch.randint(0, vocab, (shared_prefix,), generator=gen).tolist()
    return [shared + torch.randint(0, vocab, (lengths[i],), generator=gen).tolist()
            for i in order]


def _run_order(run: int) -> tuple[str, ...]:
    """Modes in the order timed run ``run`` runs them: alternating, so that neither mode
    always runs first on a GPU that is still warming up."""
    return MODES if run % 2 == 0 else MODES[::-1]


def _mode_report(runtime: SpecRuntime, mode: str) -> ModeReport:
    s = runtime.stats
    pools = runtime.pools
    pool_bytes = pools.total_slot_bytes + pools.record_row_bytes * pools.record_rows
    return ModeReport(
        mode=mode, seconds=s.seconds, generated_tokens=s.generated_tokens,
        tokens_per_second=s.tokens_per_second,
        decode_tokens_per_second=s.decode_tokens_per_second, steps=s.steps,
        acceptance_rate=s.acceptance_rate, accept_histogram=list(s.accept_histogram),
        state_bytes_per_request=measured_state_bytes(runtime),
        planner_state_bytes_per_request=planned_state_bytes(
            runtime.model.config, mode, runtime.num_spec, runtime.config.prefix_caching,
            fused=runtime.config.fused),
        state_pool_bytes=pool_bytes, prefix_cache_hits=runtime.cache.stats.hits,
        prefix_cache_hit_tokens=runtime.cache.stats.hit_tokens,
        graph_steps=s.graph_steps, deferred_rows=s.deferred_rows,
        decode_runs=[s.decode_tokens_per_second],
        run_seconds=[s.seconds],
    )


def _warm_up(model: HybridModel, config: RuntimeConfig, drafter: Drafter,
             prompt: list[int]) -> None:
    """A short untimed run of one prompt: kernel compilation and graph capture happen on a
    mode's first steps, and this keeps them out of the tokens/s compared. Its pools and
    graphs are freed on return."""
    with SpecRuntime(model, config, drafter) as warm_up:
        warm_up.add_request(prompt, 2 * (config.num_spec + 1))
        warm_up.run()


def run_demo(options: DemoOptions, progress: ProgressFn | None = None) -> DemoReport:
    """Run the job and return its report (see the module docstring)."""
    started = time.perf_counter()
    device = resolve_device(options.device)
    on_gpu = device.type == "cuda"
    preset = options.model if options.model != "auto" else ("gpu" if on_gpu else "cpu")
    config = MODEL_PRESETS[preset]
    if options.dtype != "auto":
        config = config.with_dtype(options.dtype)
    num_requests = options.num_requests or (16 if on_gpu else 8)
    max_new = options.max_new_tokens or (64 if on_gpu else 32)
    S = options.num_spec
    longest = 64 if on_gpu else 40
    block_size = options.block_size or max(16, S + 1)
    # With prefix caching the prompts share a two-block system prompt and run in two waves,
    # so that the second wave can resume from blocks the first one cached.
    shared = 2 * block_size if options.prefix_caching else 0
    max_running = -(-num_requests // 2) if options.prefix_caching else num_requests
    prefill_budget = options.max_prefill_tokens or (GPU_PREFILL_TOKENS if on_gpu else 64)
    max_model_len = shared + longest + max_new + S
    if options.checkpoint is not None:
        # room for a follow-up turn: prompt + answer + new tokens + its own answer
        max_model_len += FOLLOW_UP_TOKENS + max_new
    model: HybridModel = build_model(config, device)
    prompts = demo_prompts(num_requests, config.vocab_size, options.seed, longest, shared)
    oracle = options.drafter == "oracle"
    phases = (["greedy"] if oracle else []) + [
        f"{m} run {i + 1}" if options.repeat > 1 else m
        for i in range(options.repeat) for m in _run_order(i)]
    if options.checkpoint is not None:
        phases += (["wave 2 greedy"] if oracle else []) + [
            f"wave 2 {m} {kind}" for m in MODES for kind in ("cold", "restored")]
    total = len(phases) * num_requests * max_new
    report = DemoReport(
        device=str(device), model=config.to_dict(), model_summary=config.describe(),
        num_spec=S, drafter=options.drafter, corruption=None,
        prompt_lengths=[len(p) for p in prompts], max_new_tokens=max_new,
        threads=torch.get_num_threads(), checkpoint=options.checkpoint,
        repeat=options.repeat, max_prefill_tokens=prefill_budget,
        block_size=block_size if options.prefix_caching else None,
        commit=("recovery commits after each step" if not options.fused_commit else
                "recovery commits inside the next step's verify (fused; rows that reach a "
                "state block's end commit after their step)" if options.prefix_caching else
                "recovery commits inside the next step's verify (fused)"),
    )

    def tracker(phase: str) -> Callable[[int, int], None]:
        offset = phases.index(phase) * num_requests * max_new

        def update(done: int, _: int) -> None:
            if progress is not None:
                progress(phase, offset + done, total)

        update(0, total)  # announce the phase
        return update

    drafter: Drafter
    oracle_drafter: OracleDrafter | None = None
    references: list[list[int]] | None = None
    if options.drafter == "oracle":
        greedy_progress = tracker("greedy")
        t0 = time.perf_counter()
        references = greedy_continuations(model, prompts, max_new, max_model_len=max_model_len,
                                          max_running=num_requests)
        report.greedy_seconds = time.perf_counter() - t0
        greedy_progress(num_requests * max_new, total)
        corruption = corruption_for_acceptance(options.acceptance, S)
        report.corruption = corruption
        drafter = oracle_drafter = OracleDrafter(
            {tuple(p): r for p, r in zip(prompts, references, strict=True)},
            corruption, config.vocab_size, seed=options.seed)
    else:
        drafter = MTPDrafter()
    outputs: dict[str, list[list[int]]] = {}
    cuda_graph = on_gpu if options.cuda_graph is None else options.cuda_graph
    place = (CheckpointPlace(options.checkpoint, options.checkpoint_dir)
             if options.checkpoint is not None else None)
    wave2: list[list[int]] | None = None
    identical_runs = True
    try:
        for run in range(options.repeat):
            for mode in _run_order(run):
                config_of_mode = RuntimeConfig(
                    mode=mode, num_spec=S, max_running=max_running,
                    max_model_len=max_model_len, max_prefill_tokens=prefill_budget,
                    block_size=block_size, prefix_caching=options.prefix_caching,
                    cuda_graph=cuda_graph, fused_commit=options.fused_commit,
                )
                if on_gpu and run == 0:
                    _warm_up(model, config_of_mode, drafter, prompts[0])
                # the previous run's pools and graphs go before this run's are allocated
                runtime = None
                runtime = SpecRuntime(model, replace(
                    config_of_mode, checkpoint=place.config if place is not None else None,
                ), drafter)
                phase = f"{mode} run {run + 1}" if options.repeat > 1 else mode
                with runtime:
                    for p in prompts:
                        runtime.add_request(p, max_new)
                    finished = runtime.run(progress=tracker(phase))
                    generated = [r.generated for r in finished]
                    if run == 0:
                        outputs[mode] = generated
                        report.modes[mode] = _mode_report(runtime, mode)
                    else:
                        identical_runs &= generated == outputs[mode]
                        report.modes[mode].add_run(_mode_report(runtime, mode))
                    if place is None:
                        continue
                    if wave2 is None:
                        wave2 = second_wave_prompts(prompts, outputs[mode], config.vocab_size,
                                                    options.seed)
                        if oracle_drafter is not None:
                            wave2_progress = tracker("wave 2 greedy")
                            refs2 = greedy_continuations(model, wave2, max_new,
                                                         max_model_len=max_model_len,
                                                         max_running=num_requests)
                            wave2_progress(num_requests * max_new, total)
                            oracle_drafter.references.update(
                                {tuple(p): r for p, r in zip(wave2, refs2, strict=True)})
                    report.checkpoints[mode] = run_second_wave(
                        runtime, model, drafter, wave2, max_new,
                        tracker(f"wave 2 {mode} cold"), tracker(f"wave 2 {mode} restored"))
    finally:
        if place is not None:
            place.close()
    report.outputs_identical = outputs[RECOVERY] == outputs[FULL_STATE] and identical_runs
    if references is not None:
        report.matches_greedy = outputs[RECOVERY] == references
    report.bytes_match_planner = all(
        m.state_bytes_per_request == m.planner_state_bytes_per_request
        for m in report.modes.values()
    )
    report.wall_seconds = time.perf_counter() - started
    return report
