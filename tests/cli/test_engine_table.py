"""The table ``recoverssm demo --engine vllm`` prints (no engine: a report built by hand)."""

from __future__ import annotations

from vllm_recoverssm.cli.engine_table import format_engine_report
from vllm_recoverssm.harness.engine_demo import EngineDemoOptions, EngineDemoReport, WaveTwo
from vllm_recoverssm.harness.run_engine import EngineReport, KVReport, WaveReport


def _engine(mode: str, blocks_per_request: int, outputs: list[list[int]]) -> EngineReport:
    page = 841_728
    kv = KVReport(num_blocks=79, allocated_bytes=79 * page, bytes_per_block=page,
                  blocks_per_request=blocks_per_request,
                  state_bytes_per_request=blocks_per_request * page,
                  max_concurrency=79 / blocks_per_request,
                  scratch_bytes=196_608 if mode == "on" else 0)
    return EngineReport(vllm_version="0.32.0", mode=mode, recovery=mode == "on",
                        decision=[f"vllm-recoverssm: recovery: {mode} [mode {mode}]\nreason"],
                        outputs=outputs, num_cached_tokens=[0] * len(outputs), drafts=10,
                        draft_tokens=30, accepted_tokens=20, preemptions=0,
                        generated_tokens=sum(map(len, outputs)), seconds=2.0, kv=kv)


def _wave(outputs: list[list[int]], cached: list[int], seconds: float) -> WaveReport:
    return WaveReport(prompts=[[1] * 40, [2] * 60], outputs=outputs, num_cached_tokens=cached,
                      seconds=seconds, prompt_tokens=100, local_hits=0,
                      external_hits=sum(cached), cached_by_source={})


def _report(restored_outputs: list[list[int]], restored: list[int]) -> EngineDemoReport:
    answers = [[5, 6], [7, 8]]
    options = EngineDemoOptions(num_requests=2, max_new_tokens=2, checkpoint="disk")
    waves = {m: WaveTwo("disk", _wave(answers, [0, 0], 1.5),
                        _wave(restored_outputs, restored, 0.5), {}, True)
             for m in ("recovery", "full_state")}
    return EngineDemoReport(options=options, prompt_lengths=[30, 50], corruption=0.2,
                            modes={"recovery": _engine("on", 1, answers),
                                   "full_state": _engine("off", 4, answers)},
                            planner_bytes={"recovery": 841_728, "full_state": 4 * 841_728},
                            wall_seconds=10.0, checkpoints=waves)


def test_the_table_names_both_modes_the_allocation_and_wave_two() -> None:
    report = _report([[5, 6], [7, 8]], [31, 51])
    text = format_engine_report(report)
    assert report.ok
    assert "vLLM 0.32.0's LLM engine" in text
    assert "(4.00x less), == planner" in text
    assert "outputs identical (recovery vs full-state): yes (4 tokens)" in text
    assert "7 engine start-ups included" in text
    [recovery_row] = [line for line in text.splitlines()
                      if line.startswith("recovery") and "0.50" in line]
    assert recovery_row.split() == ["recovery", "100", "100", "18", "82", "1.50", "0.50",
                                    "yes"]
    assert "every follow-up restored its earlier turn: yes" in text
    # no commit line logged: the plugin's default
    assert "  commit   eager, right after sampling" in text
    assert "recovery with the connector: the commit right after sampling (not fused)" in text
    assert "record scratch of 196,608 B for 4 rows" in text


def test_the_table_shows_the_fused_commit_and_its_two_scratch_halves() -> None:
    report = _report([[5, 6], [7, 8]], [31, 51])
    rec = report.modes["recovery"]
    rec.commit_lines = ["vllm-recoverssm: commit: fused into the next verify (record "
                        "scratch of 2 x 4 rows)"]
    rec.deferred_commit_steps = 5
    assert report.checkpoints is not None
    report.checkpoints["recovery"].fused_steps = 9
    report.checkpoints["recovery"].export_settles = 2
    text = format_engine_report(report)
    assert "  commit   fused into the next verify (record scratch of 2 x 4 rows)" in text
    assert "record scratch of 196,608 B for 8 rows" in text
    assert ("recovery with the connector: commit fused in 9 steps; 2 commits of finished "
            "requests' last records before their export") in text
    assert report.to_dict()["scratch_rows"] == 8


def test_the_table_says_when_wave_two_differs_or_missed_a_restore() -> None:
    report = _report([[5, 6], [7, 9]], [31, 0])
    text = format_engine_report(report)
    assert not report.ok
    rows = [line.split() for line in text.splitlines() if line.endswith(" NO")]
    assert [r[0] for r in rows] == ["recovery", "full-state"]
    assert "NO (not restored: recovery 1, full-state 1)" in text
