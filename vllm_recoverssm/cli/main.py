"""Entry point of the ``recoverssm`` command: one sub-command per capability.

Each sub-command lives in its own module that exposes ``register(subparsers)``; the
module adds its parser and sets ``func`` (``args -> exit code``) as the default.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from .args import UsageError

__all__ = ["COMMAND_MODULES", "UsageError", "build_parser", "main"]

# Sub-command modules, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "vllm_recoverssm.cli.demo",
    "vllm_recoverssm.cli.kernel_check",
    "vllm_recoverssm.cli.kernel_resources",
    "vllm_recoverssm.cli.bench",
    "vllm_recoverssm.cli.plan",
    "vllm_recoverssm.cli.check",
    "vllm_recoverssm.cli.checkpoints",
    "vllm_recoverssm.cli.oracle",
)


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument as one line (``prog: error: ...``) and exits with 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every registered sub-command."""
    parser = _Parser(
        prog="recoverssm",
        description="Speculative-state recovery for hybrid linear-attention models in vLLM.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a bad argument (already reported in one line) or --help
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, OSError) as exc:
        # Bad input that only the command could see (a config file, a directory): one line.
        message = str(exc).replace("\n", " ")
        print(f"recoverssm {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
