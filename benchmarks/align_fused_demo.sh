#!/bin/bash
# The demo under prefix caching (align mode): fused against separate commit, recovery
# against full state, on the GPU. Usage: bash this-script.sh OUTPUT_DIR [RUN...]
# (from the repository root, with the project importable by python3); RUN names pick runs.
set -u
out=${1:?usage: $0 OUTPUT_DIR [RUN...]}
shift
picked=" $* "
mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
run() {  # name, demo flags...
  local name=$1; shift
  if [ "$picked" != "  " ] && [[ "$picked" != *" $name "* ]]; then return; fi
  echo "== recoverssm demo --model glm-tp2 --dtype float32 $*" > "$out/$name.txt"
  timeout 120 python3 -m vllm_recoverssm.cli.main demo --model glm-tp2 --dtype float32 \
    --no-progress "$@" >> "$out/$name.txt" 2>&1
  echo "rc=$?" >> "$out/$name.txt"
  grep -E "decode tok/s recovery|fused commit|identical|^recovery |^full-state " \
    "$out/$name.txt" | sed "s/^/$name: /"
}
# 64 requests (two waves of 32); blocks of 256 tokens need smaller prefill steps, since
# the shared prompt is two blocks long and the reference model's prefill attention is dense
for S in 3 7; do
  for commit in fused sep; do
    flag=(); [ $commit = sep ] && flag=(--separate-commit)
    run b256-s$S-$commit --num-spec $S --requests 64 --repeat 3 --prefix-caching \
      --block-size 256 --max-prefill-tokens 1024 "${flag[@]}"
    run b64-s$S-$commit --num-spec $S --requests 64 --repeat 3 --prefix-caching \
      --block-size 64 "${flag[@]}"
    run b16-s$S-$commit --num-spec $S --requests 64 --repeat 3 --prefix-caching "${flag[@]}"
    # 16 requests (two waves of 8)
    run r16-b256-s$S-$commit --num-spec $S --requests 16 --repeat 3 --prefix-caching \
      --block-size 256 "${flag[@]}"
  done
done
