#!/usr/bin/env bash
# Hash every output file of a fixed set of conversions, to compare two versions of ctconvert byte for byte.
#   scripts/output_hashes.sh CODE_DIR [MODEL] [DEVICE] > hashes.txt
# CODE_DIR: a checkout (its ctconvert/ is put first on PYTHONPATH); MODEL: a bf16 checkpoint (default: the
# 1.2B one `scripts/bench.py --make-model /tmp/ctbench/model` generates); DEVICE: cpu (default) or cuda.
# Runs the 8 schemes, --lm-head nvfp4a16 and fp8, --target marlin (W4A16, NVFP4A16), repack of
# W4A16_ASYM and of FP8 (fp16) and decompress (FP8, W4A16_ASYM, NVFP4A16, MXFP4A16; --dtype fp16/fp32); prints "== NAME rc=N" then "file sha256" per output file
# (the provenance is hashed without its source path). Compare two runs with diff.
set -u
CODE=$(cd "$1" && pwd); M=$(realpath -m "${2:-/tmp/ctbench/model}"); DEV=${3:-cpu}
[ -f "$M/model.safetensors.index.json" ] || python3 "$CODE/scripts/bench.py" --make-model "$M" > /dev/null
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
# run from the temp folder: `python -m` puts the working directory before PYTHONPATH (a checkout there would win)
ct() { (cd "$W" && PYTHONPATH="$CODE" python3 -m ctconvert -q "$@"); }
hashes() { (cd "$W/o" 2>/dev/null && for f in $(ls | sort); do
  if [ "$f" = ctconvert-provenance.json ]; then
    echo "$f $(python3 -c "import json,sys,hashlib;d=json.load(open('$f'));d.pop('source',None);print(hashlib.sha256(json.dumps(d,sort_keys=True).encode()).hexdigest())")"
  else echo "$f $(sha256sum "$f" | cut -c1-64)"; fi; done); }
run() { name=$1; shift; rm -rf "$W/o"; ct "$@" > /dev/null 2>&1; echo "== $name rc=$?"; hashes; }
for s in FP8_DYNAMIC FP8_BLOCK W8A8 W4A16 W4A16_ASYM W8A16 NVFP4A16 MXFP4A16; do run "$s" quantize "$M" -o "$W/o" --scheme $s --device $DEV; done
run nvfp4-lmhead quantize "$M" -o "$W/o" --scheme NVFP4A16 --lm-head nvfp4a16 --device $DEV
run fp8-lmhead quantize "$M" -o "$W/o" --scheme FP8_DYNAMIC --lm-head fp8 --device $DEV
run w4-marlin quantize "$M" -o "$W/o" --scheme W4A16 --target marlin --device $DEV
run nvfp4-marlin quantize "$M" -o "$W/o" --scheme NVFP4A16 --target marlin --device $DEV
ct quantize "$M" -o "$W/w4" --scheme W4A16_ASYM --device $DEV
run repack-asym repack "$W/w4" -o "$W/o" --target marlin --device $DEV
ct quantize "$M" -o "$W/fp8" --scheme FP8_DYNAMIC --device $DEV
run repack-fp8 repack "$W/fp8" -o "$W/o" --target marlin --device $DEV --act-dtype fp16
run decompress-fp8 decompress "$W/fp8" -o "$W/o"
run decompress-fp8-fp32 decompress "$W/fp8" -o "$W/o" --dtype fp32
run decompress-w4asym decompress "$W/w4" -o "$W/o"
ct quantize "$M" -o "$W/nv" --scheme NVFP4A16 --device $DEV
run decompress-nvfp4-fp16 decompress "$W/nv" -o "$W/o" --dtype fp16
ct quantize "$M" -o "$W/mx" --scheme MXFP4A16 --device $DEV
run decompress-mxfp4 decompress "$W/mx" -o "$W/o"
