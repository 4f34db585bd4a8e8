"""The table ``recoverssm demo --engine vllm`` prints from an :class:`EngineDemoReport`."""

from __future__ import annotations

from ..config.state_mode import StateMode
from ..harness.engine_demo import EngineDemoReport, engine_count
from .text import mib, mode_title, table


def format_engine_report(report: EngineDemoReport) -> str:
    """The human-readable table."""
    o = report.options
    rec, full = report.modes[StateMode.RECOVERY], report.modes[StateMode.FULL_STATE]
    lines = [
        "recoverssm demo --engine vllm: the tiny GLM-5.3 (all-KDA, random weights) through "
        f"vLLM {rec.vllm_version}'s LLM engine",
        f"  batch    {o.num_requests} prompts of {min(report.prompt_lengths)}.."
        f"{max(report.prompt_lengths)} tokens, {o.max_new_tokens} new tokens each, S = "
        f"{o.num_spec}, {o.max_num_seqs} rows at a time, 32-token prompt chunks",
        f"  drafter  oracle (greedy continuation, {report.corruption:.0%} of drafts corrupted)",
        f"  cache    {o.kv_cache_bytes / (1 << 20):.0f} MiB of KV cache "
        f"(--kv-cache-memory-bytes)",
        f"  commit   {report.commit}",
    ]
    if o.gpu_defaults:
        lines.append("  runner   vLLM's GPU defaults: model runner V2, asynchronous scheduling, "
                     "prefix caching in align mode (here on the CPU, V2's Triton kernels in "
                     "Triton's interpreter)")
    lines += [
        "",
    ]
    lines += table(
        [("mode", "<11"), ("tokens/s", ">9.1f"), ("accepted", ">9.1%"), ("blocks", ">7"),
         ("blocks/req", ">10"), ("state/request", ">14"), ("planner", ">12"),
         ("max conc.", ">10.2f")],
        [(mode_title(name), r.tokens_per_s, r.acceptance, r.kv.num_blocks,
          r.kv.blocks_per_request, mib(r.kv.state_bytes_per_request),
          mib(report.planner_bytes[name]), r.kv.max_concurrency)
         for name, r in report.modes.items()])
    ratio = full.kv.state_bytes_per_request / max(rec.kv.state_bytes_per_request, 1)
    total = sum(len(x) for x in rec.outputs)
    lines += [
        "",
        f"state per request (vLLM's allocation): recovery {rec.kv.state_bytes_per_request:,} B"
        f" vs full state {full.kv.state_bytes_per_request:,} B ({ratio:.2f}x less), "
        f"{'==' if report.bytes_match_planner else '!='} planner; recovery adds a record "
        f"scratch of {rec.kv.scratch_bytes:,} B for {report.scratch_rows} rows",
        f"outputs identical (recovery vs full-state): "
        f"{'yes' if report.outputs_identical else 'NO'} ({total} tokens)",
        f"decision logged: {rec.decision[0].splitlines()[0] if rec.decision else 'none'}",
        f"wall time {report.wall_seconds:.1f} s ({engine_count(o)} engine start-ups "
        "included)",
    ]
    if report.checkpoints:
        lines += ["", *format_checkpoints(report)]
    return "\n".join(lines)


BACKENDS = {"ram": "LMCache LocalCPUBackend, both waves in one engine",
            "disk": "LMCache fs backend, wave 2 in a fresh engine process"}


def format_checkpoints(report: EngineDemoReport) -> list[str]:
    """Wave 2 (follow-up turns) computed cold against restored, per mode."""
    assert report.checkpoints is not None
    o = report.options
    backend = o.checkpoint or "ram"
    lines = [
        f"checkpoints: {backend} ({BACKENDS[backend]}); wave 2 = every request's follow-up "
        f"turn (its prompt + its {o.max_new_tokens}-token answer + {o.follow_up_tokens} new "
        "tokens)",
        "",
    ]
    lines += table(
        [("mode", "<11"), ("prompt tok", ">10"), ("computed cold", ">13"),
         ("computed restored", ">17"), ("restored", ">9"), ("cold s", ">7.2f"),
         ("restored s", ">10.2f"), ("identical", ">9")],
        [(mode_title(name), c.cold.prompt_tokens, c.computed_cold, c.computed_restored,
          c.restored_tokens, c.cold.seconds, c.restored.seconds,
          "yes" if c.outputs_identical else "NO")
         for name, c in report.checkpoints.items()])
    missed = [f"{mode_title(n)} {c.restored.num_cached_tokens.count(0)}"
              for n, c in report.checkpoints.items() if not c.every_request_restored]
    unflushed = [mode_title(n) for n, c in report.checkpoints.items() if not c.flushed]
    lines.append("")
    lines.append("every follow-up restored its earlier turn: "
                 + ("yes" if not missed else f"NO (not restored: {', '.join(missed)})"))
    if unflushed:
        lines.append(f"exports still unwritten when an engine stopped: {', '.join(unflushed)}")
    lines.append("times are wave 2's generate() alone (prefill and "
                 f"{o.max_new_tokens} decoded tokens per request), engine start-up excluded")
    rec = report.checkpoints.get(StateMode.RECOVERY)
    if o.fused_commit and rec is not None:
        lines.append(
            f"recovery with the connector: commit fused in {rec.fused_steps} steps; "
            f"{rec.export_settles} commits of finished requests' last records before their "
            "export" if rec.fused_steps else
            "recovery with the connector: the commit right after sampling (not fused)")
    return lines
