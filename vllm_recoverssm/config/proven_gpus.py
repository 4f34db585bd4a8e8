"""The GPU architectures where automatic recovery has been proven inside vLLM's GPU engine.

Recovery is on by default on a GPU only where vLLM's real GPU engine has run the plugin and
its GPU engine tests (``tests/harness/test_gpu_engine.py``: greedy tokens of recovery equal
to full speculative states, vLLM's own KDA kernels as the baseline) passed. Elsewhere the
automatic mode keeps full states and says why; ``--use-replayssm`` (mode ``on``) still
turns recovery on, as every eligibility condition holds.

A new entry needs those tests passing on that architecture: docs/testing.md, "GPU engine
tests", says how they run and README's "what is proven where" names the runs.
"""

from __future__ import annotations

PROVEN_GPUS: dict[int, str] = {
    9: "SM90 (H100, H200)",
}
"""Compute-capability major -> the GPUs the GPU engine tests passed on."""

__all__ = ["PROVEN_GPUS", "is_proven_gpu", "unproven_gpu_reason"]


def is_proven_gpu(capability: tuple[int, int]) -> bool:
    """Whether a GPU of ``capability`` belongs to an architecture of :data:`PROVEN_GPUS`."""
    return capability[0] in PROVEN_GPUS


def unproven_gpu_reason(capability: tuple[int, int]) -> str:
    """Why automatic mode keeps full states on a GPU of ``capability`` (not proven)."""
    proven = ", ".join(PROVEN_GPUS.values())
    return (
        f"this GPU is SM{capability[0]}{capability[1]}, where vLLM's GPU engine has not yet "
        f"run the plugin's GPU engine tests (proven: {proven}), so full speculative states "
        "are kept; --use-replayssm (mode on) uses recovery here"
    )
