"""Build a C source file into a shared library on first use, and split work over threads.

Used by the CPU kernels (:mod:`ctconvert.formats.native`, the quantizers, and
:mod:`ctconvert.layouts.cpu`, the Marlin tiles). A library is built once per machine with the
system C compiler (``cc -O3`` with the CPU's vector extensions, never ``-ffast-math``: results must equal the
torch references bit for bit) into a cache folder (``$CTCONVERT_CACHE`` or
``~/.cache/ctconvert``), keyed by the source's hash and the flags. No
compiler, a failed build or ``CTCONVERT_NATIVE=0`` gives ``None``; callers then
use their torch reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import os
import platform
import queue
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

#: the AVX-512 subsets the kernels are built with where the CPU has all of them (``/proc/cpuinfo`` spelling)
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def flags() -> list[str]:
    """The C compiler's flags: ``-O3``, IEEE arithmetic kept (no contraction into FMA, no fast math), and the
    vector extensions of this x86-64 CPU (AVX2/F16C/FMA, AVX-512 F/BW/VL/DQ where present); results are the
    same bytes with every set (tests/formats build the kernels without them too)."""
    out = ["-O3", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off", "-fno-trapping-math", "-std=gnu11"]
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            cpu = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpu = ""
        if " avx2 " in cpu and " f16c " in cpu and " fma " in cpu:
            out += ["-mavx2", "-mf16c", "-mfma"]
            if all(f" {f} " in cpu for f in AVX512):  # 16 lanes: the quantize loops run 1.1-1.6x faster (one core)
                out += [f"-m{f}" for f in AVX512] + ["-mprefer-vector-width=512"]
    return out


def _source_bytes(src: Path) -> bytes:
    """``src`` and every local header it includes (``#include "x.h"``, beside it, recursively): what a build depends
    on, so a changed header builds the library anew instead of loading a stale cached one."""
    seen: list[Path] = []
    todo = [src]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += [p.parent / m.decode() for m in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', p.read_bytes(), re.M)]
    return b"".join(p.read_bytes() for p in seen)


#: why the last :func:`build` of each source gave no library (source path -> a clause), for :meth:`Library.why_not`
_WHY_NOT: dict[str, str] = {}


def build(src: Path) -> ctypes.CDLL | None:
    """The compiled library of ``src`` (built now if not cached), or None (:data:`_WHY_NOT` then says why). A build
    that fails leaves a marker, ``<stem>-<key>.failed`` holding the compiler's first error line, beside where the library
    would be: later runs with the same source, compiler and flags do not try again (each run compiled in vain before)."""
    if os.environ.get("CTCONVERT_NATIVE", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        _WHY_NOT[str(src)] = "no C compiler was found (cc, gcc or clang on PATH, or $CC)"
        return None
    fl = flags()
    try:
        source = _source_bytes(src)
    except OSError:  # an install without the C sources (a wheel that left them out): the torch fallbacks run
        _WHY_NOT[str(src)] = f"this installation lacks the C source {src.name}"
        return None
    key = hashlib.sha256(source + " ".join([cc, *fl, platform.machine()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("CTCONVERT_CACHE") or Path.home() / ".cache" / "ctconvert")
    so, failed = cache / f"{src.stem}-{key}.so", cache / f"{src.stem}-{key}.failed"
    if failed.is_file() and not so.exists():
        _WHY_NOT[str(src)] = f"{src.name} did not compile with {cc} (not tried again while {failed} exists)"
        return None
    tmp = None
    try:
        if not so.exists():
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            subprocess.run([cc, *fl, str(src), "-o", tmp, "-lm"], check=True, capture_output=True)
            os.replace(tmp, so)
            tmp = None
        return ctypes.CDLL(str(so))
    except subprocess.CalledProcessError as e:
        _WHY_NOT[str(src)] = f"{src.name} did not compile with {cc}"
        first = next((line for line in (e.stderr or b"").decode(errors="replace").splitlines() if line.strip()), f"exit {e.returncode}")
        with contextlib.suppress(OSError):  # (a cache that cannot be written: the next run tries again)
            failed.write_text(f"{cc} {' '.join(fl)} {src}: {first}\n")
        return None
    except OSError as e:
        _WHY_NOT[str(src)] = f"{src.name} could not be built or loaded ({e.strerror or e})"
        return None
    finally:
        if tmp is not None:  # a failed build leaves no half-made library in the cache
            Path(tmp).unlink(missing_ok=True)


class Library:
    """A C source built on first use (once per process, thread-safe) with its functions' ctypes signatures.

    ``signatures``: function name -> (argtypes, restype or None). :meth:`get` gives the loaded
    library, or None without a compiler, after a failed build, or while ``CTCONVERT_NATIVE=0``.
    """

    def __init__(self, src: Path, signatures: dict[str, tuple[list, object]]):
        self.src, self.signatures = src, signatures
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if os.environ.get("CTCONVERT_NATIVE", "1") == "0":
            return None
        with self._lock:
            if not self._tried:
                self._tried = True
                lib = build(self.src)
                if lib is not None:
                    for name, (argtypes, restype) in self.signatures.items():
                        fn = getattr(lib, name)
                        fn.argtypes = argtypes
                        if restype is not None:
                            fn.restype = restype
                self._lib = lib
        return self._lib

    def why_not(self) -> str | None:
        """Why :meth:`get` gives no library (a clause: no compiler, a failed build and its marker file ...), or None
        where it gives one or ``CTCONVERT_NATIVE=0`` asked for none."""
        if os.environ.get("CTCONVERT_NATIVE", "1") == "0" or self.get() is not None:
            return None
        return _WHY_NOT.get(str(self.src), "the library did not build")


def threads() -> int:
    return max(1, torch.get_num_threads())


class _Pool:
    """Long-lived daemon worker threads for :func:`parallel_ranges` (one set per process, grown on demand):
    a call hands its ranges to idle workers instead of starting threads (a run makes thousands of calls).
    Daemon threads: an interrupted run never waits for them at exit."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.size = 0
        self.lock = threading.Lock()

    def ensure(self, n: int) -> None:
        with self.lock:
            while self.size < n:
                self.size += 1
                threading.Thread(target=self._work, daemon=True, name=f"ctconvert-cpu-{self.size}").start()

    def _work(self) -> None:
        while True:
            fn, a, b, done = self.tasks.get()
            try:
                fn(a, b)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                done.errors.append(e)
            finally:
                done.release()


_POOL = _Pool()


class _Done:
    """Counts finished ranges of one call; errors raised in workers are collected here."""

    def __init__(self, n: int) -> None:
        self.sem = threading.Semaphore(0)
        self.n = n
        self.errors: list[BaseException] = []

    def release(self) -> None:
        self.sem.release()

    def wait(self) -> None:
        for _ in range(self.n):
            self.sem.acquire()


#: pieces per thread of a :func:`parallel_ranges` call: threads take pieces as they come free, so one that
#: is preempted (readers, writers and hashing share the cores) holds up a small piece, not half the call
PIECES_PER_THREAD = 4


#: elements a kernel call must have per thread before a second thread is woken for it: handing a range to a worker
#: and waiting for it costs 50-150 us on a 2-core machine, about what a quantization kernel takes for 2**17 elements
#: (0.6-2.2 ns an element on one core, ``scripts/bench_small_tensors.py``). A small MoE expert or a norm ran on one
#: thread faster than on two: 64 x 128 NVFP4 55 us on one, 187 us on two
GRAIN_ELEMENTS = 1 << 17


def parallel_ranges(n: int, align: int, fn, per: int = 0, grain: int = GRAIN_ELEMENTS) -> None:
    """Run ``fn(r0, r1)`` over disjoint ranges covering ``range(n)`` (starts aligned to ``align``), on this thread
    and the process's worker threads (:class:`_Pool`, started once). ctypes releases the GIL, so the ranges run in
    parallel. ``range(n)`` is cut into up to :data:`PIECES_PER_THREAD` pieces per thread, which the threads
    take in turn until none are left (``fn`` must not depend on how the rows are cut, or in which order).
    ``per``: elements of one index of ``range(n)`` (a row's columns); given, a call takes one thread per ``grain``
    elements at most, so a small one runs on this thread alone (:data:`GRAIN_ELEMENTS`; 0: no such limit, for
    kernels whose cost is not in proportion to the elements).
    Calls from several threads at once share the workers; a call made from a worker runs its ranges itself
    (no waiting on a busy pool)."""
    t = min(threads(), max(1, n // max(align, 16)))
    if per > 0:
        t = min(t, max(1, n * per // max(1, grain)))
    if t <= 1 or threading.current_thread().name.startswith("ctconvert-cpu-"):
        fn(0, n)
        return
    pieces = min(t * PIECES_PER_THREAD, max(t, n // max(align, 16)))
    step = -(-n // pieces)
    step = -(-step // align) * align
    ranges = [(r0, min(n, r0 + step)) for r0 in range(0, n, step)]
    taken = itertools.count()  # next() is atomic under the GIL: each piece is taken once

    def drain(_a=None, _b=None) -> None:
        for i in taken:
            if i >= len(ranges):
                return
            fn(*ranges[i])

    helpers = min(t, len(ranges)) - 1
    _POOL.ensure(helpers)
    done = _Done(helpers)
    for _ in range(helpers):
        _POOL.tasks.put((drain, 0, 0, done))
    try:
        drain()
    finally:
        done.wait()
    if done.errors:
        raise done.errors[0]
