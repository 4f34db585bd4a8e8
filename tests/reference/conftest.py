"""Fixtures of the reference-runtime tests: one tiny model and its greedy references."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.reference_runs import MAX_MODEL_LEN, MAX_NEW, make_prompts
from vllm_recoverssm.reference import TEST_MODEL, HybridModel, build_model, greedy_continuations


@pytest.fixture(autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """Tiny tensors: one thread is as fast and immune to a busy machine's thread contention."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model() -> HybridModel:
    """The 4-layer test model (3 KDA + 1 attention) on the CPU."""
    return build_model(TEST_MODEL)


@pytest.fixture(scope="session")
def prompts(tiny_model: HybridModel) -> list[list[int]]:
    """Four prompts of 3..21 tokens."""
    return make_prompts(4, tiny_model.config.vocab_size)


@pytest.fixture(scope="session")
def references(tiny_model: HybridModel, prompts: list[list[int]]) -> list[list[int]]:
    """Plain greedy continuations (no speculation) of ``prompts``, with room for S = 7."""
    return greedy_continuations(tiny_model, prompts, MAX_NEW + 8,
                                max_model_len=MAX_MODEL_LEN + 8)
