"""The CUDA library as nvcc compiles it: every instantiation builds, none spills where its
source says it does not, and each keeps the blocks per SM it was tuned for.

No GPU is needed, only nvcc (skipped without it); the report's parsing and occupancy
arithmetic are tested on fixed ptxas text everywhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_recoverssm.cli.main import main
from vllm_recoverssm.ops import cuda_resources as cr
from vllm_recoverssm.ops import cuda_window as cw

NVCC = cr.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")

# One kernel as ptxas 13.0 reported it for sm_90 (a spilling recovery verify).
PTXAS_SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN10recoverssm13window_kernelILi0ELi1ELi8EfEEvNS_6ParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN10recoverssm13window_kernelILi0ELi1ELi8EfEEvNS_6ParamsE
    56 bytes stack frame, 64 bytes spill stores, 56 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 56 bytes cumulative stack size, 29856 bytes smem, 480 bytes cmem[0]
ptxas info    : Compile time = 105.854 ms
ptxas info    : Compiling entry function '_ZN10recoverssm13commit_kernelI13__nv_bfloat16Li16EEEvNS_12CommitParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN10recoverssm13commit_kernelI13__nv_bfloat16Li16EEEvNS_12CommitParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 122 registers, used 1 barriers, 10240 bytes smem, 480 bytes cmem[0]
"""  # noqa: E501


def test_ptxas_report_is_read_per_kernel() -> None:
    found = cr.parse_ptxas(PTXAS_SAMPLE)
    assert [r.label() for r in found] == ["window_kernel<0, 1, 8, float>",
                                          "commit_kernel<__nv_bfloat16, 16>"]
    verify, commit = found
    assert (verify.registers, verify.spill_store_bytes, verify.spill_load_bytes,
            verify.stack_bytes, verify.smem_bytes) == (96, 64, 56, 56, 29856)
    assert verify.describe() == cr.KernelRole("verify", "recovery", 16, 8, "float32")
    assert (commit.registers, commit.spill_bytes, commit.smem_bytes) == (122, 0, 10240)
    assert commit.describe() == cr.KernelRole("commit", "", 16, 0, "bfloat16")


@pytest.mark.parametrize("name", ["_Z3foov", "_ZN10recoverssm13window_kernelEv",
                                  "_ZN10recoverssm13window_kernelILi0ELi1Ed"])
def test_unreadable_kernel_names_are_refused(name: str) -> None:
    with pytest.raises(cr.UnknownKernelName, match="recoverssm kernel|template arguments"):
        cr.parse_template_args(name)


def _kernel(registers: int, smem: int) -> cr.KernelResources:
    return cr.KernelResources("window_kernel", ("0", "1", "8", "float"), registers, 0, 0, 0,
                              smem)


@pytest.mark.parametrize(("registers", "smem", "arch", "blocks"), [
    (96, 29856, "sm_90", 5),    # registers: 96 * 128 = 12288 per block
    (128, 29856, "sm_90", 4),
    (152, 38048, "sm_90", 3),   # 152 * 32 = 4864 = 19 allocation units per warp
    (254, 38048, "sm_90", 2),   # rounded up to 256 per thread
    (170, 0, "sm_90", 2),       # 5440 per warp, rounded up to 5632: 3 would need 5461
    (32, 0, "sm_90", 16),       # resident warps: 64 / 4
    (32, 0, "sm_86", 12),       # 48 resident warps
    (64, 29856, "sm_86", 3),    # shared memory: 100 KiB / (29856 + 1024)
    (64, 29856, "sm_80", 5),
])
def test_blocks_per_sm_follows_registers_warps_and_shared_memory(
        registers: int, smem: int, arch: str, blocks: int) -> None:
    assert cr.blocks_per_sm(_kernel(registers, smem), arch) == blocks


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="argument 'arch'.*sm_75"):
        cr.blocks_per_sm(_kernel(96, 0), "sm_75")


# ---- the library itself, compiled

# Every instantiation the launchers dispatch to: the verify by mode, rows per warp, token
# slots and activations (launch_rows / launch_mode), the commit by records and rows per
# warp (commit_rows).
VERIFY_KINDS = {(mode, rows, slots, dt) for mode in ("recovery", "full", "fused")
                for rows in (16, 32) for slots in (4, 8) for dt in ("float32", "bfloat16")}
COMMIT_KINDS = {(rows, dt) for rows in (4, 8, 16) for dt in ("float32", "bfloat16")}
RECOVERY_SPILL_BUDGET = 128
"""Bytes (stores + loads) the recovery verify may spill: its launch bound trades a few
spilled registers for 4-5 blocks per SM (``min_blocks_per_sm`` in csrc/kda_window.cuh)."""


def min_blocks(role: cr.KernelRole) -> int:
    """The blocks per SM each kernel was tuned to keep (csrc/kda_window.cuh explains the
    verify's; the commit's 16 warps are the fewest it was measured with)."""
    if role.op == "commit":
        return 4
    if role.mode == "recovery":
        return 5 if role.rows_per_warp == 16 else 4
    if role.mode == "fused" and role.rows_per_warp == 16 and role.token_slots == 4:
        return 4
    return 3 if role.rows_per_warp == 16 else 2


@pytest.fixture(scope="module", params=["sm_80", "sm_90"])
def compiled(request: pytest.FixtureRequest) -> tuple[str, list[cr.KernelResources]]:
    if NVCC is None:
        pytest.skip("nvcc not found")
    return request.param, cr.compile_report(request.param)


@needs_nvcc
@pytest.mark.slow
def test_every_dispatched_instantiation_is_built(
        compiled: tuple[str, list[cr.KernelResources]]) -> None:
    _, found = compiled
    roles = [r.describe() for r in found]
    verify = {(r.mode, r.rows_per_warp, r.token_slots, r.act_dtype) for r in roles
              if r.op == "verify"}
    commit = {(r.rows_per_warp, r.act_dtype) for r in roles if r.op == "commit"}
    assert verify == VERIFY_KINDS
    assert commit == COMMIT_KINDS
    assert len(found) == len(VERIFY_KINDS) + len(COMMIT_KINDS)


@needs_nvcc
def test_kernels_keep_their_registers_and_blocks_per_sm(
        compiled: tuple[str, list[cr.KernelResources]]) -> None:
    arch, found = compiled
    problems = []
    for res in found:
        role = res.describe()
        budget = RECOVERY_SPILL_BUDGET if role.mode == "recovery" else 0
        if res.spill_bytes > budget:
            problems.append(f"{res.label()}: spills {res.spill_bytes} bytes (budget {budget})")
        blocks, want = cr.blocks_per_sm(res, arch), min_blocks(role)
        if blocks < want:
            problems.append(f"{res.label()}: {blocks} blocks per SM ({res.registers} registers,"
                            f" {res.smem_bytes} bytes smem), tuned for {want}")
    assert problems == [], f"{arch}:\n" + "\n".join(problems)


@needs_nvcc
@pytest.mark.slow
def test_cli_prints_the_table_and_json(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "res.json"
    assert main(["kernel-resources", "--arch", "sm_90", "--no-progress",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "blocks/SM" in text and "recovery" in text and "commit" in text
    doc = json.loads(out.read_text())
    assert doc["arch"] == "sm_90"
    assert len(doc["kernels"]) == len(VERIFY_KINDS) + len(COMMIT_KINDS)
    assert all(k["blocks_per_sm"] >= 2 for k in doc["kernels"])


def test_cli_without_nvcc_says_so(monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("NVCC", "/nonexistent/nvcc")
    assert main(["kernel-resources", "--no-progress"]) == 1
    assert "nvcc" in capsys.readouterr().err


# ---- tuning variants (build-time overrides of the launch bounds and the row depth)

def test_tuning_overrides_are_checked() -> None:
    assert cw.parse_defines("") == ()
    assert cw.parse_defines(" recovery_depth=2, RECOVERSSM_FULL_BLOCKS_16 = 3 ") == (
        ("FULL_BLOCKS_16", 3), ("RECOVERY_DEPTH", 2))
    for bad, why in [("NOPE=1", "NAME one of"), ("RECOVERY_DEPTH", "NAME one of"),
                     ("RECOVERY_DEPTH=0", "1..8"), ("RECOVERY_DEPTH=9", "1..8"),
                     ("RECOVERY_DEPTH=2.5", "1..8"), ("RECOVERY_DEPTH=1,RECOVERY_DEPTH=2",
                                                      "twice")]:
        with pytest.raises(ValueError, match=f"{cw.DEFINES_ENV}: .*{re.escape(why)}"):
            cw.parse_defines(bad)
    assert cw.define_flags((("RECOVERY_DEPTH", 2),)) == ["-DRECOVERSSM_RECOVERY_DEPTH=2"]
    names = {cw.library_name(d) for d in [(), (("RECOVERY_DEPTH", 2),),
                                          (("RECOVERY_DEPTH", 3),),
                                          (("FULL_BLOCKS_16", 2), ("RECOVERY_DEPTH", 2))]}
    assert len(names) == 4 and cw.library_name(()) == "recoverssm_window"
    assert cw.library_name((("FUSED_BLOCKS_16_TP8", 4),)) == (
        "recoverssm_window_fused_blocks_16_tp8_4")


def test_a_bad_override_stops_the_library_with_its_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cw, "_state", {})
    monkeypatch.setenv(cw.DEFINES_ENV, "RECOVERY_DEPTH=0")
    with pytest.raises(ValueError, match="RECOVERSSM_CUDA_DEFINES: RECOVERY_DEPTH"):
        cw.library()
    assert cw._state == {}  # nothing cached: the next call reads the variable again


@needs_nvcc
@pytest.mark.slow
def test_overrides_reach_the_compiler() -> None:
    def by_role(found: list[cr.KernelResources]) -> dict[cr.KernelRole, cr.KernelResources]:
        return {r.describe(): r for r in found}

    fused = cr.KernelRole("verify", "fused", 16, 8, "bfloat16")
    base = by_role(cr.compile_report("sm_90", sources=("kda_window_fused.cu",)))
    four = by_role(cr.compile_report("sm_90", sources=("kda_window_fused.cu",),
                                     defines=(("FUSED_BLOCKS_16_TP8", 4),)))
    assert cr.blocks_per_sm(base[fused], "sm_90") == 3
    assert four[fused].registers <= 128 and cr.blocks_per_sm(four[fused], "sm_90") == 4
    # the other fused instantiations (32 rows, or half-width windows) keep their build
    def others(d: dict[cr.KernelRole, cr.KernelResources]) -> dict[cr.KernelRole, object]:
        return {k: v for k, v in d.items() if (k.rows_per_warp, k.token_slots) != (16, 8)}

    assert len(others(base)) == 6 and others(four) == others(base)


@needs_nvcc
@pytest.mark.slow
def test_cli_reports_a_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "v.json"
    assert main(["kernel-resources", "--no-progress", "--define", "recovery_depth=8",
                 "--json", str(out)]) == 0
    assert "RECOVERY_DEPTH=8" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["defines"] == {"RECOVERY_DEPTH": 8}
    deep = [k for k in doc["kernels"] if k["role"]["mode"] == "recovery"
            and k["role"]["rows_per_warp"] == 32 and k["role"]["token_slots"] == 8]
    # all eight k-steps of 32 rows in flight do not fit 128 registers
    assert deep and all(k["spill_store_bytes"] > RECOVERY_SPILL_BUDGET for k in deep)
