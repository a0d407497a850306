"""Triton's cache key, computed early on a thread of its own (torch-free).

Triton finds a compiled kernel in its on-disk cache by a key that starts with a hash of Triton itself: of its
compiler's and language's sources and of its compiler library, ``libtriton.so`` (``triton_key`` in
``triton/runtime/cache.py``, Triton 3.x, computed once per process and kept, ``functools.lru_cache``). A process
pays it at its first kernel launch, cache or no cache: on an H100 machine the first launch of a conversion spent
1.40 s there (most of it sha256 of the library), while the computing thread's first MoE batch waited 0.47-0.57 s
for the warm-up's launch to finish (a cProfile of the run's threads; ``scripts/trace_timeline.py``).

:func:`begin` computes it on a daemon thread as soon as the engine is imported, while the command plans, opens its
output and copies the first tensors; the first launch then finds it made. The key is Triton's own function's
result, so nothing about which kernel is used changes; where Triton is missing, or has no such function, nothing
happens, and an error there is kept (:data:`ERROR`) and otherwise ignored: the launch computes the key itself, as it
would have.
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


def _compute() -> None:
    global ERROR
    try:
        import triton.runtime.cache as cache

        fn = getattr(cache, "triton_key", None)
        if fn is None:  # Triton 2.x kept it in the compiler module
            import triton.compiler.compiler as compiler

            fn = getattr(compiler, "triton_key", None)
        if fn is not None:
            fn()
    except BaseException as e:  # noqa: BLE001 - the launch computes the key itself and reports its own errors
        ERROR = e


def begin() -> threading.Thread | None:
    """Start computing Triton's cache key on a daemon thread (once per process); the thread, or None where Triton
    is not installed. Call it after torch is imported: Triton's import then runs beside no other import of torch."""
    global _THREAD
    with _LOCK:
        if _THREAD is None:
            if importlib.util.find_spec("triton") is None:
                return None
            _THREAD = threading.Thread(target=_compute, daemon=True, name="ctconvert-triton-key")
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
    kernels: one of :data:`KERNEL_COMMANDS`, not ``--device cpu``, on a machine with an NVIDIA device node (the test
    :func:`ctconvert.calibration.worker.has_room` makes; torch-free)."""
    if command not in KERNEL_COMMANDS:
        return False
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv) and argv[i + 1] == "cpu" or a == "--device=cpu":
            return False
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0"))
