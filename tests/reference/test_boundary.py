"""Request-boundary capture and restore (the hooks a checkpoint store uses)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.reference_runs import MAX_MODEL_LEN, MAX_NEW, oracle
from vllm_recoverssm.checkpoint import RequestCheckpoint
from vllm_recoverssm.reference import (
    FULL_STATE,
    MODES,
    RECOVERY,
    HybridModel,
    Request,
    RuntimeConfig,
    SpecRuntime,
    capture_request,
    layout_identity,
)


def _capturing_run(
    model: HybridModel, prompts: list[list[int]], drafter: object, mode: str, **config: object
) -> tuple[list[list[int]], dict[tuple[int, str], RequestCheckpoint], SpecRuntime]:
    captured: dict[tuple[int, str], RequestCheckpoint] = {}

    def hook(runtime: SpecRuntime, req: Request, boundary: str) -> None:
        captured[(req.rid, boundary)] = capture_request(runtime, req, boundary)

    rt = SpecRuntime(model, RuntimeConfig(mode=mode, num_spec=3, block_size=8,
                                          max_model_len=MAX_MODEL_LEN, **config),  # type: ignore[arg-type]
                     drafter, on_boundary=hook)  # type: ignore[arg-type]
    for p in prompts:
        rt.add_request(p, MAX_NEW)
    return [r.generated for r in rt.run()], captured, rt


def _restored_run(model: HybridModel, prompts: list[list[int]], drafter: object, mode: str,
                  checkpoints: list[RequestCheckpoint]) -> tuple[list[list[int]], SpecRuntime]:
    rt = SpecRuntime(model, RuntimeConfig(mode=mode, num_spec=3, block_size=8,
                                          max_model_len=MAX_MODEL_LEN),
                     drafter)  # type: ignore[arg-type]
    for p, ck in zip(prompts, checkpoints, strict=True):
        rt.add_request(p, MAX_NEW, restore=ck)
    return [r.generated for r in rt.run()], rt


@pytest.mark.parametrize("capture_mode", MODES)
@pytest.mark.parametrize("restore_mode", MODES)
def test_prompt_checkpoint_resumes_without_prefill(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    capture_mode: str, restore_mode: str,
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    cold, captured, _ = _capturing_run(tiny_model, prompts, drafter, capture_mode)
    checkpoints = [captured[(i, "prompt")] for i in range(len(prompts))]
    assert [ck.tokens for ck in checkpoints] == [tuple(p) for p in prompts]
    warm, rt = _restored_run(tiny_model, prompts, drafter, restore_mode, checkpoints)
    assert warm == cold
    assert rt.stats.prefill_tokens == 0  # an exact prompt hit needs no compute
    assert rt.stats.restored_tokens == sum(len(p) for p in prompts)


@pytest.mark.parametrize("mode", MODES)
def test_response_checkpoint_continues_a_conversation(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]], mode: str
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    first, captured, _ = _capturing_run(tiny_model, prompts, drafter, mode)
    ck = captured[(0, "response")]
    # the response checkpoint holds every computed token: all but the last sampled one
    assert list(ck.tokens) == prompts[0] + first[0][:-1]
    follow_up = prompts[0] + first[0] + [3, 1, 4]
    cold, _, _ = _capturing_run(tiny_model, [follow_up], None, mode)
    warm, rt = _restored_run(tiny_model, [follow_up], None, mode, [ck])
    assert warm == cold
    assert rt.stats.prefill_tokens == len(follow_up) - ck.num_tokens


def test_both_modes_capture_the_same_state(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]]
) -> None:
    """Zero speculative offset: recovery's checkpoint equals full state's accepted column."""
    drafter = oracle(tiny_model, prompts, references, 0.3)
    _, rec, _ = _capturing_run(tiny_model, prompts, drafter, RECOVERY)
    _, full, full_rt = _capturing_run(tiny_model, prompts, drafter, FULL_STATE)
    assert rec.keys() == full.keys()
    for key in rec:
        a, b = rec[key], full[key]
        assert a.tokens == b.tokens
        for lname, tensors in a.layers.items():
            for tname, t in tensors.items():
                torch.testing.assert_close(t, b.layers[lname][tname], rtol=0, atol=1e-6)
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    # full state was compacted after each capture
    assert all(r.num_accepted == 1 for r in full_rt.finished)


def test_restore_refuses_a_foreign_checkpoint(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]]
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    _, captured, _ = _capturing_run(tiny_model, prompts, drafter, RECOVERY)
    ck = captured[(0, "prompt")]
    rt = SpecRuntime(tiny_model, RuntimeConfig(block_size=8, max_model_len=MAX_MODEL_LEN))
    with pytest.raises(ValueError, match="not a prefix"):
        rt.add_request(prompts[1], 4, restore=ck)
    broken = RequestCheckpoint(tokens=ck.tokens, layers={k: v for k, v in ck.layers.items()
                                                         if k != "layer.0"}, logits=ck.logits)
    with pytest.raises(ValueError, match="expected layers"):
        rt.add_request(prompts[0], 4, restore=broken)


@pytest.mark.lmcache
def test_checkpoint_round_trip_through_the_store(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    tmp_path: Path,
) -> None:
    """Prompt checkpoints stored on disk through LMCache restore into a fresh runtime."""
    pytest.importorskip("lmcache")
    from vllm_recoverssm.checkpoint import CheckpointConfig, CheckpointStore

    drafter = oracle(tiny_model, prompts, references, 0.3)
    cold, captured, rt = _capturing_run(tiny_model, prompts, drafter, RECOVERY)
    config = CheckpointConfig(backend="disk", path=tmp_path / "ckpt", ram_bytes=8 << 20,
                              chunk_bytes=1 << 20)
    store = CheckpointStore(config, layout_identity(rt))
    try:
        for i in range(len(prompts)):
            assert store.store(captured[(i, "prompt")]).stored
        hits = [store.lookup(p) for p in prompts]
    finally:
        store.close()
    assert all(h is not None and h.exact for h in hits)
    warm, warm_rt = _restored_run(tiny_model, prompts, drafter, RECOVERY,
                                  [h.checkpoint for h in hits if h is not None])
    assert warm == cold
    assert warm_rt.stats.prefill_tokens == 0
