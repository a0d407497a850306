"""Repack benchmark: every quantized Linear of a checkpoint into a kernel layout, on one device.

    python scripts/bench_repack.py SRC_BF16 [--workdir /tmp/ctrepack] [--device cuda] [--schemes W4A16,FP8_DYNAMIC,NVFP4A16]

For each scheme: quantize SRC once (ctconvert), load every quantized module's
tensors onto the device, then time ``repack_module`` over all of them (CUDA
events after a warm-up pass, median of --repeat passes) and report weight
bytes (the compressed tensors read) per second. Then time, as separate
processes, ``ctconvert quantize`` and ``ctconvert quantize --target marlin``.
One JSON line per scheme.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ctconvert import api
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import read_tensor
from ctconvert.layouts import targets
from ctconvert.modules import modules_of


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--workdir", default="/tmp/ctrepack")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--schemes", default="W4A16,FP8_DYNAMIC,NVFP4A16")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device(a.device)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    for scheme in a.schemes.split(","):
        q = work / f"q-{scheme}"
        if not q.exists():
            api.quantize(a.src, q, scheme, device=a.device)
        ck = open_checkpoint(q)
        mods = [m for m in modules_of(ck).values() if m.quantized and m.group]
        jobs = []
        nbytes = 0
        for m in mods:
            kernel = targets.choose_kernel("marlin", m.format, m.weights or {}, set(m.parts))
            t = {p: read_tensor(i).to(dev) for p, i in m.parts.items()}
            nbytes += sum(x.numel() * x.element_size() for x in t.values())
            jobs.append((kernel, t, m.weights or {}, m.format))

        def run_all():
            for kernel, t, w, fmt in jobs:
                targets.repack_module(kernel, t, w, fmt, "0.33", torch.bfloat16)

        run_all()
        times = []
        for _ in range(a.repeat):
            if dev.type == "cuda":
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                run_all()
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1) / 1000)
            else:
                t0 = time.perf_counter()
                run_all()
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        walls = {}
        for label, extra in (("quantize", []), ("quantize_target_marlin", ["--target", "marlin"])):
            out = work / f"o-{scheme}-{label}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "ctconvert", "-q", "quantize", a.src, "-s", scheme, "-o", str(out), "--device", a.device, *extra],
                           check=True)
            walls[label] = round(time.perf_counter() - t0, 3)
        print(json.dumps({"scheme": scheme, "device": a.device, "modules": len(jobs), "weight_bytes": nbytes, "repack_seconds": round(med, 5),
                          "repack_TBps": round(nbytes / med / 1e12, 3), "wall_seconds": walls}), flush=True)


if __name__ == "__main__":
    main()
