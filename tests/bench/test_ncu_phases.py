"""``python -m vllm_recoverssm.bench.ncu_phases`` on a source page in ncu's CSV layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_recoverssm.bench import ncu_phases as nc

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed",'
          '"stall_barrier","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"')


def _row(addr: int, source: str, samples: int, executed: int, barrier: int, long_sb: int,
         wait: int) -> str:
    return (f'"0x{addr:x}","      {source}","{samples}","{samples}","{samples}","{executed}",'
            f'"{barrier}","{long_sb}","{wait}","{long_sb}"')


# Two phases: loads and a wait on them, ended by a barrier; then the rest of the kernel.
PAGE = "\n".join([
    '"Kernel Name","void window_kernel<0, 2, 8>(Params)",',
    HEADER,
    _row(0, "LDG.E.128 R4, desc[UR4][R2.64]", 2, 100, 0, 0, 2),
    _row(16, "@!P0 LOP3.LUT R5, R4, 0xffffe000, RZ, 0xc0, !PT", 60, 100, 0, 55, 5),
    _row(32, "BAR.SYNC.DEFER_BLOCKING 0x0", 8, 100, 8, 0, 0),
    _row(48, "MOV R6, R5", 10, 300, 0, 0, 10),
    _row(64, "@UP1 HMMA.1688.F32.TF32 R8, R4, R6, R8", 20, 400, 0, 0, 20),
    '"","","","","","","","","",""',  # a row without an instruction is skipped
]) + "\n"


def test_the_page_splits_into_phases_at_each_barrier() -> None:
    name, lines = nc.parse_source_csv(PAGE)
    assert name == "void window_kernel<0, 2, 8>(Params)"
    assert len(lines) == 5
    assert lines[1].stalls == {"barrier": 0.0, "long_sb": 55.0, "wait": 5.0}
    ph = nc.phases(lines)
    assert [p.index for p in ph] == [0, 1]
    assert ph[0].instr_share == pytest.approx(300 / 1000)
    assert ph[0].sample_share == pytest.approx(70 / 100)
    assert ph[0].top_stalls[0] == ("long_sb", pytest.approx(55 / 70))
    assert ph[1].first.startswith("MOV")
    assert ph[1].sample_share == pytest.approx(30 / 100)


def test_opcodes_drop_predicates_and_modifiers() -> None:
    assert nc.opcode("@!P0 LOP3.LUT R5, R4, 0x1, RZ, 0xc0, !PT") == "LOP3"
    assert nc.opcode("@UP1 HMMA.1688.F32.TF32 R8, R4, R6, R8") == "HMMA"
    assert nc.opcode("@PT BAR.SYNC 0x0") == "BAR"
    assert nc.opcode("  MOV R6, R5") == "MOV"
    _, lines = nc.parse_source_csv(PAGE)
    mix = {op: (i, s) for op, i, s in nc.opcode_mix(lines)}
    assert mix["HMMA"] == (pytest.approx(0.4), pytest.approx(0.2))
    assert nc.opcode_mix(lines)[0][0] == "HMMA"
    assert nc.stall_mix(lines)[0] == ("long_sb", pytest.approx(0.55))


def test_the_command_prints_the_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "verify.sass.csv"
    page.write_text(PAGE)
    assert nc.main([str(page)]) == 0
    out = capsys.readouterr().out
    assert "void window_kernel<0, 2, 8>(Params): 1000 warp instructions executed" in out
    assert "long_sb 79%" in out  # phase 0: 55 of its 70 samples
    assert "HMMA" in out and "stalls: long_sb 55%" in out


@pytest.mark.parametrize("text, why", [
    ("a,b\n1,2\n", "not an ncu source page"),
    ('"Kernel Name","k",\n"Address","Source"\n', "Instructions Executed"),
    ('"Kernel Name","k",\n' + HEADER + "\n", "no instructions"),
    ('"Kernel Name","k",\n' + HEADER + "\n" + _row(0, "MOV R1, R2", 1, 1, 0, 0, 1)
     .replace('"1","1","1","1"', '"x","1","1","1"', 1), "is not a number"),
])
def test_a_file_that_is_not_a_source_page_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, why: str) -> None:
    page = tmp_path / "page.csv"
    page.write_text(text)
    assert nc.main([str(page)]) == 2
    err = capsys.readouterr().err
    assert why in err and str(page) in err
