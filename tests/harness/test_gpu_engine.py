"""vLLM's real engine on a CUDA GPU: recovery on against full states, greedy, same drafts.

One process (:mod:`tests.support.gpu_engine.session`) runs every case: for each, three
``vllm.LLM`` engines with the tiny all-KDA GLM-5.3: ``cold`` (full states, every draft
wrong; its output is what the oracle drafts), then ``on`` (recovery) and ``off`` (full
speculative states, the reference) with the same oracle drafts. Per request:

* where the two full-state runs (``cold`` and ``off``) agree, the request's output does not
  depend on the draft pattern, and ``on`` must give exactly the same tokens as ``off``;
* where they do not, bf16 kernels already change the greedy output with the draft pattern
  or batch shape, with no recovery involved, so token identity cannot be asked of ``on``.
  At the first token where ``on`` and ``off`` differ (same context in both), each run's
  choice must be a near tie in both runs: the other run's token is among the best
  :data:`~tests.support.gpu_engine.session.LOGPROBS` and its log-probability is within
  :data:`TIE_NATS` of the chosen one, in ``on`` and in ``off``.

Why :data:`TIE_NATS` = 0.1: the logits are bf16 (8 significant bits), so a logit of
magnitude 4 to 8 is rounded to a multiple of 2^-5 = 0.031 and its difference with another
is only known to about 0.03 nats. Full-state and recovery runs feed the same tokens through
differently ordered bf16 arithmetic (the state replayed from a record in place of a kept
intermediate state; different batch shapes), which moves hidden states by a few bf16 units
of the last place and the logits by a few of theirs: 0.1 nats is about three of them. A
recovery that computed a wrong state would not stay within it for long: the first
difference would come at a token with a clear margin.

Needs a CUDA GPU and vLLM 0.33 with the device's stand-ins: ``scripts/gpu-engine/
device-run.sh`` (docs/testing.md, "GPU engine tests"). Elsewhere the module is skipped.
Environment: ``RECOVERSSM_GPU_CASES`` (comma-separated case names, default
``session.CASES``), ``RECOVERSSM_GPU_BUDGET_S`` (seconds for all cases; a case is not
started with less than a minute left, and its test is skipped; the session is stopped a
minute after the budget), ``RECOVERSSM_GPU_OUT``
(where the session writes; a temporary folder otherwise); each case's verdict is written
to ``OUT/CASE/summary.json`` and printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.gpu_engine import session

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TIE_NATS = 0.1
"""Largest log-probability margin of a greedy choice that the other run may overturn."""
REPO = Path(__file__).resolve().parents[2]
CASES = os.environ.get("RECOVERSSM_GPU_CASES", ",".join(session.CASES)).split(",")
BUDGET_S = float(os.environ.get("RECOVERSSM_GPU_BUDGET_S", "1500"))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run every case once (one process); the folder of their reports."""
    out = Path(os.environ.get("RECOVERSSM_GPU_OUT") or tmp_path_factory.mktemp("gpu-engine"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    log = out / "session.log"
    with log.open("w") as sink:
        try:
            subprocess.run([sys.executable, "-m", "tests.support.gpu_engine.session", str(out),
                            ",".join(CASES), str(BUDGET_S)], cwd=REPO, env=env, stdout=sink,
                           stderr=subprocess.STDOUT, timeout=BUDGET_S + 60, check=False)
        except subprocess.TimeoutExpired:
            sink.write("\n[gpu-engine] session stopped at its time limit\n")
    return out


def _tail(path: Path, n: int = 40) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(line for line in lines[-n:] if " DEBUG " not in line)


def _load(results: Path, name: str) -> dict[str, dict[str, Any]]:
    where = results / name
    if (where / "error.txt").exists():
        pytest.fail(f"{name} raised:\n{_tail(where / 'error.txt', 30)}")
    if (where / "skipped.txt").exists():
        pytest.skip(f"{name}: not started, {(where / 'skipped.txt').read_text()}")
    reports = {m: json.loads((where / f"{m}.json").read_text())
               for m in ("cold", "on", "off") if (where / f"{m}.json").exists()}
    if len(reports) < 3:
        log = _tail(results / "session.log")
        if "stopped at its time limit" in log:
            pytest.skip(f"{name}: the budget ran out after {sorted(reports)}")
        pytest.fail(f"{name}: only {sorted(reports)} finished; session log tail:\n{log}")
    return reports


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _step(report: dict[str, Any], request: int, position: int) -> dict[int, float]:
    return {int(t): float(lp) for t, lp in report["logprobs"][request][position].items()}


def near_tie(on: dict[str, Any], off: dict[str, Any], request: int,
             position: int) -> dict[str, Any]:
    """The margins at the first difference: each run's choice over the other's token."""
    a, b = off["outputs"][request][position], on["outputs"][request][position]
    lp_off, lp_on = _step(off, request, position), _step(on, request, position)
    gap_off = lp_off[a] - lp_off[b] if b in lp_off else float("inf")
    gap_on = lp_on[b] - lp_on[a] if a in lp_on else float("inf")
    return dict(position=position, off_token=a, on_token=b, off_margin=gap_off,
                on_margin=gap_on, ok=max(gap_off, gap_on) <= TIE_NATS)


def noise_floor(on: dict[str, Any], off: dict[str, Any], request: int, upto: int) -> float:
    """Largest difference of the chosen token's log-probability between the runs, over the
    positions both ran with the same context."""
    worst = 0.0
    for i in range(upto):
        t = off["outputs"][request][i]
        lp_on, lp_off = _step(on, request, i), _step(off, request, i)
        if t in lp_on and t in lp_off:
            worst = max(worst, abs(lp_on[t] - lp_off[t]))
    return worst


def verdict(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cold, on, off = reports["cold"], reports["on"], reports["off"]
    rows = []
    for r in range(len(off["outputs"])):
        stable = cold["outputs"][r] == off["outputs"][r]
        diff = _first_difference(on["outputs"][r], off["outputs"][r])
        n = len(off["outputs"][r]) if diff is None else diff
        row: dict[str, Any] = dict(request=r, full_states_agree=stable, identical=diff is None,
                                   first_difference=diff,
                                   cold_off_first_difference=_first_difference(
                                       cold["outputs"][r], off["outputs"][r]),
                                   logprob_noise=round(noise_floor(on, off, r, n), 5))
        if diff is not None and diff < min(len(on["outputs"][r]), len(off["outputs"][r])):
            row["tie"] = near_tie(on, off, r, diff)
        rows.append(row)
    waves = None
    if on.get("waves"):
        waves = [w_on["outputs"] == w_off["outputs"]
                 for w_on, w_off in zip(on["waves"], off["waves"], strict=True)]
    return dict(
        requests=rows, waves_identical=waves,
        acceptance={m: [reports[m]["accepted_tokens"], reports[m]["draft_tokens"]]
                    for m in ("cold", "on", "off")},
        runner={m: reports[m].get("runner") for m in ("on", "off")},
        cudagraph_mode=on.get("cudagraph_mode"), async_scheduling=on.get("async_scheduling"),
        mamba_cache_mode=on.get("mamba_cache_mode"),
        prefix_hits=[w.get("local_hits") for w in on.get("waves", [])],
        seconds={m: reports[m].get("total_s") for m in ("cold", "on", "off")},
    )


def test_platform(results: Path) -> None:
    """The session ran on vLLM's CUDA platform with both plugins found and the stand-ins
    computing what the real ops compute."""
    env_file = results / "env.json"
    assert env_file.exists(), _tail(results / "session.log")
    env = json.loads(env_file.read_text())
    print(f"[gpu-engine] env: {env}")
    assert env["is_cuda"], env
    assert env["vllm_metadata"] == env["vllm"], env
    assert {"recoverssm", "recoverssm_harness"} <= set(env["plugins"]), env
    assert env["rms_norm_max_err"] < 0.05, env  # bf16 rounding of values of a few units
    assert env["uva_view_sees_host_writes"], env


@pytest.mark.parametrize("name", CASES)
def test_recovery_matches_full_states(results: Path, name: str) -> None:
    reports = _load(results, name)
    case = session.parse_case(name)
    summary = verdict(reports)
    (results / name / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[gpu-engine] {name}: {json.dumps(summary)}")
    on, off, cold = reports["on"], reports["off"], reports["cold"]
    assert on["recovery"] and not off["recovery"] and not cold["recovery"]
    assert on["async_scheduling"] == case.asynchronous
    assert on["draft_tokens"] > 0 and on["accepted_tokens"] > 0, summary["acceptance"]
    assert off["accepted_tokens"] > 0, summary["acceptance"]
    expected = "V2" if case.runner == "v2" else "V1"
    runner = str(on.get("runner"))
    assert ("gpu.model_runner" in runner) == (expected == "V2"), runner
    for row in summary["requests"]:
        if row["full_states_agree"]:
            assert row["identical"], (f"request {row['request']}: both full-state runs agree "
                                      f"but recovery differs at {row['first_difference']}")
        elif not row["identical"]:
            tie = row.get("tie")
            assert tie is not None, f"request {row['request']}: outputs of different lengths"
            assert tie["ok"], (f"request {row['request']}: recovery and full states part at "
                               f"token {tie['position']} with a margin over {TIE_NATS}: {tie}")
