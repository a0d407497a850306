#!/usr/bin/env python3
"""How fast do the writers put a conversion's pieces into its shards, beside a thread that runs Python (as the
computing thread does)? Records every ``ShardFile.write_many`` of a real conversion, then replays the items through
:class:`ctconvert.checkpoint.shard_file.ShardFile` with N writer threads, each item one queue entry as the executor's
writers take them, with the writes in one C call (``checkpoint/native_write.py``) or piece by piece in Python::

    python3 scripts/bench_write_items.py record SRC REC.json [--targets-experts]   # a CPU NVFP4A16 conversion
    python3 scripts/bench_write_items.py replay REC.json --dir DIR [--threads 2] [--hog] [--repeat 2]

``--hog`` runs a thread of pure Python beside the writers (each writer that lets the GIL go waits to get it back).
The replay writes fresh random bytes (not the conversion's) into new files of the recorded plan, fsyncs them, and
prints per mode the seconds to the last write and the GB/s, and whether every tensor's hash was taken as it was
written. Measured 2026-12-07 (nineteenth session, 2-core CPU machine, `--threads 2 --hog`, gpt-oss's 8B shapes, 4.06 GB
in 3,451 items, and the dense 8B's, 6.03 GB in 2,231 items; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def record(src: str, rec: str, experts: bool) -> None:
    """Convert ``src`` (NVFP4A16, CPU) into a temporary folder, recording the shards' planned tensors and every
    write_many's pieces ``(name, bytes, byte offset)``."""
    import tempfile

    from ctconvert import api
    from ctconvert.checkpoint import shard_file as sf

    shards, log, lock = {}, [], threading.Lock()
    init, write_many = sf.ShardFile.__init__, sf.ShardFile.write_many

    def rec_init(self, path, tensors, metadata=None, on_complete=None):
        if metadata != "__existing__":
            shards[Path(path).name] = [(t.name, t.dtype, list(t.shape)) for t in tensors]
        init(self, path, tensors, metadata, on_complete)

    def rec_write_many(self, pieces):
        with lock:
            log.append((self.path.name, [(n, len(sf.host_bytes(t)), off) for n, t, off in pieces]))
        return write_many(self, pieces)

    sf.ShardFile.__init__, sf.ShardFile.write_many = rec_init, rec_write_many
    kw = {"allow_unloadable": True, "targets": ["Linear", r"re:.*mlp\.experts\.\d+\..*"]} if experts else {}
    with tempfile.TemporaryDirectory(dir=Path(rec).resolve().parent) as tmp:
        api.quantize(src, Path(tmp) / "out", "NVFP4A16", device="cpu", **kw)
    Path(rec).write_text(json.dumps({"shards": shards, "log": log}))
    print(f"recorded {len(log)} items into {len(shards)} shards: {rec}")


def replay_once(rec: dict, folder: Path, threads: int, hog: bool) -> tuple[float, bool]:
    """One replay (this process's CTCONVERT_NATIVE decides the mode): seconds to the last write, hashes all taken."""
    import numpy as np

    from ctconvert.checkpoint.shard_file import PlannedTensor, ShardFile

    folder.mkdir(parents=True, exist_ok=True)
    files = {f: ShardFile(folder / f, [PlannedTensor(n, dt, tuple(sh)) for n, dt, sh in ts]) for f, ts in rec["shards"].items()}
    pool = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    q: queue.Queue = queue.Queue()
    for f, pieces in rec["log"]:
        q.put((files[f], [(n, pool[(i * 4096) % (32 << 20) :][:k], off) for i, (n, k, off) in enumerate(pieces)]))
    for _ in range(threads):
        q.put(None)

    def writer():
        while (item := q.get()) is not None:
            item[0].write_many(item[1])

    stop = threading.Event()

    def python_loop():
        x = 0
        while not stop.is_set():
            for k in range(1000):
                x += k

    if hog:
        threading.Thread(target=python_loop, daemon=True).start()
    t0 = time.perf_counter()
    ws = [threading.Thread(target=writer) for _ in range(threads)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    took = time.perf_counter() - t0
    stop.set()
    hashed = all(f._hashes[n].complete(f.offsets[n][1]) for f in files.values() for n in f._hashes)
    for f in files.values():
        f.close()
    for f in files:
        (folder / f).unlink()
    return took, hashed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("src")
    r.add_argument("rec")
    r.add_argument("--targets-experts", action="store_true", help="target the experts (gpt-oss: --allow-unloadable)")
    p = sub.add_parser("replay")
    p.add_argument("rec")
    p.add_argument("--dir", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hog", action="store_true")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--one", choices=("0", "1"), help=argparse.SUPPRESS)  # a child: one replay in this mode
    a = ap.parse_args()
    if a.cmd == "record":
        return record(a.src, a.rec, a.targets_experts)
    rec = json.loads(Path(a.rec).read_text())
    if a.one is not None:
        took, hashed = replay_once(rec, Path(a.dir), a.threads, a.hog)
        print(json.dumps({"seconds": took, "hashed": hashed}))
        return
    total = sum(k for _, pieces in rec["log"] for _, k, _ in pieces)
    best: dict[str, float] = {}
    for i in range(a.repeat):
        for mode in ("1", "0") if i % 2 == 0 else ("0", "1"):  # each mode first in turn
            os.sync()
            env = dict(os.environ, CTCONVERT_NATIVE=mode)
            cmd = [sys.executable, __file__, "replay", a.rec, "--dir", a.dir, "--threads", str(a.threads), "--one", mode] + (["--hog"] if a.hog else [])
            out = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            name = "native" if mode == "1" else "python"
            print(f"{name}: {out['seconds']:.2f} s, {total / out['seconds'] / 1e9:.2f} GB/s, hashes taken: {out['hashed']}")
            best[name] = min(best.get(name, float("inf")), out["seconds"])
    print(json.dumps({k: {"min_seconds": round(v, 3), "gb_per_s": round(total / v / 1e9, 3)} for k, v in best.items()}))


if __name__ == "__main__":
    main()
