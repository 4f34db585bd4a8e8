#!/usr/bin/env bash
# On a lent GPU machine, from the repository root: install the carry that build-carry.sh
# made (.gpu-engine/carry) into /tmp/site and run the GPU engine tests there.
#
#   bash scripts/gpu-engine/device-run.sh [PYTEST ARGS...]
#
# From this machine, through the device tool (docs/testing.md, "GPU engine tests"):
#   run(command="bash scripts/gpu-engine/device-run.sh", carry=[".gpu-engine/carry"])
#
# Environment:
#   PLUGIN=tree|head       the plugin from the working tree (default) or as committed
#                          (carry/plugin-head.tar.xz, vllm_recoverssm/ and tests/support/ of
#                          HEAD over the tree's tests: a tree mid-edit by others stays out;
#                          files HEAD lacks, such as a new test, stay the tree's)
#   RECOVERSSM_GPU_CASES   comma-separated cases (tests/support/gpu_engine/session.py)
#   RECOVERSSM_GPU_BUDGET_S  seconds for all cases (default: 420)
# Writes pytest.log, results.tar.xz (every engine's report, the session log) and
# triton-cache.tar.xz (the compiled Triton kernels) under $OUT. Unpacked into
# .gpu-engine/triton-cache and carried with the next call, that cache spares its first
# engine the kernels' compilation (about 150 s on an H100); Triton keys it by source,
# GPU and version, so a stale entry is recompiled, never reused.
set -uo pipefail
T0=$SECONDS
REPO=$(pwd)
C=$REPO/.gpu-engine/carry
S=/tmp/site
W=/tmp/gpu-engine-repo
R=/tmp/gpu-engine-out
OUT=${OUT:-/tmp/gpu-engine-device-out}
mkdir -p "$OUT"
[ -d "$C/whl" ] || { echo "no $C: run scripts/gpu-engine/build-carry.sh and carry .gpu-engine/carry"; exit 2; }

# 1. vLLM 0.33.0's Python tree, its dependencies, the stand-ins over it, the metadata.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $S \
    "$C"/whl/*.whl 2>&1 | grep -v "Running pip as" || true
tar xJf "$C/vllm033-py.tar.xz" -C $S || exit 1
cp -r tests/support/gpu_engine/standins/vllm/. $S/vllm/ && cp -r "$C"/dist-info/* $S/ || exit 1

# 2. The repository the tests run from: the plugin (tree or head) and the tree's tests.
rm -rf $W $R && mkdir -p $W $R
cp -r tests pyproject.toml $W/
if [ "${PLUGIN:-tree}" = head ]; then
    tar xJf "$C/plugin-head.tar.xz" -C $W && PLUGIN_AT="commit $(cat "$C/plugin-head.commit")"
else
    cp -r vllm_recoverssm $W/ && PLUGIN_AT="working tree"
fi
echo "[gpu-engine] installed in $((SECONDS - T0)) s; plugin: $PLUGIN_AT"

# 3. Settings. The plugin's Triton kernels, not its nvcc-built CUDA window library (no
#    build on the device); FlashInfer is not installed, and vLLM's sampler imports its
#    backend unless told not to use it.
export PYTHONPATH=$S:$W PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export RECOVERSSM_CUDA_WINDOW=${RECOVERSSM_CUDA_WINDOW:-0} VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
export RECOVERSSM_GPU_BUDGET_S=${RECOVERSSM_GPU_BUDGET_S:-420} RECOVERSSM_GPU_OUT=$R
export TRITON_CACHE_DIR=/tmp/triton-cache
rm -rf $TRITON_CACHE_DIR && mkdir -p $TRITON_CACHE_DIR
[ -d "$REPO/.gpu-engine/triton-cache" ] && cp -r "$REPO/.gpu-engine/triton-cache/." $TRITON_CACHE_DIR/ \
    && echo "[gpu-engine] Triton cache: $(ls $TRITON_CACHE_DIR | wc -l) kernels carried"

# 4. The tests.
cd $W && python3 -m pytest -p no:cacheprovider -q -s -rA -m gpu tests/harness/test_gpu_engine.py "$@" \
    2>&1 | grep -v " DEBUG " | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
tar cJf "$OUT/results.tar.xz" -C $R --exclude tiny-glm53 . 2>/dev/null
tar cJf "$OUT/triton-cache.tar.xz" -C $TRITON_CACHE_DIR . 2>/dev/null
echo "[gpu-engine] pytest rc=$rc, total $((SECONDS - T0)) s"
exit "$rc"
