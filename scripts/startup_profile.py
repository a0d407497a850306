"""Where a ctconvert process spends the time outside its call (issue 15: process <= call + 3 s).

    python3 scripts/startup_profile.py [--repeat N] -- quantize MODEL -o OUT --scheme W4A16 --device cuda

Runs ``python -m ctconvert --json ARGS`` in a child whose prelude stamps the wall clock at each phase,
and prints one JSON document (the minimum of each phase over ``--repeat`` runs):

- ``interpreter``: exec to the first line of Python (interpreter start-up, site imports);
- ``imports``: ``ctconvert.__main__``'s heavy imports (torch, click, rich, the package);
- ``before_call``: command-line parsing up to the API call;
- ``call``: the API call (``--json`` ``seconds`` is given beside it);
- ``after_call``: printing the result up to ``os._exit``;
- ``exit``: ``os._exit`` until the parent reaps the child (the kernel unmapping memory, the CUDA driver
  releasing its context and pinned pages).

With ``--imports`` it also lists the 15 slowest modules of the imports (``-X importtime``, cumulative).
The output folder named after ``-o`` is removed before every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = r"""
import time, os, sys, json
stamps = {"interpreter": time.time()}
out = os.environ["CT_STAMPS"]
_exit = os._exit
def _stamped_exit(code):
    stamps["exit"] = time.time()
    with open(out, "w") as f:
        json.dump(stamps, f)
    _exit(code)
os._exit = _stamped_exit
from ctconvert import __main__ as m
m.bytecode_cache()  # as the console script does before its imports
from ctconvert import api
from ctconvert import cli
stamps["imported"] = time.time()
def wrap(name):
    fn = getattr(api, name)
    def timed(*a, **k):
        stamps["call0"] = time.time()
        try:
            return fn(*a, **k)
        finally:
            stamps["call1"] = time.time()
    setattr(api, name, timed)
for name in ("quantize", "quantize_to_target", "repack", "decompress", "verify", "convert"):
    if hasattr(api, name):
        wrap(name)
sys.argv = ["ctconvert"] + sys.argv[1:]
cli.run()
"""


def one(args: list[str], env: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        stamps_file = f.name
    env = dict(env, CT_STAMPS=stamps_file)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", PRELUDE, "--json", *args], env=env, capture_output=True, text=True)
    t1 = time.time()
    if p.returncode != 0:
        sys.exit(f"ctconvert exited {p.returncode}: {p.stderr.strip().splitlines()[-1:] or p.stdout[-300:]}")
    s = json.loads(Path(stamps_file).read_text())
    os.unlink(stamps_file)
    doc = json.loads(p.stdout)
    phases = {
        "interpreter": s["interpreter"] - t0,
        "imports": s["imported"] - s["interpreter"],
        "before_call": s["call0"] - s["imported"],
        "call": s["call1"] - s["call0"],
        "after_call": s["exit"] - s["call1"],
        "exit": t1 - s["exit"],
    }
    phases["process"] = t1 - t0
    phases["process_minus_call"] = phases["process"] - phases["call"]
    phases["json_seconds"] = doc.get("seconds")
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in phases.items()}


def imports(env: dict) -> list[tuple[str, float]]:
    code = "import ctconvert.__main__, ctconvert.api, ctconvert.cli"
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True)
    rows = []
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, cum_us, name = line[len("import time:") :].split("|", 2)
        rows.append((name.rstrip(), int(cum_us) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:15]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--imports", action="store_true")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = args[args.index("-o") + 1] if "-o" in args else None
    runs = []
    for _ in range(a.repeat):
        if out:
            shutil.rmtree(out, ignore_errors=True)
        runs.append(one(args, env))
    if out:
        shutil.rmtree(out, ignore_errors=True)
    best = {k: min(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    doc = {"args": args, "repeat": a.repeat, "statistic": "min", "phases": best, "runs": runs}
    if a.imports:
        doc["slowest_imports"] = [{"module": m, "cumulative_seconds": round(t, 3)} for m, t in imports(env)]
    json.dump(doc, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
