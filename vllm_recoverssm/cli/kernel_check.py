"""``recoverssm kernel-check``: a small end-to-end check of the recovery operations."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``kernel-check`` sub-command."""
    p = sub.add_parser("kernel-check", help="verify recovery ops against the float64 oracle")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Placeholder until the kernels land."""
    print("kernel-check: not implemented yet")
    return 1
