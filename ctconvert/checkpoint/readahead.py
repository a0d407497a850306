"""Read a checkpoint ahead while the process is still importing torch (torch-free: ``os`` only).

``ctconvert quantize`` spends its first seconds importing torch (1.5-2.3 s on an H200 machine, 3.6-3.9 s with
a cold file cache), and reads nothing meanwhile. :class:`StartupReadAhead` uses that window: a daemon thread reads
every shard's header (the bytes the checkpoint reader parses first), then asks the kernel to bring the tensor
bytes into the page cache (``posix_fadvise(POSIX_FADV_WILLNEED)``, Linux ``mm/fadvise.c``) in file order, one
chunk at a time, each chunk awaited by reading its last byte, until :meth:`StartupReadAhead.stop` (the engine is
imported and reads for itself). Every byte it touches is one the conversion reads, in the order the conversion
reads the shards (index order, else file names sorted, as :func:`ctconvert.checkpoint.reader.open_checkpoint`
lists them); nothing is parsed, nothing is handed on: the conversion reads its own bytes, from the page cache
where the read ahead got there first. On a warm cache it costs one system call per chunk.

With ``hash_sources`` (a local run, which hashes every source tensor for its provenance) it also begins those
hashes, from the headers it read, on the hashing threads (:func:`ctconvert.checkpoint.hashing.hash_early`): the
import leaves a core idle, and the conversion's own hashes of the same ranges then take the results instead of
hashing again (the same bytes hashed the same way: the provenance does not change). Tensors of three or more
dimensions are left out: a fused 3-D experts tensor is hashed by expert region when it is split, not as one range.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

__all__ = ["CHUNK_BYTES", "StartupReadAhead", "shard_files"]

#: bytes asked for (and awaited) at a time; the thread looks at :meth:`StartupReadAhead.stop` between chunks
CHUNK_BYTES = 32 << 20
_INDEX = "model.safetensors.index.json"  # reader.py's INDEX_NAME (that module imports torch)
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)


def shard_files(folder: str | Path) -> list[Path]:
    """The safetensors shards of checkpoint ``folder`` in the order its reader lists them: the index's files
    (sorted, unique) when ``model.safetensors.index.json`` is there, else ``*.safetensors`` sorted by name
    (only ``model.safetensors`` when it is one of several, as the reader does).
    Empty when ``folder`` is not a folder or the index cannot be read (the reader then says why)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    index = root / _INDEX
    if not index.is_file():
        files = sorted(root.glob("*.safetensors"))
        single = root / "model.safetensors"  # several shards but no index: the reader uses model.safetensors only
        return [single] if len(files) > 1 and single.is_file() else files
    try:
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return [root / name for name in sorted(set(weight_map.values())) if (root / name).is_file()]
    except (OSError, ValueError, AttributeError):
        return []


class StartupReadAhead:
    """Reads ``folder``'s shard headers and, with ``data`` (a run that reads every tensor: not a dry run, not
    ``--resume``/``--refresh``), asks for their tensor bytes, on a daemon thread started by :meth:`start`.

    ``on_first_read``: called (on that thread) with ``folder`` just before its first read (the index, or the
    folder's listing), once. ``files``: the shards (:func:`shard_files`, listed on the thread); ``requested``:
    the tensor bytes asked for so far; ``headers``: the header bytes read. ``hash_sources`` (with ``data``): begin the
    source hashes too (module docs); ``hashed``: the hash blocks begun."""

    def __init__(self, folder: str | Path, data: bool = True, chunk: int = CHUNK_BYTES, on_first_read=None, hash_sources: bool = False):
        self.folder = Path(folder)
        self.hash_sources = hash_sources and data
        self.hashed = 0  # hash blocks begun (hash_sources)
        self.files: list[Path] = []
        self.data = data and _WILLNEED is not None
        self.chunk = chunk
        self.requested = 0
        self.headers = 0
        self._on_first_read = on_first_read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ctconvert-readahead", daemon=True)

    def start(self) -> StartupReadAhead:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout`` seconds) until the thread has read all it reads, or was stopped."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stop(self, wait: float | None = None) -> None:
        """No more chunks after the one in flight; with ``wait``, up to that many seconds for the thread to end."""
        self._stop.set()
        if wait is not None:
            self.join(wait)

    def _run(self) -> None:
        if self._stop.is_set():
            return
        if self._on_first_read is not None:
            self._on_first_read(self.folder)
        self.files = shard_files(self.folder)
        fds = []
        try:
            for path in self.files:  # every header first: the reader parses them all before any tensor is read
                if self._stop.is_set():
                    return
                fds.append(self._header(path))
            for fd, start in (f for f in fds if f is not None):
                self._data(fd, start)
        finally:
            for f in fds:
                if f is not None:
                    os.close(f[0])

    def _header(self, path: Path) -> tuple[int, int] | None:
        """Read ``path``'s 8-byte header length and its JSON header; ``(fd, first tensor byte)`` or None."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        size = os.fstat(fd).st_size
        if not 0 < n <= size - 8:  # not a safetensors file: the reader says so
            os.close(fd)
            return None
        raw = os.pread(fd, n, 8)
        self.headers += 8 + len(raw)
        if self.hash_sources:
            self._hash(path, raw, 8 + n)
        return fd, 8 + n

    def _hash(self, path: Path, raw: bytes, base: int) -> None:
        """Begin the hashes of the tensors of ``path`` under three dimensions (``raw``: its JSON header; ``base``:
        its first tensor byte). A header that does not parse is left to the reader, which says why."""
        from .hashing import hash_early  # torch-free

        try:
            header = json.loads(raw)
            spans = [[int(x) for x in e["data_offsets"]] for k, e in header.items() if k != "__metadata__" and len(e["shape"]) < 3]
            ranges = [(base + a, b - a) for a, b in spans]
        except (ValueError, TypeError, KeyError, AttributeError):
            return
        self.hashed += hash_early(path, [r for r in ranges if r[1] > 0])

    def _data(self, fd: int, start: int) -> None:
        size = os.fstat(fd).st_size
        pos = start
        while self.data and pos < size and not self._stop.is_set():
            n = min(self.chunk, size - pos)
            try:
                os.posix_fadvise(fd, pos, n, _WILLNEED)
                os.pread(fd, 1, pos + n - 1)  # wait for the chunk: one in flight at a time
            except OSError:
                return
            self.requested += n
            pos += n
