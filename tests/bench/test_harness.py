"""Timers, targets, the progress bar, the fla-core peer wiring, and the GPU path."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_recoverssm.bench import accounting as acc
from vllm_recoverssm.bench import workload as wl
from vllm_recoverssm.bench.grid import MIB, parse_int_list
from vllm_recoverssm.bench.progress import Progress
from vllm_recoverssm.bench.report import evaluate_targets, format_text
from vllm_recoverssm.bench.timing import EagerTimer, GraphTimer, Timing, make_timer, measure_roof
from vllm_recoverssm.cli.main import main

CPU = torch.device("cpu")


def test_eager_timer_counts_reps_and_flushes() -> None:
    calls: list[int] = []
    timer = make_timer(CPU, smoke=True, flush_bytes=4096, warmup=2, reps=5)
    assert isinstance(timer, EagerTimer)
    t = timer.measure(lambda: calls.append(int(timer.flush_buf[0])))
    assert len(calls) == 7 and len(t.samples_ms) == 5
    assert calls == [0, 1, 0, 1, 2, 3, 4]  # every call sees a freshly written flush buffer


def test_read_flush_reads_the_buffer_and_leaves_it() -> None:
    timer = make_timer(CPU, smoke=True, flush_bytes=4096, warmup=1, reps=3, flush_mode="read")
    seen: list[float] = []
    timer.flush_buf.view(torch.float32).fill_(0.5)
    bits = timer.flush_buf.clone()
    timer.measure(lambda: seen.append(float(timer._flush_sum)))
    # every call comes after a sum of the 1024 halves, read in the buffer's own width (no
    # cast, no temporary), and nothing wrote the buffer
    assert seen == [512.0] * 4 and torch.equal(timer.flush_buf, bits)
    assert timer._flush_sum.dtype == torch.float32
    assert "flush that reads the flush buffer" in timer.method
    assert "flush that writes" in make_timer(CPU, True, 4096, 0, 1).method
    with pytest.raises(ValueError, match="argument 'flush_mode': expected one of"):
        make_timer(CPU, smoke=True, flush_bytes=4096, warmup=0, reps=1, flush_mode="clean")


def test_timing_stats() -> None:
    t = Timing((3.0, 1.0, 2.0, 10.0))
    assert (t.median_ms, t.min_ms, t.max_ms) == (2.5, 1.0, 10.0)
    assert t.as_dict() == {"ms": 2.5, "ms_min": 1.0, "ms_max": 10.0, "reps": 4}


def test_roof_counts_read_and_write() -> None:
    timer = make_timer(CPU, smoke=True, flush_bytes=1024, warmup=0, reps=2)
    moved, t = measure_roof(timer, 1 << 20)
    assert moved == 2 << 20 and t.median_ms > 0


def test_parse_int_list_sorts_and_dedups() -> None:
    assert parse_int_list("batch", " 8,1,8 ", 1) == (1, 8)


def test_distinct_pools() -> None:
    assert wl.distinct_pools(10, 34, 1000) == 34
    assert wl.distinct_pools(10, 34, 95) == 9
    assert wl.distinct_pools(10, 34, 9) == 0


def test_progress_lines_without_a_terminal() -> None:
    buf = io.StringIO()
    p = Progress(3, stream=buf)
    for label in ("a", "b", "c", "d"):
        p.step(label)
    p.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4 and lines[2].startswith("bench 3/3") and lines[3].endswith(" d")


def _row(S: int, B: int, total: float, fused: float, frac: float) -> dict[str, Any]:
    ops = {n: {"roof_frac": frac} for n in ("verify", "commit_all", "commit_2")}
    return {"num_spec": S, "batch": B, "layers": 1, "ops": ops,
            "ratios": {"total_all/fla": total, "total_2/fla": None, "fused_all/fla": fused}}


def test_targets() -> None:
    rows = [_row(3, 1, 1.0, 1.01, 0.1), _row(3, 16, 9.0, 9.0, 0.1), _row(3, 32, 0.61, 0.59, 0.1),
            _row(7, 128, 0.27, 0.21, 0.80), _row(3, 256, 0.47, 0.33, 0.79)]
    fid = {"num_spec": 7, "batch": 8, "windows": 16, "methods": {
        "recovery": {"one_window": 1e-6, "drift": 2.5e-6},
        "fused": {"one_window": 1.1e-6, "drift": 2.3e-6},
        "fla_full": {"one_window": 1e-6, "drift": 2e-6}}}
    got = {(t["num_spec"], t["batch"], t["check"]): t["met"]
           for t in evaluate_targets({"rows": rows, "fidelity": [fid]})}
    assert all(t.get("floor") is None for t in evaluate_targets({"rows": rows}))  # no bytes
    assert got == {
        (3, 1, "total_all/fla"): True,  # <= 1.0 at batch 1 and 8
        (3, 1, "fused_all/fla"): False,
        (3, 32, "total_all/fla"): False,  # <= 0.60 at S = 3, batch 32
        (3, 32, "fused_all/fla"): True,
        (7, 128, "total_all/fla"): True,  # <= 0.27 at S = 7, batch >= 128
        (7, 128, "fused_all/fla"): False,  # <= 0.20
        (7, 128, "verify roof fraction"): True,  # >= 80% of the copy at batch >= 128
        (3, 256, "total_all/fla"): False,  # <= 0.46 at S = 3
        (3, 256, "fused_all/fla"): True,  # <= 0.33
        (3, 256, "verify roof fraction"): False,
        (7, 8, "recovery state error, 1 window"): True,  # <= 1e-6
        (7, 8, "recovery / fla drift, 16 windows"): False,  # 1.25 > 1.2
        (7, 8, "fused state error, 1 window"): False,
        (7, 8, "fused / fla drift, 16 windows"): True,  # 1.15
    }


def test_a_limit_below_copy_speed_is_reported_out_of_reach() -> None:
    """A ratio target the op could not meet even at the copy roof, given fla-core's measured
    time on this card, is marked out of reach, with the floor it would reach."""
    def op(mib: float, frac: float) -> dict[str, float]:
        return {"ms": 1.0, "bytes": mib * MIB, "gbps": 1.0, "roof_frac": frac}

    ops = {"fla_full": op(2600, 0.78), "total_all": op(1640, 0.9), "fused_all": op(1000, 0.9),
           "verify": op(584, 0.9)}
    row = {"num_spec": 3, "batch": 256, "layers": 1, "ops": ops, "skipped": {}, "notes": [],
           "ratios": {"total_all/fla": 0.53, "fused_all/fla": 0.35},
           "memory": {"full_alloc": 0, "recovery_alloc": 0, "full_design": MIB,
                      "recovery_design": MIB}, "distinct_pools": {"full": 1, "recovery": 1}}
    by_check = {t["check"]: t for t in evaluate_targets({"rows": [row]})}
    total, fused = by_check["total_all/fla"], by_check["fused_all/fla"]
    assert total["floor"] == pytest.approx(1640 / 2600 * 0.78)  # 0.492 > 0.46
    assert not total["met"] and total["reachable"] is False
    assert fused["floor"] == pytest.approx(1000 / 2600 * 0.78)  # 0.300 <= 0.33
    assert not fused["met"] and fused["reachable"] is True
    lines = format_text({
        "rows": [row], "mode": "gpu", "date": "-", "command": "-",
        "machine": {"device": "-", "torch": "-"}, "notes": [],
        "shape": {"heads": 32, "head_dim_k": 128, "act_dtype": "bfloat16", "lower_bound": -5.0,
                  "backend": "cuda"},
        "method": {"timing": "-", "warmup": 1, "reps": 1, "flush_bytes": 0},
        "roof": {"bytes": 2 * MIB, "gbps": 1.0, "ms": 1.0}}).splitlines()
    assert "Targets met: 1/3; 1 of the missed are out of reach on this card" in "\n".join(lines)
    assert any("total_all/fla = 0.530 (limit 0.46; 0.4920 at copy speed, out of reach)" in ln
               for ln in lines)
    assert any(ln.endswith("fused_all/fla = 0.350 (limit 0.33; 0.3000 at copy speed)")
               for ln in lines)


def _fla_fwd() -> Any:
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception:  # noqa: BLE001 - any import failure: no peer here
        return None
    return fused_recurrent_kda_fwd


@pytest.mark.parametrize("num_spec", [3, 7])
def test_fla_peer_matches_our_full_state_verify(num_spec: int) -> None:
    """The peer's wiring (layouts, gate, accepted column, written slots) agrees with ours."""
    fwd = _fla_fwd()
    on_gpu = torch.cuda.is_available()
    if fwd is None or not (on_gpu or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs fla-core and a GPU or TRITON_INTERPRET=1")
    dev = torch.device("cuda" if on_gpu else "cpu")
    dims = (32, 128) if on_gpu else (2, 16)
    s = acc.OpShape(dims[0], dims[1], dims[1], num_spec, 4)
    step = wl.make_step(s, 5, 1, torch.float32, dev, "auto", 0)
    full = wl.make_full_pools(step, 1, 0)
    got = wl.peer_agreement(step, full, fwd)
    assert got["max_abs_out"] <= 1e-6 * max(1.0, got["max_abs_out_ref"] / 0.05)
    assert got["max_abs_state"] <= 2e-6  # two kernels, each within 1e-6 of float64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_timer_on_gpu() -> None:
    dev = torch.device("cuda")
    timer = make_timer(dev, smoke=False, flush_bytes=64 << 20, warmup=2, reps=10)
    assert isinstance(timer, GraphTimer)
    moved, t = measure_roof(timer, 256 << 20)
    assert len(t.samples_ms) == 10 and acc.gbps(moved, t.median_ms) > 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_runs_on_gpu(tmp_path: Path) -> None:
    """The graph-captured path end to end at a small grid (a few seconds on a GPU)."""
    js = tmp_path / "b.json"
    code = main(["bench", "--no-progress", "--num-spec", "3", "--batch", "1,8",
                 "--layers", "1,2", "--reps", "5", "--warmup", "1", "--roof-gib", "0.25",
                 "--json", str(js)])
    assert code == 0
    doc = json.loads(js.read_text())
    assert doc["mode"] == "gpu" and doc["roof"]["gbps"] > 100
    for r in doc["rows"]:
        assert not r["skipped"] and all(e["ms"] > 0 for e in r["ops"].values())
