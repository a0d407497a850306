"""A shard writer's item in one call without the GIL (``write_item.c``): the XXH3-128 digests of the whole small
tensors it holds and every ``pwritev`` of its runs.

Why: a writer thread lets the GIL go for each ``pwritev`` and for each hash update of more than 64 KiB (python-xxhash
4.1 ``_xxhash.c``: ``XXHASH_GIL_MINSIZE``), and takes it back after each. While the computing thread runs Python (a
MoE batch's staging, flags and graph replay), each taking back waits up to the interpreter's switch interval (5 ms).
A MoE shard is written in many small pieces (gpt-oss's 8B shapes: ~3,150 pieces and ~1,600 runs a GB, against ~700
of each for a dense 8B), so its writers waited in proportion: on the 2-core machine, replaying the recorded writes of
both beside a thread running Python, hashing as the writers do took gpt-oss's pieces from 0.27 to 0.13 GB/s and the
dense 8B's from 0.27 to 0.23 GB/s.

The hash is the xxhash library's own ``XXH3_128bits``, which python-xxhash's extension module exports (looked up with
ctypes); where it does not, where ctconvert hashes with SHA-256 (no xxhash), without a C compiler or with
``CTCONVERT_NATIVE=0``, :func:`available` is False and :class:`~.shard_file.ShardFile` hashes and writes piece by
piece in Python, as before. Both give the same bytes and digests (``tests/checkpoint/test_native_write.py``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np

from .. import cbuild
from .hashing import HASH_NAME

__all__ = ["available", "write_item"]

_p, _i = ctypes.c_void_p, ctypes.c_int
_LIB = cbuild.Library(Path(__file__).with_name("write_item.c"), {"ct_write_item": ([_i, _p, _i, _p, _p, _p, _i, _p, _p, _p, _p, ctypes.c_int64], _i)})
_HASH: list = []  # [address of XXH3_128bits or None], found once
_HASH_LOCK = threading.Lock()


def _xxh3_128_address() -> int | None:
    """The address of ``XXH3_128bits`` in python-xxhash's extension module, or None (no xxhash, another hash, or a
    build that does not export it)."""
    with _HASH_LOCK:
        if not _HASH:
            addr = None
            if HASH_NAME == "xxh3_128":
                try:
                    import xxhash._xxhash as ext

                    addr = ctypes.cast(ctypes.CDLL(ext.__file__).XXH3_128bits, ctypes.c_void_p).value
                except (ImportError, OSError, AttributeError):
                    addr = None
            _HASH.append(addr)
        return _HASH[0]


def available() -> bool:
    """Whether :func:`write_item` can run here (the C library is built and the hash found)."""
    return _LIB.get() is not None and _xxh3_128_address() is not None


def why_not() -> str | None:
    """Why :func:`available` is false here (a clause for a note: the shards are then written and hashed from Python,
    which waits for the GIL after each write and hash while the computing thread runs Python), or None where it is
    true or ``CTCONVERT_NATIVE=0`` asked for the Python path."""
    if os.environ.get("CTCONVERT_NATIVE", "1") == "0" or available():
        return None
    if HASH_NAME != "xxh3_128":
        return "the xxhash package is not installed (the hashes are SHA-256)"
    return _LIB.why_not() or "python-xxhash's extension does not export XXH3_128bits"


def _address(a: np.ndarray) -> int:
    if not a.flags.c_contiguous:  # its nbytes from its first byte would be other bytes
        raise ValueError("native_write takes C-contiguous arrays only")
    return a.__array_interface__["data"][0]


def write_item(fd: int, whole: list[np.ndarray], runs: list[tuple[int, list[np.ndarray]]], cap: int = 0) -> list[bytes]:
    """Hash each array of ``whole`` (C-contiguous uint8: a tensor's bytes) with XXH3-128, then write each run
    ``(file offset, [uint8 arrays back to back])`` into ``fd``, all in one call that holds no GIL. Returns the
    16-byte canonical digests of ``whole``, in order (equal to ``xxhash.xxh3_128(a).digest()``). Raises ``OSError``
    (its ``errno`` the failed ``pwritev``'s) with attribute ``run``, the index of the run that failed (the runs before it
    are written). ``cap``: 0, or at most this many bytes a ``pwritev`` (tests force short writes with it; each is
    finished from where it stopped). Call only where :func:`available`."""
    lib, fn = _LIB.get(), _xxh3_128_address()
    if lib is None or fn is None:
        raise RuntimeError("native_write.write_item called where it is not available")
    hp = np.array([_address(a) for a in whole], dtype=np.uint64)
    hl = np.array([a.nbytes for a in whole], dtype=np.uint64)
    digests = np.empty(16 * max(1, len(whole)), dtype=np.uint8)
    bufs = [b for _, bs in runs for b in bs]
    iov = np.array([(_address(b), b.nbytes) for b in bufs], dtype=np.uint64).reshape(-1, 2)
    offsets = np.array([o for o, _ in runs], dtype=np.int64)
    counts = np.array([len(bs) for _, bs in runs], dtype=np.int32)
    failed = np.zeros(1, dtype=np.int32)
    rc = lib.ct_write_item(
        fd, fn, len(whole), _address(hp), _address(hl), _address(digests), len(runs), _address(offsets), _address(counts), _address(iov), _address(failed), cap
    )
    if rc != 0:
        err = OSError(-rc, os.strerror(-rc))
        err.run = int(failed[0])
        raise err
    raw = digests.tobytes()
    return [raw[16 * i : 16 * i + 16] for i in range(len(whole))]
