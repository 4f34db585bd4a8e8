"""Run vLLM's offline engine (``LLM``) once and report what a user would compare.

``python -m vllm_recoverssm.harness.run_engine SPEC.json REPORT.json`` builds one
``vllm.LLM`` from the spec (:class:`EngineRun`), generates greedily from token-id prompts
and writes a :class:`EngineReport`: the output tokens, draft acceptance from vLLM's own
spec-decode counters, preemptions, tokens/s, the recovery decision the plugin logged, and
the state memory read from vLLM's KV-cache allocation (blocks, bytes per block, blocks per
request, vLLM's own maximum-concurrency figure, the record scratch the layers allocated).

A spec may add ``waves``: further ``generate`` calls in the same engine after the first,
whose prompts may extend an earlier request (:class:`FollowUp`: its prompt, its answer,
new tokens), and a ``kv_transfer_config``; each wave then reports its own outputs,
``num_cached_tokens``, time and vLLM's cache-hit counters, and the report carries the
request-boundary checkpoint connector's counters, taken after the exports the last wave
still owed were written (:func:`.distributed.kv_connector.flush.flush_checkpoints`), so a
later engine process finds every bundle on disk.

One engine per process: vLLM's CPU platform registers its kernel overrides once per
process, and a second ``LLM`` in the same process fails there. ``recoverssm demo --engine
vllm`` and the engine tests start this module once per engine (:func:`run_in_subprocess`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import engine_fork
from .vllm_registration import HARNESS_ENV

MODULE = "vllm_recoverssm.harness.run_engine"


class FollowUp(BaseModel):
    """A prompt made from an earlier request of the run: its prompt and its output, then
    ``extra`` (a follow-up turn)."""

    model_config = ConfigDict(extra="forbid")

    after: tuple[int, int] = Field(description="(wave, index) of the earlier request")
    extra: list[int] = Field(default_factory=list, max_length=65536)


class ImagePrompt(BaseModel):
    """A text prompt with one image: ``text`` holds the model's image placeholder."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    image: str = Field(min_length=1, description="an image file (PNG, JPEG, ...)")


Prompt = list[int] | ImagePrompt
"""Token ids, or a text prompt with an image."""


class EngineRun(BaseModel):
    """One engine run: model, recovery mode, drafter, prompts and engine arguments."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="model directory")
    mode: Literal["auto", "on", "off"]
    commit: Literal["auto", "eager", "fused"] | None = Field(
        default=None, description="additional_config['recoverssm_commit'] (None: unset)")
    num_spec: int = Field(ge=1, le=7)
    drafter: Literal["oracle", "ngram", "dflash"] = "oracle"
    oracle: str | None = Field(default=None, description="oracle file (drafter 'oracle')")
    draft_model: str | None = Field(default=None,
                                    description="DFlash draft model directory (drafter 'dflash')")
    prompts: list[Prompt] = Field(min_length=1, max_length=4096)
    max_tokens: int = Field(ge=1, le=65536)
    engine: dict[str, Any] = Field(default_factory=dict, description="more LLM(...) kwargs")
    preempt_after_steps: int | None = Field(
        default=None, ge=1,
        description="preempt every running request once, after this many engine steps")
    waves: list[list[Prompt | FollowUp]] = Field(
        default_factory=list, max_length=64,
        description="more generate() calls in the same engine, after `prompts`")
    kv_transfer_config: dict[str, Any] | None = None
    logprobs: int | None = Field(
        default=None, ge=0, le=20,
        description="report the log-probabilities of this many best tokens at every step")


class KVReport(BaseModel):
    """State memory as vLLM allocated it."""

    num_blocks: int
    allocated_bytes: int
    bytes_per_block: int
    """All KDA layers' pages of one block."""
    blocks_per_request: int
    state_bytes_per_request: int
    max_concurrency: float
    """vLLM's own figure for ``max_model_len``-token requests."""
    scratch_bytes: int
    """The recovery record scratch of all layers (0 with full states), rank 0's."""
    scratch_bytes_per_rank: list[int] = Field(default_factory=list)
    """The same for every tensor-parallel rank, sized by that rank's heads."""
    align_block_size: int | None = None
    """Prefix caching in align mode: tokens per state block (None in other modes)."""


class WaveReport(BaseModel):
    """One ``generate`` call of a run."""

    prompts: list[list[int]]
    """Each request's prompt token ids (an image prompt's with its image tokens)."""
    outputs: list[list[int]]
    num_cached_tokens: list[int]
    seconds: float
    prompt_tokens: int
    local_hits: int
    """vLLM's own prefix-cache hits (tokens) in this wave."""
    external_hits: int
    """Tokens a KV connector supplied in this wave."""
    cached_by_source: dict[str, int]


class EngineReport(BaseModel):
    """What one engine run produced."""

    vllm_version: str
    mode: str
    recovery: bool
    decision: list[str]
    """The decision lines the plugin logged (filled from the process's log)."""
    warnings: list[str] = Field(default_factory=list)
    """Every warning line the engine's processes logged (filled from the log), at most
    :data:`MAX_WARNINGS`."""
    commit_lines: list[str] = Field(default_factory=list)
    """The commit-mode lines the plugin logged (none when ``eager`` was asked for)."""
    deferred_commit_steps: int = 0
    """Steps whose commit was deferred into the next verify (fused commit)."""
    settles: int = 0
    """Steps that committed deferred rows on their own (requests that left the batch)."""
    settles_skipped: int = 0
    """Steps that skipped that: every deferred request was verified again."""
    export_settles: int = 0
    """Standalone commits of finished requests' records before the connector exported them."""
    load_settles: int = 0
    """Standalone commits of every pending record before the connector restored states."""
    boundary_commits: int = 0
    """Align mode: steps that launched the commit after sampling, since a row could have
    reached a state block's end (the host's bound; the device commits only such rows)."""
    async_scheduling: bool = False
    """Whether vLLM scheduled asynchronously: each step planned before the previous one's
    sampled tokens were known (vLLM's GPU default with MTP, EAGLE or DFlash drafting)."""
    outputs: list[list[int]]
    num_cached_tokens: list[int]
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    preemptions: int
    generated_tokens: int
    seconds: float
    kv: KVReport
    waves: list[WaveReport] = Field(default_factory=list)
    """Every ``generate`` call, the first included (runs with ``waves`` only)."""
    logprobs: list[list[dict[int, float]]] = Field(default_factory=list)
    """Per request and generated token, the best tokens' log-probabilities (runs with
    ``logprobs`` only); the sampled token is always among them."""
    connector: dict[str, Any] | None = None
    """The request-boundary checkpoint connector's worker counters, when one is set."""
    connector_per_rank: list[dict[str, Any] | None] = Field(default_factory=list)
    """The same counters for every tensor-parallel rank (rank 0's are ``connector``)."""
    checkpoints_flushed: bool | None = None
    """With a connector: every export the last wave owed was written before the report."""

    @property
    def acceptance(self) -> float:
        """Accepted draft tokens over proposed draft tokens (0 when none were proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generation (start-up excluded)."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def engine_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a CPU engine process runs in.

    * in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): this process reads
      the allocation;
    * ``VLLM_MLA_DISABLE=1``: vLLM's CPU platform turns chunked prefill and prefix caching
      off for any model whose config names MLA ranks; the tiny model has no MLA layer;
    * :data:`~.vllm_registration.HARNESS_ENV`: vLLM registers the random-weights loader;
    * OpenMP bound to one core unless set: the KDA ops run small per-token tensor ops, and
      two OpenMP threads on a two-core machine slow them ten times once anything else runs.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_MLA_DISABLE", "1")
    env[HARNESS_ENV] = "1"
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(min(os.sched_getaffinity(0)))
    return env


def llm_kwargs(run: EngineRun) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments for ``run``."""
    from ..vllm_plugin.config import COMMIT_KEY
    from .oracle_drafter import CLASS_PATH, CONFIG_KEY
    from .random_loader import LOAD_FORMAT

    extra: dict[str, Any] = {"recoverssm": run.mode}
    if run.commit is not None:
        extra[COMMIT_KEY] = run.commit
    if run.drafter == "oracle":
        spec: dict[str, Any] = {"method": "custom_class", "model": CLASS_PATH,
                                "num_speculative_tokens": run.num_spec}
        if run.oracle:
            extra[CONFIG_KEY] = {"path": run.oracle}
    elif run.drafter == "dflash":
        if not run.draft_model:
            raise ValueError("drafter 'dflash' needs draft_model (a DFlash draft directory)")
        spec = {"method": "dflash", "model": run.draft_model,
                "num_speculative_tokens": run.num_spec}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": run.num_spec,
                "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    kwargs: dict[str, Any] = dict(
        model=run.model, load_format=LOAD_FORMAT, dtype="bfloat16", skip_tokenizer_init=True,
        enforce_eager=True, max_model_len=1024, gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, max_num_seqs=8,
        disable_log_stats=False, speculative_config=spec, additional_config=extra,
    )
    kwargs.update(run.engine)
    return kwargs


DECISION_MARK = "vllm-recoverssm: recovery:"
MAX_WARNINGS = 200
COMMIT_MARK = "vllm-recoverssm: commit:"


def decision_lines(log: str) -> list[str]:
    """The recovery decisions the plugin logged, each with its indented reason lines.

    vLLM's formatter repeats a record's header (process, level, time, source) on every
    line of a multi-line message; continuation lines carry that header and then spaces.
    """
    out: list[str] = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        at = line.find(DECISION_MARK)
        if at < 0:
            continue
        header = line[:at]
        block = [line[at:]]
        for follow in lines[i + 1:]:
            rest = follow[len(header):]
            if not header or not follow.startswith(header) or not rest.startswith(" "):
                break
            block.append(rest.strip())
        out.append("\n".join(block))
    return out


def _metric(metrics: list[Any], name: str) -> int:
    for m in metrics:
        if m.name == name and hasattr(m, "value"):
            return int(m.value)
    return 0


def _by_source(metrics: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in metrics:
        if m.name == "vllm:prompt_tokens_cached_by_source" and hasattr(m, "value"):
            source = str(m.labels.get("source", "unknown"))
            out[source] = out.get(source, 0) + int(m.value)
    return out


def resolve_prompts(wave: list[Prompt | FollowUp],
                    done: list[tuple[list[Prompt], list[list[int]]]]) -> list[Prompt]:
    """A wave's prompts; a follow-up is its earlier request's prompt and output plus its
    extra tokens (the earlier request must be a token-id prompt)."""
    out: list[Prompt] = []
    for item in wave:
        if isinstance(item, FollowUp):
            w, i = item.after
            if not 0 <= w < len(done) or not 0 <= i < len(done[w][0]):
                raise ValueError(f"follow-up of request {i} of wave {w}: no such request")
            earlier = done[w][0][i]
            if isinstance(earlier, ImagePrompt):
                raise ValueError(f"follow-up of request {i} of wave {w}: an image prompt "
                                 "cannot be followed up by token ids")
            out.append(earlier + done[w][1][i] + item.extra)
        else:
            out.append(item)
    return out


def _vllm_prompt(prompt: Prompt) -> dict[str, Any]:
    if isinstance(prompt, ImagePrompt):
        from PIL import Image

        with Image.open(prompt.image) as image:
            return {"prompt": prompt.text,
                    "multi_modal_data": {"image": image.convert("RGB")}}
    return {"prompt_token_ids": list(prompt)}


def _generate(llm: Any, run: EngineRun, params: Any) -> list[Any]:
    prompts = [_vllm_prompt(p) for p in run.prompts]
    if run.preempt_after_steps is None:
        return list(llm.generate(prompts, params, use_tqdm=False))
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == run.preempt_after_steps:
            engine.reset_prefix_cache(reset_running_requests=True)
    return [done[str(i)] for i in range(len(prompts))]


def run(run: EngineRun) -> EngineReport:
    """Build the engine, generate, and report (call in a process of its own)."""
    from vllm import LLM, SamplingParams

    from ..vllm_plugin import compat
    from ..vllm_plugin.config import recovery_enabled
    from ..vllm_plugin.worker.commit import deferred_commit_counts
    from . import vllm_engine
    from .random_loader import register_loader

    # this process builds the engine core; worker processes it starts inherit the variable
    os.environ[HARNESS_ENV] = "1"
    register_loader()
    kwargs = llm_kwargs(run)
    if run.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = run.kv_transfer_config
    llm: Any = LLM(**kwargs)
    params = SamplingParams(max_tokens=run.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=run.logprobs)
    start = time.perf_counter()
    outs = _generate(llm, run, params)
    seconds = time.perf_counter() - start
    metrics = llm.get_metrics()
    waves: list[WaveReport] = []
    if run.waves:
        waves.append(_wave_report(outs, seconds, [], metrics))
        done: list[tuple[list[Prompt], list[list[int]]]] = [(list(run.prompts),
                                                              waves[0].outputs)]
        for wave in run.waves:
            prompts = resolve_prompts(wave, done)
            before = metrics
            t0 = time.perf_counter()
            wave_outs = list(llm.generate([_vllm_prompt(p) for p in prompts], params,
                                          use_tqdm=False))
            took = time.perf_counter() - t0
            metrics = llm.get_metrics()
            waves.append(_wave_report(wave_outs, took, before, metrics))
            done.append((prompts, waves[-1].outputs))
    connector = None
    connector_per_rank: list[dict[str, Any] | None] = []
    flushed = None
    if run.kv_transfer_config is not None:
        from ..vllm_plugin.distributed.kv_connector.flush import flush_checkpoints

        flushed = flush_checkpoints(llm)
        connector_per_rank = list(llm.collective_rpc(vllm_engine.worker_connector_stats))
        connector = connector_per_rank[0]
    core = compat.in_process_engine_core(llm)
    single_worker = core is not None and hasattr(core.model_executor, "driver_worker")
    counts = {} if not single_worker else deferred_commit_counts(
        compat.layer_table(vllm_engine.in_process_model_runner(core)))
    return EngineReport(
        vllm_version=compat.vllm_version(), mode=run.mode,
        deferred_commit_steps=counts.get("deferred_commit_steps", 0),
        settles=counts.get("settles", 0), settles_skipped=counts.get("settles_skipped", 0),
        export_settles=counts.get("export_settles", 0),
        load_settles=counts.get("load_settles", 0),
        boundary_commits=counts.get("boundary_commits", 0),
        async_scheduling=llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True,
        recovery=recovery_enabled(llm.llm_engine.vllm_config), decision=[],
        outputs=[list(o.outputs[0].token_ids) for o in outs],
        num_cached_tokens=[int(o.num_cached_tokens or 0) for o in outs],
        drafts=_metric(metrics, "vllm:spec_decode_num_drafts"),
        draft_tokens=_metric(metrics, "vllm:spec_decode_num_draft_tokens"),
        accepted_tokens=_metric(metrics, "vllm:spec_decode_num_accepted_tokens"),
        preemptions=_metric(metrics, "vllm:num_preemptions"),
        generated_tokens=sum(len(o.outputs[0].token_ids) for o in outs), seconds=seconds,
        kv=KVReport(**vllm_engine.kv_allocation(llm)), waves=waves, connector=connector,
        checkpoints_flushed=flushed, connector_per_rank=connector_per_rank,
        logprobs=_logprobs(outs) if run.logprobs is not None else [],
    )


def _logprobs(outs: list[Any]) -> list[list[dict[int, float]]]:
    return [[{int(t): float(lp.logprob) for t, lp in step.items()}
             for step in (o.outputs[0].logprobs or [])] for o in outs]


def _wave_report(outs: list[Any], seconds: float, before: list[Any],
                 after: list[Any]) -> WaveReport:
    def delta(name: str) -> int:
        return _metric(after, name) - _metric(before, name)

    old = _by_source(before)
    prompts = [list(o.prompt_token_ids) for o in outs]
    return WaveReport(
        prompts=prompts, outputs=[list(o.outputs[0].token_ids) for o in outs],
        num_cached_tokens=[int(o.num_cached_tokens or 0) for o in outs], seconds=seconds,
        prompt_tokens=sum(len(p) for p in prompts),
        local_hits=delta("vllm:prefix_cache_hits"),
        external_hits=delta("vllm:external_prefix_cache_hits"),
        cached_by_source={k: v - old.get(k, 0) for k, v in _by_source(after).items()
                          if v - old.get(k, 0)},
    )


def run_in_subprocess(spec: EngineRun, workdir: Path, *, timeout: float = 900,
                      env: dict[str, str] | None = None, module: str = MODULE) -> EngineReport:
    """Run ``spec`` in a process of its own (a fork of :mod:`.engine_fork`'s server where
    that applies, else a fresh ``python -m``); raises ``RuntimeError`` with its log tail.

    ``module``: another ``python -m`` entry taking this module's arguments, which must set
    things up before vLLM is imported; it always runs in a fresh process."""
    workdir.mkdir(parents=True, exist_ok=True)
    stem = f"run-{time.monotonic_ns()}"
    spec_path, report_path = workdir / f"{stem}.json", workdir / f"{stem}.report.json"
    spec_path.write_text(spec.model_dump_json())
    full_env = engine_environment(env)
    argv = [str(spec_path), str(report_path)]
    log_path = workdir / f"{stem}.log"
    forked = (engine_fork.run_forked(f"{MODULE}:main", argv, full_env, log_path, timeout)
              if module == MODULE else None)
    if forked is not None:
        code = forked
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
    else:
        proc = subprocess.run([sys.executable, "-m", module, *argv], env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        code, log = proc.returncode, proc.stdout + proc.stderr
    if code != 0 or not report_path.exists():
        tail = "\n".join(log.splitlines()[-40:])
        raise RuntimeError(f"engine run failed (exit {code}):\n{tail}")
    report = EngineReport.model_validate_json(report_path.read_text())
    report.decision = decision_lines(log)
    report.warnings = [line for line in log.splitlines() if " WARNING " in line][
        -MAX_WARNINGS:]
    report.commit_lines = [line[line.find(COMMIT_MARK):] for line in log.splitlines()
                           if COMMIT_MARK in line]
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m ... SPEC REPORT``: run one engine and write its report."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(f"usage: python -m {MODULE} SPEC.json REPORT.json", file=sys.stderr)
        return 2
    spec = EngineRun.model_validate(json.loads(Path(args[0]).read_text()))
    report = run(spec)
    Path(args[1]).write_text(report.model_dump_json())
    return 0


if __name__ == "__main__":
    for key, value in engine_environment().items():
        os.environ.setdefault(key, value)
    raise SystemExit(main())
