"""What the CUDA compiler gives each kernel of the CUDA library, without a GPU.

The CUDA verify and commit (``ops/csrc/``) are built on the serving machine, at first use, for
its GPU; a build that fails, or a change that pushes a kernel into spilling or out of the
blocks per SM it was tuned for, shows up there only as a warning or as lost speed. This
module compiles the same sources with the same flags for a named architecture (nvcc alone:
no GPU, no CUDA build of PyTorch) and reads ``ptxas``'s report of every kernel
instantiation: registers, spilled bytes, stack, static shared memory, and the blocks of
one SM those leave room for. ``recoverssm kernel-resources`` prints it; the tests hold
each kernel to the budget its source states.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .cuda_window import CSRC, NVCC_FLAGS, SOURCES, define_flags

__all__ = [
    "ARCHES", "KernelResources", "KernelRole", "SmLimits", "UnknownKernelName", "blocks_per_sm",
    "compile_report", "find_nvcc", "parse_ptxas", "parse_template_args",
]

THREADS_PER_BLOCK = 128
"""Both kernels run 4 warps per block (``kThreads`` and ``kCommitThreads`` in ``ops/csrc/``)."""
REGISTER_ALLOCATION_UNIT = 256
"""Registers are given to a warp in multiples of this many."""
RESERVED_SMEM_PER_BLOCK = 1024
"""Shared memory the driver keeps per resident block (SM80 and newer)."""
REGISTERS_PER_SM = 65536


@dataclass(frozen=True)
class SmLimits:
    """The per-SM limits that decide how many blocks of a kernel fit."""

    max_warps: int
    smem_bytes: int


ARCHES: dict[str, SmLimits] = {
    # resident warps and shared memory per SM, from the CUDA programming guide's
    # table of compute capabilities
    "sm_80": SmLimits(64, 164 * 1024),
    "sm_86": SmLimits(48, 100 * 1024),
    "sm_89": SmLimits(48, 100 * 1024),
    "sm_90": SmLimits(64, 228 * 1024),
    "sm_100": SmLimits(64, 228 * 1024),
    "sm_120": SmLimits(48, 100 * 1024),
}
"""Architectures the report knows the SM limits of (the library needs SM80 or newer)."""


class UnknownKernelName(ValueError):
    """A mangled kernel name this module cannot read template arguments from."""


@dataclass(frozen=True)
class KernelResources:
    """One kernel instantiation as ptxas compiled it."""

    kernel: str
    """``window_kernel`` or ``commit_kernel``."""
    template_args: tuple[str, ...]
    """Its template arguments as written in the source: ints, ``float``, ``__nv_bfloat16``."""
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    smem_bytes: int
    """Static shared memory per block."""

    @property
    def spill_bytes(self) -> int:
        """Bytes stored to and loaded from local memory because registers ran out."""
        return self.spill_store_bytes + self.spill_load_bytes

    def label(self) -> str:
        """``window_kernel<0, 1, 8, float>``: the name as the source instantiates it."""
        return f"{self.kernel}<{', '.join(self.template_args)}>"

    def describe(self) -> KernelRole:
        """What this instantiation serves, read from its template arguments."""
        a = self.template_args
        if self.kernel == "window_kernel" and len(a) == 4:
            return KernelRole("verify", WINDOW_MODES.get(a[0], a[0]), 16 * int(a[1]),
                              int(a[2]), DTYPE_NAMES.get(a[3], a[3]))
        if self.kernel == "commit_kernel" and len(a) == 2:
            return KernelRole("commit", "", int(a[1]), 0, DTYPE_NAMES.get(a[0], a[0]))
        return KernelRole(self.kernel, "", 0, 0, "")


WINDOW_MODES = {"0": "recovery", "1": "full", "2": "fused"}
"""``window_kernel``'s MODE argument (``Mode`` in ``ops/csrc/kda_window.cuh``)."""
DTYPE_NAMES = {"float": "float32", "__nv_bfloat16": "bfloat16"}


@dataclass(frozen=True)
class KernelRole:
    """A kernel instantiation in the library's terms."""

    op: str
    """``verify`` or ``commit``."""
    mode: str
    """The verify's mode: ``recovery``, ``full`` (the full-state baseline) or ``fused``."""
    rows_per_warp: int
    token_slots: int
    """Token columns of the verify's product (4: windows of S <= 3; 8); 0 for the commit."""
    act_dtype: str
    """Activations (verify) or records (commit): ``bfloat16`` or ``float32``."""


def find_nvcc() -> str | None:
    """The nvcc to use: ``$NVCC``, else the one on ``PATH``, else ``$CUDA_HOME/bin/nvcc``."""
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return None


def _limits(arch: str) -> SmLimits:
    if arch not in ARCHES:
        raise ValueError(f"argument 'arch': expected one of {', '.join(ARCHES)}, got {arch!r}")
    return ARCHES[arch]


def blocks_per_sm(res: KernelResources, arch: str) -> int:
    """Blocks of ``res`` one SM of ``arch`` holds at once, by registers, warps and shared
    memory (what the CUDA occupancy calculator gives for a block of 128 threads)."""
    lim = _limits(arch)
    warps = THREADS_PER_BLOCK // 32
    unit = REGISTER_ALLOCATION_UNIT
    per_warp = -(-res.registers * 32 // unit) * unit
    by_registers = REGISTERS_PER_SM // (per_warp * warps)
    by_warps = lim.max_warps // warps
    by_smem = lim.smem_bytes // (res.smem_bytes + RESERVED_SMEM_PER_BLOCK)
    return min(by_registers, by_warps, by_smem)


def parse_template_args(mangled: str) -> tuple[str, tuple[str, ...]]:
    """``(kernel, template arguments)`` of an Itanium-mangled name of ours, such as
    ``_ZN10recoverssm13window_kernelILi0ELi1ELi8EfEEvNS_6ParamsE``."""
    m = re.match(r"_ZN10recoverssm(\d+)", mangled)
    if m is None:
        raise UnknownKernelName(f"not a recoverssm kernel: {mangled!r}")
    n = int(m.group(1))
    pos = m.end()
    kernel = mangled[pos:pos + n]
    pos += n
    if mangled[pos:pos + 1] != "I":
        raise UnknownKernelName(f"no template arguments in {mangled!r}")
    pos += 1
    args: list[str] = []
    while pos < len(mangled) and mangled[pos] != "E":
        if mangled.startswith("Li", pos):  # an int literal: Li<digits>E
            end = mangled.index("E", pos)
            args.append(mangled[pos + 2:end])
            pos = end + 1
        elif mangled[pos] == "f":
            args.append("float")
            pos += 1
        elif mangled[pos].isdigit():  # a type named by its length-prefixed identifier
            d = re.match(r"\d+", mangled[pos:])
            assert d is not None
            n = int(d.group(0))
            start = pos + len(d.group(0))
            args.append(mangled[start:start + n])
            pos = start + n
        else:
            raise UnknownKernelName(f"cannot read the template arguments of {mangled!r}")
    if pos >= len(mangled):
        raise UnknownKernelName(f"unterminated template arguments in {mangled!r}")
    return kernel, tuple(args)


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str) -> list[KernelResources]:
    """The kernels of one ``ptxas -v`` report, in the order it lists them."""
    out: list[KernelResources] = []
    name: str | None = None
    frame: tuple[int, int, int] = (0, 0, 0)
    for line in text.splitlines():
        if (e := _ENTRY.search(line)) is not None:
            name, frame = e.group(1), (0, 0, 0)
        elif (f := _FRAME.search(line)) is not None and name is not None:
            frame = (int(f.group(1)), int(f.group(2)), int(f.group(3)))
        elif "Used" in line and "registers" in line and name is not None:
            regs = re.search(r"Used (\d+) registers", line)
            smem = re.search(r"(\d+) bytes smem", line)
            assert regs is not None
            kernel, targs = parse_template_args(name)
            out.append(KernelResources(
                kernel=kernel, template_args=targs, registers=int(regs.group(1)),
                spill_store_bytes=frame[1], spill_load_bytes=frame[2], stack_bytes=frame[0],
                smem_bytes=int(smem.group(1)) if smem else 0))
            name = None
    return out


def compile_report(arch: str, *, nvcc: str | None = None, sources: Sequence[str] = SOURCES,
                   csrc: Path = CSRC, defines: tuple[tuple[str, int], ...] = (),
                   progress: Callable[[str], None] | None = None) -> list[KernelResources]:
    """Compile ``sources`` (file names under ``csrc``) for ``arch`` with the library's own
    flags, plus ``defines`` (checked pairs of :func:`.cuda_window.parse_defines`: a tuning
    variant), and return every kernel instantiation ptxas reports.

    Raises ``FileNotFoundError`` without nvcc, ``ValueError`` for an architecture the
    report has no SM limits for, and ``RuntimeError`` (with the compiler's output) when a
    source does not compile.
    """
    _limits(arch)
    exe = nvcc or find_nvcc()
    if exe is None:
        raise FileNotFoundError("nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)")
    found: list[KernelResources] = []
    with tempfile.TemporaryDirectory(prefix="recoverssm-ptxas-") as tmp:
        for src in sources:
            if progress is not None:
                progress(f"compiling {src} for {arch}")
            cmd = [exe, f"-arch={arch}", *NVCC_FLAGS, *define_flags(defines), "-Xptxas",
                   "-v", "-c", str(csrc / src), "-o", str(Path(tmp) / (Path(src).stem + ".o"))]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            except OSError as exc:
                raise FileNotFoundError(f"cannot run nvcc ({exe}): {exc.strerror}") from None
            if done.returncode != 0:
                tail = (done.stderr + done.stdout).strip()[-2000:]
                raise RuntimeError(f"nvcc failed on {src} for {arch} (exit {done.returncode}):\n"
                                   f"{tail}")
            found.extend(parse_ptxas(done.stderr + done.stdout))
    return found
