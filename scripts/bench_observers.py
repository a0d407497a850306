#!/usr/bin/env python3
"""Time the weight observers against min/max on the CPU: search + quantize of one random bf16 tensor.

    PYTHONPATH=$PWD python3 scripts/bench_observers.py [--rows 1024] [--cols 4096] [--impl auto|torch|native]

Prints, per (scheme, observer; the imatrix ones with a random importance), the seconds of the min/max quantization, of the search and of the
quantization from its ranges, the ratio to min/max, and the search's ns per element and grid step.
"""

from __future__ import annotations

import argparse
import time

import torch

from ctconvert.formats import WeightArgs, get_format
from ctconvert.formats.common import tensor_absmax
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.formats.observers import OBSERVERS, Importance, range_absmax

CASES = [
    ("NVFP4A16", "nvfp4-pack-quantized", WeightArgs(type="float", num_bits=4, strategy="tensor_group", group_size=16), "nvfp4_expanded_mse"),
    ("W4A16", "pack-quantized", WeightArgs(type="int", num_bits=4, strategy="group", group_size=128), "memoryless_mse"),
    ("MXFP4A16", "mxfp4-pack-quantized", WeightArgs(type="float", num_bits=4, strategy="group", group_size=32), "memoryless_mse"),
    ("FP8_DYNAMIC", "float-quantized", WeightArgs(type="float", num_bits=8, strategy="channel"), "memoryless_mse"),
    ("W4A16", "pack-quantized", WeightArgs(type="int", num_bits=4, strategy="group", group_size=128), "imatrix_mse"),
    ("NVFP4A16", "nvfp4-pack-quantized", WeightArgs(type="float", num_bits=4, strategy="tensor_group", group_size=16), "nvfp4_expanded_imatrix"),
]


def _time(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--impl", default="auto", choices=["auto", "torch", "native"])
    a = ap.parse_args()
    torch.manual_seed(0)
    w = (torch.randn(a.rows, a.cols) * 0.02).to(torch.bfloat16)
    print(f"bf16 [{a.rows}, {a.cols}], {torch.get_num_threads()} threads, impl {a.impl}")
    for scheme, name, args, obs_name in CASES:
        fmt, obs = get_format(name), OBSERVERS[obs_name]
        if obs.needs_data:  # a random importance per input channel, as a calibration pass would give (torch search)
            obs = obs.with_importance(Importance(torch.rand(a.cols) ** 4, 1))
        gs = nvfp4_global_scale(tensor_absmax(w), w.dtype) if fmt.needs_global_scale else None
        base, _ = _time(lambda: fmt.quantize(w, args, gs))  # noqa: B023
        impl = a.impl if args.strategy in ("group", "tensor_group") else "torch"  # no C search per channel
        found_t, found = _time(lambda: obs.search(w, args, impl=impl))  # noqa: B023
        gs2 = nvfp4_global_scale(range_absmax(*found.ranges), w.dtype) if fmt.needs_global_scale else None
        quant_t, _ = _time(lambda: fmt.quantize(w, args, gs2, ranges=found.ranges))  # noqa: B023
        steps = max(1, found.improved.numel())
        per = found_t / (w.numel() * steps) * 1e9
        print(
            f"{scheme:12s} {obs_name:20s} minmax {base:7.3f}s  search {found_t:7.2f}s ({impl}, {steps} steps, {per:.1f} ns/elem/step)"
            f"  quantize {quant_t:6.3f}s  ratio {(found_t + quant_t) / base:6.0f}x"
        )


if __name__ == "__main__":
    main()
