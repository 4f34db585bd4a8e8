"""KDA state operations for speculative decoding: reference (PyTorch) and Triton kernels.

Use the functions exported here; they validate their arguments and pick the Triton kernels
for CUDA tensors and the PyTorch reference otherwise.
"""

from .api import (
    BACKENDS,
    CommitPlan,
    commit,
    commit_tables,
    conv_compact,
    conv_prefill,
    conv_update,
    prefill,
    verify_full,
    verify_fused,
    verify_recovery,
)
from .reference import (
    capture_boundary,
    kda_gate,
    kda_step,
    l2_normalize,
)

NULL_SLOT = -1
"""Any negative state index is the null slot; -1 is the one this package writes."""

__all__ = [
    "BACKENDS",
    "NULL_SLOT",
    "CommitPlan",
    "capture_boundary",
    "commit",
    "commit_tables",
    "conv_compact",
    "conv_prefill",
    "conv_update",
    "kda_gate",
    "kda_step",
    "l2_normalize",
    "prefill",
    "verify_full",
    "verify_fused",
    "verify_recovery",
]
