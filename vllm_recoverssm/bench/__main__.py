"""``python -m vllm_recoverssm.bench [options]``: the ``bench`` sub-command on its own.

Same options and exit codes as ``recoverssm bench``, without importing the other
sub-commands (a GPU machine may have only torch and triton installed).
"""

from __future__ import annotations

import argparse
import sys

from ..cli import bench as bench_cli


def main(argv: list[str] | None = None) -> int:
    """Parse the bench options and run; bad input is a one-line error and exit code 2."""
    parser = argparse.ArgumentParser(prog="recoverssm")
    bench_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"recoverssm bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
