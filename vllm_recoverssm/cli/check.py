"""``recoverssm check``: does a deployment use recovery, and why.

Exit codes: 0 when a decision was reached (recovery on or off), 1 when recovery was
forced (``--mode on``) on a deployment that fails a condition, 2 for bad arguments or an
unreadable config.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from pydantic import ValidationError

from ..config.commit_mode import commit_summary, fused_commit_blockers
from ..config.eligibility import Deployment, IneligibleError, decide
from .args import Int, Text, UsageError, Validator, flag_error
from .deployment import (
    PLAN_FIELD_FLAGS,
    activation_dtype,
    add_deployment_args,
    checked_plan,
    model_from_args,
    validation_message,
)

CHECK_FIELD_FLAGS: dict[str, str] = {
    **PLAN_FIELD_FLAGS,
    "pipeline_parallel_size": "--pp", "stochastic_rounding": "--stochastic-rounding",
    "kernel_backend": "--kernel-backend", "gpu_capability": "--gpu-capability",
    "model_runner": "--runner", "device": "--device", "kv_connector": "--kv-connector",
    "spec_method": "--spec-method",
    "architecture": "--arch", "head_dim": "--head-dim",
}
"""Eligibility field -> the flag that sets it."""


class Capability(Validator):
    """A CUDA compute capability (``9.0``, ``sm120``, ``sm_90``), ``none`` or ``auto``."""

    expected = "a compute capability like 9.0 or sm120 (major 1..99, minor 0..9), 'none' or 'auto'"

    def parse(self, text: str) -> tuple[int, int] | str:
        t = text.strip().lower()
        if t in ("auto", "none"):
            return t
        m = re.fullmatch(r"(\d{1,2})\.(\d)", t) or re.fullmatch(r"sm_?(\d{1,2})(\d)", t)
        if m is None or int(m[1]) < 1:
            raise self.fail(text)
        return int(m[1]), int(m[2])

    def samples(self) -> list[str]:
        """Good and bad spellings."""
        return ["9.0", "sm120", "sm_90", "0.0", "100.0", "9.10", "sm1", "auto", "none"] + \
            super().samples()


def detect_gpu() -> tuple[tuple[int, int] | None, str | None]:
    """The first CUDA GPU's capability and the best available kernel backend."""
    cap: tuple[int, int] | None = None
    try:
        import torch

        if torch.cuda.is_available():
            cap = tuple(torch.cuda.get_device_capability(0))  # type: ignore[assignment]
    except Exception:  # pragma: no cover - broken torch install
        cap = None
    backend = detect_backend(cap)
    return cap, backend


def detect_backend(cap: tuple[int, int] | None) -> str | None:
    """``b12x`` on SM12x when an installed b12x has the recovery API the plugin calls, else
    ``triton`` when importable, else None."""
    import importlib
    import importlib.util

    if cap is not None and cap[0] == 12 and importlib.util.find_spec("b12x") is not None:
        from ..ops.b12x_kda import B12X_MODULE, b12x_recovery_api

        try:
            module = importlib.import_module(B12X_MODULE)
        except Exception:  # a broken optional package means "not available"
            module = None
        if b12x_recovery_api(module):
            return "b12x"
    return "triton" if importlib.util.find_spec("triton") is not None else None


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``check`` sub-command."""
    p = sub.add_parser(
        "check", help="decide whether a deployment uses recovery, and why",
        description="Check every eligibility condition of recovery for a deployment and "
                    "print the decision. Exit 0: decided; 1: --mode on but ineligible; "
                    "2: bad arguments.",
    )
    add_deployment_args(p, min_num_spec=0)
    e = p.add_argument_group("eligibility")
    e.add_argument("--mode", choices=("auto", "on", "off"), default="auto",
                   help="auto (default), on (force; fail if ineligible), off (full states)")
    e.add_argument("--arch", type=Text(128, r"[A-Za-z][A-Za-z0-9_.]*", "an architecture name"),
                   help="architecture name (default: the model's)")
    e.add_argument("--spec-method", default=None,
                   type=Text(32, r"[A-Za-z0-9_\-]+", "a speculative method name"),
                   help="speculative method: mtp, dflash, eagle, ngram, ..., or none "
                        "(default: mtp when --num-spec > 0)")
    e.add_argument("--head-dim", type=Int(1, 4096),
                   help="linear head dim (default: the model's)")
    e.add_argument("--pp", type=Int(1, 256), default=1,
                   help="pipeline-parallel size (default 1)")
    e.add_argument("--runner", choices=("v1", "v2"), default="v2",
                   help="vLLM GPU model runner (default v2)")
    e.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default), or cpu: vLLM's CPU platform, where the plugin runs "
                        "the PyTorch reference ops")
    e.add_argument("--gpu-capability", type=Capability(), default="auto",
                   help="CUDA compute capability like 9.0, 'none' for no GPU, or 'auto' "
                        "(detect; default)")
    e.add_argument("--kernel-backend", choices=("auto", "triton", "b12x", "reference", "none"),
                   default="auto", help="available kernel backend (default: detect)")
    e.add_argument("--kv-connector",
                   choices=("none", "recoverssm", "request_boundary", "generic", "pd"),
                   default="none", help="KV connector: recoverssm (the plugin's "
                                        "RecoverSSMCheckpointConnector), or another one's "
                                        "kind: request_boundary (atomic), generic (aligned), "
                                        "pd (prefill/decode split)")
    e.add_argument("--stochastic-rounding", action="store_true",
                   help="stochastic rounding of the state is on")
    p.set_defaults(func=run)


_CONNECTOR_KINDS: dict[str, str | None] = {"none": None, "recoverssm": "request_boundary"}
"""``--kv-connector`` values that are not a connector kind of their own."""


def commit_line(args: argparse.Namespace, dep: Deployment) -> tuple[str, list[str]]:
    """How the plugin would commit in the deployment: its start-up line and the blockers
    of the fused commit (``--commit`` as the plugin's ``recoverssm_commit``)."""
    blockers = fused_commit_blockers(dep, own_connector=args.kv_connector == "recoverssm")
    return commit_summary(args.commit, blockers, args.max_num_seqs), blockers


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """Validate the flags into a :class:`Deployment` (one-line UsageError if invalid).

    The deployment flags shared with ``plan`` are checked exactly as ``plan`` checks them
    first, so ``check`` never answers for a deployment ``plan`` refuses.
    """
    checked_plan(args)
    spec = model_from_args(args)
    method = args.spec_method
    if method is not None and method.strip().lower() == "none":
        method = None
        if args.num_spec > 0:
            raise flag_error("--spec-method", f"none means no speculation, which needs "
                                              f"--num-spec 0, got --num-spec {args.num_spec}")
    elif method is None:
        method = "mtp" if args.num_spec > 0 else None
    cap = args.gpu_capability
    if args.device == "cpu":
        if cap not in ("auto", "none"):
            raise flag_error("--gpu-capability", "--device cpu has no GPU; leave it out or "
                                                 "pass none")
        detected: str | None = "reference"
        cap = None
    elif cap == "auto":
        cap, detected = detect_gpu()
    else:
        cap = None if cap == "none" else cap
        detected = detect_backend(cap)
    backend = args.kernel_backend
    backend = detected if backend == "auto" else (None if backend == "none" else backend)
    try:
        return Deployment.model_validate(dict(
            architecture=spec.architecture if args.arch is None else args.arch,
            spec_method=method,
            num_spec=args.num_spec,
            activation_dtype=activation_dtype(args) or spec.dtype,
            state_dtype=args.state_dtype,
            head_dim=args.head_dim if args.head_dim is not None else spec.linear_head_dim,
            pipeline_parallel_size=args.pp,
            model_runner=args.runner,
            device=args.device,
            gpu_capability=cap,
            kernel_backend=backend,
            kv_connector=_CONNECTOR_KINDS.get(args.kv_connector, args.kv_connector),
            cache_mode=args.cache_mode,
            stochastic_rounding=args.stochastic_rounding,
        ))
    except ValidationError as exc:
        raise UsageError(validation_message(exc, CHECK_FIELD_FLAGS)) from None


def validate(args: argparse.Namespace) -> object:
    """Check every flag without deciding (for tests and ``--help``-level checks)."""
    return deployment_from_args(args)


def run(args: argparse.Namespace) -> int:
    """Print the decision and its reasons (JSON with ``--json``)."""
    dep = deployment_from_args(args)
    try:
        decision = decide(dep, args.mode)
    except IneligibleError as exc:
        if args.json:
            sys.stdout.write(json.dumps({
                "deployment": dep.model_dump(mode="json"), "mode": args.mode,
                "use_recovery": None, "error": str(exc),
                "failures": [f.model_dump() for f in exc.failures],
            }, indent=2) + "\n")
        else:
            print(f"recovery: forced on [mode on] but not eligible for {dep.architecture}")
            print("failing conditions:")
            for f in exc.failures:
                print(f"  - {f.name}: {f.message}")
        print(f"recoverssm check: error: {exc}", file=sys.stderr)
        return 1
    line, blockers = commit_line(args, dep)
    if args.json:
        commit = None if not decision.use_recovery else {
            "mode": args.commit, "fused": args.commit != "eager" and not blockers,
            "blockers": blockers, "summary": line}
        sys.stdout.write(json.dumps({"deployment": dep.model_dump(mode="json"),
                                     **decision.model_dump(mode="json"), "commit": commit},
                                    indent=2) + "\n")
        return 0
    cap = "no GPU" if dep.gpu_capability is None else \
        f"SM{dep.gpu_capability[0]}{dep.gpu_capability[1]}"
    print(f"deployment: {dep.architecture}, {dep.spec_method or 'no speculation'} "
          f"S={dep.num_spec}, {dep.activation_dtype} activations, {dep.state_dtype} state, "
          f"head dim {dep.head_dim}, PP {dep.pipeline_parallel_size}, runner "
          f"{dep.model_runner}, {cap}, kernels {dep.kernel_backend or 'none'}, KV connector "
          f"{dep.kv_connector or 'none'}, cache mode {dep.cache_mode}")
    print(decision.summary())
    if decision.use_recovery:
        print(line)
    return 0
