"""The demo's checkpoint part: a second wave of requests restored from LMCache, timed against cold.

With ``recoverssm demo --checkpoint ram|disk`` each mode's runtime exports a bundle at the end
of every prompt and every response of the main batch (wave 1). Wave 2 then sends, for every
other wave-1 request, a follow-up turn (its prompt, its answer and a few new tokens, which
restores the response bundle and computes only the tail) and, for the rest, the same prompt
again (an exact hit: the stored logits give the first token, the prompt is not computed).
Wave 2 runs twice: on a fresh runtime without a store (cold) and on the runtime that
exported wave 1 (restored); both must produce the same tokens.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vllm_recoverssm.checkpoint import CheckpointConfig

from ..reference.drafters import Drafter
from ..reference.model import HybridModel
from ..reference.runtime import SpecRuntime
from ..reference.runtime_config import RuntimeConfig

BACKENDS = ("ram", "disk")
FOLLOW_UP_TOKENS = 8
"""New tokens a follow-up turn adds after the previous answer."""
RAM_BYTES = 256 * 2**20
CHUNK_BYTES = 4 * 2**20


@dataclass
class CheckpointReport:
    """One mode's second wave, cold and restored.

    ``computed_*`` count prompt tokens the model computed and ``steps_*`` forward passes (both
    exact, unlike the seconds on a busy machine); ``checkpoint_seconds`` is the
    restored runtime's time in captures, stores and lookups over both waves (inside its
    ``restored_seconds`` for wave 2).
    """

    mode: str
    backend: str
    requests: int
    follow_ups: int
    repeats: int
    exported: int
    hits: int
    exact_hits: int
    restored_tokens: int
    prompt_tokens: int
    computed_cold: int
    computed_restored: int
    steps_cold: int
    steps_restored: int
    cold_seconds: float
    restored_seconds: float
    saved_seconds: float
    saved_fraction: float
    checkpoint_seconds: float
    bytes_written: int
    bytes_read: int
    rejected: int
    outputs_identical: bool


class CheckpointPlace:
    """Where the demo's bundles go: LMCache RAM, a given directory or a temporary one.

    A temporary directory is removed by :meth:`close`; a given one is kept, so that a
    second demo run finds its bundles.
    """

    def __init__(self, backend: str, directory: str | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"argument '--checkpoint': expected ram or disk, got {backend!r}")
        self._temporary: Path | None = None
        path: Path | None = None
        if backend == "disk":
            if directory is None:
                self._temporary = path = Path(tempfile.mkdtemp(prefix="recoverssm-ckpt-"))
            else:
                path = Path(directory).expanduser().resolve()
        elif directory is not None:
            raise ValueError("argument '--checkpoint-dir': only --checkpoint disk writes files")
        self.config = CheckpointConfig(backend=backend,  # type: ignore[arg-type]
                                       path=path, ram_bytes=RAM_BYTES, chunk_bytes=CHUNK_BYTES)

    def close(self) -> None:
        """Remove the temporary directory, if one was made."""
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None


def second_wave_prompts(
    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], vocab: int, seed: int
) -> list[list[int]]:
    """Follow-up turns (prompt + answer + new tokens) for even requests, repeats for odd."""
    gen = torch.Generator().manual_seed(seed + 2)
    wave = []
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        if i % 2 == 0:
            new = torch.randint(0, vocab, (FOLLOW_UP_TOKENS,), generator=gen).tolist()
            wave.append([*p, *a, *new])
        else:
            wave.append(list(p))
    return wave


def _timed_run(
    runtime: SpecRuntime, prompts: Sequence[Sequence[int]], max_new: int,
    progress: Callable[[int, int], None],
) -> tuple[list[list[int]], float]:
    for p in prompts:
        runtime.add_request(p, max_new)
    t0 = time.perf_counter()
    done = runtime.run(progress=progress)
    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    return [r.generated for r in done], time.perf_counter() - t0


def run_second_wave(
    exported: SpecRuntime,
    model: HybridModel,
    drafter: Drafter,
    wave: Sequence[Sequence[int]],
    max_new: int,
    cold_progress: Callable[[int, int], None],
    restored_progress: Callable[[int, int], None],
) -> CheckpointReport:
    """Run ``wave`` cold on a fresh runtime, then restored on ``exported``; compare."""
    store = exported.checkpoint_store
    if store is None:
        raise ValueError("argument 'exported': the runtime has no checkpoint store")
    cold_config: RuntimeConfig = replace(exported.config, checkpoint=None)
    cold_rt = SpecRuntime(model, cold_config, drafter)
    cold, cold_s = _timed_run(cold_rt, wave, max_new, cold_progress)
    s = exported.stats
    before = (s.external_hits, s.restored_tokens, s.prefill_tokens, s.steps)
    restored, restored_s = _timed_run(exported, wave, max_new, restored_progress)
    finished = exported.finished[-len(wave):]
    prompt_tokens = sum(len(p) for p in wave)
    return CheckpointReport(
        mode=exported.mode,
        backend=store.config.backend,
        requests=len(wave),
        follow_ups=(len(wave) + 1) // 2,
        repeats=len(wave) // 2,
        exported=s.checkpoints_exported,
        hits=s.external_hits - before[0],
        exact_hits=sum(r.restored_tokens == len(r.prompt) for r in finished),
        restored_tokens=s.restored_tokens - before[1],
        prompt_tokens=prompt_tokens,
        computed_cold=cold_rt.stats.prefill_tokens,
        computed_restored=s.prefill_tokens - before[2],
        steps_cold=cold_rt.stats.steps,
        steps_restored=s.steps - before[3],
        cold_seconds=cold_s,
        restored_seconds=restored_s,
        saved_seconds=cold_s - restored_s,
        saved_fraction=(cold_s - restored_s) / cold_s if cold_s else 0.0,
        checkpoint_seconds=s.checkpoint_seconds,
        bytes_written=store.stats.bytes_written,
        bytes_read=store.stats.bytes_read,
        rejected=store.stats.rejected + s.checkpoint_rejected,
        outputs_identical=restored == cold,
    )
