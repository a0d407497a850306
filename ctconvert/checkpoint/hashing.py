"""Content hashes of source tensors (provenance) and output shards: fixed-size blocks hashed in parallel.

A hash here is xxHash XXH3-128 (https://github.com/Cyan4973/xxHash; sha256
when the ``xxhash`` package is missing) in *block form*: the bytes are cut
into consecutive blocks of :data:`HASH_BLOCK_BYTES` (the last one shorter),
each block is hashed on its own, and the hash is the XXH3-128 of the
concatenated 16-byte block digests, in order (an empty range: the hash of no
digests). Blocks are hashed on a few worker threads (xxhash releases the GIL)
straight from a read-only mapping of the file (the page cache), so hashing
runs beside a conversion, off its critical path. :data:`HASH_SCHEME` names
the algorithm and block size; it is recorded with every hash (provenance
format 2). ``legacy=True`` gives the format-1 hash (one XXH3-128 over all the
bytes), for comparing with outputs of earlier releases.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

try:
    import xxhash

    HASH_NAME = "xxh3_128"

    def new_hasher():
        return xxhash.xxh3_128()
except ImportError:  # pragma: no cover - xxhash is a dependency; kept for minimal installs
    HASH_NAME = "sha256"

    def new_hasher():
        return hashlib.sha256()


HASH_BLOCK_BYTES = 16 * 2**20
#: the hash algorithm and its block size, as recorded in provenance and journals
HASH_SCHEME = f"{HASH_NAME}/blocks-{HASH_BLOCK_BYTES}"

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's hashing threads (started once; at most 4: hashing runs at memory speed)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="ctconvert-hash")
        return _POOL


def _digest(view) -> bytes:
    h = new_hasher()
    h.update(view)
    return h.digest()


class _Mapped:
    """A read-only mapping of one file (empty files have none)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        self.view = memoryview(self.mm) if self.mm is not None else memoryview(b"")

    def range(self, start: int, nbytes: int):
        if start + nbytes > len(self.view):
            raise OSError(f"{self.path} is shorter than expected ({len(self.view)} bytes, needs {start + nbytes})")
        return self.view[start : start + nbytes]


class RangeHash:
    """The block hash of one byte range of a file, computed on the hashing threads; :meth:`hexdigest` waits."""

    def __init__(self, mapped: _Mapped, start: int, nbytes: int, legacy: bool = False):
        view = mapped.range(start, nbytes)
        if legacy:
            self.blocks: list[Future] = [_pool().submit(_legacy_hex, view)]
        else:
            self.blocks = [_pool().submit(_digest, view[b : b + HASH_BLOCK_BYTES]) for b in range(0, nbytes, HASH_BLOCK_BYTES)]
        self.legacy = legacy
        self._hex: str | None = None

    def hexdigest(self) -> str:
        if self._hex is None:
            if self.legacy:
                self._hex = self.blocks[0].result()
            else:
                h = new_hasher()
                for f in self.blocks:
                    h.update(f.result())
                self._hex = h.hexdigest()
            self.blocks = []
        return self._hex


def _legacy_hex(view) -> str:
    h = new_hasher()
    for b in range(0, len(view), 64 * 2**20):
        h.update(view[b : b + 64 * 2**20])
    return h.hexdigest()


class SourceHashes:
    """Block hashes of source tensors, started at once on the hashing threads (in the given order, so the
    pages are read about when the conversion reads them) and waited for by name with :meth:`get`.
    ``infos``: objects with ``name``, ``file``, ``start`` (absolute offset) and ``nbytes`` (:class:`TensorInfo`)."""

    def __init__(self, infos, legacy: bool = False):
        self._maps: dict[Path, _Mapped] = {}
        self._hashes: dict[str, RangeHash] = {}
        for info in infos:
            if info.name in self._hashes:
                continue
            m = self._maps.get(info.file)
            if m is None:
                m = self._maps[info.file] = _Mapped(info.file)
            self._hashes[info.name] = RangeHash(m, info.start, info.nbytes, legacy)

    def __contains__(self, name: str) -> bool:
        return name in self._hashes

    def get(self, name: str) -> str:
        """The hex hash of tensor ``name`` (waits for its blocks; re-raises a read error)."""
        return self._hashes[name].hexdigest()

    def all(self) -> dict[str, str]:
        return {n: h.hexdigest() for n, h in self._hashes.items()}


def hash_tensor_bytes(info, legacy: bool = False) -> str:
    """The block hash of one source tensor's bytes (``legacy``: the format-1 hash of all its bytes)."""
    return SourceHashes([info], legacy=legacy).get(info.name)


def hash_tensors(infos, legacy: bool = False) -> dict[str, str]:
    """Block hashes of many source tensors, in parallel: name -> hex."""
    return SourceHashes(infos, legacy=legacy).all()


def file_hash(path: Path) -> str:
    """The block hash of a whole file's bytes (finished output shards; blocks hashed in parallel)."""
    m = _Mapped(path)
    return RangeHash(m, 0, len(m.view)).hexdigest()
