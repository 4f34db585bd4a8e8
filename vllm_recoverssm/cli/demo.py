"""``recoverssm demo``: speculative decoding on a tiny GLM-5.3-shaped model, both state modes.

Decodes one batch of prompts with recovery (one checkpoint per request + per-token records,
commit after acceptance) and with full states (S+1 states per request), and prints tokens/s,
acceptance, the linear-state bytes per request (measured from the allocated pools, beside
the memory planner's figure) and whether the two outputs are identical. CPU by default, the
GPU (Triton kernels, CUDA graphs) when one is present. With --checkpoint ram|disk, every
prompt and response is exported to LMCache and a second wave of follow-up turns and repeated
prompts is restored from it, timed against a cold run. Exit code 1 if the outputs differ
(between the modes, or restored vs cold) or the bytes disagree with the planner.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TextIO

import pydantic
import torch

from vllm_recoverssm.cli.args import Directory, Float, Int, UsageError, flag_error
from vllm_recoverssm.cli.text import mib, mode_title, table
from vllm_recoverssm.config.state_mode import StateMode
from vllm_recoverssm.harness.reference_demo import (
    DRAFTERS,
    GPU_PREFILL_TOKENS,
    MAX_REPEAT,
    MODEL_PRESETS,
    DemoOptions,
    DemoReport,
    run_demo,
)
from vllm_recoverssm.reference.model_config import DTYPES

BAR_WIDTH = 30
MAX_REQUESTS = 256
MAX_NEW_TOKENS = 4096
MAX_THREADS = 256
MAX_PREFILL_TOKENS = 65536
MAX_BLOCK_SIZE = 8192


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``demo`` sub-command."""
    p = sub.add_parser(
        "demo",
        help="speculative decoding on a tiny GLM-5.3-shaped model, recovery vs full state",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="reference: the project's decode loop (default); vllm: the tiny "
                        "GLM-5.3 through vLLM's own LLM engine with the plugin, both modes "
                        "(needs vLLM; --requests, --max-new-tokens, --num-spec, "
                        "--acceptance, --seed, --checkpoint, --checkpoint-dir, "
                        "--separate-commit, --json apply)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to run (default: cuda when present, else cpu)")
    p.add_argument("--model", choices=("auto", *MODEL_PRESETS), default="auto",
                   help="model size preset (default: gpu on a GPU, else cpu; glm-tp2: "
                   "GLM-5.3's 32 KDA heads x 128 per GPU at TP2, 12 KDA + 4 attention layers)")
    p.add_argument("--dtype", choices=("auto", *sorted(DTYPES)), default="auto",
                   help="activation dtype of the reference engine's model (default: the "
                        "preset's, bfloat16 on a GPU); the recurrent state is FP32 either "
                        "way. In bfloat16 the oracle's greedy reference and the speculative "
                        "path round differently, so its drafts stop matching early")
    p.add_argument("--requests", type=Int(1, MAX_REQUESTS), default=None,
                   help=f"prompts in the batch, 1..{MAX_REQUESTS} (default: 8 on CPU, 16 on GPU)")
    p.add_argument("--max-new-tokens", type=Int(1, MAX_NEW_TOKENS), default=None,
                   help=f"tokens to generate per prompt, 1..{MAX_NEW_TOKENS} (default: 32 on "
                        "CPU, 64 on GPU)")
    p.add_argument("--num-spec", type=Int(1, 7), default=3,
                   help="draft tokens per step, S (1..7)")
    p.add_argument("--drafter", choices=DRAFTERS, default="oracle",
                   help="oracle: the greedy continuation, corrupted to reach --acceptance; "
                        "mtp: the model's MTP head (random weights: rarely right)")
    p.add_argument("--acceptance", type=Float(0.0, 1.0), default=0.7,
                   help="target draft acceptance of the oracle drafter, 0..1 (default 0.7)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="keep the state every block (align mode) and reuse shared prefixes")
    p.add_argument("--block-size", type=Int(1, MAX_BLOCK_SIZE), default=None, metavar="N",
                   help="with --prefix-caching: tokens per cached state block (default 16, "
                        "at least S+1; vLLM picks hundreds or more for these models on a GPU)")
    p.add_argument("--checkpoint", choices=("ram", "disk"), default=None,
                   help="export request-boundary checkpoints to LMCache (CPU RAM, or disk "
                        "through its fs backend) and restore a second wave from them")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   type=Directory("the checkpoint directory", create=True),
                   help="with --checkpoint disk: keep the bundles in DIR (default: a "
                        "temporary directory, removed afterwards)")
    p.add_argument("--gpu-defaults", action="store_true",
                   help="with --engine vllm: run every engine as vLLM does on a GPU (model "
                        "runner V2, asynchronous scheduling, prefix caching in align mode); "
                        "on a CPU V2's Triton kernels run in Triton's interpreter")
    p.add_argument("--separate-commit", action="store_true",
                   help="recovery: commit after each step on its own instead of inside the "
                        "next step's verify (with --engine vllm: the plugin's "
                        "recoverssm_commit 'eager' instead of its default, 'auto')")
    p.add_argument("--max-prefill-tokens", type=Int(1, MAX_PREFILL_TOKENS), default=None,
                   help="prompt tokens one step may prefill (default: 64 on CPU; on GPU "
                        f"{GPU_PREFILL_TOKENS}, the whole batch's prompts in one step)")
    p.add_argument("--repeat", type=Int(1, MAX_REPEAT), default=1,
                   help=f"timed runs per mode, 1..{MAX_REPEAT}, in alternating mode order; "
                        "tokens/s are the medians (not with --checkpoint)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="on a GPU, run decode steps eagerly instead of replaying a CUDA graph")
    p.add_argument("--threads", type=Int(1, MAX_THREADS), default=1,
                   help="CPU threads for torch (default 1: the tensors are tiny)")
    p.add_argument("--seed", type=Int(0, 2**32 - 1), default=0,
                   help="prompt and drafter seed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


class ProgressBar:
    """Token progress on stderr: one redrawn line on a terminal, a line per phase otherwise."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.phase = ""

    def __call__(self, phase: str, done: int, total: int) -> None:
        """Show ``done`` of ``total`` tokens in ``phase``."""
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.started
        label = mode_title(phase)
        if self.tty:
            filled = BAR_WIDTH * done // max(total, 1)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self.stream.write(f"\r\033[K[{bar}] {done}/{total} tokens {elapsed:5.1f}s {label}")
        elif phase != self.phase:
            self.stream.write(f"demo: {label} ({done}/{total} tokens, {elapsed:.1f}s)\n")
        self.phase = phase
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def format_report(report: DemoReport) -> str:
    """The human-readable summary."""
    lines = [
        "recoverssm demo: speculative decoding on a tiny GLM-5.3-shaped hybrid "
        "(random weights)",
        f"  model    {report.model_summary}",
        f"  device   {report.device}"
        + (f" ({report.threads} thread{'s' if report.threads > 1 else ''})"
           if report.device == "cpu" else ""),
        f"  batch    {len(report.prompt_lengths)} prompts of {min(report.prompt_lengths)}.."
        f"{max(report.prompt_lengths)} tokens, {report.max_new_tokens} new tokens each, "
        f"S = {report.num_spec} drafts per step, up to {report.max_prefill_tokens} prompt "
        "tokens per step",
    ]
    drafter = report.drafter
    if report.corruption is not None:
        drafter += f" (greedy continuation, {report.corruption:.0%} of drafts corrupted)"
    lines += [f"  drafter  {drafter}"]
    if report.commit:
        lines.append(f"  commit   {report.commit}")
    lines.append("")
    lines += table(
        [("mode", "<11"), ("tokens/s", ">9.1f"), ("decode tok/s", ">13.1f"), ("steps", ">6"),
         ("accepted", ">9.1%"), ("", ""), ("accept lengths 0..S", "<22"),
         ("state/request", ">14"), ("planner", ">14")],
        [(mode_title(mode), m.tokens_per_second, m.decode_tokens_per_second, m.steps,
          m.acceptance_rate, "",
          str(m.accept_histogram), mib(m.state_bytes_per_request),
          mib(m.planner_state_bytes_per_request))
         for mode, m in report.modes.items()])
    rec, full = report.modes.get(StateMode.RECOVERY), report.modes.get(StateMode.FULL_STATE)
    lines.append("")
    if report.repeat > 1:
        lines.append(f"{report.repeat} timed runs per mode in alternating order; tokens/s are "
                     "medians. Decode tok/s of each run:")
        lines += [f"  {mode_title(mode):<11} " + " ".join(f"{v:.1f}" for v in m.decode_runs)
                  for mode, m in report.modes.items()]
        if rec is not None and full is not None:
            ratios = [a / b for a, b in zip(rec.decode_runs, full.decode_runs, strict=True)
                      if b]
            lines.append("  recovery / full state per run: "
                         + " ".join(f"{r:.3f}" for r in ratios))
    if rec is not None and full is not None and full.decode_tokens_per_second:
        lines.append(f"decode tok/s recovery / full state: "
                     f"{rec.decode_tokens_per_second / full.decode_tokens_per_second:.3f}")
    if rec is not None and full is not None and rec.state_bytes_per_request:
        ratio = full.state_bytes_per_request / rec.state_bytes_per_request
        lines.append(
            f"state per request: recovery {rec.state_bytes_per_request:,} B vs full state "
            f"{full.state_bytes_per_request:,} B ({ratio:.2f}x less); measured from the "
            f"pools {'==' if report.bytes_match_planner else '!='} planner"
        )
    total = len(report.prompt_lengths) * report.max_new_tokens
    lines.append(
        f"outputs identical (recovery vs full-state): "
        f"{'yes' if report.outputs_identical else 'NO'} ({total} tokens)"
    )
    if report.matches_greedy is not None:
        lines.append(
            "both equal plain greedy decoding without speculation: "
            f"{'yes' if report.matches_greedy else 'no'}"
        )
    if any(m.graph_steps for m in report.modes.values()):
        steps = ", ".join(f"{mode_title(k)} {m.graph_steps}" for k, m in report.modes.items())
        lines.append(f"decode steps replayed from a CUDA graph: {steps}")
    rec = report.modes.get(StateMode.RECOVERY)
    if rec is not None and rec.deferred_rows and report.block_size is not None:
        rows = sum(rec.accept_histogram)
        rest = ("" if rec.deferred_rows == rows else
                f"; the other {rows - rec.deferred_rows} reached a block's end and committed "
                "after their step")
        lines.append(f"fused commit, blocks of {report.block_size} tokens: "
                     f"{rec.deferred_rows} of {rows} decode rows waited for their next "
                     f"verify{rest}")
    if any(m.prefix_cache_hits for m in report.modes.values()):
        hits = ", ".join(f"{mode_title(k)} {m.prefix_cache_hits} ({m.prefix_cache_hit_tokens} "
                         "prompt tokens not recomputed)" for k, m in report.modes.items())
        lines.append(f"prefix-cache hits: {hits}")
    if report.checkpoints:
        lines += ["", *format_checkpoints(report)]
    lines.append(f"wall time {report.wall_seconds:.1f} s")
    return "\n".join(lines)


CHECKPOINT_BACKENDS = {"ram": "LMCache LocalCPUBackend", "disk": "LMCache fs:// backend"}


def format_checkpoints(report: DemoReport) -> list[str]:
    """The checkpoint table: wave 2 restored from LMCache vs computed cold."""
    first = next(iter(report.checkpoints.values()))
    lines = [
        f"checkpoints: {first.backend} ({CHECKPOINT_BACKENDS[first.backend]}); wave 2 = "
        f"{first.follow_ups} follow-up turns (prompt + answer + new text) and {first.repeats} "
        "repeated prompts",
    ]
    lines += table(
        [("mode", "<11"), ("exported", ">8"), ("hits", ">6"), ("exact", ">5"),
         ("restored tok", ">12"), ("prompt tok computed", ">19"), ("steps", ">8"),
         ("cold s", ">7.2f"), ("restored s", ">10.2f"), ("saved", ">6.0%")],
        [(mode_title(mode), c.exported, f"{c.hits}/{c.requests}", c.exact_hits,
          c.restored_tokens, f"{c.computed_cold} -> {c.computed_restored}",
          f"{c.steps_cold} -> {c.steps_restored}", c.cold_seconds, c.restored_seconds,
          c.saved_fraction)
         for mode, c in report.checkpoints.items()])
    same = all(c.outputs_identical for c in report.checkpoints.values())
    io = ", ".join(f"{mode_title(k)} {c.checkpoint_seconds:.2f} s" for k, c in
                   report.checkpoints.items())
    written = sum(c.bytes_written for c in report.checkpoints.values())
    lines += [
        "",
        "cold: wave 2 on a fresh runtime without a store; restored: on the runtime that "
        "exported wave 1 (lookups and restores included)",
        f"restored outputs equal the cold outputs: {'yes' if same else 'NO'}; "
        f"{mib(written)} of bundles written; capture + store + lookup time: {io}",
    ]
    rejected = sum(c.rejected for c in report.checkpoints.values())
    if rejected:
        lines.append(f"bundles rejected (computed cold instead): {rejected}")
    return lines


def check_checkpoint_dir(args: argparse.Namespace) -> None:
    """``--checkpoint-dir`` only with ``--checkpoint disk`` (``UsageError`` otherwise)."""
    if args.checkpoint_dir is not None and args.checkpoint != "disk":
        raise flag_error("--checkpoint-dir", "only --checkpoint disk writes files")


ENGINE_DEMO_FLAGS = {"num_requests": "--requests", "max_new_tokens": "--max-new-tokens",
                     "num_spec": "--num-spec", "acceptance": "--acceptance", "seed": "--seed",
                     "checkpoint": "--checkpoint", "checkpoint_dir": "--checkpoint-dir"}


def run_vllm(args: argparse.Namespace) -> int:
    """``--engine vllm``: the plugin inside vLLM's engine, recovery against full states."""
    import importlib.util

    if args.dtype != "auto":
        raise flag_error("--dtype", "applies to --engine reference only (the vLLM engine "
                         f"demo's model runs in bfloat16), got {args.dtype!r}")
    if args.block_size is not None:
        raise flag_error("--block-size", "applies to --engine reference only (vLLM picks "
                         f"its own state block size), got {args.block_size}")
    if importlib.util.find_spec("vllm") is None:
        raise flag_error("--engine", "vllm needs the vLLM package, which is not installed "
                         "here (make install-vllm installs its CPU build)")
    from vllm_recoverssm.cli.engine_table import format_engine_report
    from vllm_recoverssm.harness.engine_demo import EngineDemoOptions, run_engine_demo

    check_checkpoint_dir(args)
    fields: dict[str, object] = dict(num_spec=args.num_spec, acceptance=args.acceptance,
                                     seed=args.seed, checkpoint=args.checkpoint,
                                     fused_commit=not args.separate_commit,
                                     gpu_defaults=args.gpu_defaults)
    if args.checkpoint_dir is not None:
        fields["checkpoint_dir"] = str(args.checkpoint_dir)
    if args.requests is not None:
        fields["num_requests"] = args.requests
    if args.max_new_tokens is not None:
        fields["max_new_tokens"] = args.max_new_tokens
    try:
        options = EngineDemoOptions.model_validate(fields)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        flag = ENGINE_DEMO_FLAGS.get(str(err["loc"][0]), str(err["loc"][0]))
        raise flag_error(flag, f"{err['msg']}, got {err.get('input')!r}") from None
    started = time.monotonic()

    def progress(message: str) -> None:
        if not args.no_progress:
            print(f"demo: engine {message} ({time.monotonic() - started:.0f}s)",
                  file=sys.stderr, flush=True)

    report = run_engine_demo(options, progress=progress)
    if args.json:
        print(json.dumps(report.to_dict(), sort_keys=True))
    else:
        print(format_engine_report(report))
    return 0 if report.ok else 1


def validate(args: argparse.Namespace) -> DemoOptions:
    """The demo's options from the flags; ``UsageError`` names a bad flag (nothing runs)."""
    check_checkpoint_dir(args)
    if args.gpu_defaults:
        raise flag_error("--gpu-defaults", "applies to --engine vllm only (the reference "
                         "engine has no vLLM runner or scheduler; see --prefix-caching)")
    try:
        return DemoOptions(
            device=args.device, model=args.model, dtype=args.dtype, num_requests=args.requests,
            max_new_tokens=args.max_new_tokens, num_spec=args.num_spec, drafter=args.drafter,
            acceptance=args.acceptance, prefix_caching=args.prefix_caching,
            block_size=args.block_size, cuda_graph=False if args.no_cuda_graph else None,
            seed=args.seed, checkpoint=args.checkpoint,
            checkpoint_dir=None if args.checkpoint_dir is None else str(args.checkpoint_dir),
            fused_commit=not args.separate_commit,
            max_prefill_tokens=args.max_prefill_tokens, repeat=args.repeat,
        )
    except ValueError as exc:  # the flags above are checked; this is the runtime's last word
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when the outputs match and the bytes agree with the planner."""
    if args.engine == "vllm":
        return run_vllm(args)
    options = validate(args)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    bar = ProgressBar(sys.stderr, enabled=not args.no_progress)
    try:
        report = run_demo(options, progress=bar)
    finally:
        bar.close()
        torch.set_num_threads(previous_threads)
    if args.json:
        print(json.dumps(report.to_dict(), indent=None, sort_keys=True))
    else:
        print(format_report(report))
    return 0 if report.ok else 1
