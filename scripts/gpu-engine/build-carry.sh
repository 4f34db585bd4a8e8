#!/usr/bin/env bash
# Build, on this (CPU) machine, everything the GPU engine tests carry to a lent GPU machine,
# into the git-ignored folder .gpu-engine/carry (docs/testing.md, "GPU engine tests"):
#
#   whl/                     cp312 manylinux x86_64 wheels that the GPU machine's image lacks
#                            (vLLM 0.33.0's pure-Python dependencies; torch, triton,
#                            transformers, numpy ... are already there)
#   vllm033-py.tar.xz        vLLM 0.33.0's *.py / *.json / *.jinja files from its CUDA wheel;
#                            none of its compiled extensions (built for torch 2.14; the
#                            machine has torch 2.11): the stand-ins replace what is needed
#   dist-info/               metadata, so importlib.metadata finds vllm 0.33.0 (platform
#                            detection) and this plugin's vllm.general_plugins entry points
#   plugin-head.tar.xz       `git archive HEAD` of vllm_recoverssm/ and tests/support/
#   plugin-head.commit       (scripts/gpu-engine/device-run.sh PLUGIN=head runs them in place
#                            of the working tree's; the tree's other test files stay)
#
# The stand-in sources are tracked (tests/support/gpu_engine/standins/); device-run.sh copies
# them from the working tree, so editing one needs no rebuild.
#
#   bash scripts/gpu-engine/build-carry.sh          # build what is missing
#   bash scripts/gpu-engine/build-carry.sh --clean  # from scratch (the vLLM wheel stays cached)
#
# Needs pip with network access. The vLLM wheel (~500 MB) is cached in .gpu-engine/cache.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TOP=$REPO/.gpu-engine
CACHE=$TOP/cache
CARRY=$TOP/carry
VLLM_VERSION=0.33.0
if [ "${1:-}" = "--clean" ]; then rm -rf "$CARRY"; fi
mkdir -p "$CACHE" "$CARRY/whl" "$CARRY/dist-info"

plat() {  # pip's platform flags for CPython 3.12 on manylinux x86_64
    local p="--only-binary=:all: --python-version 3.12 --implementation cp"
    for n in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
             manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
        p="$p --platform ${n}_x86_64"
    done
    echo "$p"
}

# 1. vLLM's Python files (no compiled extension travels).
if ! ls "$CACHE"/vllm-$VLLM_VERSION-*.whl >/dev/null 2>&1; then
    pip download -q --no-deps $(plat) -d "$CACHE" vllm==$VLLM_VERSION
fi
WHEEL=$(ls "$CACHE"/vllm-$VLLM_VERSION-*.whl | head -1)
if [ ! -f "$CARRY/vllm033-py.tar.xz" ]; then
    X=$(mktemp -d)
    (cd "$X" && unzip -q "$WHEEL" 'vllm/*' -x '*.so' 'vllm/vllm-rs' \
        && find vllm -type f \( -name '*.py' -o -name '*.json' -o -name '*.jinja' \) \
             | LC_ALL=C sort > files && tar cJf "$CARRY/vllm033-py.tar.xz" -T files)
    rm -rf "$X"
fi

# 2. Wheels: the pure-Python front-end stack with its dependencies, then the packages that
#    depend on torch, without theirs; what the GPU machine's image holds is dropped.
DEPS=("pydantic>=2.12" msgspec "pyzmq>=25" cbor2 "openai>=2.25.0"
      "fastapi<0.137.0,>=0.133.0" "starlette>=1.0.1" "llguidance<1.8.0,>=1.7.0"
      partial-json-parser "prometheus_client>=0.18.0" cachetools blake3 pybase64
      setproctitle diskcache lark==1.2.2 outlines_core==0.2.14 "jsonschema>=4.23.0"
      "orjson>=3.11.6" ijson python-json-logger gguf "prometheus-fastapi-instrumentator>=8.0.0")
NODEPS=(xgrammar==0.2.8 compressed-tensors==0.17.0 depyf==0.20.0 apache-tvm-ffi==0.1.11
        loguru astor dill "oss-harmony>=0.0.11")
ON_DEVICE='^(numpy|anyio|attrs|charset_normalizer|h11|idna|pyyaml|PyYAML|requests|tqdm|urllib3|certifi)-'
if [ -z "$(ls "$CARRY/whl")" ]; then
    quiet() { grep -v "^WARNING: Location" || true; }  # this machine's extra index folders
    pip download -q $(plat) -d "$CARRY/whl" "${DEPS[@]}" 2>&1 | quiet
    pip download -q --no-deps $(plat) -d "$CARRY/whl" "${NODEPS[@]}" 2>&1 | quiet
    (cd "$CARRY/whl" && ls | grep -E "$ON_DEVICE" | xargs -r rm -f)
fi

# 3. dist-info: vLLM's own METADATA and entry points (an empty RECORD: its files are not all
#    there), and this package's entry points from pyproject.toml.
V=$CARRY/dist-info/vllm-$VLLM_VERSION.dist-info
mkdir -p "$V"
unzip -p "$WHEEL" "vllm-$VLLM_VERSION.dist-info/METADATA" > "$V/METADATA"
unzip -p "$WHEEL" "vllm-$VLLM_VERSION.dist-info/entry_points.txt" > "$V/entry_points.txt"
echo "gpu-engine-carry" > "$V/INSTALLER"; : > "$V/RECORD"
NAME_VERSION=$(python3 - "$REPO/pyproject.toml" <<'PY'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(p["name"].replace("-", "_") + "-" + p["version"])
PY
)
R=$CARRY/dist-info/$NAME_VERSION.dist-info
mkdir -p "$R"
printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "${NAME_VERSION%-*}" "${NAME_VERSION##*-}" > "$R/METADATA"
python3 - "$REPO/pyproject.toml" > "$R/entry_points.txt" <<'PY'
import sys, tomllib
for group, eps in tomllib.load(open(sys.argv[1], "rb"))["project"].get("entry-points", {}).items():
    print(f"[{group}]")
    for name, target in eps.items():
        print(f"{name} = {target}")
    print()
PY
echo "gpu-engine-carry" > "$R/INSTALLER"; : > "$R/RECORD"

# 4. The plugin and its test helpers as committed, for runs that must not pick up a working
#    tree mid-edit (the helpers go with the plugin they were written for).
(cd "$REPO" && git archive --format=tar HEAD vllm_recoverssm tests/support | xz -T0 > "$CARRY/plugin-head.tar.xz" \
    && git rev-parse HEAD > "$CARRY/plugin-head.commit")

du -sh "$CARRY"/* | sort -h
echo "carry: $(du -sh "$CARRY" | cut -f1) in $CARRY (device runs: carry [\".gpu-engine/carry\"])"
