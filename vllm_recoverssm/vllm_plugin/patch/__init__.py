"""The one seam through which the plugin changes vLLM's behaviour.

One small module per vLLM area. :data:`REGISTER` says, for each change, what it touches,
why, which vLLM versions it is for and when it can go. Patches that replace vLLM code
install at a stage: ``register`` (the plugin's entry point: only the engine-argument
wrappers, which must be in place before vLLM parses arguments) or ``model`` (when the
plugin's GLM-5.3 model module is imported, so ``register()`` stays cheap). The others are
functions the plugin calls at the one place it needs them (a config write, a private
attribute read); they are listed here so that every change to vLLM is in one register.
Modules load lazily: nothing here imports vLLM until a patch installs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Stage = Literal["register", "model", "called"]
"""When a patch takes effect: at the entry point, at model import, or where it is called."""


@dataclass(frozen=True)
class Patch:
    """One change to vLLM's behaviour, with its reasons."""

    name: str
    module: str
    what: str
    why: str
    versions: str
    until: str
    stage: Stage = "called"

    def _module_function(self, name: str) -> Callable[[], object] | None:
        module = importlib.import_module(f"{__name__}.{self.module}")
        return getattr(module, name, None)  # type: ignore[no-any-return]

    def applies(self) -> bool:
        """Whether the patch installs in this process (its module's ``applies()``)."""
        check = self._module_function("applies")
        return True if check is None else bool(check())

    def install(self) -> None:
        """Install it (its module's ``install()``); only staged patches have one."""
        install = self._module_function("install")
        if install is None:
            raise TypeError(f"patch {self.name}: module {self.module} has no install()")
        install()


ALL_VLLM = "vLLM 0.32 and 0.33"

REGISTER: tuple[Patch, ...] = (
    Patch(
        name="engine-args", module="engine_args", stage="register",
        what=("EngineArgs.add_cli_args, from_cli_args and create_engine_config (wrapped: "
              "the originals run) and the --use-replayssm argparse action's default"),
        why=("vLLM's flag defaults to False, so --no-use-replayssm cannot be told from no "
             "flag; on GLM-5.3 the flag means 'force recovery', which vLLM's own check "
             "would refuse; the decision and every start-up refusal must happen while the "
             "config is built, not mid-request"),
        versions=ALL_VLLM,
        until="vLLM gives plugins a hook on engine-argument parsing and config creation",
    ),
    Patch(
        name="mhc-cpu", module="mhc_cpu", stage="model",
        what=("vLLM's CPU forms of the mHC pre, post and fused post-pre ops "
              "(MHCPreOp, MHCPostOp, MHCFusedPostPreOp .forward_cpu)"),
        why=("they drop the layer-input RMSNorm weight that GLM-5.3 folds into the mHC "
             "pre block (input_layernorm / post_attention_layernorm), so every block "
             "reads an unnormalised input, and they accept only bfloat16/float16; "
             "transformers' GLM-5.3-Flash and vLLM's CUDA and ROCm forms normalise"),
        versions=f"{ALL_VLLM} on the CPU platform",
        until="vLLM's CPU mHC ops apply norm_weight",
    ),
    Patch(
        name="vision-qk-norm-cpu", module="vision_qk_norm_cpu", stage="model",
        what=("the q/k RMSNorm of vLLM's GLM-5.3 vision attention "
              "(vllm.models.glm5next.common.multimodal.fused_q_kv_rmsnorm)"),
        why=("it is a Triton kernel with no CPU form, so an image prompt stops on the CPU "
             "engine; the replacement computes the kernel's float32 row norm in PyTorch"),
        versions=f"{ALL_VLLM} on the CPU platform",
        until="vLLM's fused q/k norm gets a CPU form",
    ),
    Patch(
        name="v1-runner-hooks", module="v1_runner",
        what=("GPUModelRunner._update_states_after_model_execute and ._sample (wrapped: the "
              "originals run, hooks before or after)"),
        why=("runner V1 has no model-state step after sampling: the recovery commit and the "
             "checkpoint connector's captures must run there, in the same step"),
        versions=ALL_VLLM,
        until="runner V1 is gone (runner V2 has the model-state hooks the plugin uses)",
    ),
    Patch(
        name="v2-runner-sample-logits", module="v2_runner",
        what=("runner V2's GPUModelRunner.sample (wrapped: the original runs, with the "
              "model's compute_logits lent a copy-keeping wrapper while it does)"),
        why=("a request-boundary checkpoint stores the logits that sampled a request's last "
             "token; runner V2 keeps no logits after sampling, and its sampler may change "
             "them in place"),
        versions=ALL_VLLM,
        until="runner V2 hands KV connectors the step's logits",
    ),
    Patch(
        name="kda-recoverssm-flag", module="cache_config",
        what="cache_config.use_kda_recoverssm, set where GLM-5.3 runs recovery",
        why=("vLLM derives it only for Kimi's KDA RecoverSSM; runner V2 builds its "
             "RecoverSSM state and keeps graph batches in the verify window only with it"),
        versions=ALL_VLLM,
        until="vLLM derives the flag from the model's own recovery support",
    ),
    Patch(
        name="kv-load-recompute", module="kv_connector",
        what=("kv_transfer_config.kv_load_failure_policy = 'recompute' and the connector "
              "scheduler's private _kv_cache_manager (block ids of a request)"),
        why=("a failed checkpoint load must recompute, never fail the request; the "
             "connector base class gives no accessor for the manager vLLM hands it"),
        versions=ALL_VLLM,
        until="vLLM lets a connector declare its failure policy and exposes block ids",
    ),
    Patch(
        name="kda-forward-undecorated", module="kda_layer",
        what="Glm5NextLinearAttention._forward.__wrapped__ (read, not replaced)",
        why=("the plugin's layer carries vLLM's capture-break decorator on its own forward; "
             "calling the decorated parent would break the graph capture twice"),
        versions=ALL_VLLM,
        until="vLLM's layer splits its speculative path into an overridable method",
    ),
)

_installed: list[str] = []


def apply(stage: Stage) -> list[str]:
    """Install every registered patch of ``stage`` that applies here (once); returns the
    names installed in this process so far."""
    for patch in REGISTER:
        if patch.stage == stage and patch.name not in _installed and patch.applies():
            patch.install()
            _installed.append(patch.name)
    return list(_installed)


def installed() -> list[str]:
    """Names of the patches installed in this process so far."""
    return list(_installed)
