"""``recoverssm plan`` and ``recoverssm check``: output, JSON and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_recoverssm.cli.main import main

GOOD_CHECK = ["--gpu-capability", "9.0", "--kernel-backend", "triton"]


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_exit(argv, capsys):
    """Like run, for argparse errors that exit through SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# ---- plan ------------------------------------------------------------------------------


def test_plan_table(capsys):
    code, out, err = run(["plan", "--model", "glm-5.3", "--tp", "2", "--num-spec", "3"], capsys)
    assert code == 0 and err == ""
    assert "glm-5.3" in out and "TP 2, S = 3" in out
    for row in ("full states", "recovery, records in page", "recovery, records in scratch"):
        assert row in out
    assert "2,244,608" in out and "2,375,680" in out
    assert "291.1 MiB" in out and "77.0 MiB" in out and "73.5%" in out
    assert "--gpu-memory" in out  # hint, no budget given


def test_plan_json_align_budget(capsys):
    code, out, _ = run(["plan", "--model", "glm-5.3", "--tp", "2", "--num-spec", "7",
                        "--cache-mode", "align", "--block-size", "64", "--max-num-seqs", "8",
                        "--gpu-memory", "40", "--max-model-len", "32768", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["cache_mode"] == "align" and data["block_size"] == 64
    names = [lp["name"] for lp in data["layouts"]]
    assert names == ["full", "recovery_in_page", "recovery_scratch"]
    full, rec = data["layouts"][0], data["layouts"][1]
    assert full["page_bytes"] == 2_342_912 and rec["page_bytes"] == 2_605_056
    assert full["blocks_per_request"] == 9 and rec["blocks_per_request"] == 2
    assert rec["requests_fit"] > full["requests_fit"] > 0
    assert data["gpu_memory_gib"] == 40


@pytest.mark.parametrize("extra, fused", [
    ([], True),                                    # auto, as the plugin's default
    (["--commit", "fused"], True),
    (["--commit", "eager"], False),
    (["--cache-mode", "align", "--block-size", "64"], True),
    (["--commit", "eager", "--cache-mode", "align", "--block-size", "64"], False),
])
def test_plan_counts_the_scratch_rows_of_the_plugins_commit(capsys, extra, fused):
    code, out, _ = run(["plan", "--max-num-seqs", "8", "--json", *extra], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["fused_commit"] is fused
    scratch = next(lp for lp in data["layouts"] if lp["name"] == "recovery_scratch")
    per_row = data["num_linear_layers"] * data["record_bytes"]
    assert scratch["scratch_bytes"] == (2 if fused else 1) * 8 * per_row


def test_plan_budget_table(capsys):
    code, out, _ = run(["plan", "--model", "kimi-linear", "--tp", "4", "--gpu-memory", "20",
                        "--max-model-len", "131072"], capsys)
    assert code == 0 and "fit" in out and "longest context" in out and "budget 20 GiB" in out


@pytest.mark.parametrize("tp", ["1", "2", "4", "8"])
@pytest.mark.parametrize("model", ["glm-5.3", "kimi-linear", "qwen3-next-80b-a3b"])
def test_plan_models_and_tp(capsys, model, tp):
    code, out, _ = run(["plan", "--model", model, "--tp", tp, "--json"], capsys)
    assert code == 0 and json.loads(out)["tp"] == int(tp)


def test_plan_from_config(tmp_path, capsys):
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 8,
           "linear_num_value_heads": 8, "linear_value_head_dim": 64,
           "linear_num_key_heads": 4, "linear_key_head_dim": 64, "num_key_value_heads": 2,
           "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run(["plan", "--config", str(tmp_path), "--tp", "2", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["num_linear_layers"] == 6 and data["num_attention_layers"] == 2
    assert data["architecture"] == "Qwen3NextForCausalLM"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--tp", "3"], ["--tp", "does not divide"]),  # reported by the layout
        (["--tp", "0"], ["--tp"]),
        (["--tp", "two"], ["--tp", "expected an integer"]),
        (["--num-spec", "-1"], ["--num-spec"]),
        (["--num-spec", "0"], ["--num-spec", "1..7"]),
        (["--num-spec", "8"], ["--num-spec", "1..7"]),
        (["--cache-mode", "align"], ["--block-size"]),
        (["--cache-mode", "align", "--block-size", "2"], ["smaller than S+1"]),
        (["--cache-mode", "all"], ["invalid choice"]),
        (["--prefill-checkpoints"], ["align"]),
        (["--max-num-seqs", "0"], ["--max-num-seqs"]),
        (["--gpu-memory", "-1"], ["--gpu-memory"]),
        (["--model", "llama"], ["unknown model"]),
        (["--dtype", "int8"], ["invalid choice"]),
        (["--bogus"], ["unrecognized arguments"]),
    ],
)
def test_plan_bad_arguments(capsys, argv, words):
    code, out, err = run_exit(["plan", *argv], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    # argparse reports leftovers from the top-level parser ("recoverssm: error: ...")
    assert lines[0].startswith(("recoverssm plan: error:", "recoverssm: error:"))
    for w in words:
        assert w in lines[0]


@pytest.mark.parametrize(
    "content, words",
    [
        ("{", ["not valid JSON"]),
        ("{}", ["'architectures' is missing"]),
        ('{"architectures": ["KimiLinearForCausalLM"], "num_hidden_layers": 4}',
         ["'linear_attn_config' is missing"]),
        ('{"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": -2}',
         ["'num_hidden_layers' must be >= 1"]),
    ],
)
def test_plan_malformed_config(tmp_path, capsys, content, words):
    p = tmp_path / "config.json"
    p.write_text(content)
    for cmd in ("plan", "check"):
        code, out, err = run_exit([cmd, "--config", str(p)], capsys)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(p) in lines[0]
        for w in words:
            assert w in lines[0]


def test_plan_missing_config(tmp_path, capsys):
    code, _, err = run_exit(["plan", "--config", str(tmp_path / "x.json")], capsys)
    assert code == 2 and "no such file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["plan", "check"])
def test_a_long_missing_path_is_shown_with_its_end(tmp_path, capsys, command):
    """The end of a path names the file; a long one loses its middle, never its end."""
    deep = tmp_path.joinpath(*(f"level-{i}" for i in range(12)), "missing", "config.json")
    code, _, err = run_exit([command, "--config", str(deep)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "missing/config.json'" in err and str(tmp_path)[:30] in err


def test_check_takes_no_more_drafts_than_plan(capsys):
    code, _, err = run_exit(["check", "--num-spec", "8"], capsys)
    assert code == 2 and "0..7" in err


# ---- check -----------------------------------------------------------------------------


def test_check_eligible(capsys):
    code, out, _ = run(["check", "--model", "glm-5.3", "--tp", "2", "--num-spec", "3",
                        *GOOD_CHECK], capsys)
    assert code == 0
    assert "recovery: on [mode auto]" in out and "Glm5NextForConditionalGeneration" in out


def test_check_auto_off_lists_reasons(capsys):
    code, out, _ = run(["check", "--gpu-capability", "none", "--runner", "v1", "--pp", "2",
                        "--cache-mode", "align", "--block-size", "64"], capsys)
    assert code == 0
    assert "recovery: off" in out
    for name in ("gpu:", "model_runner:", "pipeline_parallel_size:"):
        assert name in out


def test_check_runner_v1_and_vllms_cpu_platform_are_eligible(capsys):
    code, out, _ = run(["check", "--runner", "v1", "--gpu-capability", "9.0"], capsys)
    assert code == 0 and "recovery: on" in out
    code, out, _ = run(["check", "--device", "cpu", "--runner", "v1"], capsys)
    assert code == 0 and "recovery: on" in out and "kernels reference" in out
    code, _, err = run(["check", "--device", "cpu", "--gpu-capability", "9.0"], capsys)
    assert code == 2 and "argument --gpu-capability" in err


def test_check_forced_ineligible(capsys):
    code, out, err = run(["check", "--mode", "on", "--kv-connector", "generic", *GOOD_CHECK],
                         capsys)
    assert code == 1
    assert "kv_connector" in out
    assert "only an atomic request-boundary connector can export recovery state" in out
    assert len(err.strip().splitlines()) == 1 and "recoverssm check: error:" in err


def test_check_forced_json(capsys):
    code, out, _ = run(["check", "--mode", "on", "--kv-connector", "pd", "--json",
                        *GOOD_CHECK], capsys)
    assert code == 1
    data = json.loads(out)
    assert [f["name"] for f in data["failures"]] == ["kv_connector"]


def test_check_opt_in_and_off(capsys):
    code, out, _ = run(["check", "--model", "kimi-linear", *GOOD_CHECK], capsys)
    assert code == 0 and "recovery: off" in out and "only for GLM-5.3" in out
    code, out, _ = run(["check", "--model", "kimi-linear", "--mode", "on", *GOOD_CHECK],
                       capsys)
    assert code == 0 and "recovery: on [mode on]" in out
    code, out, _ = run(["check", "--mode", "off", *GOOD_CHECK], capsys)
    assert code == 0 and "no-use-replayssm" in out


def test_check_json(capsys):
    code, out, _ = run(["check", "--json", "--spec-method", "dflash", "--num-spec", "7",
                        "--gpu-capability", "sm120", "--kernel-backend", "b12x"], capsys)
    assert code == 0
    data = json.loads(out)
    # eligible, but SM120 has not run vLLM's GPU engine tests: auto keeps full states
    assert data["use_recovery"] is False and data["mode"] == "auto"
    assert data["failures"] == [] and "SM120" in data["reasons"][0]
    assert data["deployment"]["gpu_capability"] == [12, 0]
    assert data["deployment"]["spec_method"] == "dflash"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--spec-method", "telepathy"], ["--spec-method", "unknown speculative method"]),
        (["--spec-method", "none", "--num-spec", "3"], ["--spec-method", "--num-spec 0"]),
        (["--gpu-capability", "fast"], ["--gpu-capability"]),
        (["--pp", "0"], ["--pp"]),
        (["--mode", "maybe"], ["invalid choice"]),
        (["--kv-connector", "nixl"], ["invalid choice"]),
        (["--arch", ""], ["--arch"]),
    ],
)
def test_check_bad_arguments(capsys, argv, words):
    code, out, err = run_exit(["check", *GOOD_CHECK, *argv], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("recoverssm check: error:")
    for w in words:
        assert w in lines[0]


@pytest.mark.parametrize("argv, line", [
    ([], "commit: fused into the next verify (record scratch of 2 x 8 rows)"),
    (["--runner", "v1"], "commit: fused into the next verify (record scratch of 2 x 8 rows)"),
    (["--runner", "v1", "--kv-connector", "recoverssm"],
     "commit: fused into the next verify (record scratch of 2 x 8 rows)"),
    (["--runner", "v1", "--kv-connector", "request_boundary"],
     "commit: eager, not fused: a KV connector other than the plugin's may export the "
     "state between steps"),
    (["--runner", "v1", "--commit", "eager"], "commit: eager, right after sampling (asked for)"),
    (["--cache-mode", "align", "--block-size", "64"],
     "commit: fused into the next verify (record scratch of 2 x 8 rows)"),
])
def test_check_says_how_the_plugin_commits(capsys, argv, line):
    code, out, _ = run(["check", "--max-num-seqs", "8", *GOOD_CHECK, *argv], capsys)
    assert code == 0 and "recovery: on" in out
    assert out.strip().splitlines()[-1] == line
    code, out, _ = run(["check", "--json", "--max-num-seqs", "8", *GOOD_CHECK, *argv], capsys)
    commit = json.loads(out)["commit"]
    assert commit["summary"] == line
    assert commit["fused"] is line.startswith("commit: fused")
    assert commit["mode"] == (argv[argv.index("--commit") + 1] if "--commit" in argv
                              else "auto")


def test_check_gives_no_commit_line_without_recovery(capsys):
    code, out, _ = run(["check", "--mode", "off", *GOOD_CHECK], capsys)
    assert code == 0 and "commit:" not in out
    code, out, _ = run(["check", "--mode", "off", "--json", *GOOD_CHECK], capsys)
    assert json.loads(out)["commit"] is None


def test_check_without_speculation(capsys):
    code, out, _ = run(["check", "--num-spec", "0", *GOOD_CHECK], capsys)
    assert code == 0 and "no speculative decoding" in out


def test_console_script():
    exe = Path(sys.executable).with_name("recoverssm")
    if not exe.exists():
        pytest.skip("the recoverssm console script is not installed next to this Python")
    r = subprocess.run([str(exe), "plan", "--model", "glm-5.3", "--tp", "2", "--num-spec",
                        "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "recovery, records in scratch" in r.stdout
    r = subprocess.run([str(exe), "plan", "--tp", "3"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_detect_backend_wants_b12x_with_the_recovery_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib
    import types

    from vllm_recoverssm.cli.check import detect_backend

    assert detect_backend((9, 0)) == "triton"
    real_import = importlib.import_module

    def bare_b12x(name: str, *args: object) -> object:
        if name.startswith("b12x"):
            return types.ModuleType(name)  # an installed b12x without gdn_decode's API
        return real_import(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib, "import_module", bare_b12x)
    assert detect_backend((12, 0)) == "triton"
    monkeypatch.setattr(importlib, "import_module", real_import)
    try:
        real_import("b12x.sequence.gdn_decode")
    except ImportError:
        return  # b12x not installed: the API case cannot be checked here
    assert detect_backend((12, 0)) == "b12x"
