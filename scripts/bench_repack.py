"""Repack benchmark: every quantized Linear of a checkpoint into a kernel layout, on one device.

    python scripts/bench_repack.py SRC_BF16 [--workdir /tmp/ctrepack] [--device cuda] [--schemes W4A16,FP8_DYNAMIC,NVFP4A16]

For each scheme: quantize SRC once (ctconvert), load every quantized module's
tensors onto the device, stacked by shape as ``ctconvert repack`` batches them,
then time the repack of all of them (``layouts.batched.repack_batch``, the
function the command runs; CUDA events after a warm-up pass, median of
--repeat passes). Reported: weight bytes (the compressed-tensors tensors read)
per second (``repack_TBps``), and all bytes read and written per second
(``moved_TBps``, to set against the HBM bandwidth), from CUDA events around
the whole repack (launch gaps included); on CUDA also the same from the sum
of the kernels' own durations (``kernel_*``, torch.profiler), and, as the
yardstick, a plain device-to-device copy of the same input bytes (``copy_*``). ``--per-module`` times the
per-module path instead (``kernels.repack_module``), for comparison. Then
time, as separate processes, ``ctconvert quantize`` and ``ctconvert quantize
--target marlin``. One JSON line per scheme.
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
from ctconvert.checkpoint.modules import modules_of
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import read_tensor
from ctconvert.layouts import batched, gpu, kernels
from ctconvert.plan import kernel_targets

from timing import median_seconds


def kernel_seconds(fn, table: bool = False) -> float:
    """GPU busy time of ``fn``: the sum of its kernels' durations (torch.profiler), without host gaps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = prof.key_averages()
    if table:
        print(evs.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60), file=sys.stderr)
    return sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) for e in evs) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--workdir", default="/tmp/ctrepack")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--schemes", default="W4A16,FP8_DYNAMIC,NVFP4A16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--per-module", action="store_true", help="time the per-module path instead of the batched one")
    ap.add_argument("--tune", action="store_true", help="sweep the Marlin tile kernel's block and warps (CUDA)")
    ap.add_argument("--profile", action="store_true", help="print the kernels' time table (CUDA)")
    ap.add_argument("--no-e2e", action="store_true", help="skip the quantize / quantize --target timings")
    a = ap.parse_args()
    dev = torch.device(a.device)
    default_tune = dict(gpu.TUNE)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    for scheme in a.schemes.split(","):
        q = work / f"q-{scheme}"
        if not q.exists():
            api.quantize(a.src, q, scheme, device=a.device)
        ck = open_checkpoint(q)
        mods = [m for m in modules_of(ck).values() if m.quantized and m.group]
        groups: dict[tuple, list] = {}
        for m in mods:
            kernel = kernel_targets.choose_kernel("marlin", m.weights or {}, set(m.parts))
            sig = (kernel, tuple(sorted((p, tuple(i.shape)) for p, i in m.parts.items())))
            groups.setdefault(sig, []).append(m)
        jobs = []
        nbytes = 0
        for (kernel, _), ms in groups.items():
            t = {p: torch.stack([read_tensor(x.parts[p]) for x in ms]).to(dev) for p in ms[0].parts}
            nbytes += sum(x.numel() * x.element_size() for x in t.values())
            jobs.append((kernel, t, ms[0].weights or {}))
        out_bytes = 0
        for kernel, t, w in jobs:
            outs, _ = batched.repack_batch(kernel, t, w, "0.33", torch.bfloat16)
            out_bytes += sum(x.numel() * x.element_size() for p, x in outs.items() if not p.endswith("_source"))

        def run_all():
            for kernel, t, w in jobs:
                if a.per_module:
                    for i in range(next(iter(t.values())).shape[0]):
                        kernels.repack_module(kernel, {p: x[i] for p, x in t.items()}, w, "0.33", torch.bfloat16)
                else:
                    batched.repack_batch(kernel, t, w, "0.33", torch.bfloat16)

        med = median_seconds(run_all, a.repeat, dev)
        kernel_s = copy_s = None
        if dev.type == "cuda":
            if a.tune:
                grid = [dict(bkt=b, num_warps=w) for b in (8, 16, 32, 64) for w in (4, 8)]
                if scheme.startswith("NVFP4"):
                    grid += [dict(scale_bg=g, scale_bp=p) for g, p in ((32, 64), (32, 256), (64, 64), (128, 64), (64, 256), (16, 512))]
                for cfg in grid:
                    gpu.TUNE.update(default_tune)
                    gpu.TUNE.update(cfg)
                    run_all()
                    print(json.dumps({"scheme": scheme, "tune": dict(gpu.TUNE), "kernel_seconds": kernel_seconds(run_all)}), flush=True)
                gpu.TUNE.update(default_tune)
            kernel_s = statistics.median(kernel_seconds(run_all) for _ in range(3))
            if a.profile:
                kernel_seconds(run_all, table=True)
            dst = [{p: torch.empty_like(x) for p, x in t.items()} for _, t, _ in jobs]

            def copy_all():  # the same bytes read and written by a plain device copy: what the memory allows
                for (_, t, _), d in zip(jobs, dst):
                    for p, x in t.items():
                        d[p].copy_(x)

            copy_all()
            copy_s = statistics.median(kernel_seconds(copy_all) for _ in range(3))
        walls = {}
        for label, extra in () if a.no_e2e else (("quantize", []), ("quantize_target_marlin", ["--target", "marlin"])):
            out = work / f"o-{scheme}-{label}"
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "ctconvert", "-q", "quantize", a.src, "-s", scheme, "-o", str(out), "--device", a.device, *extra], check=True)
            walls[label] = round(time.perf_counter() - t0, 3)
        print(
            json.dumps(
                {
                    "scheme": scheme,
                    "device": a.device,
                    "path": "per-module" if a.per_module else "batched",
                    "modules": len(mods),
                    "batches": len(jobs),
                    "weight_bytes": nbytes,
                    "output_bytes": out_bytes,
                    "repack_seconds": round(med, 6),
                    "repack_TBps": round(nbytes / med / 1e12, 3),
                    "moved_TBps": round((nbytes + out_bytes) / med / 1e12, 3),
                    "kernel_seconds": kernel_s and round(kernel_s, 6),
                    "kernel_TBps": kernel_s and round(nbytes / kernel_s / 1e12, 3),
                    "kernel_moved_TBps": kernel_s and round((nbytes + out_bytes) / kernel_s / 1e12, 3),
                    "copy_seconds": copy_s and round(copy_s, 6),
                    "copy_TBps": copy_s and round(nbytes / copy_s / 1e12, 3),
                    "wall_seconds": walls,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
