"""Which recovery kernels the plugin runs on a machine.

:func:`vllm_recoverssm.ops.backends.choose_kernel_backend` picks for a machine: our Triton
and CUDA kernels on SM80+, b12x's CuTe kernels on SM12x where the installed b12x has the
recovery API. The plugin cannot hand its rows to b12x yet: b12x keeps a request's update
records at its state slot (record pools of one row per state slot, checked by
:class:`~vllm_recoverssm.ops.b12x_kda.B12xKdaRecovery`), while the plugin keeps them in
scratch of ``max_num_seqs`` rows indexed by the step's row, so that no page vLLM caches or
exports carries them. Until the plugin allocates per-slot record pools for b12x, SM12x runs
our Triton kernels, and the plugin says so once.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ops.backends import KernelBackend, choose_kernel_backend

__all__ = ["B12X_NOT_USED", "plugin_kernel_backend"]

B12X_NOT_USED = (
    "b12x is installed, but its recovery kernels keep update records per state slot and "
    "the plugin keeps them per step row: the plugin's Triton kernels run on this SM12x GPU"
)
_said: list[bool] = []


def plugin_kernel_backend(capability: tuple[int, int] | None,
                          say: Callable[[str], None] | None = None) -> KernelBackend | None:
    """The kernels the plugin's recovery rows run on a GPU of ``capability`` (None: no
    CUDA GPU, or one older than SM80): Triton wherever :func:`choose_kernel_backend`
    would pick b12x, told once per process to ``say`` (:data:`B12X_NOT_USED`)."""
    picked = choose_kernel_backend(capability)
    if picked != "b12x":
        return picked
    if not _said and say is not None:
        _said.append(True)
        say(B12X_NOT_USED)
    return "triton"
