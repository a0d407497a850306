#!/usr/bin/env python3
"""A small sampling profiler for a whole ctconvert run, every thread (no py-spy needed).

    python scripts/sample_profile.py [--hz 50] [--top 25] [--out prof.json] -- quantize SRC -o OUT --scheme W4A16 ...

Runs ``ctconvert`` in this process (the arguments after ``--`` are the CLI's) while a
background thread samples ``sys._current_frames()`` ``--hz`` times a second. Prints,
per thread name, the functions seen most often (self: innermost frame in the
package or a library; incl: anywhere on the stack), as seconds (samples / hz),
to stderr. Time spent in C code that holds no Python frame of its own (a pread, a
ctypes kernel, a CUDA sync) is charged to the Python function that called it.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, run from anywhere


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--hz", type=float, default=50)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv[:cut])
    cli_args = argv[cut + 1 :]
    self_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl_counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: collections.Counter = collections.Counter()
    stop = threading.Event()

    def sampler() -> None:
        period = 1.0 / a.hz
        me = threading.get_ident()
        while not stop.wait(period):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                tname = names.get(ident, "?").rstrip("0123456789-_")
                samples[tname] += 1
                seen = set()
                first = True
                f = frame
                while f is not None:
                    code = f.f_code
                    key = f"{code.co_name} ({code.co_filename.rsplit('/', 2)[-2:][-1]}:{code.co_firstlineno})"
                    if first:
                        self_counts[tname][key] += 1
                        first = False
                    if key not in seen:
                        incl_counts[tname][key] += 1
                        seen.add(key)
                    f = f.f_back

    th = threading.Thread(target=sampler, daemon=True, name="sampler")
    th.start()
    t0 = time.perf_counter()
    from ctconvert.cli import main as cli_main

    try:
        cli_main.main(args=cli_args, standalone_mode=False)
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        th.join()
        report = {"wall_seconds": wall, "hz": a.hz, "threads": {}}
        for tname, n in samples.most_common():
            report["threads"][tname] = {
                "seconds": n / a.hz,
                "self": [(k, v / a.hz) for k, v in self_counts[tname].most_common(a.top)],
                "incl": [(k, v / a.hz) for k, v in incl_counts[tname].most_common(a.top)],
            }
            print(f"== thread {tname}: {n / a.hz:.2f} s sampled (wall {wall:.2f} s)", file=sys.stderr)
            for k, v in self_counts[tname].most_common(a.top):
                print(f"   self {v / a.hz:7.2f}s  {k}", file=sys.stderr)
            for k, v in incl_counts[tname].most_common(a.top):
                print(f"   incl {v / a.hz:7.2f}s  {k}", file=sys.stderr)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
