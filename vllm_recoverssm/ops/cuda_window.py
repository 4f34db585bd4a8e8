"""The CUDA window verify (``ops/csrc/kda_window*.cu``): built on first use, called via ctypes.

The same library holds the CUDA commit (``ops/csrc/kda_commit.cu``, launched by
:mod:`.cuda_commit`).

The kernel computes what :mod:`.triton_window` computes, with the product laid out by hand
for ``mma.sync`` (see the header of ``ops/csrc/kda_window.cuh``). The sources ship inside the
package (``vllm_recoverssm/ops/csrc/``, package data of the wheel) and are compiled lazily,
on a CUDA machine only, with PyTorch's extension builder (nvcc and ninja); they include no
PyTorch header, so the build takes seconds and the library does not depend on the PyTorch
version. Anything that stops it on a CUDA machine -- missing sources, no nvcc, an old GPU,
a failed build -- leaves the Triton kernels in charge, with one warning per process
saying why (:func:`library`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from .triton_window import FULL, FUSED, RECOVERY, TP, WINDOW_MAX_LOG_DECAY

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
"""The CUDA sources, package data of :mod:`vllm_recoverssm.ops`."""
SOURCES = ("kda_window_entry.cu", "kda_window_recovery.cu", "kda_window_full.cu",
           "kda_window_fused.cu", "kda_commit.cu")
HEAD_DIM = 128
ACT_CODES = {torch.bfloat16: 0, torch.float32: 2}
HALF_WIDTH_COLS = 4
"""Windows of at most this many columns (S <= 3) take the kernel's half-width product:
4 token slots, half the tensor-core products (``kHalfCols`` in ``ops/csrc/kda_window.cuh``)."""
NVCC_FLAGS = ("-O3", "-std=c++17")
"""nvcc flags of the library's build (also :mod:`.cuda_resources`' report of it)."""
DISABLE_ENV = "RECOVERSSM_CUDA_WINDOW"
"""Set to ``0`` to keep the Triton window kernel on CUDA devices (comparisons, debugging)."""
DEFINES_ENV = "RECOVERSSM_CUDA_DEFINES"
"""Build-time overrides of the verify's launch bounds and row depth for tuning sweeps,
``NAME=VALUE`` pairs separated by commas (names in :data:`TUNING_DEFINES`). The library is
built under a name of its own per set, so variants and the default do not overwrite each
other's build."""
TUNING_DEFINES: dict[str, tuple[int, int]] = {
    # blocks per SM asked of the compiler (the register bound of __launch_bounds__), by
    # mode, rows per warp and token slots
    "RECOVERY_BLOCKS_16": (1, 8),
    "RECOVERY_BLOCKS_32": (1, 8),
    "FUSED_BLOCKS_16_TP4": (1, 8),
    "FUSED_BLOCKS_16_TP8": (1, 8),
    "FUSED_BLOCKS_32": (1, 8),
    "FULL_BLOCKS_16": (1, 8),
    "FULL_BLOCKS_32": (1, 8),
    # k-steps of state rows a recovery warp has in flight ahead of its product (8: all)
    "RECOVERY_DEPTH": (1, 8),
}
"""What :data:`DEFINES_ENV` may set: ``(lowest, highest)`` per name. Each is
``RECOVERSSM_<name>`` in ``ops/csrc/kda_window.cuh``, which holds the defaults."""

_lock = threading.Lock()
_state: dict[str, object] = {}

_c_int, _c_ll, _c_f, _p = ctypes.c_int, ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p
# in the order of recoverssm_window_launch's parameters (ops/csrc/kda_window_entry.cu)
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _c_int, _c_int, _c_int, _c_int, _c_int, _c_int, _c_f, _c_f,  # mode .. scale
    _p, _p, _p, _p, _p, _p, _p, _p, _c_ll,  # q, k, v, g, beta, A_log, dt_bias, state, stride
    _p, _p, _p, _p, _c_ll, _p, _c_ll, _p,  # sidx, nacc, qsl, corr, stride, kg, stride, ridx
    _p, _c_ll, _p, _c_ll, _p, _p, _p, _p,  # pcorr, stride, pkg, stride, pridx, plen, out, stream
]
# in the order of recoverssm_commit_launch's parameters (ops/csrc/kda_commit.cu)
_COMMIT_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _c_int, _c_int, _c_int, _c_int, _c_int, _c_int, _c_f,  # act_dtype .. lower_bound
    _p, _p, _p, _p, _p, _p, _p, _p,  # state, corr, kg tables and strides, A_log, dt_bias
    _p, _p, _p, _p, _p, _p, _p,  # sidx, clen, fidx, bidx, blen, ridx, stream
]


def parse_defines(text: str, *, source: str = DEFINES_ENV) -> tuple[tuple[str, int], ...]:
    """``NAME=VALUE[,NAME=VALUE...]`` as checked pairs, sorted by name (empty: none).

    ``ValueError`` names ``source`` and the entry for an unknown name, a value that is not
    an integer in the name's range, or a name given twice.
    """
    out: dict[str, int] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, value = entry.partition("=")
        name = name.strip().upper()
        if name.startswith("RECOVERSSM_"):
            name = name[len("RECOVERSSM_"):]
        if not sep or name not in TUNING_DEFINES:
            raise ValueError(f"{source}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(TUNING_DEFINES)}, got {entry!r}")
        lo, hi = TUNING_DEFINES[name]
        try:
            number = int(value.strip(), 10)
        except ValueError:
            number = lo - 1
        if not lo <= number <= hi:
            raise ValueError(f"{source}: {name} expected an integer in {lo}..{hi}, "
                             f"got {value.strip()!r}")
        if name in out:
            raise ValueError(f"{source}: {name} given twice")
        out[name] = number
    return tuple(sorted(out.items()))


def define_flags(defines: tuple[tuple[str, int], ...]) -> list[str]:
    """nvcc ``-D`` flags of checked :func:`parse_defines` pairs."""
    return [f"-DRECOVERSSM_{name}={value}" for name, value in defines]


def library_name(defines: tuple[tuple[str, int], ...]) -> str:
    """The extension's build name: one per set of overrides (the default set: none)."""
    if not defines:
        return "recoverssm_window"
    return "recoverssm_window_" + "_".join(f"{name.lower()}_{value}" for name, value in defines)


def _build(defines: tuple[tuple[str, int], ...]) -> ctypes.CDLL:
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    path = load(
        name=library_name(defines),
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cuda_cflags=[*NVCC_FLAGS, *define_flags(defines)],
        is_python_module=False,
        verbose=False,
    )
    lib = ctypes.CDLL(str(path))
    fn = lib.recoverssm_window_launch
    fn.argtypes = _ARGTYPES
    fn.restype = ctypes.c_int
    commit = lib.recoverssm_commit_launch
    commit.argtypes = _COMMIT_ARGTYPES
    commit.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The built library, or None where it cannot be had.

    On a CUDA machine (of SM80 or newer, the library not turned off by :data:`DISABLE_ENV`)
    that cannot have it -- sources missing, no nvcc, a failed build -- the first call logs
    one warning that says why and that the Triton kernels run instead; the answer is
    cached for the process, so no later call warns again.

    :data:`DEFINES_ENV` is read at the first call; a value :func:`parse_defines` refuses
    raises its ``ValueError`` (a tuning run must not time the Triton fallback unawares).
    """
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        defines = parse_defines(os.environ.get(DEFINES_ENV, ""))
        lib: ctypes.CDLL | None = None
        why = ""
        if os.environ.get(DISABLE_ENV) == "0":
            why = f"{DISABLE_ENV}=0"
        elif not torch.cuda.is_available():
            why = "no CUDA device"
        elif torch.cuda.get_device_capability() < (8, 0):
            why = "the tf32 tensor-core product needs SM80 or newer"
        elif missing := [s for s in SOURCES if not (CSRC / s).is_file()]:
            why = (f"CUDA sources {', '.join(missing)} not found under {CSRC} (an install "
                   "without the package data of vllm_recoverssm/ops/csrc)")
        else:
            try:
                lib = _build(defines)
            except Exception as exc:  # noqa: BLE001 - any build failure means "use Triton"
                why = f"build failed ({type(exc).__name__}: {str(exc).strip()[:300]})"
        if lib is None and why not in ("no CUDA device", f"{DISABLE_ENV}=0"):
            # the result is cached below, so this is the process's only such warning
            logger.warning("vllm-recoverssm: the CUDA window verify and CUDA commit are "
                           "unavailable, the Triton kernels run instead: %s", why)
        _state["lib"] = lib
        _state["why"] = why
        return lib


def library_serves(state: torch.Tensor, act_dtype: torch.dtype, ncols: int,
                   index_tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """What every kernel of the library needs (the verify and the commit alike): a CUDA
    state pool with K = V = 128, bfloat16 or float32 activations, at most :data:`TP`
    token columns, int32 indices, and the library not turned off by :data:`DISABLE_ENV`."""
    if state.device.type != "cuda" or os.environ.get(DISABLE_ENV) == "0":
        return False
    _, _, V, K = state.shape
    if K != HEAD_DIM or V != HEAD_DIM or act_dtype not in ACT_CODES or ncols > TP:
        return False
    return all(t is None or t.dtype == torch.int32 for t in index_tensors)


def applies(q: torch.Tensor, state: torch.Tensor, lower_bound: float | None, ncols: int,
            index_tensors: tuple[torch.Tensor | None, ...],
            vector_tensors: tuple[torch.Tensor | None, ...] = ()) -> bool:
    """Whether this call can run on the CUDA kernel (without building it yet).

    ``vector_tensors`` are read or written 16 bytes at a time (keys, queries, gates, the
    kg records, the state): their base addresses must be 16-byte aligned.
    """
    if not library_serves(state, q.dtype, ncols, index_tensors):
        return False
    if lower_bound is None or abs(lower_bound) * ncols > WINDOW_MAX_LOG_DECAY:
        return False
    return not (state.stride(0) % 4 or any(t is not None and t.data_ptr() % 16
                                           for t in (state, q, *vector_tensors)))


def unavailable_reason() -> object:
    """Why :func:`library` gave None (empty before it was first called)."""
    return _state.get("why")


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for ctypes (None: a null pointer)."""
    return None if t is None else t.data_ptr()


def launch(
    mode: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
    raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, num_accepted: torch.Tensor | None,
    query_start_loc: torch.Tensor, corrections: torch.Tensor | None, kg: torch.Tensor | None,
    record_indices: torch.Tensor | None, lower_bound: float, ncols: int, rows_per_warp: int,
    prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One launch of the CUDA window kernel (arguments as :func:`.triton_window.launch_window`)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CUDA window kernel is unavailable: {unavailable_reason()}")
    if mode not in (RECOVERY, FULL, FUSED):
        raise ValueError(f"argument 'mode': expected 0, 1 or 2, got {mode}")
    _, H, _, _ = state.shape
    N = query_start_loc.shape[0] - 1
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    a_log = A_log.float().contiguous()
    dtb = dt_bias.float().contiguous()
    pc, pk, pr, pl = prev if prev is not None else (None, None, None, None)
    stream = torch.cuda.current_stream(state.device).cuda_stream
    err = lib.recoverssm_window_launch(
        mode, ACT_CODES[q.dtype], rows_per_warp, N, H, ncols, float(lower_bound),
        float(HEAD_DIM ** -0.5),
        q.data_ptr(), k.data_ptr(), v.data_ptr(), raw_g.data_ptr(), raw_beta.data_ptr(),
        a_log.data_ptr(), dtb.data_ptr(), state.data_ptr(), state.stride(0),
        state_indices.data_ptr(), ptr(num_accepted), query_start_loc.data_ptr(),
        ptr(corrections), corrections.stride(0) if corrections is not None else 0,
        ptr(kg), kg.stride(0) if kg is not None else 0, ptr(record_indices),
        ptr(pc), pc.stride(0) if pc is not None else 0,
        ptr(pk), pk.stride(0) if pk is not None else 0, ptr(pr), ptr(pl),
        out.data_ptr(), stream,
    )
    if err:
        raise RuntimeError(f"CUDA window verify launch failed: cudaError {err}")
    return out
