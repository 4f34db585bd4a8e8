"""Scheduling: chunked prefill mixed with decode rows, waiting for room, releasing state."""

from __future__ import annotations

import pytest
import torch

from tests.support.reference_runs import MAX_MODEL_LEN, MAX_NEW, make_prompts, oracle, run
from vllm_recoverssm import ops
from vllm_recoverssm.reference import (
    FULL_STATE,
    MODES,
    RECOVERY,
    HybridModel,
    Request,
    RuntimeConfig,
    SpecRuntime,
    capture_linear,
)
from vllm_recoverssm.reference.step_inputs import StepInputs


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_mixes_with_decode(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]], mode: str
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    out, rt = run(tiny_model, prompts, drafter, mode=mode, num_spec=3, max_prefill_tokens=5)
    assert out == [r[:MAX_NEW] for r in references]
    assert rt.stats.mixed_steps > 0  # prefill chunks and decode rows in one forward pass
    assert rt.stats.prefill_tokens == sum(len(p) for p in prompts)


def test_decode_tokens_per_second_counts_only_steps_without_prompt_rows(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    _, rt = run(tiny_model, prompts, drafter, mode=RECOVERY, num_spec=3, max_prefill_tokens=5)
    s = rt.stats
    # every prompt's first token comes from a step with prompt rows, and chunked prefill
    # mixes more of those with decode rows: they are left out
    assert 0 < s.decode_only_tokens <= s.generated_tokens - len(prompts)
    assert s.mixed_steps > 0
    assert 0 < s.decode_only_seconds < s.seconds
    assert s.decode_tokens_per_second == s.decode_only_tokens / s.decode_only_seconds


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_small_pool_makes_requests_wait(
    tiny_model: HybridModel, references: list[list[int]], prompts: list[list[int]],
    mode: str, prefix_caching: bool,
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    roomy, _ = run(tiny_model, prompts, drafter, mode=mode, num_spec=3,
                   prefix_caching=prefix_caching)
    per_request = RuntimeConfig(mode=mode, num_spec=3,
                                prefix_caching=prefix_caching).slots_per_request
    out, rt = run(tiny_model, prompts, drafter, mode=mode, num_spec=3,
                  prefix_caching=prefix_caching, num_slots=3 * per_request - 1)
    assert out == roomy
    assert rt.stats.max_concurrent == 2
    assert rt.stats.wait_events > 0


@pytest.mark.parametrize("mode", MODES)
def test_few_kv_pages_make_requests_wait(
    tiny_model: HybridModel, references: list[list[int]], prompts: list[list[int]], mode: str
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    roomy, _ = run(tiny_model, prompts, drafter, mode=mode, num_spec=3)
    # the longest request needs ceil((21 + 12 + 3) / 8) = 5 pages; 9 usable pages fit 1-2
    out, rt = run(tiny_model, prompts, drafter, mode=mode, num_spec=3, num_pages=10)
    assert out == roomy
    assert rt.stats.max_concurrent < len(prompts)
    assert rt.stats.wait_events > 0


@pytest.mark.parametrize("mode", MODES)
def test_finished_requests_release_every_slot_and_page(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]], mode: str
) -> None:
    drafter = oracle(tiny_model, prompts, references, 0.3)
    _, rt = run(tiny_model, prompts, drafter, mode=mode, num_spec=3, prefix_caching=True)
    assert rt.running == [] and rt.waiting == type(rt.waiting)()
    assert len(rt.cache) > 0
    rt.cache.clear()
    assert rt.slots.num_free == rt.slots.num_slots
    assert rt.pages.num_free == rt.pages.capacity
    assert all(r.pages == [] and r.slot_owners == [] for r in rt.finished)


def test_more_requests_than_rows_all_finish(tiny_model: HybridModel) -> None:
    many = make_prompts(6, tiny_model.config.vocab_size, seed=5,
                        lengths=[4, 9, 2, 15, 7, 11])
    out, rt = run(tiny_model, many, None, mode=RECOVERY, num_spec=1, max_running=2,
                  max_new=5)
    assert [len(o) for o in out] == [5] * 6
    assert rt.stats.max_concurrent == 2


def test_invalid_requests_are_refused(tiny_model: HybridModel) -> None:
    rt = SpecRuntime(tiny_model, RuntimeConfig(max_model_len=MAX_MODEL_LEN, block_size=8))
    vocab = tiny_model.config.vocab_size
    with pytest.raises(ValueError, match="'prompt'"):
        rt.add_request([], 4)
    with pytest.raises(ValueError, match="outside"):
        rt.add_request([vocab], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        rt.add_request([1, 2], 0)
    with pytest.raises(ValueError, match="max_model_len"):
        rt.add_request([1] * 60, 10)
    small = SpecRuntime(tiny_model, RuntimeConfig(max_model_len=MAX_MODEL_LEN, block_size=8,
                                                  num_pages=3))
    with pytest.raises(ValueError, match="KV pages"):
        small.add_request([1] * 20, 10)


def test_invalid_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="'mode'"):
        RuntimeConfig(mode="both")
    with pytest.raises(ValueError, match="'num_spec'"):
        RuntimeConfig(num_spec=8)
    with pytest.raises(ValueError, match="'block_size'"):
        RuntimeConfig(num_spec=7, block_size=4, prefix_caching=True)
    with pytest.raises(ValueError, match="'num_slots'"):
        RuntimeConfig(mode=FULL_STATE, num_spec=3, num_slots=3)
    with pytest.raises(ValueError, match="debug_commit_shift"):
        RuntimeConfig(mode=FULL_STATE, debug_commit_shift=1)


@pytest.mark.parametrize("mode", MODES)
def test_null_padding_rows_change_nothing(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]], mode: str
) -> None:
    """Decode steps padded with null rows (the CUDA-graph shape) give the same tokens."""
    drafter = oracle(tiny_model, prompts, references, 0.3)
    plain, _ = run(tiny_model, prompts, drafter, mode=mode, num_spec=3)
    padded, _ = run(tiny_model, prompts, drafter, mode=mode, num_spec=3, pad_decode_rows=True,
                    max_running=6)
    assert padded == plain


def test_cuda_graph_needs_a_gpu(tiny_model: HybridModel, prompts: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        run(tiny_model, prompts[:1], oracle(tiny_model, prompts[:1], [[0] * 20], 0.0),
            mode=RECOVERY, num_spec=1, cuda_graph=True)


def test_graph_sizes_pad_to_the_smallest_that_holds_the_rows() -> None:
    cfg = RuntimeConfig(max_running=12, cuda_graph=True)
    assert cfg.graph_sizes == (1, 2, 4, 8, 12)
    assert [cfg.graph_rows(n) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert RuntimeConfig(max_running=1).graph_sizes == (1,)
    assert RuntimeConfig(max_running=8).graph_sizes == (1, 2, 4, 8)
    for bad in (0, 13):
        with pytest.raises(ValueError, match="num_rows"):
            cfg.graph_rows(bad)


def test_padded_tail_steps_shrink_with_the_batch(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]]
) -> None:
    """Eager padding follows the capture sizes: a tail step pads to the next size only."""
    drafter = oracle(tiny_model, prompts, references, 0.3)
    seen: list[int] = []
    real = tiny_model.forward

    def spy(inputs: StepInputs, pools: object) -> object:
        if not inputs.linear.num_prefill_rows:
            seen.append(inputs.linear.num_decode_rows)
        return real(inputs, pools)  # type: ignore[arg-type]

    tiny_model.forward = spy  # type: ignore[method-assign]
    try:
        run(tiny_model, prompts, drafter, mode=RECOVERY, num_spec=3, pad_decode_rows=True,
            max_running=6)
    finally:
        del tiny_model.forward
    assert seen and set(seen) <= {1, 2, 4, 6}
    assert min(seen) < 6  # the tail ran smaller than the full batch


def _count_commits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = ops.commit

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ops, "commit", counting)
    return calls


def test_finished_requests_are_committed_only_for_a_reader(
    tiny_model: HybridModel, prompts: list[list[int]], references: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the fused commit a finished request's last records are committed on their own
    only when something reads its state at the response boundary."""
    drafter = oracle(tiny_model, prompts, references, 0.3)
    calls = _count_commits(monkeypatch)
    plain, rt = run(tiny_model, prompts, drafter, mode=RECOVERY, num_spec=3)
    assert rt.config.fused and calls == []  # every commit ran inside a verify
    assert all(r.pending == 0 and r.pending_row == -1 for r in rt.finished)
    states: dict[str, dict[int, list[torch.Tensor]]] = {}
    for mode in MODES:
        seen: dict[int, list[torch.Tensor]] = {}

        def hook(runtime: SpecRuntime, req: Request, boundary: str,
                 seen: dict[int, list[torch.Tensor]] = seen) -> None:
            if boundary == "response":
                seen[req.rid] = [t["state"] for t in capture_linear(runtime, req).values()]

        runtime = SpecRuntime(tiny_model, RuntimeConfig(
            mode=mode, num_spec=3, block_size=8, max_model_len=MAX_MODEL_LEN), drafter,
            on_boundary=hook)
        for p in prompts:
            runtime.add_request(p, MAX_NEW)
        assert [r.generated for r in runtime.run()] == plain
        states[mode] = seen
    assert len(calls) > 0  # the hook made recovery commit the finishing requests
    assert states[RECOVERY].keys() == states[FULL_STATE].keys() == set(range(len(prompts)))
    for rid, layers in states[RECOVERY].items():
        for rec, full in zip(layers, states[FULL_STATE][rid], strict=True):
            torch.testing.assert_close(rec, full, rtol=1e-5, atol=1e-5)
