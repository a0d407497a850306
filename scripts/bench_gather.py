#!/usr/bin/env python3
"""Is gathering gpt-oss's fused experts a bound? Times, on one device, one batch's gather of transposed expert regions
into the ``[B, M, R, K]`` values that are quantized (``pipeline/batches.py: batch_values``), against the batch's NVFP4
quantize launch and a tiled Triton transpose (CUDA only, for comparison: not used by the package)::

    python3 scripts/bench_gather.py [cuda|cpu]

Shapes: the benchmark's gpt-oss (``bench.py --family gpt_oss``: hidden 2048, expert intermediate 768), a 32 MiB
batch: 5 ``gate_up_proj`` regions [2048, 1536] (gate and up interleaved columns) and 10 ``down_proj`` regions
[768, 2048]. Prints milliseconds per batch (CUDA events; mean of 20) and the read+write GB/s of each copy; checks
that every way gives the same values.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ctconvert.formats.fp4 import nvfp4_global_scale  # noqa: E402
from ctconvert.pipeline.batches import batch_values  # noqa: E402
from ctconvert.plan.schemes import get_scheme  # noqa: E402

HIDDEN, INTER = 2048, 768


def _time(dev: str, fn, n: int = 20) -> float:
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / n / 1e3
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def _triton_gather():
    import triton
    import triton.language as tl

    @triton.jit
    def gather(src, dst, ROWS, COLS, M: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """dst[b, c % M, c // M, r] = src[b, r, c]: a tile read along c, transposed in registers, written along r."""
        b = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        mask = (r[:, None] < ROWS) & (c[None, :] < COLS)
        v = tl.load(src + b * ROWS * COLS + r[:, None] * COLS + c[None, :], mask=mask)
        off = b * ROWS * COLS + (c[:, None] % M) * (COLS // M) * ROWS + (c[:, None] // M) * ROWS + r[None, :]
        tl.store(dst + off, tl.trans(v), mask=tl.trans(mask))

    return triton, gather


def main() -> None:
    dev = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    from ctconvert.checkpoint.safetensors_io import SliceView, TensorInfo

    scheme = get_scheme("NVFP4A16")
    g = torch.Generator().manual_seed(0)
    for name, b, rows, cols, m in (("gate_up", 5, HIDDEN, 2 * INTER, 2), ("down", 10, INTER, HIDDEN, 1)):
        per = cols // m
        infos = [
            [
                TensorInfo(f"e{u}.{j}", Path("x"), "BF16", (per, rows), u * rows * cols * 2, per * rows * 2, base="e", view=SliceView(rows, cols, True, j, m))
                for j in range(m)
            ]
            for u in range(b)
        ]
        regions = torch.randn(b, rows, cols, generator=g).to(torch.bfloat16).to(dev)
        data = regions.reshape(-1).view(torch.uint8)
        want = regions.view(b, rows, per, m).permute(0, 3, 2, 1)
        x = batch_values(infos, data)
        assert torch.equal(x, want), name
        gb = regions.numel() * 2 * 2 / 1e9
        t = _time(dev, lambda infos=infos, data=data: batch_values(infos, data))
        flat = x.reshape(-1, rows)
        gs = nvfp4_global_scale(flat.float().abs().amax().reshape(1), x.dtype)
        tq = _time(dev, lambda flat=flat, gs=gs: scheme.quantize_rows(flat, gs))
        print(f"{name}: {b} regions [{rows}, {cols}]: batch_values {t * 1e3:.3f} ms ({gb / t:.0f} GB/s), the batch's quantize {tq * 1e3:.3f} ms")
        if dev == "cuda":
            triton, gather = _triton_gather()
            out = torch.empty_like(x)
            grid = (triton.cdiv(rows, 64), triton.cdiv(cols, 64), b)
            tt = _time(dev, lambda regions=regions, out=out, grid=grid: gather[grid](regions, out, rows, cols, M=m, BR=64, BC=64, num_warps=4))
            assert torch.equal(out, want), name
            print(f"   a tiled Triton transpose: {tt * 1e3:.3f} ms ({gb / tt:.0f} GB/s)")


if __name__ == "__main__":
    main()
