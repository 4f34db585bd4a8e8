"""KDA state operations for speculative decoding: kernels (Triton, CUDA) and their oracle.

Use the functions exported here; they validate their arguments and run the kernels on
CUDA tensors and the PyTorch reference (:mod:`.reference`, the oracle every kernel is tested
against) otherwise (:mod:`.backends` makes every such choice). The package is the bottom
layer: it imports no other subpackage of ``vllm_recoverssm``.

Layout: :mod:`.api` (the public operations), :mod:`.plan` (commit plans, address tables and
verify plans: what a step acts on), :mod:`.validation` (argument checks),
:mod:`.backends` (which implementation runs), :mod:`.tuning` (kernel tuning knobs),
:mod:`.reference` (the PyTorch oracle), :mod:`.triton_math` (shared Triton arithmetic and
dtypes), :mod:`.triton_kda` / :mod:`.triton_window` / :mod:`.triton_prefill` /
:mod:`.triton_conv` (Triton kernels), :mod:`.cuda_window` / :mod:`.cuda_commit` (the CUDA
library built from ``ops/csrc/``), :mod:`.cuda_resources` (its ptxas report) and
:mod:`.b12x_kda` (b12x's SM12x kernels behind the same arguments).
"""

from .api import (
    commit,
    conv_compact,
    conv_prefill,
    conv_update,
    prefill,
    verify_full,
    verify_fused,
    verify_recovery,
)
from .backends import BACKENDS
from .plan import CommitPlan, CommitTables, VerifyPlan, commit_tables, plan_verify
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
    "CommitTables",
    "VerifyPlan",
    "capture_boundary",
    "commit",
    "commit_tables",
    "conv_compact",
    "conv_prefill",
    "conv_update",
    "kda_gate",
    "kda_step",
    "l2_normalize",
    "plan_verify",
    "prefill",
    "verify_full",
    "verify_fused",
    "verify_recovery",
]
