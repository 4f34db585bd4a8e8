"""Which implementation runs a state operation: the one registry of backend choices.

Three choices, each made here and nowhere else:

* **per machine** (:func:`choose_kernel_backend`): on SM12x with a usable b12x, b12x's CuTe
  verify/commit (:mod:`.b12x_kda`); on any other GPU of compute capability 8.0 or newer,
  this package's kernels; without such a GPU, no kernel backend (the PyTorch reference).
* **per call** (:func:`use_kernels`): ``backend="auto"`` runs the kernels on CUDA tensors
  and the PyTorch reference (:mod:`.reference`, the oracle) on anything else;
  ``"triton"`` forces the kernels (on CPU tensors this needs ``TRITON_INTERPRET=1``) and
  ``"reference"`` the reference.
* **per launch** (:func:`verify_kernel`, :func:`commit_kernel`): among the kernels, the
  CUDA ones (:mod:`.cuda_window`, :mod:`.cuda_commit`) where they apply and build, else the
  Triton ones. Both give the same bits, so this choice never changes a result.

The per-launch choices honour the overrides of :mod:`.tuning`. The kernel modules are
imported only when a choice needs them, so this module (and :mod:`vllm_recoverssm.ops`)
imports without Triton.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import torch

from . import tuning
from .b12x_kda import B12X_MODULE, B12X_REQUIRED_API
from .b12x_kda import b12x_recovery_api as b12x_has_recovery_api

if TYPE_CHECKING:
    from .plan import CommitPlan, CommitTables

__all__ = ["B12X_MODULE", "B12X_REQUIRED_API", "BACKENDS", "MIN_CAPABILITY", "KernelBackend",
           "b12x_has_recovery_api", "choose_kernel_backend", "commit_kernel", "load_b12x",
           "use_kernels", "verify_kernel"]

BACKENDS = ("auto", "triton", "reference")
"""What a state operation's ``backend`` argument takes."""
KernelBackend = Literal["triton", "b12x"]
"""A machine's kernel backend: this package's kernels (Triton and CUDA) or b12x's."""
MIN_CAPABILITY = (8, 0)
"""The oldest GPU the kernels serve (Ampere)."""


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

    SM12x with a usable b12x (:func:`b12x_has_recovery_api`) -> ``"b12x"``; any other SM80+
    GPU -> ``"triton"``; older or no GPU -> None. ``b12x`` is the imported ``gdn_decode``
    module (``"detect"`` imports it only when the GPU is SM12x).
    """
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        return None
    if capability[0] == 12:
        module = load_b12x() if isinstance(b12x, str) else b12x
        if b12x_has_recovery_api(module):
            return "b12x"
    return "triton"


def use_kernels(backend: str, device: torch.device, *, kernels_serve: bool = True) -> bool:
    """Whether a call with ``backend`` on tensors of ``device`` runs the kernels (True) or
    the PyTorch reference (False); ``ValueError`` names a backend that cannot run there.

    ``kernels_serve=False`` (e.g. float64 states, a conv too wide for the kernel's
    registers) sends ``"auto"`` to the reference; a forced ``"triton"`` still gets the
    kernels, whose wrapper then refuses the call by name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"argument 'backend': expected one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"argument 'backend': 'triton' on {device.type} tensors needs "
                "TRITON_INTERPRET=1 (or CUDA tensors)"
            )
        return True
    return kernels_serve and device.type == "cuda"


def verify_kernel(lower_bound: float | None, ncols: int, state: torch.Tensor,
                  q: torch.Tensor | None = None,
                  index_tensors: tuple[torch.Tensor | None, ...] = (),
                  vector_tensors: tuple[torch.Tensor | None, ...] = ()) -> str:
    """Which verify kernel a call gets: ``"cuda"``, ``"window"`` or ``"serial"``.

    :attr:`.tuning.KernelTuning.verify_kernel` where set (a window kernel forced on a gate
    it cannot serve is refused by name); else the CUDA window kernel where it applies and
    builds (SM80+, K = V = 128, bf16 or fp32 activations, int32 indices, a bounded gate),
    else the Triton window kernel where that applies, else the serial one. The choice
    depends only on the gate, the shapes, the dtypes and the device, so a step's
    full-state and recovery verifies always run the same arithmetic.
    """
    from . import cuda_window
    from . import triton_window as win

    window = win.window_supported(lower_bound, ncols, state.device)
    forced = tuning.current().verify_kernel
    if forced is not None:
        if forced != "serial" and not window:
            raise ValueError("argument 'lower_bound': the window kernels need a bounded gate "
                             f"with |lower_bound| * (S+1) <= {win.WINDOW_MAX_LOG_DECAY}")
        return forced
    if not window:
        return "serial"
    # alignment and index dtypes are the caller's layout, the same for a step's full-state
    # and recovery calls
    if q is not None and cuda_window.applies(q, state, lower_bound, ncols, index_tensors,
                                             vector_tensors) \
            and cuda_window.library() is not None:
        return "cuda"
    return "window"


def commit_kernel(tables: CommitTables, plan: CommitPlan, lower_bound: float | None,
                  record_indices: torch.Tensor | None) -> str:
    """Which commit kernel a call gets: ``"cuda"`` or ``"triton"``.

    :attr:`.tuning.KernelTuning.commit_kernel` where set (a forced CUDA commit that does not
    apply is refused by name); else the CUDA commit where :func:`.cuda_commit.preferred`
    says it is the faster (long windows over many (request, layer, head) triples),
    :func:`.cuda_commit.applies` and the library builds, and the Triton commit elsewhere.
    """
    from . import cuda_commit, cuda_window

    index = (*plan.index_tensors(), record_indices)
    forced = tuning.current().commit_kernel
    if forced is not None:
        if forced == "cuda" and not cuda_commit.applies(
                tables.states[0], tables.kg[0], lower_bound, tables, index):
            raise ValueError("tuning.commit_kernel: the CUDA commit does not apply to "
                             "these pools, records, gate or indices")
        return forced
    ncols = tables.kg[0].shape[2]
    programs = plan.num_rows * len(tables.states) * tables.states[0].shape[1]
    if cuda_commit.preferred(ncols, programs) and cuda_commit.applies(
            tables.states[0], tables.kg[0], lower_bound, tables, index) \
            and cuda_window.library() is not None:
        return "cuda"
    return "triton"
