"""``recoverssm oracle``: vLLM with the plugin against transformers' GLM-5.3-Flash.

Makes a tiny GLM-5.3-Flash with transformers' own classes (or uses the one already in
``--model-dir``), runs transformers' greedy ``generate`` on it, then vLLM's engine with
speculative decoding, recovery on and off, and prints per mode whether every token is
transformers' and the largest log-probability gap. Needs vLLM and transformers; runs on
vLLM's CPU engine. Exit codes: 0 every token agrees, 1 some do not, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..config.state_mode import StateMode
from .args import Choice, Directory, Float, Int
from .text import table

AGREE_GAP = 1e-4
"""Nats: float32 on both sides, different summation orders (a few 1e-6 seen)."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``oracle`` sub-command."""
    p = sub.add_parser(
        "oracle", help="check vLLM + plugin against transformers' GLM-5.3-Flash",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-dir", type=Directory("the checkpoint directory", create=True),
                   default=None, metavar="DIR",
                   help="where the tiny checkpoint is made, or is already (default: a "
                        "temporary directory)")
    p.add_argument("--num-spec", type=Int(1, 7), default=3, metavar="S",
                   help="draft tokens per step, 1..7 (default 3)")
    p.add_argument("--new-tokens", type=Int(1, 256), default=32, metavar="N",
                   help="tokens generated per prompt (default 32)")
    p.add_argument("--corrupt", type=Float(0.0, 1.0), default=0.4, metavar="P",
                   help="share of drafted tokens made wrong (default 0.4)")
    p.add_argument("--tp", type=Choice(("1", "2")), default="1",
                   help="tensor parallel size of vLLM's engine (default 1)")
    p.add_argument("--no-progress", action="store_true", help="print the table only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Make or reuse the checkpoint, compare, print the table."""
    from ..harness.hf_compare import compare
    from ..harness.hf_glm53 import make_in_subprocess

    def say(line: str) -> None:
        if not args.no_progress:
            print(f"... {line}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="recoverssm-oracle-") as scratch:
        model = args.model_dir or Path(scratch) / "model"
        if not (model / "config.json").exists():
            say(f"transformers: making a tiny GLM-5.3-Flash in {model}")
            make_in_subprocess(model)
        hf, results = compare(model, Path(scratch) / "runs", num_spec=args.num_spec,
                              new_tokens=args.new_tokens, corrupt=args.corrupt,
                              tp=int(args.tp), progress=say)
    prompts = len(hf["outputs"])
    where = model if args.model_dir else "a tiny one transformers made, deleted"
    print(f"GLM-5.3-Flash ({where}): {prompts} prompts x {args.new_tokens} tokens, "
          f"S = {args.num_spec}, tensor parallel {args.tp}, float32; transformers' greedy "
          "generate is the reference")
    rows = [(StateMode.of(r.recovery).label, "yes" if r.same_tokens else "NO",
             r.acceptance, r.worst_gap) for r in results]
    for line in table([("mode", "<10"), ("tokens = transformers'", ">22"),
                       ("acceptance", ">10.1%"), ("worst log-prob gap", ">18.2e")], rows):
        print(line)
    agree = all(r.same_tokens and r.worst_gap < AGREE_GAP for r in results)
    print(f"every token and log-probability agrees with transformers: "
          f"{'yes' if agree else 'no'}")
    return 0 if agree else 1
