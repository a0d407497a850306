#!/usr/bin/env python3
"""When each part of one ctconvert run was busy: a timeline of its reads, computing, writes and flushes.

    python scripts/trace_timeline.py [--out trace.json] [--bins 20] [--longest 12] [--sync-debug] -- quantize SRC -o OUT --scheme NVFP4A16 ...

Runs the CLI in this process (the arguments after ``--`` are its own) with a wrapper around a few methods of the
pipeline's classes, each wrapper noting ``(what, thread, start, end, bytes)`` (``time.perf_counter``):

* ``read``: a reader thread's read of one job (``Executor._read``; bytes: the source bytes it reads), ``pool_wait``: its wait for a pinned buffer
  (``PinnedPool.get``), ``pinned_alloc``: the making of a new one (``buffers._pinned``, inside ``pool_wait``);
* ``compute``: the computing thread's handling of one read (``Executor._handle``; the job's kind, first source and
  unit count are kept), ``budget_wait``: its wait for room in the writers' queues (``ByteBudget.acquire``); inside
  ``compute``: ``c_values``, ``c_quantize`` (``quantize_batch``, ``Executor._quantize``), ``c_absmax``, ``c_zeros``,
  ``c_flags``, ``c_stage`` (the staging copy, its budget wait included); inside ``c_quantize``: ``c_rows`` (the
  scheme's ``quantize_rows``: the quantizer's kernels alone);
* ``write``: a writer's ``ShardFile.write_many`` (bytes: the pieces' bytes), ``fsync``: ``ShardFile.close``;
* ``warm``: the GPU warm-up thread's work (``WarmUp._work``), ``warm_batch``: its launch of one batch key,
  ``key``: the making of Triton's cache key (``triton_key._compute``; begun here by the quantize stage, or before the
  call with ``--key-ready`` as the console script begins it before torch's import), ``key_wait``: a wait for it
  (``triton_key.wait``); ``c_eager``: a batch run without a graph, ``c_capture``: a graph's capture (both inside
  ``compute``);
* ``s_source``, ``s_plan``, ``s_write``: the source, plan and write stages' ``prepare`` (headers: before the executor);
* ``hash_wait``: waits for the source hashes (``SourceHashes.all``), ``finish``: ``OutputFolder.finish`` and
  ``commit``; ``executor``: ``Executor.run``; ``call``: the API call.

Prints, per kind, the first start, the last end, the summed time, the time covered by at least one of them
(their union) and the bytes; then a table of ``--bins`` equal slices of the call, each with the share of the slice
that each kind covered and the GB written in it; the ``--longest`` compute jobs; with ``--sync-debug`` (CUDA) the
synchronisations torch's sync debug mode reports, counted by thread and ctconvert call site; with ``--wchan HZ``
(Linux) where each kind of thread was in the kernel: ``HZ`` times a second, each thread's state and wait channel
(``/proc/self/task/TID/stat`` and ``wchan``: ``R`` running, else the kernel function it sleeps in, such as an inode
lock's ``rwsem_down_write_slowpath``; a futex in a function that made a system call is a wait for the GIL) and its
innermost Python function, counted by thread name. ``--out`` keeps it all, every event included, as JSON. No GPU is needed; nothing of the package changes.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, run from anywhere

EVENTS: list[tuple[str, str, float, float, int]] = []
#: kinds listed one by one in time order (the first of each run: what a run waits for before its stream flows)
EARLY = ("s_source", "s_plan", "s_write", "warm", "key", "key_wait", "warm_batch", "c_eager", "c_capture")


def _wrap(cls, name: str, kind: str, nbytes=None, info=None):
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            n = nbytes(*args, **kw) if nbytes else 0
            ev = (kind, threading.current_thread().name, t0, time.perf_counter(), n)
            EVENTS.append((*ev, info(*args, **kw)) if info else ev)

    setattr(cls, name, wrapper)


def _job_info(self, job, *a, **kw) -> str:
    """What one job of the computing thread was: its kind, its first unit's first source, and how many units."""
    units = getattr(job, "units", None) or [job.unit]
    try:
        first = self.plan.units[units[0]].sources[0]
    except (AttributeError, IndexError, TypeError):
        first = "?"
    return f"{job.kind} {first} x{len(units)}"


def _read_bytes(self, job, *a, **kw) -> int:
    """The source bytes one read job reads: a batch's members (or fused experts' regions), copied tensors whole, a copy's
    byte range, or a chunk's rows."""
    from ctconvert.pipeline.batches import batch_infos, batch_nbytes

    if job.kind == "batch":
        return batch_nbytes(batch_infos(self.ckpt.tensors, [self.plan.units[u] for u in job.units]))
    if job.kind == "copies":
        return sum(self.ckpt.tensors[self.plan.units[u].sources[0]].nbytes for u in job.units)
    unit = self.plan.units[job.unit]
    info = self.ckpt.tensors[unit.sources[job.member]]
    if job.kind == "copy":
        return (info.nbytes if job.stop is None else job.stop) - job.start
    return (job.stop - job.start) * (info.nbytes // info.shape[0]) if info.shape and info.shape[0] else 0


def _piece_bytes(self, pieces, *a, **kw) -> int:
    total = 0
    for _, t, _ in pieces:
        total += t.numel() * t.element_size() if hasattr(t, "numel") else len(t)
    return total


def _patch() -> None:
    from ctconvert import api
    from ctconvert.checkpoint.hashing import SourceHashes
    from ctconvert.checkpoint.shard_file import ShardFile
    from ctconvert.checkpoint.writer import OutputFolder
    from ctconvert.pipeline.buffers import ByteBudget, PinnedPool
    from ctconvert.pipeline.executor import Executor

    _wrap(Executor, "_read", "read", _read_bytes)
    _wrap(PinnedPool, "get", "pool_wait")
    _wrap(Executor, "_handle", "compute", info=_job_info)
    from ctconvert.pipeline import executor as ex
    from ctconvert.pipeline.nonfinite import DeviceFlags
    from ctconvert.pipeline.zeros import ZeroTracker

    _wrap(ex, "quantize_batch", "c_quantize")  # inside compute: the pieces of a batch's handling
    _wrap(ex, "batch_values", "c_values")
    _wrap(Executor, "_stage", "c_stage")
    _wrap(Executor, "_absmax", "c_absmax")
    _wrap(Executor, "_quantize", "c_quantize")
    from ctconvert.plan.schemes import Scheme

    _wrap(Scheme, "quantize_rows", "c_rows")  # inside c_quantize: the quantizer's own call (the kernels)
    _wrap(ZeroTracker, "observe_stacked", "c_zeros")
    _wrap(ZeroTracker, "observe", "c_zeros") if hasattr(ZeroTracker, "observe") else None
    from ctconvert.pipeline import buffers

    _wrap(buffers, "_pinned", "pinned_alloc")  # a new pinned buffer of the read pool (inside pool_wait)
    _wrap(DeviceFlags, "resolve", "c_flags")
    _wrap(DeviceFlags, "add_stacked", "c_flags")
    _wrap(ByteBudget, "acquire", "budget_wait")
    _wrap(ShardFile, "write_many", "write", _piece_bytes)
    _wrap(ShardFile, "close", "fsync")
    _wrap(SourceHashes, "all", "hash_wait")
    _wrap(OutputFolder, "finish", "finish")
    _wrap(OutputFolder, "commit", "finish")
    _wrap(Executor, "run", "executor")
    _wrap(api, "quantize", "call")
    from ctconvert.formats import triton_key
    from ctconvert.pipeline import warm
    from ctconvert.pipeline.graphs import BatchGraphs
    from ctconvert.pipeline.warm import WarmUp

    _wrap(WarmUp, "_work", "warm")  # the warm-up thread's whole work (GPU)
    _wrap(triton_key, "_compute", "key")  # the making of Triton's cache key on its own thread
    _wrap(triton_key, "wait", "key_wait")  # a wait for Triton's cache key (warm.py imports the module: patched there too)
    _wrap(warm, "warm_batch", "warm_batch")
    _wrap(Executor, "_batch_eager", "c_eager")  # inside compute: a batch run without a graph
    _wrap(BatchGraphs, "_capture", "c_capture")  # inside compute: a graph's capture
    from ctconvert.stages.plan import PlanStage
    from ctconvert.stages.source import SourceStage
    from ctconvert.stages.write import WriteStage

    _wrap(SourceStage, "prepare", "s_source")  # before the executor: opening the source, planning, opening the output
    _wrap(PlanStage, "prepare", "s_plan")
    _wrap(WriteStage, "prepare", "s_write")


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _covered(spans, lo: float, hi: float) -> float:
    return _union([(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi])


def report(events, bins: int) -> dict:
    calls = [e for e in events if e[0] == "call"]
    t0, t1 = (calls[0][2], calls[0][3]) if calls else (min(e[2] for e in events), max(e[3] for e in events))
    kinds: dict[str, list] = {}
    for e in events:
        kinds.setdefault(e[0], []).append(e)
    out = {"call_seconds": round(t1 - t0, 3), "kinds": {}, "bins": []}
    for k, es in kinds.items():
        spans = [(e[2], e[3]) for e in es]
        out["kinds"][k] = {
            "count": len(es),
            "first_start": round(min(a for a, _ in spans) - t0, 3),
            "last_end": round(max(b for _, b in spans) - t0, 3),
            "summed": round(sum(b - a for a, b in spans), 3),
            "union": round(_union(spans), 3),
            "threads": len({e[1] for e in es}),
            "GB": round(sum(e[4] for e in es) / 1e9, 3),
        }
    w = (t1 - t0) / bins
    for i in range(bins):
        lo, hi = t0 + i * w, t0 + (i + 1) * w
        row = {"t": round(lo - t0, 2)}
        for k in ("read", "compute", "budget_wait", "write", "fsync"):
            spans = [(e[2], e[3]) for e in events if e[0] == k]
            row[k] = round(_covered(spans, lo, hi) / w, 2)
        row["write_GB"] = round(sum(e[4] for e in events if e[0] == "write" and lo <= e[3] < hi) / 1e9, 3)
        out["bins"].append(row)
    return out


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(
        usage="%(prog)s [--out JSON] [--bins N] [--longest N] [--sync-debug] -- quantize SRC -o OUT --scheme S ...",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("--out", default=None, help="write the report and every event as JSON here")
    ap.add_argument("--bins", type=int, default=20, help="slices of the call in the table (default 20)")
    ap.add_argument("--sync-debug", action="store_true", help="count the computing thread's CUDA synchronisations by site (torch.cuda.set_sync_debug_mode)")
    ap.add_argument("--longest", type=int, default=12, help="list the N longest compute events")
    ap.add_argument("--wchan", type=float, default=0, help="sample every thread's kernel state and wait channel HZ times a second (Linux)")
    ap.add_argument("--key-ready", action="store_true", help="make Triton's cache key before the call (as if made during the imports)")
    a = ap.parse_args(argv[:cut])
    if cut + 1 >= len(argv):
        ap.error("give the ctconvert command after --, e.g. -- quantize SRC -o OUT --scheme NVFP4A16")
    _patch()
    syncs: dict[str, int] = {}
    if a.sync_debug:
        import traceback
        import warnings

        import torch

        torch.cuda.set_sync_debug_mode("warn")
        shown = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return shown(message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if "/ctconvert/" in f.filename]
            site = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:])) or f"{filename}:{lineno}"
            key = f"{threading.current_thread().name}: {site}"
            syncs[key] = syncs.get(key, 0) + 1

        warnings.showwarning = note
        warnings.simplefilter("always")
    import gc

    from ctconvert.cli import main as cli_main

    gc.freeze()  # as the console script does after its imports: a collection then walks none of torch's objects

    if a.key_ready:
        from ctconvert.formats import triton_key

        triton_key.begin(import_here=True)  # as the console script does (Triton imported here, the key on its thread)
        triton_key.wait()

    waits = KernelWaits(a.wchan) if a.wchan > 0 else None
    try:
        cli_main.main(args=argv[cut + 1 :], standalone_mode=False)
    finally:
        if waits is not None:
            waits.stop()
        _print(a, syncs)
        if waits is not None:
            waits.print()


class KernelWaits:
    """A thread sampling, ``hz`` times a second, every Python thread's kernel state and wait channel (Linux ``/proc``):
    counts per (thread name without its number, state or wait channel)."""

    def __init__(self, hz: float):
        self.period, self.counts, self.samples = 1.0 / hz, {}, {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="trace-wchan")
        self._t.start()

    def _run(self) -> None:
        me = threading.get_native_id()
        while not self._stop.wait(self.period):
            frames = sys._current_frames()
            for t in threading.enumerate():
                tid = t.native_id
                if tid is None or tid == me:
                    continue
                try:
                    state = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    where = "R" if state == "R" else f"{state}:{Path(f'/proc/self/task/{tid}/wchan').read_text() or '?'}"
                except OSError:
                    continue
                name = t.name.rstrip("0123456789-_") or t.name
                f = frames.get(t.ident)
                where += f" in {f.f_code.co_name}" if f is not None else ""
                self.samples[name] = self.samples.get(name, 0) + 1
                self.counts[(name, where)] = self.counts.get((name, where), 0) + 1

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def print(self) -> None:
        print("kernel states by thread (share of its samples; R: running):", file=sys.stderr)
        for (name, where), n in sorted(self.counts.items(), key=lambda kv: (kv[0][0], -kv[1])):
            if n / self.samples[name] >= 0.01:
                print(f"  {name:22} {where:56} {n / self.samples[name]:5.2f}  ({n})", file=sys.stderr)


def _print(a, syncs: dict[str, int]) -> None:
    """The report on stderr (and with ``--out`` as JSON); only a note where the run stopped before its executor."""
    if not any(e[0] == "executor" for e in EVENTS):
        print("no timeline: the run stopped before its executor started (its own error is above)", file=sys.stderr)
        return
    r = report(EVENTS, a.bins)
    print(f"call {r['call_seconds']} s", file=sys.stderr)
    print(f"{'kind':12} {'count':>6} {'first':>6} {'last':>6} {'summed':>7} {'union':>6} {'thr':>4} {'GB':>7}", file=sys.stderr)
    for k, v in r["kinds"].items():
        cols = f"{v['count']:6d} {v['first_start']:6.2f} {v['last_end']:6.2f} {v['summed']:7.2f} {v['union']:6.2f}"
        print(f"{k:12} {cols} {v['threads']:4d} {v['GB']:7.3f}", file=sys.stderr)
    print(f"{'t':>5} {'read':>5} {'comp':>5} {'bwait':>5} {'write':>5} {'fsync':>5} {'wGB':>6}", file=sys.stderr)
    for b in r["bins"]:
        cols = " ".join(f"{b[k]:5.2f}" for k in ("t", "read", "compute", "budget_wait", "write", "fsync"))
        print(f"{cols} {b['write_GB']:6.3f}", file=sys.stderr)
    t0 = next((e[2] for e in EVENTS if e[0] == "call"), 0.0)
    comp = sorted((e for e in EVENTS if e[0] == "compute"), key=lambda e: e[2] - e[3])[: a.longest]
    print("longest compute events (start, seconds, job):", file=sys.stderr)
    for e in comp:
        print(f"  {e[2] - t0:6.3f} {e[3] - e[2]:6.3f}  {e[5] if len(e) > 5 else ''}", file=sys.stderr)
    early = sorted((e for e in EVENTS if e[0] in EARLY), key=lambda e: e[2])[: a.longest * 2]
    print("start-up events (start, seconds, kind, thread):", file=sys.stderr)
    for e in early:
        print(f"  {e[2] - t0:6.3f} {e[3] - e[2]:6.3f}  {e[0]:10} {e[1]}", file=sys.stderr)
    if syncs:
        print("CUDA synchronisations by site:", file=sys.stderr)
        for k, v in sorted(syncs.items(), key=lambda kv: -kv[1]):
            print(f"  {v:6d}  {k}", file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**r, "syncs": syncs, "events": EVENTS}, f)


if __name__ == "__main__":
    main()
