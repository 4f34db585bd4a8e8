"""``recoverssm checkpoints gc DIR``: remove leftovers of interrupted and lost checkpoint writes.

Lists every file it removes (or, with ``--dry-run``, would remove) and a summary line. Parts
of published bundles, writes in flight and anything younger than ``--grace`` seconds are kept;
names the store does not write and entries that are not regular files are never touched.
Exit codes: 0 done, 1 some files could not be removed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..checkpoint.config import DEFAULT_GRACE_S, MIN_GRACE_S
from ..checkpoint.errors import CheckpointConfigError
from ..checkpoint.gc import DEFAULT_MAX_FILES, MAX_FILES_LIMIT, collect_garbage
from .args import Directory, Int, UsageError

MAX_GRACE_S = 10 * 365 * 24 * 3600


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``checkpoints`` sub-command and its ``gc`` action."""
    p = sub.add_parser(
        "checkpoints", help="maintain a disk checkpoint directory",
        description="Maintenance of a disk checkpoint directory written by the checkpoint "
                    "store (vllm_recoverssm.checkpoint).",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    gc = actions.add_parser(
        "gc", help="remove parts of interrupted and lost writes",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gc.add_argument("directory", metavar="DIR",
                    type=Directory("the checkpoint directory"),
                    help="the checkpoint directory (CheckpointConfig.path)")
    gc.add_argument("--grace", type=Int(MIN_GRACE_S, MAX_GRACE_S), default=DEFAULT_GRACE_S,
                    metavar="SECONDS",
                    help=f"keep anything younger than this (default {DEFAULT_GRACE_S}, "
                         f"at least {MIN_GRACE_S}); longer than any write takes")
    gc.add_argument("--max-files", type=Int(1, MAX_FILES_LIMIT), default=DEFAULT_MAX_FILES,
                    metavar="N", help=f"scan at most N directory entries (default "
                                      f"{DEFAULT_MAX_FILES:,})")
    gc.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    gc.add_argument("--json", action="store_true", help="print the report as one JSON object")
    gc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Collect the directory and print what was removed."""
    try:
        report = collect_garbage(args.directory, grace_s=args.grace, max_files=args.max_files,
                                 dry_run=args.dry_run)
    except CheckpointConfigError as exc:
        raise UsageError(f"argument DIR: {exc}") from None
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), sort_keys=True) + "\n")
    else:
        verb = "would remove" if report.dry_run else "removed"
        for r in report.removed:
            print(f"{verb} {r.kind} {r.name} ({r.nbytes:,} bytes): {r.reason}")
        for name in report.damaged_manifests:
            print(f"left damaged manifest {name}: the next store of its prefix replaces it")
        for name in report.left_alone:
            print(f"left {name}: not a regular file")
        for err in report.errors:
            print(f"could not remove {err}", file=sys.stderr)
        print(f"{report.directory}: {report.summary()}")
    return 1 if report.errors else 0
