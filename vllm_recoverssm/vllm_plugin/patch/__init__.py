"""The one seam through which the plugin changes vLLM's behaviour.

Each patch is one small module per vLLM area. :data:`REGISTER` says, for each, what it
changes, why, which vLLM versions it is for and when it can go; :func:`apply` installs
the patches that apply in this process and returns their names. Patches install
lazily (when the plugin's GLM-5.3 model module is imported), never from the plugin's
entry point, so ``register()`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import mhc_cpu, vision_qk_norm_cpu


@dataclass(frozen=True)
class Patch:
    """One change to vLLM's behaviour, with its reasons."""

    name: str
    what: str
    why: str
    versions: str
    until: str
    applies: Callable[[], bool]
    install: Callable[[], None]


REGISTER: tuple[Patch, ...] = (
    Patch(
        name="mhc-cpu",
        what=("vLLM's CPU forms of the mHC pre, post and fused post-pre ops "
              "(MHCPreOp, MHCPostOp, MHCFusedPostPreOp .forward_cpu)"),
        why=("they drop the layer-input RMSNorm weight that GLM-5.3 folds into the mHC "
             "pre block (input_layernorm / post_attention_layernorm), so every block "
             "reads an unnormalised input, and they accept only bfloat16/float16; "
             "transformers' GLM-5.3-Flash and vLLM's CUDA and ROCm forms normalise"),
        versions="vLLM 0.32 and 0.33 on the CPU platform",
        until="vLLM's CPU mHC ops apply norm_weight (then drop this patch)",
        applies=mhc_cpu.applies,
        install=mhc_cpu.install,
    ),
    Patch(
        name="vision-qk-norm-cpu",
        what=("the q/k RMSNorm of vLLM's GLM-5.3 vision attention "
              "(vllm.models.glm5next.common.multimodal.fused_q_kv_rmsnorm)"),
        why=("it is a Triton kernel with no CPU form, so an image prompt stops on the CPU "
             "engine; the replacement computes the kernel's float32 row norm in PyTorch"),
        versions="vLLM 0.32 and 0.33 on the CPU platform",
        until="vLLM's fused q/k norm gets a CPU form (then drop this patch)",
        applies=vision_qk_norm_cpu.applies,
        install=vision_qk_norm_cpu.install,
    ),
)

_installed: list[str] = []


def apply() -> list[str]:
    """Install every registered patch that applies here (once); the names installed."""
    for patch in REGISTER:
        if patch.name not in _installed and patch.applies():
            patch.install()
            _installed.append(patch.name)
    return list(_installed)


def installed() -> list[str]:
    """Names of the patches installed in this process so far."""
    return list(_installed)
