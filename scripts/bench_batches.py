#!/usr/bin/env python3
"""A/B of expert batching (``pipeline/batches.py``): the same conversion with ``CTCONVERT_BATCH=0`` and ``=1``,
interleaved, each output compared file for file, the minimum call and process seconds of each, and the GB/s::

    python3 scripts/bench_batches.py --family qwen3_moe --device cuda [--repeat 3] [--scheme NVFP4A16] [--workdir DIR]
    python3 scripts/bench_batches.py --model DIR --device cuda

``--variants "base:;noahead:CTCONVERT_READAHEAD=0"`` compares other settings instead (``LABEL:NAME=VALUE ...``,
separated by ``;``; every output compared with the first's; a word starting ``--`` or without ``=`` is a quantize
option of that setting, e.g. ``"one:;four:--max-shard-size 1GB"``; ``OUTDIR=DIR`` writes that setting's output under
``DIR`` instead of ``--workdir``, e.g. ``"disk:;tmpfs:OUTDIR=/dev/shm/bb"``: a run without the disk's writeback);
``--settle`` waits before each run until the disk has written back what the runs before it left (``os.sync``,
then ``/proc/meminfo``), so that no run pays for another's writeback; ``--rotate`` puts each setting first in turn;
a label ``NAME@DIR`` runs the ctconvert package found in
``DIR`` (another tree of the project, e.g. ``git archive`` of an earlier commit), as ``python -m ctconvert`` there.
``--family``/``--size``/``--scale``/``--layers`` generate the
checkpoint as ``scripts/bench.py --make-model`` does (gpt-oss with its experts targeted, as bench.py runs it);
``--model`` takes one. The page cache is warmed by reading the source once first. Each setting's output folder
(``out-LABEL``) is replaced by its next run. Prints one line per run and a JSON
summary (``min_call``, ``min_process``, ``gb_per_s`` per setting, ``identical``). Exit 1 when two outputs differ.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import FAMILY_ARGS, make_model  # noqa: E402


def _differ(a: Path, b: Path) -> list[str]:
    """The files of output folders ``a`` and ``b`` that differ (in one only, or other bytes); empty when identical."""
    cmp = filecmp.dircmp(a, b)
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return sorted({*cmp.left_only, *cmp.right_only, *cmp.funny_files, *mismatch, *errors})


def _dirty_bytes() -> int:
    """Dirty and under-writeback page-cache bytes of the machine (``/proc/meminfo``; 0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("Dirty", "Writeback")}
    except (OSError, ValueError):
        return 0
    return sum(kb.values()) * 1024


def settle(limit_s: float = 20.0) -> float:
    """Wait until the disk has written back what earlier runs left dirty: ``os.sync()``, then until ``/proc/meminfo``'s
    Dirty + Writeback is under 64 MiB (at most ``limit_s``). So a run does not pay for its predecessor's writeback, which
    moved runs by up to 2.4 s depending on their place in a repeat. Returns the seconds it waited."""
    t0 = time.monotonic()
    os.sync()
    while _dirty_bytes() > 64 * 2**20 and time.monotonic() - t0 < limit_s:
        time.sleep(0.05)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--family", default="qwen3_moe", choices=("llama", "qwen3_moe", "qwen3_moe_fused", "gpt_oss"))
    ap.add_argument("--size", default="8b", choices=("1b", "8b"))
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=None, help="MoE families: decoder layers (bench.py --layers; 12: the dense 8B's size)")
    ap.add_argument("--scheme", default="NVFP4A16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench-batches"))
    ap.add_argument("--settle", action="store_true", help="before each run, wait until the disk has written back what runs left dirty (os.sync, /proc/meminfo)")
    ap.add_argument("--rotate", action="store_true", help="rotate the settings' order from one repeat to the next")
    ap.add_argument("--variants", default="0:CTCONVERT_BATCH=0;1:CTCONVERT_BATCH=1", help="LABEL:NAME=VALUE NAME=VALUE;LABEL:... (the settings compared)")
    a = ap.parse_args()
    variants = {}
    for part in a.variants.split(";"):
        label, _, kv = part.partition(":")
        variants[label] = kv.split()
    a.workdir.mkdir(parents=True, exist_ok=True)
    src = a.model or make_model(
        a.workdir / f"src-{a.family}-{a.size}-{a.scale}{f'-l{a.layers}' if a.layers else ''}", size=a.size, family=a.family, scale=a.scale, layers=a.layers
    )
    nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    for f in src.glob("*.safetensors"):  # warm the page cache
        with open(f, "rb") as h:
            while h.read(64 << 20):
                pass
    extra = FAMILY_ARGS.get(a.family, []) if a.model is None else []
    runs: dict[str, list[tuple[float, float]]] = {b: [] for b in variants}
    identical = True
    outs: dict[str, Path] = {}
    for rep in range(a.repeat):
        order = list(variants)
        if a.rotate:  # each setting first in turn: no setting always runs right after the same one
            order = order[rep % len(order) :] + order[: rep % len(order)]
        for b in order:
            env = dict(x.split("=", 1) for x in variants[b] if "=" in x and not x.startswith("-"))
            out = Path(env.pop("OUTDIR", a.workdir)) / f"out-{b.partition('@')[0]}"
            shutil.rmtree(out, ignore_errors=True)
            if a.settle:
                settle()
            outs[b] = out
            args = [x for x in variants[b] if "=" not in x or x.startswith("-")]  # quantize options of this setting
            cmd = [sys.executable, "-m", "ctconvert", "--json", "quantize", str(src), "-o", str(out), "--scheme", a.scheme, "--device", a.device, *extra, *args]
            t0 = time.monotonic()
            tree = b.partition("@")[2] or None  # NAME@DIR: the package of another tree
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **env), cwd=tree)
            wall = time.monotonic() - t0
            if p.returncode:
                print(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}", file=sys.stderr)
                return p.returncode
            call = json.loads(p.stdout)["seconds"]
            runs[b].append((call, wall))
            print(f"[rep {rep + 1}] {b} {variants[b]}: call {call:.2f} s, process {wall:.2f} s", flush=True)
        labels = list(variants)
        differ = {x: d for x in labels[1:] if (d := _differ(outs[labels[0]], outs[x]))}
        identical &= not differ
        said = "; ".join(f"{x}: {', '.join(d[:4])}{' ...' if len(d) > 4 else ''}" for x, d in differ.items())
        print(f"[rep {rep + 1}] outputs {'DIFFER from ' + labels[0] + ' (' + said + ')' if differ else 'identical'}", flush=True)
    summary = {
        "source": str(src),
        "source_bytes": nbytes,
        "scheme": a.scheme,
        "device": a.device,
        "identical": identical,
        **{
            f"batch_{b}" if a.variants == ap.get_default("variants") else b: {
                "min_call": min(c for c, _ in r),
                "median_call": statistics.median(c for c, _ in r),
                "min_process": min(w for _, w in r),
                "median_process": statistics.median(w for _, w in r),
                "gb_per_s": round(nbytes / 1e9 / min(c for c, _ in r), 3),
            }
            for b, r in runs.items()
        },
    }
    print(json.dumps(summary, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
