#!/usr/bin/env python3
"""What verify's value-by-value check (ctconvert/checkpoint/grid.py) costs: ``verify --reference`` timed with it and
without it (its accumulator made a no-op), interleaved, on outputs of one checkpoint.

    python3 scripts/bench_verify.py --model /tmp/ctb/model [--schemes W4A16,NVFP4A16,FP8_DYNAMIC] [--repeat 2] [--workdir /tmp/bv]

Each scheme's output is made once (``ctconvert quantize``, kept in --workdir); each timing runs in its own process.
Prints one JSON document: per scheme, the seconds of every run of each side, their minimums, the values judged and
the values off the grid (0 for a correct output).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RUN = """
import json, sys, time
from ctconvert import api
import ctconvert.checkpoint.grid as grid
if sys.argv[3] == "off":
    grid.GridCheck.add = lambda self, *a: None
t = time.perf_counter()
rep = api.verify(sys.argv[1], sys.argv[2])
dt = time.perf_counter() - t
rows = rep["tensors"]
print(json.dumps({"seconds": dt, "ok": rep["ok"], "judged": sum(r.get("values_checked", 0) for r in rows),
                  "off_grid": sum(r.get("values_off_grid", 0) for r in rows)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--schemes", default="W4A16,NVFP4A16,FP8_DYNAMIC")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/bv")
    a = ap.parse_args()
    out = {}
    for scheme in a.schemes.split(","):
        q = Path(a.workdir) / scheme
        if not (q / "config.json").exists():
            subprocess.run([sys.executable, "-m", "ctconvert", "-q", "quantize", a.model, "-o", str(q), "--scheme", scheme], check=True)
        runs = {"on": [], "off": []}
        last = {}
        for _ in range(a.repeat):
            for side in ("off", "on"):
                r = json.loads(subprocess.run([sys.executable, "-c", RUN, str(q), a.model, side], check=True, capture_output=True, text=True).stdout)
                runs[side].append(round(r["seconds"], 2))
                last[side] = r
        out[scheme] = {
            "seconds_with_value_check": runs["on"],
            "seconds_without": runs["off"],
            "min_with": min(runs["on"]),
            "min_without": min(runs["off"]),
            "values_judged": last["on"]["judged"],
            "values_off_grid": last["on"]["off_grid"],
            "ok": last["on"]["ok"],
        }
        print(scheme, out[scheme], file=sys.stderr)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
