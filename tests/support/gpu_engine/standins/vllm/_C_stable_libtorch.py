"""Stand-in for vLLM 0.33.0's compiled ``vllm._C_stable_libtorch`` (GPU engine tests only).

Why it is needed: ``vllm/platforms/cuda.py`` imports this extension unconditionally, and the
real one is built against torch 2.14, so it does not load under the lent GPU machine's
torch 2.11. ``scripts/gpu-engine/build-carry.sh`` copies this file over the extracted vLLM
Python tree. It registers, under the same op namespaces, only what the tests' engine path
needs, and each entry is one of three kinds (table: docs/testing.md, "GPU engine tests"):

* ``not-supported``: a capability query that answers "not supported" (False), so vLLM
  takes its other path;
* ``computes-same``: computes what the real op computes, in PyTorch;
* ``absent-if-called``: the op must exist because a layer's ``__init__`` looks it up, but
  the tests run vLLM's PyTorch forms (``custom_ops: ["none"]``); calling it raises.

Written from the ops' documented semantics; no upstream kernel code is reproduced.
"""

from __future__ import annotations

import torch

_LIBS: list[torch.library.Library] = []
STANDINS: dict[str, str] = {}


def _lib(ns: str) -> torch.library.Library:
    lib = torch.library.Library(ns, "FRAGMENT")
    _LIBS.append(lib)
    return lib


_C = _lib("_C")
_CU = _lib("_C_cuda_utils")


def _define(lib: torch.library.Library, schema: str, fn, kind: str,
            key: str = "CompositeExplicitAutograd") -> None:
    name = schema.split("(", 1)[0]
    lib.define(schema)
    lib.impl(name, fn, key)
    STANDINS[f"{lib.ns}::{name}"] = kind


# ---------------------------------------------------------------- capability queries
def _false(cuda_device_capability: int) -> bool:
    return False


for _q in ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8",
           "cutlass_scaled_mm_supports_fp4", "cutlass_group_gemm_supported",
           "mxfp4_experts_quant_supported"):
    _define(_C, f"{_q}(int cuda_device_capability) -> bool", _false, "not-supported")


# ---------------------------------------------------------------- RMS norm
def _rms_scale(x: torch.Tensor, epsilon: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon)


def _rms_norm(result: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None,
              epsilon: float) -> None:
    # normalise in fp32, round to the activation dtype, then scale by the weight in it
    y = _rms_scale(input, epsilon).to(input.dtype)
    if weight is not None:
        y = y * weight
    result.copy_(y)


def _fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor,
                        weight: torch.Tensor | None, epsilon: float) -> None:
    # residual <- input + residual (in the activation dtype); input <- rms_norm(residual)
    residual.add_(input)
    y = _rms_scale(residual, epsilon).to(input.dtype)
    if weight is not None:
        y = y * weight
    input.copy_(y)


_define(_C, "rms_norm(Tensor(a!) result, Tensor input, Tensor? weight, float epsilon) -> ()",
        _rms_norm, "computes-same")
_define(_C, "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, "
        "float epsilon) -> ()", _fused_add_rms_norm, "computes-same")


# ---------------------------------------------------------------- penalties
def _apply_repetition_penalties_(logits: torch.Tensor, prompt_mask: torch.Tensor,
                                 output_mask: torch.Tensor,
                                 repetition_penalties: torch.Tensor) -> None:
    pen = repetition_penalties.unsqueeze(1).to(logits.dtype)
    seen = prompt_mask | output_mask
    factor = torch.where(logits > 0, 1.0 / pen, pen)
    logits.copy_(torch.where(seen, logits * factor, logits))


_define(_C, "apply_repetition_penalties_(Tensor(a!) logits, Tensor prompt_mask, "
        "Tensor output_mask, Tensor repetition_penalties) -> ()",
        _apply_repetition_penalties_, "computes-same")


# ---------------------------------------------------------------- tensor views
def _weak_ref_tensor(input: torch.Tensor) -> torch.Tensor:
    # Same storage, offset, sizes and strides. The real op does not keep the storage
    # alive; this alias does (more memory can stay held, the values are the same).
    return input.as_strided(input.size(), input.stride(), input.storage_offset())


_C.define("weak_ref_tensor(Tensor(a) input) -> Tensor(a)")
_C.impl("weak_ref_tensor", _weak_ref_tensor, "CompositeExplicitAutograd")
STANDINS["_C::weak_ref_tensor"] = "computes-same (alias keeps storage alive)"


class _CudaArray:
    """``__cuda_array_interface__`` over a byte range of UVA-addressable host memory."""

    def __init__(self, ptr: int, nbytes: int, owner: torch.Tensor) -> None:
        self.owner = owner  # keeps the pinned host buffer alive as long as the view
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


def _get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    # A CUDA tensor over the pinned host buffer's own memory (unified virtual
    # addressing: a pinned allocation's host address is valid on the device).
    if cpu_tensor.device.type != "cpu" or not cpu_tensor.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor: needs a pinned CPU tensor")
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    storage = cpu_tensor.untyped_storage()
    base = storage.data_ptr()
    raw = torch.as_tensor(_CudaArray(base, storage.nbytes(), cpu_tensor), device="cuda")
    typed = raw.view(cpu_tensor.dtype)
    return typed.as_strided(cpu_tensor.size(), cpu_tensor.stride(),
                            cpu_tensor.storage_offset())


_C.define("get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor")
_C.impl("get_cuda_view_from_cpu_tensor", _get_cuda_view_from_cpu_tensor,
        "CompositeExplicitAutograd")
STANDINS["_C::get_cuda_view_from_cpu_tensor"] = "computes-same"


# ---------------------------------------------------------------- ops only looked up
def _absent(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(
            f"torch.ops._C.{name}: stand-in only (vLLM's compiled _C is not loadable here); "
            "run with compilation_config custom_ops ['none']")
    return fn


for _a in ("silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul",
           "fatrelu_and_mul", "situ_and_mul", "gelu_new", "gelu_fast", "gelu_quick",
           "gelu_tanh", "relu_squared", "relu2_no_mul"):
    _define(_C, f"{_a}(Tensor(a!) out, Tensor input) -> ()", _absent(_a), "absent-if-called")
_define(_C, "silu_and_mul_with_clamp(Tensor(a!) out, Tensor input, float limit) -> ()",
        _absent("silu_and_mul_with_clamp"), "absent-if-called")
_define(_C, "activation_lut_bf16(Tensor(a!) out, Tensor input) -> ()",
        _absent("activation_lut_bf16"), "absent-if-called")


# ---------------------------------------------------------------- device attributes
def _device_attribute(attribute: int, device: int) -> int:
    try:
        from cuda.bindings import runtime as rt  # cuda-python, present on the device

        err, value = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr(attribute), device)
        if int(err) == 0:
            return int(value)
    except Exception:
        pass
    import ctypes

    lib = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        raise RuntimeError("get_device_attribute stand-in: no CUDA runtime found")
    out = ctypes.c_int()
    rc = lib.cudaDeviceGetAttribute(ctypes.byref(out), int(attribute), int(device))
    if rc != 0:
        raise RuntimeError(f"cudaDeviceGetAttribute({attribute}) failed: {rc}")
    return int(out.value)


_CUDA_DEV_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97


def _max_shared_memory(device: int) -> int:
    return _device_attribute(_CUDA_DEV_ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device)


_define(_CU, "get_device_attribute(int attribute, int device) -> int", _device_attribute,
        "computes-same")
_define(_CU, "get_max_shared_memory_per_block_device_attribute(int device) -> int",
        _max_shared_memory, "computes-same")
