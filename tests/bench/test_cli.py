"""``recoverssm bench --smoke`` end to end on the CPU: tables, JSON fields, plot, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_recoverssm.bench import accounting as acc
from vllm_recoverssm.bench import workload as wl
from vllm_recoverssm.bench.plot import matplotlib_available
from vllm_recoverssm.bench.runner import OPS
from vllm_recoverssm.cli.main import main

SMALL = ["bench", "--smoke", "--no-progress", "--num-spec", "3", "--batch", "1,2",
         "--layers", "1,3", "--reps", "2", "--warmup", "0"]
RECOVERY_OPS = ("verify", "commit_all", "commit_2", "total_all", "total_2", "fused_all",
                "fused_2")


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_smoke_default_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "bench.json"
    code, out, err = _run(["bench", "--smoke", "--json", str(js)], capsys)
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert doc["schema"] == "recoverssm-bench/2" and doc["mode"] == "smoke"
    assert {(r["num_spec"], r["batch"], r["layers"]) for r in doc["rows"]} == {
        (s, b, L) for s in (3, 7) for b in (1, 2) for L in (1, 2)}
    assert "S=3 B=1 L=1" in err  # progress on stderr
    for head in ("Time per step", "Achieved bandwidth", "Unique bytes", "State bytes"):
        assert head in out


def test_json_fields_and_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "bench.json"
    code, out, _ = _run([*SMALL, "--json", str(js)], capsys)
    assert code == 0
    doc = json.loads(js.read_text())
    assert doc["command"].startswith("recoverssm bench --smoke --num-spec 3 --batch 1,2")
    assert doc["machine"]["device"] and doc["machine"]["torch"] == torch.__version__
    assert doc["method"]["reps"] == 2 and doc["method"]["flush_bytes"] == 1 << 20
    assert doc["method"]["flush_mode"] == "write" and "--flush-mode" not in doc["command"]
    assert doc["roof"]["gbps"] > 0 and doc["roof"]["bytes"] == 2 * (1 << 30) // 64
    assert doc["peer"]["available"] is False  # no CUDA: the peer column is skipped cleanly
    assert any("fla-core peer column skipped" in n for n in doc["notes"])
    assert isinstance(doc["targets"], list)
    # smoke fidelity: every method of ours against float64, at tiny shapes
    (fid,) = doc["fidelity"]
    assert fid["num_spec"] == 3 and set(fid["methods"]) == {"recovery", "fused", "ours_full"}
    assert all(m["drift"] <= 1e-5 for m in fid["methods"].values())
    assert "Fidelity: max |committed state - float64|" in out
    for r in doc["rows"]:
        assert set(r["ops"]) == {"ours_full", *RECOVERY_OPS} and not r["skipped"]
        s = acc.OpShape(2, 16, 16, r["num_spec"], 2)
        B, L = r["batch"], r["layers"]
        for e in r["ops"].values():
            assert e["reps"] == 2 and 0 < e["ms_min"] <= e["ms"] <= e["ms_max"]
            assert e["gbps"] == pytest.approx(e["bytes"] / (e["ms"] * 1e-3) / 1e9)
            assert e["roof_frac"] == pytest.approx(e["gbps"] / doc["roof"]["gbps"])
        assert r["ops"]["verify"]["bytes"] == acc.recovery_verify_bytes(s, B, L)
        assert r["ops"]["total_2"]["bytes"] == (acc.recovery_verify_bytes(s, B, L)
                                                + acc.commit_bytes(s, B, 2, L))
        assert r["ops"]["fused_all"]["bytes"] == acc.fused_verify_bytes(s, B, 4, L)
        assert r["ops"]["fused_2"]["bytes"] == acc.fused_verify_bytes(s, B, 2, L)
        ratios = r["ratios"]
        assert ratios["total_all/fla"] is None
        assert ratios["total_all/ours_full"] == pytest.approx(
            r["ops"]["total_all"]["ms"] / r["ops"]["ours_full"]["ms"])
        mem = r["memory"]
        assert mem["full_alloc"] == mem["full_design"] == acc.full_state_bytes_per_request(s, L)
        assert mem["recovery_alloc"] == mem["recovery_design"]
        assert r["distinct_pools"] == {"full": L, "recovery": L}
    lines = out.splitlines()
    i = lines.index(next(x for x in lines if x.startswith("Time per step")))
    assert lines[i + 1].split()[:4] == ["S", "B", "L", "ours-full"]
    assert len([x for x in lines[i + 3:] if x.strip()][:4]) == 4  # one line per point


def test_memory_budget_shares_full_state_pools(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    s = acc.OpShape(2, 16, 16, 3, 2)
    B, L = 2, 3
    step = wl.make_step(s, B, L, torch.bfloat16, torch.device("cpu"), "reference", 0)
    pool = wl.full_pool_bytes(s, B)
    assert wl.recovery_pool_bytes(s, B) * L <= 1.5 * pool  # recovery still fits
    budget = (step.input_bytes + 1.5 * pool) / (1 << 30)
    js = tmp_path / "b.json"
    args = ["bench", "--smoke", "--no-progress", "--num-spec", "3", "--batch", "2", "--layers",
            "3", "--reps", "1", "--mem-budget-gib", repr(budget), "--json", str(js)]
    code, out, _ = _run(args, capsys)
    assert code == 0
    row = json.loads(js.read_text())["rows"][0]
    assert row["distinct_pools"] == {"full": 1, "recovery": 3}
    assert "take turns over 1 distinct pools" in out and "ours_full" in row["ops"]
    # the per-request figure is what an engine allocates, not what the bench shared
    assert row["memory"]["full_alloc"] == acc.full_state_bytes_per_request(s, L)

    budget = (step.input_bytes + 0.5 * pool) / (1 << 30)
    args[args.index("--mem-budget-gib") + 1] = repr(budget)
    code, out, _ = _run(args, capsys)
    assert code == 0
    row = json.loads(js.read_text())["rows"][0]
    assert not row["ops"] and set(row["skipped"]) == {"ours_full", *RECOVERY_OPS}
    assert row["memory"]["full_alloc"] is None and "skipped" in out


@pytest.mark.skipif(not matplotlib_available(), reason="needs matplotlib")
@pytest.mark.slow
def test_plot_is_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "bench.png"
    code, _, _ = _run([*SMALL, "--plot", str(png)], capsys)
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-spec", "0"], "--num-spec"),
        (["--num-spec", "8"], "--num-spec"),
        (["--num-spec", "3,x"], "--num-spec"),
        (["--batch", "0"], "--batch"),
        (["--batch", ""], "--batch"),
        (["--layers", "1,-2"], "--layers"),
        (["--reps", "0"], "--reps"),
        (["--reps", "2.5"], "--reps"),
        (["--warmup", "-1"], "--warmup"),
        (["--heads", "zero"], "--heads"),
        (["--head-dim", "24"], "--head-dim"),
        (["--dtype", "int8"], "--dtype"),
        (["--backend", "cuda"], "--backend"),
        (["--device", "tpu"], "--device"),
        (["--flush-mib", "nan"], "--flush-mib"),
        (["--flush-mode", "clean"], "--flush-mode"),
        (["--mem-budget-gib", "-1"], "--mem-budget-gib"),
        (["--json", "/nonexistent-dir/x.json"], "--json"),
    ],
)
def test_bad_arguments_exit_2(args: list[str], needle: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["bench", "--smoke", *args], capsys)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("recoverssm bench: error:") and needle in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_full_run_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["bench", "--batch", "1"], capsys)
    assert code == 2 and "--smoke" in err and len(err.strip().splitlines()) == 1


def test_reference_backend_is_smoke_only(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["bench", "--backend", "reference"], capsys)
    assert code == 2 and "--smoke" in err


def test_ops_order_lists_every_measured_op() -> None:
    assert OPS[0] == "fla_full" and set(RECOVERY_OPS) < set(OPS)


def test_module_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_recoverssm.cli.bench import main as bench_main

    assert bench_main(["--smoke", "--layers", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recoverssm bench: error: argument --layers")
    assert bench_main(["--smoke", "--no-progress", "--num-spec", "3", "--batch", "1",
                       "--layers", "1", "--reps", "1"]) == 0
    assert "Time per step" in capsys.readouterr().out


def test_a_failing_op_is_a_skipped_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    def broken(*_: object) -> dict[str, object]:
        return {"ours_full": lambda: 1 / 0}

    monkeypatch.setattr(wl, "full_ops", broken)
    js = tmp_path / "b.json"
    code, out, _ = _run(["bench", "--smoke", "--no-progress", "--num-spec", "3", "--batch", "1",
                         "--layers", "1", "--reps", "1", "--json", str(js)], capsys)
    assert code == 0
    row = json.loads(js.read_text())["rows"][0]
    assert row["skipped"]["ours_full"].startswith("ZeroDivisionError")
    assert set(row["ops"]) == set(RECOVERY_OPS) and row["ratios"]["total_all/ours_full"] is None
    assert "ours_full skipped: ZeroDivisionError" in out


def test_read_flush_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "bench.json"
    code, out, err = _run(["bench", "--smoke", "--no-progress", "--num-spec", "3", "--batch",
                           "1", "--layers", "1", "--reps", "1", "--warmup", "0",
                           "--no-fidelity", "--flush-mode", "read", "--json", str(js)], capsys)
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert doc["method"]["flush_mode"] == "read"
    assert doc["command"].endswith("--flush-mode read --no-fidelity")
    assert "a flush that reads the flush buffer" in out
