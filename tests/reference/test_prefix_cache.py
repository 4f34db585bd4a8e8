"""Align-mode prefix caching: a later request resumes from the deepest cached block."""

from __future__ import annotations

import pytest

from tests.support.reference_runs import MAX_MODEL_LEN, MAX_NEW, make_prompts, run
from vllm_recoverssm.reference import (
    MODES,
    HybridModel,
    OracleDrafter,
    RuntimeConfig,
    SpecRuntime,
    greedy_continuations,
)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size", [4, 8])
def test_prefix_hit_equals_cold_run(tiny_model: HybridModel, mode: str, block_size: int) -> None:
    vocab = tiny_model.config.vocab_size
    (first,) = make_prompts(1, vocab, seed=11, lengths=[10])
    (first_out,) = greedy_continuations(tiny_model, [first], MAX_NEW, max_model_len=MAX_MODEL_LEN)
    # A follow-up turn that extends the first request's whole conversation, and a request
    # that shares only the first 8 prompt tokens.
    follow_up = first + first_out + [5, 6]
    sibling = first[:8] + [7, 8, 9]
    prompts = [first, follow_up, sibling]
    refs = greedy_continuations(tiny_model, prompts, MAX_NEW + 4, max_model_len=MAX_MODEL_LEN)
    drafter = OracleDrafter({tuple(p): r for p, r in zip(prompts, refs, strict=True)}, 0.3,
                            vocab)
    config = RuntimeConfig(mode=mode, num_spec=3, block_size=block_size, prefix_caching=True,
                           max_running=1, max_model_len=MAX_MODEL_LEN)
    rt = SpecRuntime(tiny_model, config, drafter)
    for p in prompts:
        rt.add_request(p, MAX_NEW)
    warm = [r.generated for r in rt.run()]
    cold, _ = run(tiny_model, prompts, drafter, mode=mode, num_spec=3)
    assert warm == cold == [r[:MAX_NEW] for r in refs]
    hits = [r.prefix_hit_tokens for r in rt.finished]
    # the first request's 10 + 11 computed tokens hold (10 + 11) // B blocks; the follow-up
    # (its prompt is 24 tokens) resumes from the deepest, which the decode phase wrote
    assert hits == [0, (10 + MAX_NEW - 1) // block_size * block_size, 8]
    assert hits[1] > len(first)
    assert rt.cache.stats.hits == 2
    assert rt.cache.stats.hit_tokens == sum(hits)
    assert rt.stats.prefill_tokens == sum(len(p) for p in prompts) - sum(hits)


@pytest.mark.parametrize("mode", MODES)
def test_boundaries_inside_speculative_steps_are_captured(
    tiny_model: HybridModel, mode: str
) -> None:
    """Blocks ending in the middle of an accepted window are cached and reused correctly."""
    vocab = tiny_model.config.vocab_size
    firsts = make_prompts(3, vocab, seed=21, lengths=[5, 6, 7])
    outs = greedy_continuations(tiny_model, firsts, 20, max_model_len=MAX_MODEL_LEN)
    seconds = [p + o[:17] for p, o in zip(firsts, outs, strict=True)]
    prompts = firsts + seconds
    refs = greedy_continuations(tiny_model, prompts, 24, max_model_len=MAX_MODEL_LEN)
    drafter = OracleDrafter({tuple(p): r for p, r in zip(prompts, refs, strict=True)}, 0.0,
                            vocab)
    config = RuntimeConfig(mode=mode, num_spec=3, block_size=5, prefix_caching=True,
                           max_running=3, max_model_len=MAX_MODEL_LEN)
    rt = SpecRuntime(tiny_model, config, drafter)
    for p in prompts:
        rt.add_request(p, 20)
    warm = [r.generated for r in rt.run()]
    assert rt.stats.boundaries_mid_step > 0
    assert [r.prefix_hit_tokens for r in rt.finished[3:]] == [20, 20, 20]
    assert warm == [r[:20] for r in refs]


def test_cache_capacity_evicts_least_recently_used(tiny_model: HybridModel) -> None:
    prompts = make_prompts(3, tiny_model.config.vocab_size, seed=3, lengths=[17, 17, 17])
    _, rt = run(tiny_model, prompts, None, mode="recovery", num_spec=1, block_size=4,
                prefix_caching=True, max_cached_blocks=3, max_new=4)
    assert len(rt.cache) == 3
    assert rt.cache.stats.evicted_blocks == rt.cache.stats.stored_blocks - 3
