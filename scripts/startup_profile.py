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

    python3 scripts/startup_profile.py --targets --model MODEL [--repeat 5] [--scheme W4A16] [--strace]

checks issue 27's start-up targets instead: the median wall time over ``--repeat`` runs (default 5) of
``python -m ctconvert --version``, ``--help``, ``schemes`` and ``schemes --json`` (target <= 0.5 s each: from
before the parent starts the child to its exit), and for ``quantize MODEL -o TMP -s SCHEME -q`` the median time
from the start of the child to its first source byte read, from the child's ``CTCONVERT_TRACE=1`` stamps
(``time.monotonic()``, the clock of every process of the machine; target <= 1 s): ``first_read`` is the
earliest read of a source file (the read ahead of ``ctconvert/checkpoint/readahead.py``, while torch is imported),
``conversion_first_open`` the conversion's own first open of one (after the imports), ``engine`` the end of the
imports, ``process`` the whole run; the same with ``CTCONVERT_READAHEAD=0`` beside it. ``--strace`` adds an
independent count: the first ``openat`` of a file under MODEL by any thread, from ``strace -f -ttt``.
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
api.preload()  # as the console script does before a command that reads tensors
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


#: issue 27's start-up targets, seconds
TARGET_LIGHT, TARGET_FIRST_READ = 0.5, 1.0
LIGHT_COMMANDS = (["--version"], ["--help"], ["schemes"], ["schemes", "--json"])


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return round((xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2, 3)


def light(args: list[str], env: dict) -> float:
    """Wall seconds of ``python -m ctconvert ARGS``, from before the child starts to its exit."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "ctconvert", *args], env=env, cwd=env["CT_ROOT"], capture_output=True)
    if p.returncode != 0:
        sys.exit(f"ctconvert {' '.join(args)} exited {p.returncode}")
    return time.monotonic() - t0


def traced_quantize(model: str, scheme: str, env: dict, read_ahead: bool) -> dict:
    """One ``quantize`` with ``CTCONVERT_TRACE=1``: seconds from before the child starts to each stamp."""
    out = tempfile.mkdtemp(prefix="ct-startup-")
    shutil.rmtree(out)
    env = dict(env, CTCONVERT_TRACE="1", CTCONVERT_READAHEAD="1" if read_ahead else "0")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "ctconvert", "quantize", model, "-o", out, "-s", scheme, "-q"]
    p = subprocess.run(cmd, env=env, cwd=env["CT_ROOT"], capture_output=True, text=True)
    t1 = time.monotonic()
    shutil.rmtree(out, ignore_errors=True)
    if p.returncode != 0:
        sys.exit(f"ctconvert quantize exited {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    stamps = {}
    for line in p.stderr.splitlines():
        if line.startswith("ctconvert-trace "):
            step, seconds = line.split()[1:3]
            stamps.setdefault(step, float(seconds) - t0)
    row = {k: stamps.get(k) for k in ("main", "readahead", "engine", "first-open")}
    reads = [v for v in (row["readahead"], row["first-open"]) if v is not None]
    row["first_read"] = min(reads) if reads else None  # None: a checkout without CTCONVERT_TRACE (use --strace)
    row["process"] = t1 - t0
    return {k.replace("-", "_").replace("first_open", "conversion_first_open"): v for k, v in row.items()}


def strace_first_open(model: str, scheme: str, env: dict) -> float | None:
    """Seconds from before ``strace -f -ttt -e trace=openat`` starts the child to the first ``openat`` of a path
    under ``model`` (any thread), read from strace's own wall-clock stamps; None when strace is not installed."""
    if not shutil.which("strace"):
        return None
    out = tempfile.mkdtemp(prefix="ct-startup-")
    shutil.rmtree(out)
    root = os.path.abspath(model)
    with tempfile.NamedTemporaryFile(suffix=".strace") as log:
        t0 = time.time()
        cmd = ["strace", "-f", "-ttt", "-e", "trace=openat", "-o", log.name, sys.executable, "-m", "ctconvert"]
        cmd += ["quantize", model, "-o", out, "-s", scheme, "-q"]
        subprocess.run(cmd, env=env, cwd=env["CT_ROOT"], capture_output=True, check=True)
        shutil.rmtree(out, ignore_errors=True)
        for line in Path(log.name).read_text().splitlines():
            parts = line.split(None, 2)  # pid, seconds, call
            if len(parts) == 3 and parts[2].startswith("openat(") and f'"{root}/' in parts[2]:
                return float(parts[1]) - t0
    return None


def targets(a, env: dict) -> dict:
    """The start-up targets of issue 27, median of ``a.repeat`` runs each (module docstring)."""
    doc: dict = {"root": env["CT_ROOT"], "repeat": a.repeat, "statistic": "median", "load_average": os.getloadavg(), "light": {}}
    for args in LIGHT_COMMANDS:
        m = _median([light(args, env) for _ in range(a.repeat)])
        doc["light"][" ".join(args)] = {"seconds": m, "target": TARGET_LIGHT, "met": m <= TARGET_LIGHT}
    if a.model:
        for name, ahead in (("quantize", True), ("quantize_without_readahead", False)):
            runs = [traced_quantize(a.model, a.scheme, env, ahead) for _ in range(a.repeat)]
            row = {k: _median([r[k] for r in runs]) for k in runs[0] if runs[0][k] is not None}
            doc[name] = {**row, "target_first_read": TARGET_FIRST_READ, "met": row.get("first_read", 1e9) <= TARGET_FIRST_READ}
        if a.strace:
            got = [strace_first_open(a.model, a.scheme, env) for _ in range(a.repeat)]
            doc["quantize"]["strace_first_open"] = _median(got) if None not in got else None
    doc["load_average_after"] = os.getloadavg()
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=None, help="runs per figure (default 3; 5 with --targets)")
    ap.add_argument("--imports", action="store_true")
    ap.add_argument("--targets", action="store_true", help="issue 27's start-up targets (module docstring)")
    ap.add_argument("--model", help="--targets: the checkpoint quantize reads")
    ap.add_argument("--scheme", default="W4A16", help="--targets: quantize's scheme")
    ap.add_argument("--strace", action="store_true", help="--targets: also the first openat under MODEL, from strace")
    ap.add_argument("--root", default=str(ROOT), help="--targets: the ctconvert checkout to measure (default: this one; another for an A/B)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if a.targets:
        root = os.path.abspath(a.root)
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), CT_ROOT=root)
        a.repeat = a.repeat or 5
        a.model = a.model and os.path.abspath(a.model)
        json.dump(targets(a, env), sys.stdout, indent=2)
        print()
        return
    a.repeat = a.repeat or 3
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
