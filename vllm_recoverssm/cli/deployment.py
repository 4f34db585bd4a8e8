"""The deployment flags of ``recoverssm plan`` and ``recoverssm check``, validated once.

Both commands take the same model and deployment flags and both validate them through
:func:`checked_plan`, so ``check`` refuses exactly what ``plan`` refuses (a TP size that does
not divide the heads, a block size below S+1 in align mode, ...) instead of ignoring flags it
does not use itself.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

from pydantic import ValidationError

from ..config.eligibility import MAX_NUM_SPEC, MIN_NUM_SPEC
from ..config.models import ModelConfigError, ModelSpec, get_model_spec, load_hf_config
from ..state.planner import Plan, PlanConfig, plan
from .args import Float, InputFile, Int, Text, UsageError, flag_error

DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32", "half", "float")
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                "fp32": "float32", "float": "float32"}
MAX_CONFIG_BYTES = 4 * 2**20
MAX_TP = 1024
MAX_BLOCK_SIZE = 2**20
MAX_NUM_SEQS = 2**16
MAX_MODEL_LEN = 2**26
MAX_GPU_MEMORY_GIB = 65536.0

PLAN_FIELD_FLAGS: dict[str, str] = {
    "prefill_checkpoint_blocks": "--prefill-checkpoints", "activation_dtype": "--dtype",
    "kv_cache_dtype": "--kv-cache-dtype", "gpu_memory_gib": "--gpu-memory",
    "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
    "state_dtype": "--state-dtype", "block_size": "--block-size", "cache_mode": "--cache-mode",
    "num_spec": "--num-spec", "tp": "--tp", "fused_commit": "--commit",
}
"""Planner field -> the flag that sets it, for messages that come from the planner."""


def flag_names(message: str, fields: Mapping[str, str]) -> str:
    """``message`` with every planner/eligibility field name replaced by its flag."""
    for field in sorted(fields, key=len, reverse=True):
        message = re.sub(rf"(?<![\w-])'?{field}'?(?!\w)", fields[field], message)
    return message.replace("\n", " ")


def validation_message(exc: ValidationError, fields: Mapping[str, str]) -> str:
    """One line naming every invalid field of a pydantic error by its flag."""
    parts = []
    for e in exc.errors(include_url=False, include_input=False):
        loc = ".".join(str(x) for x in e["loc"])
        msg = flag_names(str(e["msg"]).removeprefix("Value error, "), fields)
        if loc in fields:
            parts.append(f"argument {fields[loc]}: {msg}")
        else:
            parts.append(flag_names(f"{loc}: {msg}", fields) if loc else msg)
    return "; ".join(parts)


def add_deployment_args(p: argparse.ArgumentParser, min_num_spec: int = MIN_NUM_SPEC) -> None:
    """Flags describing the model and how it is served (plan and check); ``check`` also
    takes ``--num-spec 0`` (a deployment without speculation)."""
    m = p.add_argument_group("model")
    m.add_argument("--model", default="glm-5.3",
                   type=Text(64, r"[A-Za-z0-9_.\-]+", "a model name"),
                   help="built-in model: glm-5.3, kimi-linear, qwen3-next-80b-a3b "
                        "(default: glm-5.3)")
    m.add_argument("--config", metavar="PATH",
                   type=InputFile(MAX_CONFIG_BYTES, "a Hugging Face config.json", "config.json"),
                   help="a Hugging Face config.json (or its directory); overrides --model")
    d = p.add_argument_group("deployment")
    d.add_argument("--tp", type=Int(1, MAX_TP), default=1,
                   help="tensor-parallel size (default 1)")
    d.add_argument("--num-spec", type=Int(min_num_spec, MAX_NUM_SPEC), default=3,
                   help=f"speculative (draft) tokens per step, S in {min_num_spec}.."
                        f"{MAX_NUM_SPEC} (default 3)")
    d.add_argument("--cache-mode", choices=("none", "align"), default="none",
                   help="prefix caching of recurrent state (default none)")
    d.add_argument("--block-size", type=Int(1, MAX_BLOCK_SIZE),
                   help="state block size B in align mode (B >= S+1)")
    d.add_argument("--prefill-checkpoints", action="store_true",
                   help="align mode: one extra FlashKDA prefill-checkpoint block per request")
    d.add_argument("--dtype", choices=DTYPES, help="activation dtype (default: the model's)")
    d.add_argument("--state-dtype", choices=("auto", "float32", "float16", "bfloat16"),
                   default="auto", help="recurrent-state dtype (default auto: float32 "
                                        "for KDA)")
    d.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="attention KV cache dtype (default auto: the activation dtype)")
    d.add_argument("--max-num-seqs", type=Int(1, MAX_NUM_SEQS), default=256,
                   help="running requests at most (scratch rows; default 256)")
    d.add_argument("--commit", choices=("auto", "eager", "fused"), default="auto",
                   help="recovery commit, as the plugin's additional_config "
                        "recoverssm_commit: fused into the next verify (two scratch rows "
                        "per running request) or eager (after sampling, one row); auto, the "
                        "default, and fused are fused except with --cache-mode align, "
                        "where the plugin commits eagerly")
    d.add_argument("--max-model-len", type=Int(1, MAX_MODEL_LEN),
                   help="context length of a max-length request (default: the model's)")
    d.add_argument("--gpu-memory", type=Float(0.0, MAX_GPU_MEMORY_GIB, lo_open=True),
                   metavar="GiB", help="per-GPU memory for KV cache and states, in GiB")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The built-in spec named by ``--model``, or the one read from ``--config``."""
    if args.config:
        try:
            return load_hf_config(args.config)
        except ModelConfigError as exc:
            raise flag_error("--config", str(exc)) from None
    try:
        return get_model_spec(args.model)
    except ValueError as exc:
        raise flag_error("--model", str(exc)) from None


def activation_dtype(args: argparse.Namespace) -> str | None:
    """The ``--dtype`` flag's dtype under its canonical name (None: the model's)."""
    if args.dtype is None:
        return None
    return _DTYPE_NAMES.get(args.dtype, args.dtype)


def _check_cache_flags(args: argparse.Namespace) -> None:
    S = args.num_spec
    if args.cache_mode == "align":
        if args.block_size is None:
            raise flag_error("--block-size", f"--cache-mode align needs a state block size "
                                             f"B >= S+1 = {S + 1}")
        if args.block_size < S + 1:
            raise flag_error("--block-size", f"{args.block_size} is smaller than S+1 = {S + 1} "
                                             f"(--num-spec {S}); align mode needs one "
                                             "speculative window to fit a block")
        return
    if args.block_size is not None:
        raise flag_error("--block-size", "applies only with --cache-mode align")
    if args.prefill_checkpoints:
        raise flag_error("--prefill-checkpoints", "applies only with --cache-mode align")


def fused_commit(args: argparse.Namespace) -> bool:
    """Whether the plugin would fuse the commit in the deployment the flags describe.

    It does unless eager is asked for (in align mode too, where rows at a state block's
    end still commit after sampling); b12x or a KV connector other than the plugin's keep
    it eager, with one scratch row per running request (``recoverssm check`` applies
    every blocker)."""
    return bool(args.commit != "eager")


def plan_config_from_args(args: argparse.Namespace) -> PlanConfig:
    """Validate the flags into a :class:`PlanConfig` (one-line UsageError if invalid)."""
    spec = model_from_args(args)
    _check_cache_flags(args)
    try:
        return PlanConfig.model_validate(dict(
            model=spec, tp=args.tp, num_spec=args.num_spec, cache_mode=args.cache_mode,
            block_size=args.block_size, activation_dtype=activation_dtype(args),
            state_dtype=args.state_dtype, kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            gpu_memory_gib=args.gpu_memory,
            prefill_checkpoint_blocks=int(args.prefill_checkpoints),
            fused_commit=fused_commit(args),
        ))
    except ValidationError as exc:
        raise UsageError(validation_message(exc, PLAN_FIELD_FLAGS)) from None


def checked_plan(args: argparse.Namespace) -> Plan:
    """The plan of the deployment the flags describe; every flag is checked on the way."""
    cfg = plan_config_from_args(args)
    try:
        return plan(cfg)
    except ValueError as exc:  # e.g. a TP size that does not divide the heads
        raise UsageError(flag_names(str(exc), PLAN_FIELD_FLAGS)) from None
