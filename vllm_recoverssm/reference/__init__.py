"""Reference runtime: speculative decoding on a tiny GLM-5.3-shaped hybrid model.

A small, readable harness (not a serving engine) that proves the state machinery end to
end: the same prompts and drafter in recovery mode (one checkpoint + per-token records,
commit after acceptance) and full-state mode (``S+1`` state columns) must give the same
greedy output token for token.
"""

from .boundary import capture_linear, capture_request, layout_identity, restore_request
from .drafters import (
    Drafter,
    MTPDrafter,
    OracleDrafter,
    corruption_for_acceptance,
    expected_acceptance,
)
from .greedy import greedy_continuations
from .model import HybridModel, build_model
from .model_config import CPU_MODEL, GLM_TP2_MODEL, GPU_MODEL, TEST_MODEL, ModelConfig
from .request import Request
from .runtime import SpecRuntime
from .runtime_config import RuntimeConfig, slots_per_request
from .stats import RuntimeStats
from .step_inputs import FULL_STATE, MODES, RECOVERY

__all__ = [
    "CPU_MODEL",
    "FULL_STATE",
    "GLM_TP2_MODEL",
    "GPU_MODEL",
    "MODES",
    "RECOVERY",
    "TEST_MODEL",
    "Drafter",
    "HybridModel",
    "MTPDrafter",
    "ModelConfig",
    "OracleDrafter",
    "Request",
    "RuntimeConfig",
    "RuntimeStats",
    "SpecRuntime",
    "build_model",
    "capture_linear",
    "capture_request",
    "corruption_for_acceptance",
    "expected_acceptance",
    "greedy_continuations",
    "layout_identity",
    "restore_request",
    "slots_per_request",
]
