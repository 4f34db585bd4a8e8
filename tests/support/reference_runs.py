"""Shared set-up for the reference-runtime tests: prompts, references and one-call runs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_recoverssm.reference import (
    Drafter,
    HybridModel,
    OracleDrafter,
    RuntimeConfig,
    SpecRuntime,
)

MAX_NEW = 12
MAX_MODEL_LEN = 64


def make_prompts(count: int, vocab: int, seed: int = 1, lengths: Sequence[int] | None = None
                 ) -> list[list[int]]:
    """``count`` random prompts of different lengths (3..21 tokens by default)."""
    gen = torch.Generator().manual_seed(seed)
    lens = list(lengths) if lengths is not None else [3 + (6 * i) % 19 for i in range(count)]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens[:count]]


def oracle(model: HybridModel, prompts: Sequence[Sequence[int]], references: Sequence[list[int]],
           corruption: float, seed: int = 0) -> OracleDrafter:
    """An oracle drafter over ``references`` (greedy continuations of ``prompts``)."""
    table = {tuple(p): r for p, r in zip(prompts, references, strict=True)}
    return OracleDrafter(table, corruption, model.config.vocab_size, seed=seed)


def run(
    model: HybridModel,
    prompts: Sequence[Sequence[int]],
    drafter: Drafter | None,
    max_new: int = MAX_NEW,
    **config: object,
) -> tuple[list[list[int]], SpecRuntime]:
    """Run ``prompts`` to completion; returns the generated tokens and the runtime."""
    config.setdefault("max_model_len", MAX_MODEL_LEN)
    config.setdefault("block_size", 8)
    runtime = SpecRuntime(model, RuntimeConfig(**config), drafter)  # type: ignore[arg-type]
    for p in prompts:
        runtime.add_request(p, max_new)
    return [r.generated for r in runtime.run()], runtime
