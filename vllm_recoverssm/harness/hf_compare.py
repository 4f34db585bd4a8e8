"""vLLM's engine with the plugin against transformers' GLM-5.3-Flash on one checkpoint.

:func:`compare` runs transformers' greedy ``generate`` (:mod:`.hf_glm53`) on random
word prompts, then vLLM's ``LLM`` with speculative decoding, recovery on and off, drafting
transformers' own continuation with a share of wrong drafts (the oracle drafter, so the
acceptance is set), and reports per mode whether the tokens are transformers' and how far
each step's log-probabilities are from transformers' (:func:`worst_logprob_gap`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hf_glm53 import TinyFlash, greedy_in_subprocess
from .oracle_drafter import write_oracle
from .run_engine import EngineReport, EngineRun, Prompt, run_in_subprocess

FLASH_ENGINE: dict[str, Any] = {
    "load_format": "auto", "dtype": "float32", "skip_tokenizer_init": False,
    "max_model_len": 512, "enable_chunked_prefill": True, "max_num_batched_tokens": 32,
    "max_num_seqs": 4,
}
"""vLLM's default loader and the checkpoint's tokenizer and processor, in float32; four
rows at a time and 32-token chunks, so prompt chunks share steps with verify rows."""
TP2: dict[str, Any] = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
"""vLLM's CPU platform runs one worker process per rank."""
PROMPT_LENGTHS = (7, 45, 19, 70)
TOP_LOGPROBS = 5


def word_prompts(shape: TinyFlash, lengths: Sequence[int] = PROMPT_LENGTHS,
                 seed: int = 1) -> list[list[int]]:
    """Random prompts of plain-word token ids (below the multimodal markers)."""
    rng = random.Random(seed)
    top = min(shape.image_token_ids.values())
    return [[rng.randrange(2, top) for _ in range(n)] for n in lengths]


def tp_binding() -> dict[str, str]:
    """Each rank's OpenMP threads on a core of its own (the same one on a one-core
    machine)."""
    cores = sorted(os.sched_getaffinity(0))
    pair = cores[:2] if len(cores) >= 2 else cores * 2
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in pair)}


def worst_logprob_gap(hf: Sequence[Sequence[dict[int, float]]],
                      engine: Sequence[Sequence[dict[int, float]]]) -> float:
    """The largest log-probability difference over every step's tokens both list;
    ``ValueError`` when the two disagree on the number of steps or share no token."""
    worst = 0.0
    for hf_steps, steps in zip(hf, engine, strict=True):
        if len(hf_steps) != len(steps):
            raise ValueError(f"{len(hf_steps)} transformers steps against {len(steps)}")
        for want, got in zip(hf_steps, steps, strict=True):
            shared = set(want) & set(got)
            if not shared:
                raise ValueError("a step whose best tokens the two sides do not share")
            worst = max(worst, *(abs(want[t] - got[t]) for t in shared))
    return worst


@dataclass(frozen=True)
class ModeResult:
    """One vLLM engine run against transformers."""

    mode: str
    recovery: bool
    same_tokens: bool
    acceptance: float
    worst_gap: float
    report: EngineReport


def compare(model: Path, workdir: Path, *, num_spec: int = 3, new_tokens: int = 32,
            corrupt: float = 0.4, tp: int = 1, shape: TinyFlash | None = None,
            progress: Callable[[str], None] = lambda _: None) -> tuple[dict[str, Any],
                                                                       list[ModeResult]]:
    """transformers' greedy result and one :class:`ModeResult` per recovery mode."""
    prompts = word_prompts(shape or TinyFlash())
    progress("transformers: greedy generate")
    hf = greedy_in_subprocess(model, prompts, new_tokens, workdir)
    oracle = write_oracle(workdir / "oracle.json",
                          [(p + o, corrupt) for p, o in zip(prompts, hf["outputs"],
                                                            strict=True)])
    engine = {**FLASH_ENGINE, **(TP2 if tp == 2 else {})}
    results = []
    for mode in ("on", "off"):
        progress(f"vLLM: recovery {mode}, S = {num_spec}, tensor parallel {tp}")
        report = run_in_subprocess(
            EngineRun(model=str(model), mode=mode, num_spec=num_spec, oracle=str(oracle),
                      prompts=list[Prompt](prompts), max_tokens=new_tokens, logprobs=TOP_LOGPROBS,
                      engine=engine), workdir, env=tp_binding() if tp == 2 else None)
        results.append(ModeResult(
            mode=mode, recovery=report.recovery, same_tokens=report.outputs == hf["outputs"],
            acceptance=report.acceptance,
            worst_gap=worst_logprob_gap(hf["logprobs"], report.logprobs), report=report))
    return hf, results
