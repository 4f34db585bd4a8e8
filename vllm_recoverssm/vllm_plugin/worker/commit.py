"""The commit after sampling under vLLM's model runner V1.

Runner V2 commits through its model state (:mod:`.model_state`). Runner V1 (the one
vLLM's CPU platform, and CUDA without ``VLLM_USE_V2_MODEL_RUNNER``, run) has no such
step, so the plugin hooks the method it runs right after sampling
(:func:`..patch.v1_runner.install_v1_commit_hook`) and commits there, in the same step:

* the verify records live in a scratch indexed by the step's speculative row, so they
  are consumed before the next step overwrites them;
* a request that vLLM does not schedule in the next step (token budget, preemption,
  finishing) keeps a committed checkpoint. A commit deferred to the request's next step
  could not do that: runner V1 re-adds such a request with its accepted count reset to 1
  (``InputBatch.add_request``), so the count the commit needs would be lost;
* a request-boundary export that reads the state after the step sees it committed, with
  zero speculative offset.

A request that ends in this step may have more tokens accepted than it keeps (vLLM cuts
the output at ``max_tokens``); a registered limit (:func:`register_commit_limit`) then
commits only the kept tokens, so the finished request's page holds the state of its
final tokens, which a request-boundary export stores.

Each KV-cache group's :class:`~.commit_context.RecoveryCommitContext` registers
itself here when its builder is created (in the worker, after the runner module is
loaded); the hook finds the contexts of the runner that sampled through the runner's layer
table.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import compat
from ..patch import v1_runner

if TYPE_CHECKING:
    from .commit_context import RecoveryCommitContext

_contexts: weakref.WeakSet[RecoveryCommitContext] = weakref.WeakSet()

CommitLimit = Callable[[Any, torch.Tensor], torch.Tensor]
"""``limit(runner, num_sampled) -> num_sampled``: fewer tokens for some rows, never more."""
_limits: list[CommitLimit] = []


def register_commit_limit(limit: CommitLimit) -> None:
    """Commit at most ``limit``'s count per row (rows of requests that end this step)."""
    if limit not in _limits:
        _limits.append(limit)


def register_commit_context(context: RecoveryCommitContext) -> None:
    """Commit ``context``'s steps after sampling under runner V1 (installs the hook)."""
    _contexts.add(context)
    v1_runner.install_v1_commit_hook(commit_after_sampling)


def _groups(forward_context: dict[str, Any]) -> list[RecoveryCommitContext]:
    """The recovery groups of one runner's layer table (``forward_context``)."""
    return [c for c in list(_contexts) if c.forward_context is forward_context]


def deferred_commit_counts(forward_context: dict[str, Any]) -> dict[str, int]:
    """The fused commit's step counts over the recovery groups of ``forward_context`` (a
    runner's layer table): ``deferred_commit_steps``, ``settles``, ``settles_skipped``,
    ``export_settles``, ``load_settles``, ``boundary_commits`` (all 0 under the eager
    commit)."""
    tables = [c.deferred for c in _groups(forward_context) if c.deferred is not None]
    return {
        "deferred_commit_steps": sum(d.deferred_steps for d in tables),
        "settles": sum(d.settles for d in tables),
        "settles_skipped": sum(d.settles_skipped for d in tables),
        "export_settles": sum(d.export_settles for d in tables),
        "load_settles": sum(d.load_settles for d in tables),
        "boundary_commits": sum(d.boundary_commits for d in tables),
    }


def settle_requests(forward_context: dict[str, Any], request_ids: set[str]) -> None:
    """Commit the pending records of requests ``request_ids`` (fused commit) in every
    recovery group of ``forward_context``, before an export reads their states."""
    for context in _groups(forward_context):
        context.settle_requests(request_ids)


def settle_absent(forward_context: dict[str, Any], request_ids: list[str | None]) -> None:
    """Commit the pending records of requests not among ``request_ids`` (the step about to
    run; fused commit) in every recovery group of ``forward_context``, before vLLM copies
    states between blocks for that step (runner V2's align-mode pre-copy)."""
    keys = {k for k in request_ids if k is not None}
    for context in _groups(forward_context):
        context.settle_absent(keys)


def settle_pending(forward_context: dict[str, Any]) -> None:
    """Commit every deferred row (fused commit) in every recovery group of
    ``forward_context``, before a restore writes states into slots."""
    for context in _groups(forward_context):
        context.settle_pending()


def see_step(forward_context: dict[str, Any], request_ids: list[str | None]) -> None:
    """Name the request of each batch row of the step about to be built (runner V2) to
    every recovery group of ``forward_context``: the fused commit keys its pending records
    by request, so a step that verifies every pending request again skips the standalone
    commit."""
    for context in _groups(forward_context):
        context.see_step(request_ids)


def sampled_counts(sampled_token_ids: torch.Tensor) -> torch.Tensor:
    """Tokens sampled per batch row (accepted drafts + 1): vLLM pads rows with -1."""
    return (sampled_token_ids != -1).sum(dim=1).to(torch.int32)


def commit_after_sampling(runner: Any, sampled_token_ids: torch.Tensor) -> None:
    """Commit every recovery group of ``runner``'s model for the step just sampled."""
    mine = _groups(compat.layer_table(runner))
    if not mine:
        return
    num_sampled = sampled_counts(sampled_token_ids)
    for limit in list(_limits):
        num_sampled = torch.minimum(num_sampled, limit(runner, num_sampled))
    request_ids = compat.batch_request_ids(runner.input_batch)
    for context in mine:
        context.see_batch(runner, request_ids)
        context.commit_step(num_sampled)
