#!/usr/bin/env python3
"""Time the weight observers against min/max: search + quantize of one random tensor; on CUDA also the GPU
search against the CPU path, bit for bit, and whole conversions.

    PYTHONPATH=$PWD python3 scripts/bench_observers.py [--rows 1024] [--cols 4096] [--impl auto|torch|native]
    PYTHONPATH=$PWD python3 scripts/bench_observers.py --imatrix [--rows 1024 --cols 4096 --repeat 3]
    PYTHONPATH=$PWD python3 scripts/bench_observers.py --device cuda [--rows 14336 --cols 4096]
    PYTHONPATH=$PWD python3 scripts/bench_observers.py --device cuda --e2e [--workdir /tmp/obsbench]

CPU (default): per (scheme, observer; the imatrix ones with a random importance), the seconds of the min/max quantization, of the search and of the
quantization from its ranges, the ratio to min/max, and the search's ns per element and grid step.
``--imatrix``: the imatrix observers (random importance, and none: the uniform fallback) on bf16 and fp16, min of
``--repeat``: min/max quantization, the torch search, the C kernel's search (``ct_imatrix_search``), each search's
ratio to min/max, the kernel's speed-up over torch, and whether the two searches are identical (``same``; exit 1 if not).
``--device cuda``: per (scheme, observer, dtype), the GPU search's seconds (synchronized, after a warm-up),
the groups its kernel left to be settled exactly, the CPU path's seconds, and whether every field of the two
searches (ranges, steps, improvements, hits) is identical (``same``). ``--e2e``: ``quantize --device cuda``
of Llama-3-8B's shape (scripts/bench.py's generated checkpoint, 16 GB) with NVFP4A16, min/max against
``nvfp4_expanded_mse`` (call seconds from ``--json``, process wall, their ratio; target <= 1.5x), then the
output of a one-layer checkpoint of the same shapes converted with the observer on the CPU and on CUDA,
compared file by file (sha256). The exit code is 1 if anything differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ctconvert.formats import WeightArgs, get_format  # noqa: E402
from ctconvert.formats.common import tensor_absmax  # noqa: E402
from ctconvert.formats.fp4 import nvfp4_global_scale  # noqa: E402
from ctconvert.formats.observers import OBSERVERS, Importance, range_absmax  # noqa: E402

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


def cpu_table(a) -> int:
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
    return 0


def _same(x, y) -> bool:
    if x is None or y is None:
        return x is None and y is None
    x, y = x.cpu(), y.cpu()
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.is_floating_point() else torch.equal(x, y)


def gpu_table(a) -> int:
    from ctconvert.formats.observers import gpu_search

    bad = 0
    print(f"[{a.rows}, {a.cols}] on {torch.cuda.get_device_name()}, CPU path with {torch.get_num_threads()} threads")
    for scheme, _name, args, obs_name in CASES[:3]:
        obs = OBSERVERS[obs_name]
        for dtype in (torch.bfloat16, torch.float16):
            g = torch.Generator().manual_seed(0)
            w = ((torch.randn(a.rows, a.cols, generator=g) * 0.02) * torch.rand(a.rows, 1, generator=g)).to(dtype)
            wd = w.cuda()
            obs.search(wd[:64], args)  # compile
            torch.cuda.synchronize()
            t = time.perf_counter()
            got = obs.search(wd, args)
            torch.cuda.synchronize()
            gpu_t = time.perf_counter() - t
            launch = gpu_search._Launch(obs, args, wd, obs.total_steps)
            torch.cuda.synchronize()
            t = time.perf_counter()
            unsure = int(launch.run(wd.reshape(-1, args.group_size))["unsure"].sum())
            kernel_t = time.perf_counter() - t
            cpu_t, ref = _time(lambda: obs.search(w, args))  # noqa: B023
            same = all(_same(x, y) for x, y in zip((got.min, got.max, got.step, got.improved, got.hits), (ref.min, ref.max, ref.step, ref.improved, ref.hits)))
            bad += not same
            groups = got.step.numel()
            rate = w.numel() * max(1, got.improved.numel()) / gpu_t / 1e9
            print(
                f"{scheme:10s} {obs_name:20s} {str(dtype)[6:]:9s} GPU {gpu_t:7.3f}s (kernel {kernel_t:6.3f}s, {rate:6.1f} G elem-steps/s)"
                f"  settled {unsure}/{groups} groups ({unsure / groups:.2%})  CPU {cpu_t:7.2f}s  same {same}"
            )
    return 1 if bad else 0


def tune(a) -> None:
    """The kernel alone (no settling) per launch configuration of ``gpu_search.TUNE``, bf16 NVFP4, 111 steps."""
    from ctconvert.formats.observers import gpu_search

    obs, args = OBSERVERS["nvfp4_expanded_mse"], CASES[0][2]
    w = (torch.randn(a.rows, a.cols, device="cuda") * 0.02).to(torch.bfloat16)
    xg = w.reshape(-1, 16)
    for elems in (512, 1024, 2048):
        for warps in (2, 4, 8):
            gpu_search.TUNE.update(elems=elems, num_warps=warps)
            launch = gpu_search._Launch(obs, args, w, obs.total_steps)
            launch.run(xg)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(3):
                launch.run(xg)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) / 3
            print(f"tune elems {elems:5d} warps {warps}: {dt * 1e3:7.2f} ms, {w.numel() * obs.total_steps / dt / 1e9:6.1f} G elem-steps/s")
    gpu_search.TUNE.update(elems=1024, num_warps=4)


def _quantize(src: Path, out: Path, device: str, observer: str, scheme: str) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "ctconvert", "--json", "quantize", str(src), "-o", str(out), "--scheme", scheme, "--device", device, "--observer", observer]
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode:
        sys.exit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)["seconds"], wall


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in (".safetensors", ".json")}


def e2e(a) -> int:
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    work = Path(a.workdir)
    big = bench.make_model(work / "llama3-8b-bf16", size="8b")
    times = {}
    for rep in range(a.repeat):
        for obs in ("minmax", "nvfp4_expanded_mse"):
            call, wall = _quantize(big, work / "out", "cuda", obs, "NVFP4A16")
            best = times.get(obs, (1e9, 1e9))
            times[obs] = (min(best[0], call), min(best[1], wall))
            print(f"[rep {rep + 1}] 8B NVFP4A16 {obs}: call {call:.2f}s, process {wall:.2f}s", flush=True)
    (c0, w0), (c1, w1) = times["minmax"], times["nvfp4_expanded_mse"]
    print(f"8B NVFP4A16 nvfp4_expanded_mse / minmax (min of {a.repeat}): call {c1:.2f}/{c0:.2f}s = {c1 / c0:.2f}x, process {w1:.2f}/{w0:.2f}s = {w1 / w0:.2f}x")
    bench.CONFIG_8B = dict(bench.CONFIG_8B, num_hidden_layers=a.layers, vocab_size=1024)
    small = bench.make_model(work / f"llama3-8b-{a.layers}layer", shards=1, size="8b")
    bad = 0
    for scheme, obs in (("NVFP4A16", "nvfp4_expanded_mse"), ("W4A16", "memoryless_mse")):
        outs = {}
        for dev in ("cuda", "cpu"):
            call, _ = _quantize(small, work / f"small-{dev}", dev, obs, scheme)
            outs[dev] = _hashes(work / f"small-{dev}")
            print(f"{a.layers}-layer 8B shape {scheme} {obs} on {dev}: call {call:.2f}s", flush=True)
        diff = [k for k in outs["cpu"] if outs["cpu"][k] != outs["cuda"].get(k)]
        bad += bool(diff) or outs["cpu"].keys() != outs["cuda"].keys()
        verdict = "identical to" if not diff else "DIFFERS from"
        print(f"{scheme} {obs}: CUDA output {verdict} the CPU output ({len(outs['cpu'])} files{', ' + ', '.join(diff) if diff else ''})")
    return 1 if bad else 0


def _best(fn, repeat: int) -> tuple[float, object]:
    """The minimum seconds of ``repeat`` calls of ``fn`` (a loaded machine), and its last result."""
    times, out = [], None
    for _ in range(repeat):
        t, out = _time(fn)
        times.append(t)
    return min(times), out


def imatrix_table(a) -> int:
    """The imatrix rows: min/max against the torch search and the C kernel, the same run, min of repeats."""
    print(f"[{a.rows}, {a.cols}], {torch.get_num_threads()} threads, min of {a.repeat}")
    differ = 0
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        w = (torch.randn(a.rows, a.cols) * 0.02).to(dtype)
        for scheme, name, args, obs_name in CASES:
            if not OBSERVERS[obs_name].needs_data:
                continue
            fmt = get_format(name)
            gs = nvfp4_global_scale(tensor_absmax(w), w.dtype) if fmt.needs_global_scale else None
            base, _ = _best(lambda: fmt.quantize(w, args, gs), a.repeat)  # noqa: B023
            for label, stat in (("weighted", Importance(torch.rand(a.cols) ** 4, 1)), ("uniform", None)):
                obs = OBSERVERS[obs_name].with_importance(stat)
                t_torch, ref = _best(lambda: obs.search(w, args, impl="torch"), a.repeat)  # noqa: B023
                t_nat, got = _best(lambda: obs.search(w, args, impl="native"), a.repeat)  # noqa: B023
                same = all(torch.equal(x, y) for x, y in ((ref.min, got.min), (ref.max, got.max), (ref.step, got.step), (ref.improved, got.improved)))
                differ += not same
                print(
                    f"{scheme:9s} {obs_name:23s} {str(dtype)[6:]:8s} {label:8s} minmax {base:7.4f}s  torch {t_torch:7.2f}s ({t_torch / base:6.0f}x)"
                    f"  native {t_nat:7.3f}s ({t_nat / base:5.0f}x)  speed-up {t_torch / t_nat:5.1f}x  same {same}"
                )
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--impl", default="auto", choices=["auto", "torch", "native"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--e2e", action="store_true", help="whole conversions (CUDA): 8B wall times and CPU == CUDA bytes")
    ap.add_argument("--workdir", default="/tmp/obsbench")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1, help="layers of the checkpoint whose CPU and CUDA outputs are compared")
    ap.add_argument("--tune", action="store_true", help="time the kernel per launch configuration (CUDA)")
    ap.add_argument("--imatrix", action="store_true", help="the imatrix observers: torch search against the C kernel (CPU)")
    a = ap.parse_args()
    if a.imatrix:
        return imatrix_table(a)
    if a.device == "cpu":
        return cpu_table(a)
    if a.tune:
        tune(a)
        return 0
    return e2e(a) if a.e2e else gpu_table(a)


if __name__ == "__main__":
    sys.exit(main())
