#!/usr/bin/env bash
# One GPU call's worth of conversion-rate figures (run from the checkout's root on the device machine):
#   scripts/device_perf_check.sh OUTDIR [CASE ...]      CASE: dense | qwen3_moe | gpt_oss | fp8block (default: the first three)
# Per case: the 8B-sized benchmark checkpoint (dense Llama-3-8B shape; Qwen3-MoE or gpt-oss layout of ~11 GB; the dense
# one requantized from FP8-block), scripts/bench.py NVFP4A16 on the device (warm; floors from the same run) into
# OUTDIR/bench-CASE.{json,log}, then one profiled run of every thread (scripts/profile_site: raw JSON kept in
# OUTDIR/prof-CASE.tgz with the run's --json, report in OUTDIR/prof-CASE.txt). Each case's folder is removed after it (the disk is 64 GB).
# At the end everything in OUTDIR is packed into OUTDIR/perf.tgz (the device returns at most 8 files a call).
# Environment: REPEAT (2), SCHEMES (NVFP4A16), PROFILE (1; empty: none), BENCH_TIMEOUT (240 s a case).
set -u
OUT=${1:?OUTDIR}; shift
S=${SCHEMES:-NVFP4A16}
CASES=${*:-dense qwen3_moe gpt_oss}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null | head -2; nproc; df -h /tmp | tail -1
for C in $CASES; do
  W=/tmp/perf-$C
  case $C in
    dense) args=(--size 8b) ;;
    qwen3_moe | gpt_oss) args=(--size 8b --family "$C") ;;
    fp8block) args=(--size 8b --source-scheme FP8_BLOCK) ;;
    *) echo "unknown case $C"; continue ;;
  esac
  t0=$(date +%s)
  timeout "${BENCH_TIMEOUT:-240}" python3 scripts/bench.py --workdir "$W" "${args[@]}" --device cuda --schemes "$S" \
    --repeat "${REPEAT:-2}" --no-peer --no-kernels > "$OUT/bench-$C.json" 2> "$OUT/bench-$C.log"
  echo "== $C rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "^\[rep|ctconvert|GB/s" "$OUT/bench-$C.log" | head -12
  SRC=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['model'])" "$OUT/bench-$C.json" 2>/dev/null)
  if [ -n "${PROFILE-1}" ] && [ -n "$SRC" ] && [ -d "$SRC" ]; then
    extra=(); [ "$C" = gpt_oss ] && extra=(--allow-unloadable --targets Linear --targets 're:.*mlp\.experts\.\d+\..*')
    rm -rf "$W/out-prof"
    CTPROF_DIR="$OUT/prof-$C" PYTHONPATH=scripts/profile_site:${PYTHONPATH:-} timeout 120 python3 -m ctconvert --json quantize \
      "$SRC" -o "$W/out-prof" --scheme "${S%%,*}" --device cuda "${extra[@]}" > "$OUT/prof-run-$C.json" 2>&1
    python3 scripts/profile_site/report.py "$OUT/prof-$C" --top 14 > "$OUT/prof-$C.txt" 2>&1
    grep -E '"seconds"' "$OUT/prof-run-$C.json"
    tar czf "$OUT/prof-$C.tgz" -C "$OUT" "prof-$C" "prof-run-$C.json" && rm -rf "$OUT/prof-$C" "$OUT/prof-run-$C.json"
  fi
  rm -rf "$W"
done
(cd "$OUT" && tar czf perf.tgz --exclude=perf.tgz ./* && find . -mindepth 1 ! -name perf.tgz -delete)
