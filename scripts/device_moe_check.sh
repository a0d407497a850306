#!/usr/bin/env bash
# One GPU call's worth of MoE checks (run from the checkout's root on the device machine):
#   scripts/device_moe_check.sh OUTDIR [FAMILY ...]
# 1. the CUDA cases of the expert-batching tests (pipeline/test_batches.py, formats/test_nvfp4_rows.py,
#    checkpoint/test_safetensors_io.py);
# 2. per family (default: gpt_oss qwen3_moe), the 11.2 GB benchmark checkpoint converted to NVFP4A16 with batching
#    off and on, interleaved, outputs compared file for file (scripts/bench_batches.py), and one profile of every
#    thread of a batched run (scripts/profile_site) written to OUTDIR/prof-FAMILY.txt.
# Each family's folder is removed after it (the device machine's disk is 64 GB).
set -u
OUT=${1:?OUTDIR}; shift
FAMILIES=${*:-gpt_oss qwen3_moe}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null | head -2
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/pipeline/test_batches.py tests/formats/test_nvfp4_rows.py \
  tests/checkpoint/test_safetensors_io.py -k cuda > "$OUT/pytest-batches.log" 2>&1
echo "pytest rc=$? $(tail -1 "$OUT/pytest-batches.log")"
grep -E "FAILED|Error" "$OUT/pytest-batches.log" | head -10
for F in $FAMILIES; do
  W=/tmp/bb-$F
  timeout 420 python3 scripts/bench_batches.py --family "$F" --device cuda --repeat "${REPEAT:-2}" --workdir "$W" > "$OUT/bb-$F.log" 2>&1
  echo "== $F rc=$?"; grep -E "rep|identical|min_call|gb_per_s|Error|error" "$OUT/bb-$F.log" | head -20
  if [ -n "${PROFILE:-1}" ] && [ -d "$W/src-$F-8b-1.0" ]; then
    rm -rf /tmp/prof-$F "$W/out-prof"
    extra=""; [ "$F" = gpt_oss ] && extra="--allow-unloadable --targets Linear --targets re:.*mlp\\.experts\\.\\d+\\..*"
    CTPROF_DIR=/tmp/prof-$F PYTHONPATH=scripts/profile_site:${PYTHONPATH:-} timeout 120 python3 -m ctconvert --json quantize \
      "$W/src-$F-8b-1.0" -o "$W/out-prof" --scheme NVFP4A16 --device cuda $extra > "$OUT/prof-run-$F.json" 2>&1
    python3 scripts/profile_site/report.py /tmp/prof-$F --top 12 > "$OUT/prof-$F.txt" 2>&1
  fi
  rm -rf "$W"
done
