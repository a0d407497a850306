#!/usr/bin/env bash
# One H200 call's worth of GPU checks (run from the checkout's root on the device machine):
#   scripts/device_check.sh OUTDIR
# 1. the CUDA cases of the test suite (formats, pipeline, layouts, commands, calibration, the conservation matrix);
# 2. CPU == CUDA: scripts/output_hashes.sh on a generated Llama (every scheme, --target, repack, decompress), both
#    devices, diffed; 3. the same command twice on CUDA gives the same bytes (output_hashes.sh run again).
# Writes OUTDIR/pytest.log, OUTDIR/hashes-{cpu,cuda,cuda2}.txt and prints a summary.
set -u
OUT=${1:?OUTDIR}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=/tmp/devcheck/model
python3 scripts/bench.py --make-model "$M" > /dev/null 2>&1 || { echo "cannot make the model"; exit 2; }
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/formats tests/pipeline tests/layouts tests/commands tests/calibration \
  $(ls tests/test_conservation.py 2>/dev/null) -k "cuda or gpu or triton or device" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? $(tail -1 "$OUT/pytest.log")"
scripts/output_hashes.sh . "$M" cpu > "$OUT/hashes-cpu.txt" 2>&1
scripts/output_hashes.sh . "$M" cuda > "$OUT/hashes-cuda.txt" 2>&1
scripts/output_hashes.sh . "$M" cuda > "$OUT/hashes-cuda2.txt" 2>&1
echo "runs: $(grep -c '^==' "$OUT/hashes-cpu.txt"), failed: $(grep '^==' "$OUT/hashes-cpu.txt" "$OUT/hashes-cuda.txt" | grep -vc 'rc=0')"
if diff -q "$OUT/hashes-cpu.txt" "$OUT/hashes-cuda.txt" > /dev/null; then echo "CPU == CUDA: identical"; else echo "CPU != CUDA:"; diff "$OUT/hashes-cpu.txt" "$OUT/hashes-cuda.txt" | head -20; fi
if diff -q "$OUT/hashes-cuda.txt" "$OUT/hashes-cuda2.txt" > /dev/null; then echo "CUDA twice: identical"; else echo "CUDA twice differs:"; diff "$OUT/hashes-cuda.txt" "$OUT/hashes-cuda2.txt" | head; fi
