"""Profile every Python process of a run, children too (the calibration process): put this folder on ``PYTHONPATH``
and set ``CTPROF_DIR``; each process then samples all its threads (``CTPROF_HZ``, default 100 a second) and rewrites
``CTPROF_DIR/<pid>.json`` every half second (a child that leaves through ``os._exit`` keeps its last dump):

    CTPROF_DIR=/tmp/prof PYTHONPATH=scripts/profile_site ctconvert quantize SRC -o OUT --scheme NVFP4 ...
    python3 scripts/profile_site/report.py /tmp/prof

Per thread: the functions seen most often (self: the innermost frame; incl: anywhere on the stack; site: the innermost
ctconvert frame and its line, which says where a thread waits), and a timeline of
its innermost ctconvert (else any) frame per 0.25 s, on the wall clock shared by the processes. No effect without
``CTPROF_DIR``. Time in C code without a Python frame is charged to its Python caller.
"""

import os

if os.environ.get("CTPROF_DIR"):
    import collections
    import json
    import sys
    import threading
    import time

    _T0 = time.time()
    _DIR = os.environ["CTPROF_DIR"]
    _HZ = float(os.environ.get("CTPROF_HZ", "100"))

    def _key(code) -> str:
        return f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"

    def _run() -> None:
        selfc = collections.defaultdict(collections.Counter)
        incl = collections.defaultdict(collections.Counter)
        line = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
        site = collections.defaultdict(collections.Counter)  # innermost ctconvert frame with its line: where a wait is
        n = collections.Counter()
        me = threading.get_ident()
        last = time.time()
        os.makedirs(_DIR, exist_ok=True)
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        while True:
            time.sleep(1 / _HZ)
            now = time.time()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                tn = names.get(ident, "?")
                n[tn] += 1
                f, seen, inner, ours = frame, set(), None, None
                while f is not None:
                    k = _key(f.f_code)
                    inner = inner or k
                    if ours is None and "/ctconvert/" in f.f_code.co_filename:
                        ours = k
                        site[tn][f"{k} line {f.f_lineno}"] += 1
                    if k not in seen:
                        incl[tn][k] += 1
                        seen.add(k)
                    f = f.f_back
                selfc[tn][inner] += 1
                line[tn][round((now - _T0) * 4) / 4][ours or inner] += 1
            if now - last > 0.5:
                last = now
                doc = {"pid": os.getpid(), "argv": sys.argv[:4], "t0": _T0, "hz": _HZ, "threads": {}}
                for tn, c in n.items():
                    doc["threads"][tn] = {
                        "seconds": c / _HZ,
                        "self": selfc[tn].most_common(40),
                        "incl": incl[tn].most_common(60),
                        "site": site[tn].most_common(40),
                        "timeline": [(t, cc.most_common(2)) for t, cc in sorted(line[tn].items())],
                    }
                with open(path + ".tmp", "w") as fh:
                    json.dump(doc, fh)
                os.replace(path + ".tmp", path)

    threading.Thread(target=_run, name="ctprof", daemon=True).start()
