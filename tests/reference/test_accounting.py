"""Allocated state bytes per request equal the memory planner's figure, in every mode."""

from __future__ import annotations

import pytest

from tests.support.reference_runs import oracle, run
from vllm_recoverssm.reference import CPU_MODEL, GPU_MODEL, MODES, HybridModel, ModelConfig
from vllm_recoverssm.reference.accounting import measured_state_bytes, planned_state_bytes
from vllm_recoverssm.reference.pools import ModelPools


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_spec", [1, 3])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_measured_bytes_equal_planner(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    mode: str, num_spec: int, prefix_caching: bool,
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    _, rt = run(tiny_model, prompts, drafter, mode=mode, num_spec=num_spec,
                prefix_caching=prefix_caching, block_size=4)
    assert rt.stats.peak_slots_per_request == rt.config.slots_per_request
    # the fused commit (recovery's default) holds a second record row
    assert rt.config.fused == (mode == "recovery")
    assert measured_state_bytes(rt) == planned_state_bytes(
        tiny_model.config, mode, num_spec, prefix_caching, fused=rt.config.fused)


def test_fused_commit_holds_one_more_record_row(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    _, fused = run(tiny_model, prompts, drafter, mode="recovery", num_spec=3)
    _, separate = run(tiny_model, prompts, drafter, mode="recovery", num_spec=3,
                      fused_commit=False)
    row = separate.pools.record_row_bytes
    assert row > 0 and fused.pools.record_rows == 2 * separate.pools.record_rows
    assert measured_state_bytes(fused) == measured_state_bytes(separate) + row


@pytest.mark.parametrize("config", [CPU_MODEL, GPU_MODEL], ids=["cpu", "gpu"])
def test_pool_page_bytes_match_planner_per_slot(config: ModelConfig) -> None:
    """One slot of the pools (allocated on the meta device) is the planner's page."""
    S = 3
    pools = ModelPools(config, mode="full_state", num_spec=S, num_slots=1, record_rows=1,
                       num_pages=2, block_size=4, device="meta")
    planned_full = planned_state_bytes(config, "full_state", S, False)
    assert (S + 1) * pools.slot_bytes == planned_full
    rec = ModelPools(config, mode="recovery", num_spec=S, num_slots=1, record_rows=1,
                     num_pages=2, block_size=4, device="meta")
    assert rec.slot_bytes + rec.record_row_bytes == planned_state_bytes(config, "recovery",
                                                                        S, False)
    # recovery keeps 1 state page instead of S+1 (plus its records)
    assert rec.slot_bytes + rec.record_row_bytes < planned_full / 2
