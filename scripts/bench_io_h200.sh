#!/usr/bin/env bash
# Issue 27 (cold reads overlapped with writes, MoE at the dense rate) on one H200: every ratio, this branch A/B
# against a baseline checkout, each figure with its floors from the same run (scripts/bench.py).
#
#   scripts/bench_io_h200.sh OUTDIR [BASELINE_CHECKOUT]
#
# OUTDIR gets one JSON document per run (bench.py's stdout) and its table (stderr). BASELINE_CHECKOUT (e.g.
# `git archive 813b591 | tar -x -C /tmp/base`) runs the same measurements with that ctconvert (bench.py --code).
# Sections (each generated checkpoint is deleted after its section, so that 64 GB of disk do):
#   1. 8B dense bf16 (16 GB), NVFP4A16 and FP8_DYNAMIC, warm then --cold: call / max(read, write), call / concurrent floor
#   2. Qwen3-MoE layout, per-expert tensors (--family qwen3_moe, ~11 GB): GB/s against the dense 8B's
#   3. gpt-oss layout, fused 3-D experts quantized (--family gpt_oss, ~11 GB)
#   4. FP8-block source (the 8B quantized to FP8_BLOCK first) requantized to NVFP4A16: call / floor of its bytes
# What it should show: cold `call/r&w` (ratio_call_over_concurrent) <= 1.15 with this branch; the MoE rows'
# GBps_input_call about the dense 8B's; the FP8-block row's ratio_call_over_max_read_write about 1.
set -euo pipefail
OUT=${1:?OUTDIR}; BASE=${2:-}
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/ctbench-h200}
mkdir -p "$OUT" "$WORK"
COMMON=(--workdir "$WORK" --device cuda --no-peer --repeat "${REPEAT:-2}")

run() {  # run NAME ARGS...: this branch, then the baseline (when given), same arguments
    local name=$1; shift
    python3 "$HERE/scripts/bench.py" "${COMMON[@]}" "$@" > "$OUT/$name.json" 2> "$OUT/$name.txt"
    if [ -n "$BASE" ]; then
        python3 "$HERE/scripts/bench.py" "${COMMON[@]}" --code "$BASE" "$@" > "$OUT/$name-base.json" 2> "$OUT/$name-base.txt"
    fi
    python3 - "$OUT/$name.json" ${BASE:+"$OUT/$name-base.json"} <<'EOF'
import json, sys
for path in sys.argv[1:]:
    d = json.load(open(path))
    for r in d["results"]:
        print(f"{path.rsplit('/', 1)[-1]:28s} {r['scheme']:12s} cold={d['cold']!s:5s} call={r['ctconvert']['call_seconds']:.2f}s "
              f"GB/s={r['ctconvert']['GBps_input_call']:.2f} call/max(r,w)={r['ratio_call_over_max_read_write']:.2f} "
              f"call/concurrent={r['ratio_call_over_concurrent']:.2f} rss={r['ctconvert']['peak_rss_bytes'] / 2**20:.0f}MiB")
EOF
}

run dense8b-warm --size 8b --schemes NVFP4A16,FP8_DYNAMIC
run dense8b-cold --size 8b --schemes NVFP4A16,FP8_DYNAMIC --cold --drop-caches --no-kernels
run dense8b-fp8block --size 8b --schemes NVFP4A16 --source-scheme FP8_BLOCK
rm -rf "$WORK/llama3-8b-bf16" "$WORK/llama3-8b-bf16-fp8_block"
run qwen3moe --family qwen3_moe --schemes NVFP4A16,FP8_DYNAMIC --no-kernels
run qwen3moe-cold --family qwen3_moe --schemes NVFP4A16 --cold --drop-caches --no-kernels
rm -rf "$WORK/qwen3_moe-x1-bf16"
run gptoss --family gpt_oss --schemes NVFP4A16,FP8_DYNAMIC --no-kernels
rm -rf "$WORK/gpt_oss-x1-bf16"
