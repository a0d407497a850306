#!/usr/bin/env bash
# One GPU call's worth of the remaining H200 figures (run from the checkout's root on the device machine, Ray's
# wheels installed on PYTHONPATH, its `ray` script on PATH):
#   scripts/device_ray_check.sh OUTDIR
# 1. requantizing an FP8-block source to NVFP4A16 against the floor of its bytes (scripts/bench.py --source-scheme
#    FP8_BLOCK on the 8B shape; the bf16 checkpoint and its FP8-block copy are generated once in /tmp/w8), and a
#    profile of every thread of one such run (scripts/profile_site, OUTDIR/prof-fp8b.txt);
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
if [ -n "${PROFILE:-1}" ] && [ -d /tmp/w8/llama3-8b-bf16-fp8_block ]; then  # every thread of one requantizing run
  rm -rf /tmp/prof-fp8b /tmp/w8/out-prof
  CTPROF_DIR=/tmp/prof-fp8b PYTHONPATH=scripts/profile_site:${PYTHONPATH:-} timeout 120 python3 -m ctconvert --json quantize \
    /tmp/w8/llama3-8b-bf16-fp8_block -o /tmp/w8/out-prof --scheme NVFP4A16 --device cuda > "$OUT/prof-run-fp8b.json" 2>&1
  python3 scripts/profile_site/report.py /tmp/prof-fp8b --top 12 > "$OUT/prof-fp8b.txt" 2>&1
fi
rm -rf /tmp/w8/*-fp8_block /tmp/w8/out* 2>/dev/null
timeout 360 python3 scripts/bench_ray.py --model /tmp/w8/llama3-8b-bf16 --device cuda --repeat "${REPEAT:-2}" --schemes NVFP4A16 \
  --workdir /tmp/wr > "$OUT/ray.json" 2> "$OUT/ray.log"
echo "ray rc=$?"; tail -14 "$OUT/ray.log"
