"""Triton's cache key, computed early on a thread of its own (torch-free).

Triton finds a compiled kernel in its on-disk cache by a key that starts with a hash of Triton itself: of its
compiler's and language's sources and of its compiler library, ``libtriton.so`` (``triton_key`` in
``triton/runtime/cache.py``, Triton 3.x, computed once per process and kept, ``functools.lru_cache``). A process
pays it at its first kernel launch, cache or no cache: on an H100 machine the first launch of a conversion spent
1.40 s there (most of it sha256 of the library), while the computing thread's first MoE batch waited 0.47-0.57 s
for the warm-up's launch to finish (a cProfile of the run's threads; ``scripts/trace_timeline.py``).

:func:`begin` computes the key on a daemon thread (~0.5 s on an H100 host, mostly hashing with the GIL released);
with ``import_here`` it first imports Triton on the calling thread (~0.35 s there). The console script calls it so,
*before* it imports torch (:mod:`ctconvert.__main__`), so that the hashing runs beside torch's import (1.5 s or more) and the key is made
before the command starts: begun after torch's import instead, the key took 0.7-0.9 s of the call, the warm-up
waited 0.56-0.62 s for it, and a Qwen3-MoE run's first batch of experts 0.29-0.39 s (an H100, 2026-12-07;
``scripts/trace_timeline.py``, "start-up events"). There only the hashing is on the other thread, never an import:
the key made after ``import triton`` imports no module (checked on that machine), so no import runs on two threads
at once. The key is Triton's own function's result, so nothing about which kernel is used changes; where Triton is
missing, or has no such function, nothing happens, and an error there (its import's too) is kept (:data:`ERROR`)
and otherwise ignored: the launch computes the key itself, as it would have.
"""

from __future__ import annotations

import importlib.util
import os
import threading

__all__ = ["KERNEL_COMMANDS", "begin", "wait", "wanted"]

_THREAD: threading.Thread | None = None
_LOCK = threading.Lock()
#: the exception the early computation raised, if any (the first launch then computes the key itself)
ERROR: BaseException | None = None


def _key_function():
    """Triton's ``triton_key`` (imported here, on the calling thread), or None where this Triton has none."""
    import triton.runtime.cache as cache

    fn = getattr(cache, "triton_key", None)
    if fn is None:  # Triton 2.x kept it in the compiler module
        import triton.compiler.compiler as compiler

        fn = getattr(compiler, "triton_key", None)
    return fn


def _compute(fn=None) -> None:
    """Make the key with ``fn`` (Triton's function), or import Triton first where it is None."""
    global ERROR
    try:
        fn = fn or _key_function()
        if fn is not None:
            fn()
    except BaseException as e:  # noqa: BLE001 - the launch computes the key itself and reports its own errors
        ERROR = e


def begin(import_here: bool = False) -> threading.Thread | None:
    """Make Triton's cache key on a daemon thread (once per process); the thread, or None where Triton is not
    installed. ``import_here``: import Triton on the calling thread first (the console script, before torch's import:
    only the hashing runs beside that import; None also where the import fails, :data:`ERROR` saying why, or this
    Triton has no key function); else the thread imports it too (the API, after torch's import: beside the plan, as
    the key's whole making was before the console script began it early)."""
    global _THREAD, ERROR
    with _LOCK:
        if _THREAD is None:
            if importlib.util.find_spec("triton") is None:
                return None
            fn = None
            if import_here:
                try:
                    fn = _key_function()
                except Exception as e:  # noqa: BLE001 - a broken Triton: its first launch says so, as it would have
                    ERROR = e
                    return None
                if fn is None:
                    return None
            _THREAD = threading.Thread(target=_compute, args=(fn,), daemon=True, name="ctconvert-triton-key")
            _THREAD.start()
        return _THREAD


def wait() -> None:
    """Wait for the key :func:`begin` is making, if it began (a first launch would otherwise make it again beside
    it: ``lru_cache`` does not hold a second caller back); at once where it did not."""
    t = _THREAD
    if t is not None:
        t.join()


#: the commands that may launch Triton kernels (``quantize`` and ``repack`` take ``--device``; ``batch`` runs quantize
#: jobs); ``inspect``, ``verify``, ``decompress`` and ``convert`` compute on the CPU
KERNEL_COMMANDS = ("quantize", "repack", "batch")


def wanted(command: str | None, argv: list[str]) -> bool:
    """Whether command line ``argv``, of command ``command`` (its first word that names one), may launch Triton
    kernels: one of :data:`KERNEL_COMMANDS`, not ``--device cpu`` nor ``--dry-run`` (which computes nothing), on a
    machine with an NVIDIA device node (the test :func:`ctconvert.calibration.worker.has_room` makes; torch-free)."""
    if command not in KERNEL_COMMANDS or "--dry-run" in argv:
        return False
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv) and argv[i + 1] == "cpu" or a == "--device=cpu":
            return False
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0"))
