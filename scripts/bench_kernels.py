"""Time each quantize kernel on one large bf16 weight (no I/O). JSON lines on stdout.

    python scripts/bench_kernels.py [--rows 28672 --cols 8192] [--device cpu|cuda] [--impl auto|torch|native|triton]

CPU: wall time, median of --repeat runs. CUDA: CUDA events after warm-up, median
of --repeat runs. Throughput is bf16 input bytes per second. On CUDA, a device
copy of the weight is timed too: ``memory_bound_GBps`` is the input rate a
kernel would reach if it moved its bytes (input read + outputs written) at
copy speed, and ``of_bound`` the fraction of it reached.
"""

from __future__ import annotations

import argparse
import json

import torch

from ctconvert.formats.common import tensor_absmax
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.plan.schemes import get_scheme

from timing import median_seconds

SCHEMES = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16", "MXFP8A16"]


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
    copy_bps = None
    if dev.type == "cuda":  # yardstick: a device copy of the weight moves 2 x its bytes; each scheme is bounded by it
        dst = torch.empty_like(w)
        copy_bps = 2 * nbytes / median_seconds(lambda: dst.copy_(w), a.repeat, dev)  # bytes read + written per second
        print(json.dumps({"copy": True, "moved_GBps": copy_bps / 1e9}))
    for name in a.schemes.split(","):
        s = get_scheme(name)
        gs = nvfp4_global_scale(tensor_absmax(w), w.dtype).to(dev) if s.global_scale else None
        med = median_seconds(lambda: s.quantize_rows(w, gs, impl=a.impl), a.repeat, dev)
        doc = {"scheme": name, "device": a.device, "impl": a.impl, "shape": [a.rows, a.cols], "seconds": med, "GBps": nbytes / med / 1e9}
        if copy_bps:
            out = s.quantize_rows(w, gs, impl=a.impl)
            moved = nbytes + sum(t.numel() * t.element_size() for t in out.values())
            doc["memory_bound_GBps"] = copy_bps * nbytes / moved / 1e9  # input rate if the kernel moved its bytes at copy speed
            doc["of_bound"] = round(doc["GBps"] / doc["memory_bound_GBps"], 3)
        print(json.dumps(doc))


if __name__ == "__main__":
    main()
