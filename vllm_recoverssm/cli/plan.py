"""``recoverssm plan``: the memory planner's table for a model and deployment."""

from __future__ import annotations

import argparse
import sys

from ..state.planner import format_plan
from .deployment import add_deployment_args, checked_plan


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``plan`` sub-command."""
    p = sub.add_parser(
        "plan", help="memory planner: pages, per-request reserve and fitted context",
        description="Report per-layer page bytes of the full-state and recovery layouts "
                    "(records in every page, as vLLM 0.32 lays them out, or in a scratch "
                    "area), the per-request reserve and saving, and what fits a per-GPU "
                    "budget. Needs no GPU.",
    )
    add_deployment_args(p)
    p.set_defaults(func=run)


def validate(args: argparse.Namespace) -> object:
    """Check every flag (the plan itself is the check); ``UsageError`` names the flag."""
    return checked_plan(args)


def run(args: argparse.Namespace) -> int:
    """Print the plan as a table, or JSON with ``--json``."""
    result = checked_plan(args)
    if args.json:
        sys.stdout.write(result.model_dump_json(indent=2) + "\n")
    else:
        print(format_plan(result))
    return 0
