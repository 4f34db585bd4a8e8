"""A hook on vLLM's GPU model runner V2's sampling: the step's raw logits.

Runner V2 computes a step's logits inside ``sample`` and hands them to its sampler, which
may change them in place; nothing keeps them. A request-boundary checkpoint stores the
logits row that sampled a request's last token, so the wrapper lends the model a
``compute_logits`` that keeps a copy of the first call's result (the sampling logits; the
prompt-logprob calls come later in the step) while ``sample`` runs, then calls each hook
with the copy. The method is wrapped once and only while a hook is installed; its
signature is checked when the first hook is, so a vLLM that changed it fails at start-up.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..compat import UnsupportedVllmError, vllm_version

V2_RUNNER = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
V2_SAMPLE = "sample"
"""Runner V2's method that computes a step's logits and samples from them."""
V2_SAMPLE_PARAMS = ["self", "hidden_states", "input_batch", "grammar_output"]
_HOOKS = "_recoverssm_hooks"

AfterSampling = Callable[[Any, "torch.Tensor | None", Any], None]
"""``hook(runner, logits, input_batch)``: the step's raw logits (None when the runner did
not call ``compute_logits``, e.g. with its sampler sharded over ranks)."""


def _runner_cls() -> Any:
    return getattr(importlib.import_module(V2_RUNNER[0]), V2_RUNNER[1])


def install_v2_sample_hook(hook: AfterSampling) -> None:
    """Run ``hook(runner, logits, input_batch)`` right after runner V2 samples (idempotent)."""
    runner_cls: Any = _runner_cls()
    current = getattr(runner_cls, V2_SAMPLE, None)
    if current is None:
        raise UnsupportedVllmError(f"vLLM {vllm_version()}'s model runner V2 has no "
                                   f"{V2_SAMPLE}(); vllm-recoverssm cannot hook it")
    hooks: list[AfterSampling] | None = getattr(current, _HOOKS, None)
    if hooks is None:
        have = list(inspect.signature(current).parameters)
        if have[: len(V2_SAMPLE_PARAMS)] != V2_SAMPLE_PARAMS:
            raise UnsupportedVllmError(
                f"vLLM {vllm_version()}'s runner V2 {V2_SAMPLE} takes {have}, not "
                f"({', '.join(V2_SAMPLE_PARAMS)}); vllm-recoverssm cannot hook it")
        hooks = []
        setattr(runner_cls, V2_SAMPLE, _wrapper(getattr(current, "__wrapped__", current),
                                                hooks))
    if all(h is not hook for h in hooks):
        hooks.append(hook)


def _wrapper(original: Callable[..., Any], hooks: list[AfterSampling]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sample(self: Any, hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
        if not hooks:
            return original(self, hidden_states, input_batch, grammar_output)
        model = self.model
        own = model.compute_logits
        kept: list[torch.Tensor] = []

        def compute_logits(*args: Any, **kwargs: Any) -> Any:
            logits = own(*args, **kwargs)
            if not kept and isinstance(logits, torch.Tensor):
                kept.append(logits.detach().clone())
            return logits

        lent = vars(model).get("compute_logits")  # an instance's own, kept as it was
        model.compute_logits = compute_logits
        try:
            result = original(self, hidden_states, input_batch, grammar_output)
        finally:
            if lent is None:
                del model.compute_logits  # the class's method again
            else:
                model.compute_logits = lent
        for hook in list(hooks):
            hook(self, kept[0] if kept else None, input_batch)
        return result

    setattr(sample, _HOOKS, hooks)
    return sample
