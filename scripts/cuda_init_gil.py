#!/usr/bin/env python3
"""Does CUDA's initialisation on a thread keep the GIL? (The reason for ``ctconvert/pipeline/driver.py``.)

    python3 scripts/cuda_init_gil.py torch     # a thread calls torch.cuda.is_available(), then torch.empty(1, device="cuda")
    python3 scripts/cuda_init_gil.py ctypes    # the thread first makes cuInit and the primary context through ctypes

The main thread spins in Python meanwhile and records every gap over 2 ms between two of its iterations: a gap is
the time it could not run Python (the GIL held elsewhere). Prints the thread's call times and the main thread's gaps.
Run each mode in a fresh process (CUDA is initialised once per process). Needs an NVIDIA GPU.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time


def main() -> None:
    t0 = time.perf_counter()
    import torch

    print(f"import torch {time.perf_counter() - t0:.2f} s", flush=True)
    mode = sys.argv[1] if len(sys.argv) > 1 else "torch"
    said: list[str] = []

    def work() -> None:
        t = time.perf_counter()
        if mode == "ctypes":
            cu = ctypes.CDLL("libcuda.so.1")
            rc = cu.cuInit(0)
            t1 = time.perf_counter()
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            cu.cuDeviceGet(ctypes.byref(dev), 0)
            rc2 = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
            said.append(f"ctypes: cuInit {t1 - t:.3f} s (rc {rc}), primary context {time.perf_counter() - t1:.3f} s (rc {rc2})")
            t = time.perf_counter()
        torch.cuda.is_available()
        t1 = time.perf_counter()
        torch.empty(1, device="cuda")
        said.append(f"torch: is_available {t1 - t:.3f} s, first allocation {time.perf_counter() - t1:.3f} s")

    th = threading.Thread(target=work)
    gaps, last, start, n = [], time.perf_counter(), time.perf_counter(), 0
    th.start()
    while th.is_alive() or time.perf_counter() - start < 0.05:
        now = time.perf_counter()
        if now - last > 0.002:
            gaps.append(now - last)
        last, n = now, n + 1
    print(mode, "|", " | ".join(said))
    took = time.perf_counter() - start
    print(f"main thread: {n} iterations in {took:.3f} s; gaps over 2 ms: {len(gaps)}, {sum(gaps):.3f} s in all, largest {max(gaps, default=0):.3f} s")


if __name__ == "__main__":
    main()
