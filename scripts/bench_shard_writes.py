"""How fast can several threads fill one output shard? A micro-benchmark of the ways to write it.

    python scripts/bench_shard_writes.py [--dir /tmp/sw] [--gb 4] [--piece-mib 64] [--threads 1,4,8] [--files 1,4]
                                         [--modes pwrite,mmap,mmapf,mmapp] [--repeat 2] [--no-writeback]

Each run writes ``--gb`` GB of fresh bytes in ``--piece-mib`` pieces, taken by ``--threads`` threads from one queue
(as ctconvert's writers take writes), into ``--files`` files created at full size (``ftruncate``, as
:class:`ctconvert.checkpoint.shard_file.ShardFile` does), handing dirty pages to the disk every 32 MiB written to a
file (``sync_file_range``), then fsyncs every file. Modes:

* ``pwrite``: ``os.pwrite`` of each piece (a buffered write holds its file's inode lock: writers of one file take turns);
* ``mmap``: a copy into a shared mapping of the file (``torch.Tensor.copy_``, which drops the GIL); page faults take
  no inode lock;
* ``mmapf``: ``mmap`` into a file whose blocks ``posix_fallocate`` reserved first (a full disk then fails up front,
  not as a SIGBUS at a page fault);
* ``mmapp``: ``mmapf``, each piece's pages made first by one ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14; the
  kernel allocates them in one call instead of a fault per 4 KiB page);
* ``--no-writeback``: without the ``sync_file_range`` every 32 MiB (the page cache alone until the fsyncs).

Prints one line per run (seconds to the last byte written, seconds to the end of the fsyncs, GB/s) and a JSON summary
(min over repeats) on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ctconvert.checkpoint.shard_file import WRITEBACK_BYTES, start_writeback  # noqa: E402

_LIBC = ctypes.CDLL(None, use_errno=True)
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14)


def _populate(m: mmap.mmap, off: int, n: int) -> None:
    """Make the pages of bytes ``[off, off + n)`` of mapping ``m`` writable in one call (``MADV_POPULATE_WRITE``)."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    lo = off // mmap.PAGESIZE * mmap.PAGESIZE
    if _LIBC.madvise(ctypes.c_void_p(base + lo), ctypes.c_size_t(off + n - lo), MADV_POPULATE_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")


def run(d: Path, mode: str, total: int, piece: int, threads: int, files: int, src: torch.Tensor, writeback: bool = True) -> tuple[float, float]:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    per_file = total // files
    fds = []
    maps = []
    for i in range(files):
        fd = os.open(d / f"s{i}.safetensors", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, per_file)
        if mode in ("mmapf", "mmapp"):
            os.posix_fallocate(fd, 0, per_file)
        fds.append(fd)
        if mode.startswith("mmap"):
            m = mmap.mmap(fd, per_file, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            maps.append((m, torch.frombuffer(m, dtype=torch.uint8)))
    q: queue.Queue = queue.Queue()
    for f in range(files):  # pieces in file order, as a conversion fills its shards one after another
        for off in range(0, per_file, piece):
            q.put((f, off, min(piece, per_file - off)))
    unflushed = [0] * files
    lock = threading.Lock()
    raw = src.numpy()

    def worker():
        while True:
            try:
                f, off, n = q.get_nowait()
            except queue.Empty:
                return
            if mode == "pwrite":
                done = 0
                view = memoryview(raw[:n])
                while done < n:
                    done += os.pwrite(fds[f], view[done:], off + done)
            else:
                if mode == "mmapp":
                    _populate(maps[f][0], off, n)
                maps[f][1][off : off + n].copy_(src[:n])
            with lock:
                unflushed[f] += n
                kick = unflushed[f] >= WRITEBACK_BYTES
                if kick:
                    unflushed[f] = 0
            if kick and writeback:
                start_writeback(fds[f])

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    t1 = time.perf_counter()
    for fd in fds:
        os.fsync(fd)
    t2 = time.perf_counter()
    for m, t in maps:
        del t
        m.close()
    for fd in fds:
        os.close(fd)
    shutil.rmtree(d, ignore_errors=True)
    return t1 - t0, t2 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/shard-writes")
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--piece-mib", type=int, default=64)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--files", default="1,4")
    ap.add_argument("--modes", default="pwrite,mmap,mmapf")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-writeback", action="store_true", help="no sync_file_range every 32 MiB: the page cache alone until the fsyncs")
    a = ap.parse_args()
    total, piece = int(a.gb * 1e9) // 4096 * 4096, a.piece_mib * 2**20
    src = torch.randint(0, 256, (piece,), dtype=torch.uint8)
    best: dict[str, list[float]] = {}
    for rep in range(a.repeat):
        for mode in a.modes.split(","):
            for files in map(int, a.files.split(",")):
                for threads in map(int, a.threads.split(",")):
                    w, s = run(Path(a.dir), mode, total, piece, threads, files, src, not a.no_writeback)
                    key = f"{mode} files={files} threads={threads}"
                    print(f"[rep {rep + 1}] {key}: written {w:.2f} s, synced {s:.2f} s, {total / s / 1e9:.2f} GB/s", file=sys.stderr, flush=True)
                    old = best.get(key)
                    best[key] = [min(w, old[0]), min(s, old[1])] if old else [w, s]
    json.dump({"bytes": total, "piece": piece, "min_seconds": best}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
