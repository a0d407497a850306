#!/usr/bin/env python3
"""What pinning host memory costs on a GPU machine, and what it does to the device's copies meanwhile::

    python3 scripts/bench_pinned.py

Prints the time to pin buffers of 8 to 256 MiB (``torch.empty(..., pin_memory=True)``, 4 of each), then twenty
128 MiB host-to-device copies alone and while another thread pins 8 x 128 MiB. The executor's read pool pins one
buffer per batch size when first needed (``pipeline/buffers.py``), which is why batches stay small
(``pipeline/reads.py: BATCH_BYTES``). Needs CUDA.
"""

from __future__ import annotations

import threading
import time

import torch


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.zeros(1, device="cuda")
    for mib in (8, 32, 64, 128, 256):
        keep = []
        t = time.perf_counter()
        for _ in range(4):
            keep.append(torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True))
        dt = (time.perf_counter() - t) / 4
        print(f"pinned {mib} MiB: {dt * 1e3:.1f} ms each ({mib / 1024 / dt:.2f} GiB/s)", flush=True)
    src = torch.empty(128 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")

    def copies(n: int, out: list) -> None:
        t = time.perf_counter()
        for _ in range(n):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)

    alone: list = []
    copies(20, alone)
    beside: list = []
    th = threading.Thread(target=copies, args=(20, beside))
    th.start()
    keep = [torch.empty(128 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(8)]
    th.join()
    print(f"20 host-to-device copies of 128 MiB: {alone[0]:.3f} s alone, {beside[0]:.3f} s while 8 x 128 MiB were pinned ({len(keep)} kept)")


if __name__ == "__main__":
    main()
