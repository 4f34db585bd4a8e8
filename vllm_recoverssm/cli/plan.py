"""``recoverssm plan``: the memory planner's table for a model and deployment.

Also holds the deployment flags shared with ``recoverssm check``.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import NoReturn

from pydantic import ValidationError

from ..config.models import ModelSpec, get_model_spec, load_hf_config
from ..state.planner import PlanConfig, format_plan, plan
from .main import UsageError

DTYPES = ("bfloat16", "float16", "float32", "bf16", "fp16", "fp32", "half", "float")
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                "fp32": "float32", "float": "float32"}


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make argparse report a bad argument as one line (``prog: error: ...``), exit 2."""

    def error(self: argparse.ArgumentParser, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    p.error = types.MethodType(error, p)  # type: ignore[method-assign]
    return p


def validation_message(exc: ValidationError) -> str:
    """One line naming every invalid field of a pydantic error."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts).replace("\n", " ")


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    """Flags describing the model and how it is served (plan and check)."""
    m = p.add_argument_group("model")
    m.add_argument("--model", default="glm-5.3",
                   help="built-in model: glm-5.3, kimi-linear, qwen3-next-80b-a3b "
                        "(default: glm-5.3)")
    m.add_argument("--config", metavar="PATH",
                   help="a Hugging Face config.json (or its directory); overrides --model")
    d = p.add_argument_group("deployment")
    d.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    d.add_argument("--num-spec", type=int, default=3,
                   help="speculative (draft) tokens per step, S (default 3)")
    d.add_argument("--cache-mode", choices=("none", "align"), default="none",
                   help="prefix caching of recurrent state (default none)")
    d.add_argument("--block-size", type=int,
                   help="state block size B in align mode (B >= S+1)")
    d.add_argument("--prefill-checkpoints", action="store_true",
                   help="align mode: one extra FlashKDA prefill-checkpoint block per request")
    d.add_argument("--dtype", choices=DTYPES, help="activation dtype (default: the model's)")
    d.add_argument("--state-dtype", choices=("auto", "float32", "float16", "bfloat16"),
                   default="auto", help="recurrent-state dtype (default auto: float32 "
                                        "for KDA)")
    d.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="attention KV cache dtype (default auto: the activation dtype)")
    d.add_argument("--max-num-seqs", type=int, default=256,
                   help="running requests at most (scratch rows; default 256)")
    d.add_argument("--max-model-len", type=int,
                   help="context length of a max-length request (default: the model's)")
    d.add_argument("--gpu-memory", type=float, metavar="GiB",
                   help="per-GPU memory for KV cache and states, in GiB")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The built-in spec named by ``--model``, or the one read from ``--config``."""
    if args.config:
        return load_hf_config(args.config)
    return get_model_spec(args.model)


def activation_dtype(args: argparse.Namespace) -> str | None:
    if args.dtype is None:
        return None
    return _DTYPE_NAMES.get(args.dtype, args.dtype)


def plan_config_from_args(args: argparse.Namespace) -> PlanConfig:
    """Validate the flags into a :class:`PlanConfig` (one-line UsageError if invalid)."""
    spec = model_from_args(args)
    try:
        return PlanConfig.model_validate(dict(
            model=spec, tp=args.tp, num_spec=args.num_spec, cache_mode=args.cache_mode,
            block_size=args.block_size, activation_dtype=activation_dtype(args),
            state_dtype=args.state_dtype, kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            gpu_memory_gib=args.gpu_memory,
            prefill_checkpoint_blocks=int(args.prefill_checkpoints),
        ))
    except ValidationError as exc:
        raise UsageError(_flag_names(validation_message(exc))) from None


_FLAGS = {"tp": "--tp", "num_spec": "--num-spec", "block_size": "--block-size",
          "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len",
          "gpu_memory_gib": "--gpu-memory", "prefill_checkpoint_blocks":
          "--prefill-checkpoints", "cache_mode": "--cache-mode"}


def _flag_names(msg: str) -> str:
    for field, flag in _FLAGS.items():
        msg = msg.replace(f"argument '{field}': ", f"{flag}: ").replace(f"{field}: ", f"{flag}: ")
    return msg


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``plan`` sub-command."""
    p = sub.add_parser(
        "plan", help="memory planner: pages, per-request reserve and fitted context",
        description="Report per-layer page bytes of the full-state and recovery layouts "
                    "(records in every page, as vLLM 0.32 lays them out, or in a scratch "
                    "area), the per-request reserve and saving, and what fits a per-GPU "
                    "budget. Needs no GPU.",
    )
    one_line_errors(p)
    add_deployment_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan as a table, or JSON with ``--json``."""
    cfg = plan_config_from_args(args)
    try:
        result = plan(cfg)
    except ValueError as exc:  # e.g. a TP size that does not divide the heads
        raise UsageError(_flag_names(str(exc))) from None
    if args.json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
    else:
        print(format_plan(result))
    return 0
