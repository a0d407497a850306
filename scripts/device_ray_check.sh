#!/usr/bin/env bash
# One GPU call's worth of the remaining H200 figures (run from the checkout's root on the device machine, Ray's
# wheels installed on PYTHONPATH, its `ray` script on PATH):
#   scripts/device_ray_check.sh OUTDIR
# 1. requantizing an FP8-block source to NVFP4A16 against the floor of its bytes (scripts/bench.py --source-scheme
#    FP8_BLOCK on the 8B shape; the bf16 checkpoint and its FP8-block copy are generated once in /tmp/w8);
# 2. the Ray executor with one GPU worker against the local executor on the same 8B checkpoint, with and without
#    resident workers (scripts/bench_ray.py --device cuda --keep).
set -u
OUT=${1:?OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null | head -1
timeout 330 python3 scripts/bench.py --size 8b --device cuda --no-peer --no-kernels --repeat "${REPEAT:-2}" --schemes NVFP4A16 \
  --source-scheme FP8_BLOCK --workdir /tmp/w8 > "$OUT/fp8block.json" 2> "$OUT/fp8block.log"
echo "fp8block rc=$?"; tail -12 "$OUT/fp8block.log"
rm -rf /tmp/w8/*-fp8_block /tmp/w8/out* 2>/dev/null
timeout 360 python3 scripts/bench_ray.py --model /tmp/w8/llama3-8b-bf16 --device cuda --repeat "${REPEAT:-2}" --schemes NVFP4A16 \
  --workdir /tmp/wr > "$OUT/ray.json" 2> "$OUT/ray.log"
echo "ray rc=$?"; tail -14 "$OUT/ray.log"
