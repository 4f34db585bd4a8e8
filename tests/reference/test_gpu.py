"""The reference runtime on a CUDA GPU: Triton kernels, GLM-5.3 head size, CUDA graphs."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from tests.support.reference_runs import make_prompts, oracle, run
from vllm_recoverssm.reference import (
    FULL_STATE,
    GPU_MODEL,
    MODES,
    RECOVERY,
    HybridModel,
    RuntimeConfig,
    SpecRuntime,
    build_model,
    corruption_for_acceptance,
    greedy_continuations,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_NEW = 24
LEN = 96


@pytest.fixture(scope="module")
def gpu_model() -> HybridModel:
    """The GPU preset: 8 KDA heads of 128, bfloat16 activations."""
    return build_model(GPU_MODEL, "cuda")


@pytest.fixture(scope="module")
def gpu_prompts() -> list[list[int]]:
    """Eight prompts of 4..53 tokens."""
    return make_prompts(8, GPU_MODEL.vocab_size, seed=2,
                        lengths=[4, 11, 18, 25, 32, 39, 46, 53])


@pytest.fixture(scope="module")
def gpu_references(gpu_model: HybridModel, gpu_prompts: list[list[int]]) -> list[list[int]]:
    """Plain greedy continuations."""
    return greedy_continuations(gpu_model, gpu_prompts, MAX_NEW + 8, max_model_len=LEN + 8)


@pytest.mark.parametrize("num_spec", [1, 3, 7])
@pytest.mark.parametrize("target", [1.0, 0.5, 0.0])
def test_recovery_matches_full_state_on_gpu(
    gpu_model: HybridModel, gpu_prompts: list[list[int]], gpu_references: list[list[int]],
    num_spec: int, target: float,
) -> None:
    drafter = oracle(gpu_model, gpu_prompts, gpu_references,
                     corruption_for_acceptance(target, num_spec))
    common = dict(num_spec=num_spec, max_model_len=LEN, block_size=8, max_new=MAX_NEW)
    rec, rec_rt = run(gpu_model, gpu_prompts, drafter, mode=RECOVERY, **common)  # type: ignore[arg-type]
    full, _ = run(gpu_model, gpu_prompts, drafter, mode=FULL_STATE, **common)  # type: ignore[arg-type]
    assert rec_rt.config.fused  # the commit inside the next verify
    assert rec == full
    if target == 0.5:
        separate, _ = run(gpu_model, gpu_prompts, drafter, mode=RECOVERY, fused_commit=False,
                          **common)  # type: ignore[arg-type]
        assert separate == full
    if target == 0.0:
        assert rec_rt.stats.acceptance_rate == 0.0
    else:
        assert rec_rt.stats.acceptance_rate > 0.0


@pytest.fixture(scope="module")
def gpu_model_fp32() -> HybridModel:
    """The GPU preset in float32.

    A warm run batches its prefill tail and decode rows differently from a cold run, and
    GPU matrix products are not batch-invariant: in bfloat16 the resulting last-bit logit
    differences flip near-tied greedy choices of the random model. In float32 they stay
    around 1e-7 relative, so the comparison tests the prefix cache, not the GEMM library.
    """
    return build_model(dataclasses.replace(GPU_MODEL, dtype="float32"), "cuda")


@pytest.mark.parametrize("mode", MODES)
def test_prefix_caching_on_gpu(
    gpu_model_fp32: HybridModel, gpu_prompts: list[list[int]], mode: str,
) -> None:
    refs = greedy_continuations(gpu_model_fp32, gpu_prompts, MAX_NEW + 8,
                                max_model_len=LEN + 8)
    drafter = oracle(gpu_model_fp32, gpu_prompts, refs, 0.3)
    common = dict(mode=mode, num_spec=3, max_model_len=LEN, block_size=8, max_new=MAX_NEW)
    cold, _ = run(gpu_model_fp32, gpu_prompts, drafter, **common)  # type: ignore[arg-type]
    warm, rt = run(gpu_model_fp32, gpu_prompts + gpu_prompts, drafter, prefix_caching=True,
                   max_running=8, **common)  # type: ignore[arg-type]
    assert warm == cold + cold
    assert rt.cache.stats.hits > 0


@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replay_matches_eager(
    gpu_model: HybridModel, gpu_prompts: list[list[int]], gpu_references: list[list[int]],
    mode: str,
) -> None:
    drafter = oracle(gpu_model, gpu_prompts, gpu_references, 0.3)
    common = dict(mode=mode, num_spec=3, max_model_len=LEN, block_size=8, max_new=MAX_NEW)
    eager, eager_rt = run(gpu_model, gpu_prompts, drafter, pad_decode_rows=True, **common)  # type: ignore[arg-type]
    graph, graph_rt = run(gpu_model, gpu_prompts, drafter, cuda_graph=True, **common)  # type: ignore[arg-type]
    assert graph == eager
    assert graph_rt.stats.graph_steps > 0 and eager_rt.stats.graph_steps == 0
    # the tail, with fewer requests left, replays graphs captured for fewer rows
    assert graph_rt.stats.graph_captures >= 2
    assert graph_rt.stats.graph_steps > graph_rt.stats.graph_captures


def test_a_finished_runtime_frees_its_graphs_and_pools(
    gpu_model: HybridModel, gpu_prompts: list[list[int]], gpu_references: list[list[int]],
) -> None:
    """Dropping a runtime that captured CUDA graphs frees its state pools and graphs at
    once, with no garbage collection, and leaves nothing of its own behind (the demo runs
    one runtime after another on one GPU; a cycle through the graphs kept each one's memory
    alive, and a new warm-up stream per capture left a 32 MiB cuBLAS workspace each)."""
    drafter = oracle(gpu_model, gpu_prompts, gpu_references, 0.3)
    config = RuntimeConfig(mode=FULL_STATE, num_spec=3, max_model_len=LEN, block_size=8,
                           cuda_graph=True)

    def one_run() -> SpecRuntime:
        with SpecRuntime(gpu_model, config, drafter) as rt:
            for p in gpu_prompts:
                rt.add_request(p, MAX_NEW)
            rt.run()
        assert rt.stats.graph_captures > 0
        return rt

    one_run()  # lazily built kernels and caches first
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        rt = one_run()
        held = torch.cuda.memory_allocated() - before  # its pools and graphs
        ref = weakref.ref(rt)
        del rt
        assert ref() is None
        freed_to = torch.cuda.memory_allocated() - before
    finally:
        gc.enable()
    assert held > 0
    assert freed_to <= held // 10
