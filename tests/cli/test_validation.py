"""Every ``recoverssm`` command validates every argument the same way, with bounds.

A bad value is one line on stderr that names the real flag and says what was expected, exit
code 2, no traceback, no unbounded allocation and no waiting. The flags are found by
introspecting the parser, so a flag added later is covered (and must declare a validator).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_recoverssm.cli import bench as bench_cli
from vllm_recoverssm.cli.args import Validator, unvalidated_options, validators_of
from vllm_recoverssm.cli.main import COMMAND_MODULES, build_parser, main

# Arguments that make each command otherwise valid (and cheap to validate).
BASE = {
    "plan": [],
    "check": ["--gpu-capability", "9.0", "--kernel-backend", "triton"],
    "demo": ["--device", "cpu", "--model", "test"],
    "kernel-check": [],
    "kernel-resources": ["--no-progress"],
    "bench": ["--smoke"],
    "checkpoints gc": [],
    "oracle": [],
}
RUNS_FULLY = {"plan", "check"}  # cheap enough to run main() on every fuzzed value
MODULES = {
    "plan": "plan", "check": "check", "demo": "demo", "kernel-check": "kernel_check",
    "kernel-resources": "kernel_resources",
    "bench": "bench", "checkpoints gc": "checkpoints", "oracle": "oracle",
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, nested ones as ``"checkpoints gc"``."""
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, prefix: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix} {name}".strip())
                return
        out[prefix] = p

    walk(build_parser(), "")
    return out


COMMANDS = _commands()


def _flags(cmd: str) -> dict[str, Validator]:
    checks = dict(validators_of(COMMANDS[cmd]))
    if cmd == "bench":
        checks.update(bench_cli.DEFERRED_CHECKS)
    return checks


CASES = [(cmd, flag) for cmd in sorted(COMMANDS) for flag in sorted(_flags(cmd))]


def test_every_command_is_covered_and_every_option_declares_a_check() -> None:
    assert set(COMMANDS) == set(BASE)
    assert len(COMMAND_MODULES) == len(COMMANDS)
    for cmd, parser in COMMANDS.items():
        deferred = bench_cli.DEFERRED_CHECKS if cmd == "bench" else {}
        assert unvalidated_options(parser, deferred) == [], cmd


def _real_flags(cmd: str) -> set[str]:
    return {s for a in COMMANDS[cmd]._actions for s in a.option_strings}


def _argv(cmd: str, flag: str, value: str, tmp: Path) -> list[str]:
    words = cmd.split()
    if flag == "DIR":
        return [*words, "--", value]
    extra = [str(tmp)] if cmd == "checkpoints gc" else []
    return [*words, *BASE[cmd], f"{flag}={value}", *extra]


def _validate(cmd: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and stderr of validating ``argv`` (running it for the cheap commands)."""
    if cmd in RUNS_FULLY:
        code = main(argv)
        return code, capsys.readouterr().err
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0), capsys.readouterr().err
    module = importlib.import_module(f"vllm_recoverssm.cli.{MODULES[cmd]}")
    validate = getattr(module, "validate", None)
    if validate is None:
        return 0, ""
    try:
        validate(args)
    except ValueError as exc:  # UsageError is one: main() prints it as one line, exit 2
        return 2, f"recoverssm {cmd}: error: {exc}\n"
    return 0, ""


def _check_outcome(cmd: str, flag: str, code: int, err: str, value: str) -> None:
    assert code in (0, 2), (cmd, flag, code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"recoverssm {cmd.split()[0]}"), err
        assert "Traceback" not in err and len(lines[0]) < 1000
        assert flag in lines[0] or (flag == "DIR" and "DIR" in lines[0]), err
        # the message may echo the bad value, which can look like a flag ('--a')
        text = lines[0].replace(repr(value), "").replace(f"'{value}'", "")
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
        assert named <= _real_flags(cmd), f"{cmd}: names flags that do not exist: {err}"


@pytest.mark.parametrize(("cmd", "flag"), CASES)
def test_edge_values_of_every_flag(cmd: str, flag: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    for value in _flags(cmd)[flag].samples():
        code, err = _validate(cmd, _argv(cmd, flag, value, tmp_path), capsys)
        _check_outcome(cmd, flag, code, err, value)
        if code == 0 and flag != "DIR":
            # an accepted value is within the validator's bounds, by construction
            _flags(cmd)[flag](value)


text_values = st.one_of(
    st.text(max_size=24),
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.from_regex(r"-?[0-9]{1,25}(\.[0-9]{0,5})?(e[-+]?[0-9]{1,4})?", fullmatch=True),
    st.lists(st.integers(-5, 5000).map(str), min_size=1, max_size=20).map(",".join),
    st.sampled_from(["/", "/dev/null", "/dev/zero", "~", ".", "..", "/proc/self/fd/0"]),
)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), value=text_values)
@example(case=("bench", "--backend"), value="--a")  # an echoed value that looks like a flag
def test_random_values_of_every_flag(case: tuple[str, str], value: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    cmd, flag = case
    if "\0" in value or (flag == "DIR" and value.startswith("-")):
        return
    code, err = _validate(cmd, _argv(cmd, flag, value, tmp_path), capsys)
    _check_outcome(cmd, flag, code, err, value)


# ---- the cases the fault test found -------------------------------------------------------


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["plan", "--gpu-memory", "inf"], ["--gpu-memory", "finite"]),
        (["plan", "--gpu-memory", "1e300"], ["--gpu-memory"]),
        (["plan", "--cache-mode", "align", "--block-size", "9" * 40], ["--block-size"]),
        (["plan", "--max-model-len", "9" * 30], ["--max-model-len"]),
        (["plan", "--max-num-seqs", "99999999999"], ["--max-num-seqs"]),
        (["plan", "--block-size", "64"], ["--block-size", "--cache-mode align"]),
        (["kernel-check", "--heads", "0"], ["--heads"]),
        (["kernel-check", "--head-dim", "-4"], ["--head-dim"]),
        (["kernel-check", "--batch", "0"], ["--batch"]),
        (["kernel-check", "--batch", "1024", "--heads", "128", "--head-dim", "256"],
         ["--batch", "--heads", "--head-dim", "GiB"]),
        (["demo", "--requests", "1000000000"], ["--requests"]),
        (["demo", "--max-new-tokens", "10000000"], ["--max-new-tokens"]),
        (["demo", "--acceptance", "nan"], ["--acceptance"]),
        (["bench", "--smoke", "--flush-mib", "inf"], ["--flush-mib"]),
        (["bench", "--smoke", "--reps", "1000000000000"], ["--reps"]),
        (["bench", "--smoke", "--roof-gib", "60"], ["--roof-gib", "GiB"]),
        (["bench", "--smoke", "--batch", "4096", "--heads", "256", "--head-dim", "256"],
         ["--batch", "GiB"]),
        (["checkpoints", "gc", "/nonexistent-dir"], ["DIR"]),
        (["checkpoints", "gc", "/", "--grace", "1"], ["--grace", "60"]),
    ],
)
def test_absurd_values_are_one_line_errors(argv: list[str], words: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(argv, capsys)
    for w in words:
        assert w in line, line


PLAN_REFUSES = [
    ["--tp", "3"], ["--tp", "-2"], ["--tp", "0"],
    ["--cache-mode", "align"], ["--cache-mode", "align", "--block-size", "2"],
    ["--cache-mode", "align", "--num-spec", "7", "--block-size", "7"],
    ["--block-size", "16"], ["--prefill-checkpoints"], ["--max-num-seqs", "-5"],
    ["--max-model-len", "0"], ["--gpu-memory", "-1"], ["--gpu-memory", "nan"],
    ["--model", "llama"], ["--config", "/dev/null"],
]


@pytest.mark.parametrize("argv", PLAN_REFUSES)
def test_check_refuses_what_plan_refuses(argv: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    plan_line = _one_line(["plan", *argv], capsys)
    check_line = _one_line(["check", *BASE["check"], *argv], capsys)
    assert plan_line.split("error: ", 1)[1] == check_line.split("error: ", 1)[1]


@pytest.mark.parametrize("value", ["-1", "8", "99"])
def test_plan_and_check_refuse_more_drafts_than_seven(value: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``check`` also takes 0 (no speculation), so only the range's start differs."""
    plan_line = _one_line(["plan", "--num-spec", value], capsys)
    check_line = _one_line(["check", *BASE["check"], "--num-spec", value], capsys)
    assert "--num-spec: expected an integer in 1..7" in plan_line
    assert "--num-spec: expected an integer in 0..7" in check_line


def _config(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.json"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("[" * 100_000 + "]" * 100_000, ["nested too deeply"]),
        ('{"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 1000000000000}',
         ["num_hidden_layers", "<= 4096"]),
        ('{"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 8, '
         '"linear_num_heads": 10000000000}', ["linear_num_heads"]),
        ('{"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 8, '
         '"max_position_embeddings": 1' + "0" * 40 + "}", ["max_position_embeddings"]),
        ('{"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 8, '
         '"linear_lower_bound": 1e999}', ["linear_lower_bound", "finite"]),
        ('{"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": ' + "9" * 5000 + "}",
         ["not a model config"]),
    ],
)
def test_hostile_config_files(tmp_path: Path, content: str, words: list[str],
                              capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path, content)
    for cmd in (["plan"], ["check", *BASE["check"]]):
        line = _one_line([*cmd, "--config", str(path)], capsys)
        assert "--config" in line
        for w in words:
            assert w in line, line


def test_huge_config_file_is_refused_unread(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(2**40)  # sparse: reading it would take a terabyte
    line = _one_line(["plan", "--config", str(path)], capsys)
    assert "--config" in line and "bytes" in line


def test_fifo_as_config_is_refused_without_waiting(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(main(["plan", "--config", str(tmp_path)])),
                         daemon=True)
    t.start()
    t.join(30)
    assert result == [2], "plan waited on a FIFO"
    assert "not a regular file" in capsys.readouterr().err


def test_load_hf_config_refuses_a_fifo_itself(tmp_path: Path) -> None:
    from vllm_recoverssm.config.models import ModelConfigError, load_hf_config

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(ModelConfigError, match="not a regular file"):
        load_hf_config(fifo)


def test_help_and_module_entry_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    assert main(["plan", "--tp"]) == 2
    assert "expected one argument" in capsys.readouterr().err
