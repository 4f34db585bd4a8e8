"""``recoverssm demo``: the main job, at the smallest model size so that CI stays fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_recoverssm.cli.main import main
from vllm_recoverssm.harness.reference_demo import ModeReport

SMALL = ["demo", "--device", "cpu", "--model", "test", "--requests", "3",
         "--max-new-tokens", "6"]


def test_json_reports_identical_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--json", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["outputs_identical"] is True
    assert report["matches_greedy"] is True
    assert report["ok"] is True and err == ""
    rec, full = report["modes"]["recovery"], report["modes"]["full_state"]
    for m in (rec, full):
        assert m["state_bytes_per_request"] == m["planner_state_bytes_per_request"]
        assert m["generated_tokens"] == 3 * 6
        assert m["tokens_per_second"] > 0
    assert rec["state_bytes_per_request"] < full["state_bytes_per_request"]
    assert rec["accept_histogram"] == full["accept_histogram"]
    assert report["prompt_lengths"] and len(report["prompt_lengths"]) == 3
    assert "checkpoints" not in report  # only with --checkpoint


def test_text_report_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--num-spec", "2", "--acceptance", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert "outputs identical (recovery vs full-state): yes" in out
    assert "tokens/s" in out and "planner" in out
    for phase in ("greedy", "recovery", "full-state"):
        assert f"demo: {phase}" in err  # progress lines (stderr is not a terminal here)


def test_repeated_runs_report_medians(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--repeat", "3", "--max-prefill-tokens", "16", "--json",
                 "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["repeat"] == 3 and report["max_prefill_tokens"] == 16
    assert report["outputs_identical"] is True  # every run, in both modes
    for m in report["modes"].values():
        runs = m["decode_runs"]
        assert len(runs) == 3 and len(m["run_seconds"]) == 3
        assert m["decode_tokens_per_second"] == sorted(runs)[1]
        assert m["tokens_per_second"] == pytest.approx(
            m["generated_tokens"] / sorted(m["run_seconds"])[1])
    assert main([*SMALL, "--repeat", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "2 timed runs per mode in alternating order" in out
    assert "recovery / full state per run:" in out


def test_repeated_runs_fold_into_medians() -> None:
    def one_run(decode: float, seconds: float) -> ModeReport:
        return ModeReport(
            mode="recovery", seconds=seconds, generated_tokens=100,
            tokens_per_second=100 / seconds, decode_tokens_per_second=decode, steps=5,
            acceptance_rate=0.5, accept_histogram=[1, 1], state_bytes_per_request=1,
            planner_state_bytes_per_request=1, state_pool_bytes=1, prefix_cache_hits=0,
            prefix_cache_hit_tokens=0, graph_steps=0, decode_runs=[decode],
            run_seconds=[seconds])

    report = one_run(300.0, 4.0)
    report.add_run(one_run(100.0, 1.0))
    report.add_run(one_run(200.0, 2.0))
    assert report.decode_runs == [300.0, 100.0, 200.0]
    assert report.decode_tokens_per_second == 200.0
    assert report.seconds == 2.0 and report.tokens_per_second == 50.0


def test_repeat_is_refused_with_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--repeat", "2", "--checkpoint", "ram", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--repeat" in err and "--checkpoint" in err and err.count("\n") == 1


def test_mtp_drafter(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--drafter", "mtp", "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["outputs_identical"] is True
    assert report["matches_greedy"] is None  # no greedy reference without the oracle


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--num-spec", "8", "num-spec"), ("--acceptance", "1.5", "acceptance"),
     ("--requests", "0", "requests"), ("--threads", "0", "threads"),
     ("--checkpoint-dir", "ckpt", "checkpoint-dir"), ("--dtype", "int8", "dtype"),
     ("--repeat", "0", "repeat"), ("--max-prefill-tokens", "0", "max-prefill-tokens"),
     ("--block-size", "64", "only with --prefix-caching")],
)
def test_bad_arguments_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    assert main([*SMALL, flag, value, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_dtype_sets_the_model_activations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--dtype", "bfloat16", "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["dtype"] == "bfloat16"  # the test preset's own is float32
    assert report["outputs_identical"] is True and report["ok"] is True
    rec, full = report["modes"]["recovery"], report["modes"]["full_state"]
    assert rec["state_bytes_per_request"] == rec["planner_state_bytes_per_request"]
    assert rec["state_bytes_per_request"] < full["state_bytes_per_request"]


def test_dtype_is_refused_for_the_vllm_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--engine", "vllm", "--dtype", "float32", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "reference" in err and err.count("\n") == 1


def test_gpu_defaults_is_refused_for_the_reference_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SMALL, "--gpu-defaults", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--gpu-defaults" in err and "--engine vllm" in err and err.count("\n") == 1


def test_prefix_caching_second_wave_hits(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--device", "cpu", "--model", "test", "--requests", "4",
            "--max-new-tokens", "4", "--prefix-caching", "--json", "--no-progress"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["outputs_identical"] is True
    for m in report["modes"].values():
        assert m["prefix_cache_hits"] == 2  # the second wave of two reuses the shared prompt
        assert m["prefix_cache_hit_tokens"] == 2 * 32


def test_block_size_sets_the_cached_blocks_and_the_fused_commit_reports_its_rows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With blocks of 8 tokens the shared prompt is 16 tokens; rows that reach a block's end
    commit after their step, the rest wait for their next verify."""
    args = ["demo", "--device", "cpu", "--model", "test", "--requests", "4",
            "--max-new-tokens", "12", "--prefix-caching", "--block-size", "8", "--no-progress"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["block_size"] == 8
    assert "fused" in report["commit"]
    for m in report["modes"].values():
        assert m["prefix_cache_hit_tokens"] == 2 * 16
    rec = report["modes"]["recovery"]
    assert 0 < rec["deferred_rows"] < sum(rec["accept_histogram"])
    assert report["modes"]["full_state"]["deferred_rows"] == 0
    assert main(args) == 0
    assert "fused commit, blocks of 8 tokens: " in capsys.readouterr().out
    assert main([*args, "--separate-commit", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["modes"]["recovery"]["deferred_rows"] == 0
    assert main([*args[:-3], "--block-size", "3", "--no-progress"]) == 2
    assert "S+1 = 4" in capsys.readouterr().err


def test_block_size_is_refused_for_the_vllm_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--engine", "vllm", "--block-size", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--block-size" in err and "reference" in err and err.count("\n") == 1


@pytest.mark.lmcache
@pytest.mark.parametrize("backend", ["ram", "disk"])
def test_checkpoint_second_wave_is_restored(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, backend: str
) -> None:
    args = [*SMALL, "--checkpoint", backend, "--json", "--no-progress"]
    if backend == "disk":
        args += ["--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["checkpoint"] == backend
    assert set(report["checkpoints"]) == {"recovery", "full_state"}
    for c in report["checkpoints"].values():
        assert c["outputs_identical"] is True and c["rejected"] == 0
        # 3 requests: two follow-up turns and one repeated prompt, all restored
        assert (c["requests"], c["follow_ups"], c["repeats"]) == (3, 2, 1)
        assert c["hits"] == 3 and c["exact_hits"] == 1
        # wave 1: prompt + response of 3 requests; wave 2: those of the 2 follow-ups
        assert c["exported"] == 10
        assert c["computed_cold"] == c["prompt_tokens"]
        # a follow-up computes its answer's last token and the 8 new ones; a repeat nothing
        assert c["computed_restored"] == 2 * (1 + 8)
        assert c["restored_tokens"] == c["prompt_tokens"] - c["computed_restored"]
        assert c["cold_seconds"] > 0 and c["restored_seconds"] > 0
        assert c["steps_restored"] < c["steps_cold"]
    if backend == "disk":  # a given directory is kept
        assert any((tmp_path / "ckpt").glob("*kind%manifest*"))


@pytest.mark.lmcache
def test_checkpoint_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--checkpoint", "ram", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: ram (LMCache LocalCPUBackend)" in out
    assert "restored outputs equal the cold outputs: yes" in out
    assert "prompt tok computed" in out and "saved" in out
