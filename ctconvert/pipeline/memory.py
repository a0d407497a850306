"""Process memory knobs for long streaming runs.

glibc raises its mmap threshold to the size of each large block it frees (up to 32 MiB, ``mallopt(3)``,
``M_MMAP_THRESHOLD``: "dynamic adjustment"), after which chunk-sized temporaries come from the heaps of
the threads that allocate them and fragment them: requantizing the 1.2B benchmark checkpoint (dequantized
fp32 temporaries made on the reader thread, freed on the computing one) grew to 1.1-1.6 GiB of RSS this
way, against 0.48 GiB with a fixed threshold (``scripts/bench_requantize.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["fix_mmap_threshold"]

_M_MMAP_THRESHOLD = -3  # glibc malloc.h
_done = False


def fix_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Serve allocations of ``nbytes`` and more by ``mmap`` (returned to the system when freed), which also
    turns glibc's dynamic threshold off. Once per process; a no-op (False) where there is no glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        return False
    _done = ok
    return ok
