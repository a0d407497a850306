"""Time each quantize kernel on one large bf16 weight (no I/O). JSON lines on stdout.

    python scripts/bench_kernels.py [--rows 28672 --cols 8192] [--device cpu|cuda] [--impl auto|torch|native|triton]

CPU: wall time, median of --repeat runs. CUDA: CUDA events after warm-up, median
of --repeat runs. Throughput is bf16 input bytes per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ctconvert.formats.common import tensor_absmax
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.schemes import get_scheme

SCHEMES = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    a = ap.parse_args()
    dev = torch.device(a.device)
    w = (torch.randn(a.rows, a.cols, device=dev) * 0.02).to(torch.bfloat16)
    nbytes = w.numel() * 2
    for name in a.schemes.split(","):
        s = get_scheme(name)
        gs = nvfp4_global_scale(tensor_absmax(w), w.dtype).to(dev) if s.global_scale else None
        times = []
        for i in range(a.repeat + 1):
            if dev.type == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                s.quantize_rows(w, gs, impl=a.impl)
                e1.record()
                torch.cuda.synchronize()
                dt = e0.elapsed_time(e1) / 1000
            else:
                t0 = time.perf_counter()
                s.quantize_rows(w, gs, impl=a.impl)
                dt = time.perf_counter() - t0
            if i:  # the first run is warm-up
                times.append(dt)
        med = statistics.median(times)
        print(json.dumps({"scheme": name, "device": a.device, "impl": a.impl, "shape": [a.rows, a.cols], "seconds": med, "GBps": nbytes / med / 1e9}))


if __name__ == "__main__":
    main()
