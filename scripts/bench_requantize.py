"""Requantize benchmark: wall time and peak RSS of ``quantize`` on an already-quantized checkpoint.

    python3 scripts/bench_requantize.py                     # 1.2B bench model -> FP8_BLOCK (once) -> NVFP4A16
    python3 scripts/bench_requantize.py --model SRC --source-scheme W4A16 --scheme FP8_DYNAMIC --repeat 3

The dense model is ``scripts/bench.py``'s (made with ``bench.py --make-model`` when ``--model`` does
not exist; an existing one is only read). The quantized source is written once into ``--workdir``.
Each measurement is a fresh ``python3 -m ctconvert --json quantize`` process: wall time of the whole
process, ctconvert's own ``seconds`` and the process's peak RSS (``ru_maxrss`` from ``wait4``). The
same is measured for the dense model -> ``--scheme`` for comparison. ``--verify`` also runs
``verify OUT --reference SRC`` (the requantized output against the dequantized source).
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_measured(args: list[str]) -> dict:
    """Run ``python3 -m ctconvert --json ARGS``; wall seconds, ctconvert's seconds, peak RSS (MiB)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ctconvert", "--json", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"ctconvert {' '.join(args)} failed:\n{err.decode()[-2000:]}")
    doc = json.loads(out)
    return {"wall_s": round(wall, 3), "call_s": doc.get("seconds"), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "doc": doc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/ctbench/model", help="dense bf16 checkpoint (made by scripts/bench.py --make-model if missing)")
    ap.add_argument("--workdir", default="/tmp/ctbench-requantize")
    ap.add_argument("--source-scheme", default="FP8_BLOCK")
    ap.add_argument("--scheme", default="NVFP4A16")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--verify", action="store_true")
    a = ap.parse_args()
    model, work = Path(a.model), Path(a.workdir)
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("bench.py")), "--make-model", str(model)], check=True)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"src-{a.source_scheme.lower()}"
    if not (src / "config.json").exists():
        run_measured(["quantize", str(model), "-o", str(src), "--scheme", a.source_scheme, "--device", a.device, "--overwrite"])
    out = work / f"requantized-{a.scheme.lower()}"
    base = work / f"dense-{a.scheme.lower()}"
    req, dense = [], []
    for _ in range(a.repeat):
        req.append(run_measured(["quantize", str(src), "-o", str(out), "--scheme", a.scheme, "--device", a.device, "--overwrite"]))
        dense.append(run_measured(["quantize", str(model), "-o", str(base), "--scheme", a.scheme, "--device", a.device, "--overwrite"]))

    def summary(runs):
        return {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "call_s", "peak_rss_mib")}

    result = {
        "model": str(model),
        "source": str(src),
        "source_scheme": a.source_scheme,
        "scheme": a.scheme,
        "device": a.device,
        "repeat": a.repeat,
        "input_bytes": req[0]["doc"]["input_bytes"],
        "output_bytes": req[0]["doc"]["output_bytes"],
        "requantize": summary(req),
        "quantize_from_dense": summary(dense),
    }
    if a.verify:
        v = subprocess.run([sys.executable, "-m", "ctconvert", "--json", "verify", str(out), "--reference", str(src)], capture_output=True, text=True)
        doc = json.loads(v.stdout)
        errs = [t["rel_l2"] for t in doc.get("tensors", [])]
        result["verify"] = {"ok": doc["ok"], "max_rel_l2": max(errs) if errs else None}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
