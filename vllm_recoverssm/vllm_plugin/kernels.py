"""Which kernels run recovery verify/commit on this machine.

Our Triton kernels run on every NVIDIA GPU of compute capability 8.0 (Ampere) and newer.
On SM12x (RTX 50xx, RTX PRO 6000, GB10) b12x ships CuTe verify/commit kernels for the same
record layout; they are preferred there when the installed ``b12x`` has the API the plugin
calls. Without a CUDA GPU there is no kernel backend (the PyTorch reference is for tests).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Literal

import torch

from ..ops.b12x_kda import B12X_MODULE, B12X_REQUIRED_API, B12xKdaRecovery, b12x_recovery_api

KernelBackend = Literal["triton", "b12x"]

__all__ = ["B12X_MODULE", "B12X_REQUIRED_API", "KernelBackend", "b12x_has_recovery_api",
           "b12x_recovery_for", "choose_kernel_backend", "cuda_capability", "load_b12x"]

MIN_CAPABILITY = (8, 0)


def b12x_has_recovery_api(module: ModuleType | None) -> bool:
    """Whether ``module`` (b12x's ``gdn_decode``, or None when absent) has what
    :class:`~vllm_recoverssm.ops.b12x_kda.B12xKdaRecovery` calls: every name of
    ``B12X_REQUIRED_API``, ``Caps`` with the recovery fields (``recover_speculative_state``)
    and ``run_kda`` taking ``apply_output_norm``."""
    return b12x_recovery_api(module)


def load_b12x() -> ModuleType | None:
    """Import b12x's ``gdn_decode`` module, or None when b12x is not installed or broken."""
    try:
        return importlib.import_module(B12X_MODULE)
    except Exception:  # an absent or broken optional package means "not available"
        return None


def choose_kernel_backend(
    capability: tuple[int, int] | None, b12x: ModuleType | None | str = "detect"
) -> KernelBackend | None:
    """Pick the recovery kernel backend for a GPU of ``capability`` (None = no CUDA GPU).

    SM12x with a usable b12x -> ``"b12x"``; any other SM80+ GPU -> ``"triton"``; older or
    no GPU -> None. ``b12x`` is the imported ``gdn_decode`` module (``"detect"`` imports it
    only when the GPU is SM12x).
    """
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        return None
    if capability[0] == 12:
        module = load_b12x() if isinstance(b12x, str) else b12x
        if b12x_has_recovery_api(module):
            return "b12x"
    return "triton"


def cuda_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or None without a CUDA GPU."""
    from .compat import cuda_capability as detect

    return detect()


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
