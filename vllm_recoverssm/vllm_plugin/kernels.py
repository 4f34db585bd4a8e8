"""The b12x kernels of one KV-cache group, from a vLLM config.

Which kernels run on a machine is :func:`vllm_recoverssm.ops.backends.choose_kernel_backend`
(our Triton/CUDA kernels on SM80+, b12x's CuTe kernels on SM12x where the installed b12x has
the recovery API); this module only adds what needs a vLLM config: sizing b12x's adapter.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.b12x_kda import B12xKdaRecovery
from ..ops.backends import choose_kernel_backend
from .compat import cuda_capability

__all__ = ["b12x_recovery_for"]


def b12x_recovery_for(vllm_config: Any, device: torch.device) -> B12xKdaRecovery | None:
    """The b12x verify/commit of one KV-cache group, or None when Triton runs.

    b12x runs when ``device`` is a CUDA GPU for which :func:`choose_kernel_backend` picks
    it (SM12x with a usable b12x). Verify and commit then both run on b12x: its records
    and ours have one format, but a deployment never mixes the two.
    """
    if device.type != "cuda" or choose_kernel_backend(cuda_capability()) != "b12x":
        return None
    text = vllm_config.model_config.hf_text_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    return B12xKdaRecovery(
        num_heads=int(text.linear_num_heads) // tp,
        num_spec=int(vllm_config.num_speculative_tokens),
        max_seqs=int(vllm_config.scheduler_config.max_num_seqs),
    )
