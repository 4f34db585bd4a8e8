"""End to end: recovery output == full-state output, token for token (DESIGN section 6)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.reference_runs import MAX_NEW, oracle, run
from vllm_recoverssm.reference import (
    FULL_STATE,
    RECOVERY,
    HybridModel,
    MTPDrafter,
    corruption_for_acceptance,
)

# target acceptance -> (lowest, highest) measured: ~100 %, ~50 %, 0 %
ACCEPTANCE = {1.0: (0.9, 1.0), 0.5: (0.25, 0.75), 0.0: (0.0, 0.0)}


@pytest.mark.parametrize("num_spec", [1, 3, 7])
@pytest.mark.parametrize("target", sorted(ACCEPTANCE))
def test_recovery_matches_full_state(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    num_spec: int, target: float,
) -> None:
    corruption = corruption_for_acceptance(target, num_spec)
    drafter = oracle(tiny_model, prompts, references, corruption)
    rec, rec_rt = run(tiny_model, prompts, drafter, mode=RECOVERY, num_spec=num_spec)
    full, full_rt = run(tiny_model, prompts, drafter, mode=FULL_STATE, num_spec=num_spec)
    assert rec == full
    # both also reproduce plain greedy decoding without speculation
    assert rec == [r[:MAX_NEW] for r in references]
    assert rec_rt.stats.accept_histogram == full_rt.stats.accept_histogram
    low, high = ACCEPTANCE[target]
    assert low <= rec_rt.stats.acceptance_rate <= high


def test_every_accept_length_occurs(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]]
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.35)
    rec, rt = run(tiny_model, prompts, drafter, mode=RECOVERY, num_spec=3)
    assert all(count > 0 for count in rt.stats.accept_histogram), rt.stats.accept_histogram
    full, _ = run(tiny_model, prompts, drafter, mode=FULL_STATE, num_spec=3)
    assert rec == full


def test_mtp_drafter_modes_agree(tiny_model: HybridModel, prompts: list[list[int]],
                                 references: list[list[int]]) -> None:
    rec, rec_rt = run(tiny_model, prompts, MTPDrafter(), mode=RECOVERY, num_spec=3)
    full, _ = run(tiny_model, prompts, MTPDrafter(), mode=FULL_STATE, num_spec=3)
    assert rec == full == [r[:MAX_NEW] for r in references]
    assert rec_rt.stats.proposed_drafts > 0


@pytest.mark.parametrize("block_size", [None, 8], ids=["no-prefix-caching", "align-B8"])
def test_fused_and_separate_commit_agree(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    block_size: int | None,
) -> None:
    """The commit fused into the next verify gives the tokens of a commit after each step;
    with prefix caching too, where rows at a block's end commit after the step."""
    drafter = oracle(tiny_model, prompts, references, 0.35)
    cache: dict[str, Any] = ({} if block_size is None else
                             dict(prefix_caching=True, block_size=block_size))
    fused, fused_rt = run(tiny_model, prompts, drafter, mode=RECOVERY, num_spec=3, **cache)
    separate, sep_rt = run(tiny_model, prompts, drafter, mode=RECOVERY, num_spec=3,
                           fused_commit=False, **cache)
    assert fused_rt.config.fused and not sep_rt.config.fused
    assert fused == separate == [r[:MAX_NEW] for r in references]
    assert fused_rt.stats.accept_histogram == sep_rt.stats.accept_histogram
    decode_rows = sum(fused_rt.stats.accept_histogram)
    assert sep_rt.stats.deferred_rows == 0
    if block_size is None:
        assert fused_rt.stats.deferred_rows == decode_rows
    else:  # some rows reached a block's end and committed after their step
        assert 0 < fused_rt.stats.deferred_rows < decode_rows


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("shift", [1, -1])
def test_wrong_commit_count_breaks_equivalence(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]], shift: int,
    fused: bool,
) -> None:
    """Negative control: committing one token too many or too few changes the output."""
    drafter = oracle(tiny_model, prompts, references, 0.35)
    full, _ = run(tiny_model, prompts, drafter, mode=FULL_STATE, num_spec=3)
    wrong, _ = run(tiny_model, prompts, drafter, mode=RECOVERY, num_spec=3,
                   debug_commit_shift=shift, fused_commit=fused)
    assert wrong != full


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on a CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("mode", [RECOVERY, FULL_STATE])
def test_runtime_on_the_triton_kernels(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]], mode: str
) -> None:
    """The kernels (interpreted) drive the same runtime: padded null rows, align mode."""
    few = prompts[:3]
    drafter = oracle(tiny_model, few, references[:3], 0.3)
    out, rt = run(tiny_model, few, drafter, mode=mode, num_spec=3, block_size=4, max_new=8,
                  prefix_caching=True, pad_decode_rows=True, max_running=4, backend="triton")
    assert out == [r[:8] for r in references[:3]]
    assert rt.stats.boundaries_mid_step > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on a CPU need TRITON_INTERPRET=1")
def test_runtime_fused_commit_on_the_triton_kernels(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]]
) -> None:
    """The fused verify kernel (interpreted) with padded null rows and requests that
    finish at different steps (each flushed on its own)."""
    few = prompts[:3]
    drafter = oracle(tiny_model, few, references[:3], 0.3)
    out, rt = run(tiny_model, few, drafter, mode=RECOVERY, num_spec=3, max_new=8,
                  pad_decode_rows=True, max_running=4, backend="triton")
    assert rt.config.fused and out == [r[:8] for r in references[:3]]
