"""Shared timing for the benchmark scripts (not part of the package)."""

from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, repeat: int, device: torch.device | str = "cuda") -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after one warm-up run: CUDA events on a CUDA
    device (``fn``'s GPU time, synchronized after each run), ``time.perf_counter`` otherwise."""
    cuda = torch.device(device).type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
