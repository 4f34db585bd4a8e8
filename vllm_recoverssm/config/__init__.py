"""Deployment configuration: eligibility decisions and model specs."""

from .eligibility import (
    GLM53_ARCHITECTURES,
    KIMI_ARCHITECTURES,
    QWEN3_NEXT_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    Decision,
    Deployment,
    Failure,
    IneligibleError,
    RecoveryMode,
    check_conditions,
    decide,
)

__all__ = [
    "GLM53_ARCHITECTURES",
    "KIMI_ARCHITECTURES",
    "QWEN3_NEXT_ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "Decision",
    "Deployment",
    "Failure",
    "IneligibleError",
    "RecoveryMode",
    "check_conditions",
    "decide",
]
