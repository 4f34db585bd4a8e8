"""Hooks around vLLM's V1 GPU model runner: before sampling and after its post-sampling
update.

Runner V1 has no model-state step after sampling (runner V2 has one, which the plugin
uses there), so the recovery commit and the checkpoint connector's captures wrap two of
its methods. Each method is wrapped once; every hook joins the wrapper's ordered list,
and the method's signature is checked when the first hook is installed, so a vLLM that
changed it fails at start-up.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ..compat import UnsupportedVllmError, vllm_version

V1_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
V1_HOOK = "_update_states_after_model_execute"
"""The V1 runner method that runs right after sampling (``sample_tokens``), with the
sampled tokens of every batch row (``-1`` past the accepted ones)."""
V1_SAMPLE = "_sample"
"""The V1 runner method that samples from a step's logits (``sample_tokens``)."""
_HOOKS = "_recoverssm_hooks"

COMMIT_ORDER = 0
"""Where the recovery commit runs among the after-sampling hooks (lower runs first)."""

CommitAfterSampling = Callable[[Any, Any], None]
"""``hook(runner, sampled_token_ids)``; called after vLLM's own post-sampling update."""
BeforeSampling = Callable[[Any, Any, Any], None]
"""``hook(runner, logits, spec_decode_metadata)``; called before vLLM samples."""


def _v1_runner_cls() -> Any:
    return getattr(importlib.import_module(V1_RUNNER[0]), V1_RUNNER[1])


def _install_v1_wrapper(method: str, params: list[str], hook: Callable[..., None],
                        order: int, after: bool) -> None:
    """Wrap the V1 runner's ``method`` once; every hook joins the wrapper's ordered list.

    A method replaced since (a newer wrapper of someone else, a test) gets a fresh
    wrapper and list, so hooks never outlive the method they were installed on.
    """
    runner_cls: Any = _v1_runner_cls()
    current = getattr(runner_cls, method, None)
    if current is None:
        raise UnsupportedVllmError(
            f"vLLM {vllm_version()}'s V1 model runner has no {method}(); vllm-recoverssm "
            "cannot hook it"
        )
    hooks: list[tuple[int, Callable[..., None]]] | None = getattr(current, _HOOKS, None)
    if hooks is None:
        have = list(inspect.signature(current).parameters)
        if have[: len(params)] != params:
            raise UnsupportedVllmError(
                f"vLLM {vllm_version()}'s {method} takes {have}, not ({', '.join(params)}); "
                "vllm-recoverssm cannot hook it"
            )
        original = getattr(current, "__wrapped__", current)
        hooks = []
        wrapper = _after_wrapper(original, hooks) if after else _before_wrapper(original, hooks)
        setattr(wrapper, _HOOKS, hooks)
        setattr(runner_cls, method, wrapper)
    if all(h is not hook for _, h in hooks):
        hooks.append((order, hook))
        hooks.sort(key=lambda item: item[0])  # stable: equal orders keep install order


def _after_wrapper(original: Callable[..., Any],
                   hooks: list[tuple[int, Callable[..., None]]]) -> Callable[..., Any]:
    @functools.wraps(original)
    def after_sampling(self: Any, output_token_ids: Any, scheduler_output: Any) -> Any:
        result = original(self, output_token_ids, scheduler_output)
        for _, hook in list(hooks):
            hook(self, output_token_ids)
        return result

    return after_sampling


def _before_wrapper(original: Callable[..., Any],
                    hooks: list[tuple[int, Callable[..., None]]]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        for _, hook in list(hooks):
            hook(self, logits, spec_decode_metadata)
        return original(self, logits, spec_decode_metadata)

    return sample


def install_v1_commit_hook(hook: CommitAfterSampling) -> None:
    """Run ``hook`` after the V1 model runner's post-sampling state update (idempotent).

    vLLM's V1 runner has no model-state postprocess step (runner V2 has one, which the
    plugin uses there); its ``_update_states_after_model_execute(output_token_ids,
    scheduler_output)`` is where it settles hybrid models' speculative state after
    sampling, so the commit goes right after it.
    """
    install_v1_after_sampling_hook(hook, COMMIT_ORDER)


def install_v1_after_sampling_hook(hook: CommitAfterSampling, order: int) -> None:
    """Run ``hook`` after the V1 runner's post-sampling update, ordered by ``order``.

    The recovery commit has order :data:`COMMIT_ORDER`; a request-boundary capture that
    must see committed state uses a higher order (idempotent per hook).
    """
    _install_v1_wrapper(V1_HOOK, ["self", "output_token_ids", "scheduler_output"], hook,
                        order, after=True)


def install_v1_sample_hook(hook: BeforeSampling) -> None:
    """Run ``hook(runner, logits, spec_decode_metadata)`` before the V1 runner samples.

    The logits are the step's raw logits (before any in-place sampling transform); a
    request-boundary checkpoint keeps the row that sampled a request's last token.
    """
    _install_v1_wrapper(V1_SAMPLE, ["self", "logits", "spec_decode_metadata"], hook, 0,
                        after=False)
