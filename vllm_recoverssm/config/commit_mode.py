"""Whether the recovery commit is fused into the next verify, and why not.

One rule for the vLLM plugin (which applies it to the ``VllmConfig`` it is handed) and for
``recoverssm check`` (which applies it to the deployment its flags describe), so that both
print the same line for the same deployment.
"""

from __future__ import annotations

from typing import Literal

from .eligibility import Deployment

CommitMode = Literal["auto", "eager", "fused"]

COMMIT_MODES: tuple[CommitMode, ...] = ("auto", "eager", "fused")
"""``fused``: each step's accepted records are replayed inside the request's next verify
(one launch that reads the state once and writes it once), where nothing below blocks it;
``eager``: a commit launch of its own right after sampling; ``auto`` (the default): fused
where it applies, eager elsewhere (``fused`` differs only in warning when it cannot)."""

DEFAULT_COMMIT: CommitMode = "auto"


def fused_commit_blockers(dep: Deployment, *, own_connector: bool) -> list[str]:
    """Why the commit of ``dep`` cannot be fused into the next verify (empty: it can).

    The deferred records live in the step-row scratch until the request's next verify, so
    nothing else may read the state in between: no export of a KV connector other than
    the plugin's (``own_connector``: the connector is the plugin's, which commits a
    finished request's records before it exports it). With prefix caching (cache mode
    ``align``, runner V2) the rows whose accepted tokens reach a state block's end, or
    whose state moves to another block, still commit right after sampling
    (:mod:`vllm_recoverssm.state.align_deferral`); the rest wait. b12x has no fused
    verify, so it keeps the eager commit. Either runner applies: V1 through the plugin's
    hook after sampling, V2 through vLLM's model state.
    """
    out: list[str] = []
    if dep.kv_connector is not None and not own_connector:
        out.append("a KV connector other than the plugin's may export the state between "
                   "steps")
    if dep.kernel_backend == "b12x":
        out.append("b12x runs verify and commit here and has no fused verify")
    return out


def commit_summary(mode: CommitMode, blockers: list[str], max_num_seqs: int) -> str:
    """The one line that says how a recovery deployment commits (start-up log, ``check``)."""
    if mode == "eager":
        return "commit: eager, right after sampling (asked for)"
    if not blockers:
        return ("commit: fused into the next verify (record scratch of "
                f"2 x {max_num_seqs} rows)")
    return "commit: eager, not fused: " + "; ".join(blockers)
