"""Content hashes of source tensors (provenance) and output shards: fixed-size blocks hashed in parallel.

A hash here is xxHash XXH3-128 (https://github.com/Cyan4973/xxHash; sha256
when the ``xxhash`` package is missing) in *block form*: the bytes are cut
into consecutive blocks of :data:`HASH_BLOCK_BYTES` (the last one shorter),
each block is hashed on its own, and the hash is the XXH3-128 of the
concatenated 16-byte block digests, in order (an empty range: the hash of no
digests). Blocks are hashed on a few worker threads (xxhash and ``preadv``
release the GIL), each block read from the page cache into the thread's own
buffer, so hashing runs beside a conversion, off its critical path. :data:`HASH_SCHEME` names
the algorithm and block size; it is recorded with every hash (provenance
format 2). ``legacy=True`` gives the format-1 hash (one XXH3-128 over all the
bytes), for comparing with outputs of earlier releases.
"""

from __future__ import annotations

import hashlib
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
#: block hashes begun by :func:`hash_early`, by ``(st_dev, st_ino, st_size, st_mtime_ns, start, nbytes)``: taken
#: (once) by the :class:`RangeHash` of the same block of the same, unchanged file
_EARLY: dict[tuple, Future] = {}
_LOCAL = threading.local()  # each hashing thread's read buffer (_hash_range)
READ_PIECE_BYTES = 4 * 2**20  # bytes of one read of a block being hashed


def _pool() -> ThreadPoolExecutor:
    """The process's hashing threads (started once; at most 4: hashing runs at memory speed)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="ctconvert-hash")
        return _POOL


def _hash_range(path: Path, start: int, nbytes: int, legacy: bool = False):
    """Digest (bytes) of ``nbytes`` of ``path`` from ``start`` (``legacy``: hex of the whole range), read by ``preadv``
    in pieces of :data:`READ_PIECE_BYTES` into one buffer per hashing thread (reused: a thread's resident memory is that
    buffer). Raises ``OSError`` where the file is shorter than the range.

    Reading into a buffer replaced a read-only mapping of each block (an H100, 2026-12-06: Qwen3-MoE NVFP4A16 call
    4.56 -> 3.99 s, gpt-oss 5.23 -> 4.62 s, min of 3; ``scripts/bench_batches.py --variants``): mapping and unmapping
    16 MiB per block, and faulting its pages in, took as long as hashing it, and unmapping stalls every thread of
    the process (the readers, writers and the computing thread) on the address space's lock."""
    return _Part.value(_hash_spans(path, [(start, nbytes)], legacy)[0])


def _hash_spans(path: Path, spans: list[tuple[int, int]], legacy: bool = False) -> list:
    """:func:`_hash_range` of each span ``(start, nbytes)`` of ``path``, the file opened once (a job of several small
    ranges: :func:`_submit`); a span the file does not hold gets its ``OSError`` in its place (the other spans of
    the job are hashed: an error belongs to the tensor whose bytes are missing). Raises ``OSError`` where the file
    cannot be opened."""
    out: list = []
    buf = getattr(_LOCAL, "buf", None)
    if buf is None:
        buf = _LOCAL.buf = memoryview(bytearray(READ_PIECE_BYTES))
    fd = os.open(path, os.O_RDONLY) if any(k for _, k in spans) else None
    try:
        for start, nbytes in spans:
            h = new_hasher()
            pos, end = start, start + nbytes
            try:
                while pos < end:
                    k = os.preadv(fd, [buf[: min(len(buf), end - pos)]], pos)
                    if k <= 0:
                        raise OSError(f"{path} is shorter than expected (needs {end} bytes)")
                    h.update(buf[:k])
                    pos += k
            except OSError as e:
                out.append(e)
                continue
            out.append(h.hexdigest() if legacy else h.digest())
    finally:
        if fd is not None:
            os.close(fd)
    return out


class _Part:
    """One span's digest from a job that hashes several spans (:func:`_submit`); ``result()`` as a future's."""

    __slots__ = ("future", "index")

    def __init__(self, future: Future, index: int):
        self.future, self.index = future, index

    def result(self):
        return self.value(self.future.result()[self.index])

    @staticmethod
    def value(r):
        """A span's digest, or its error raised (:func:`_hash_spans`)."""
        if isinstance(r, BaseException):
            raise r
        return r


#: spans of one file hashed by one job on a hashing thread at most, and their bytes: a MoE's thousands of expert
#: tensors of a few MiB each are a few jobs, not a future each (18,867 futures took ~0.7 s of the main thread before
#: a 48-layer, 128-expert checkpoint's first read, with the hashing threads contending for the GIL)
JOB_SPANS = 256
JOB_BYTES = HASH_BLOCK_BYTES


def _submit(path: Path, spans: list[tuple[int, int]]) -> list[_Part]:
    """Hash ``spans`` of ``path`` on the hashing threads: consecutive spans together in jobs of at most
    :data:`JOB_SPANS` spans and :data:`JOB_BYTES` bytes (a larger span alone). One :class:`_Part` per span, in order."""
    parts: list[_Part] = []
    i = 0
    while i < len(spans):
        j, total = i + 1, spans[i][1]
        while j < len(spans) and j - i < JOB_SPANS and total + spans[j][1] <= JOB_BYTES:
            total += spans[j][1]
            j += 1
        fut = _pool().submit(_hash_spans, path, spans[i:j])
        parts += [_Part(fut, k) for k in range(j - i)]
        i = j
    return parts


def _identity(path) -> tuple:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _spans(start: int, nbytes: int) -> list[tuple[int, int]]:
    """The blocks ``(offset, nbytes)`` of a range: :data:`HASH_BLOCK_BYTES` each from its start, the last one shorter."""
    if 0 < nbytes <= HASH_BLOCK_BYTES:  # most tensors: one block
        return [(start, nbytes)]
    return [(start + b, min(HASH_BLOCK_BYTES, nbytes - b)) for b in range(0, nbytes, HASH_BLOCK_BYTES)]


def _early(path: Path, spans: list[tuple[int, int]]) -> list:
    """The block hashes :func:`hash_early` began for ``spans`` of ``path`` (as the file is now: same inode, size and
    modification time), taken (once); None for each span it did not begin."""
    if not _EARLY:
        return [None] * len(spans)
    try:
        ident = _identity(path)
    except OSError:
        return [None] * len(spans)  # the hash itself says why
    with _POOL_LOCK:
        return [_EARLY.pop((*ident, b, k), None) for b, k in spans]


def _blocks(path: Path, spans: list[tuple[int, int]]) -> list:
    """The block hashes of ``spans`` (blocks, :func:`_spans`) of ``path``, on the hashing threads: those
    :func:`hash_early` began for this file taken from there, the others submitted now (small ones together)."""
    early = _early(path, spans)
    todo = [s for s, f in zip(spans, early) if f is None]
    new = iter(_submit(path, todo) if todo else [])
    return [f if f is not None else next(new) for f in early]


def hash_early(path: Path, ranges: list[tuple[int, int]]) -> int:
    """Begin the block hashes of ``ranges`` (``(absolute offset, nbytes)`` of tensors in ``path``) on the hashing
    threads now, before anything asks for them: a :class:`RangeHash` of the same range of the same unchanged file
    later takes them instead of hashing again (the console script hashes a source while it imports torch, on a core
    the import leaves idle: :mod:`ctconvert.checkpoint.readahead`). Returns the blocks begun (0: ``path`` cannot be
    read; the conversion then says why). What no hash takes is never waited for."""
    try:
        ident = _identity(path)
    except OSError:
        return 0
    spans = [s for start, nbytes in ranges for s in _spans(start, nbytes)]
    parts = _submit(path, spans)
    with _POOL_LOCK:
        for (b, k), part in zip(spans, parts):
            _EARLY[(*ident, b, k)] = part
    return len(spans)


class RangeHash:
    """The block hash of one byte range of a file, computed on the hashing threads; :meth:`hexdigest` waits."""

    def __init__(self, path: Path, start: int, nbytes: int, legacy: bool = False, blocks: list | None = None):
        if blocks is not None:  # begun by the caller (SourceHashes: many ranges' blocks submitted together)
            self.blocks: list = blocks
        elif legacy:
            self.blocks = [_pool().submit(_hash_range, path, start, nbytes, True)]
        else:
            self.blocks = _blocks(path, _spans(start, nbytes))
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


def stored_ranges(info) -> list[tuple[Path, int, int]]:
    """The stored byte ranges ``(file, absolute offset, nbytes)`` a source tensor's bytes come from: its own range; for a derived tensor
    with a ``view`` (an interleaved or transposed expert of a fused 3-D tensor) the whole expert
    region it is taken from (its own bytes are not one range); for a *virtual* tensor (a dequantized
    weight of a quantized source, :mod:`.sources`) the ranges of the stored tensors it is computed from."""
    virtual = getattr(info, "virtual", None)
    if virtual is not None:
        return [r for part in virtual.stored() for r in stored_ranges(part)]
    view = getattr(info, "view", None)
    if view is not None:
        return [(info.file, info.start, view.rows * view.cols * info.itemsize)]
    return [(info.file, info.start, info.nbytes)]


class _Combined:
    """The hash of several ranges: the block hash of their hashes, in order."""

    def __init__(self, parts: list[RangeHash]):
        self.parts = parts
        self._hex: str | None = None

    def hexdigest(self) -> str:
        if self._hex is None:
            h = new_hasher()
            for p in self.parts:
                h.update(bytes.fromhex(p.hexdigest()))
            self._hex = h.hexdigest()
        return self._hex


class SourceHashes:
    """Block hashes of source tensors, started at once on the hashing threads (in the given order, so the
    pages are read about when the conversion reads them) and waited for by name with :meth:`get`.
    ``infos``: objects with ``name``, ``file``, ``start`` (absolute offset) and ``nbytes`` (:class:`TensorInfo`)."""

    def __init__(self, infos, legacy: bool = False):
        self._hashes: dict[str, RangeHash | _Combined] = {}
        todo: list[tuple[str, list[tuple[Path, int, int]], bool]] = []  # (name, stored ranges, whether its own range)
        for info in infos:
            if info.name not in self._hashes:
                self._hashes[info.name] = None  # type: ignore[assignment]  # (made below)
                ranges = stored_ranges(info)
                todo.append((info.name, ranges, len(ranges) == 1 and ranges[0] == (info.file, info.start, info.nbytes)))
        if legacy:
            for name, ranges, own in todo:
                self._hashes[name] = RangeHash(*ranges[0], True) if own else _Combined([RangeHash(*r, True) for r in ranges])
            return
        # every range's blocks: those hash_early began taken, the others submitted in order, small ones together; a
        # range several tensors come from (gpt-oss's gate and up: one expert region) is hashed once
        unique = list(dict.fromkeys(r for _, ranges, _ in todo for r in ranges))
        paths: dict = {}  # one Path per file (18,867 Path() calls took 0.18 s of a 48-layer MoE's start, profiled)
        for f, _, _ in unique:
            if f not in paths:
                paths[f] = f if isinstance(f, Path) else Path(f)
        blocks_of = [_spans(start, nbytes) for _, start, nbytes in unique]  # each range's blocks, made once
        spans = [(paths[r[0]], sp) for r, bl in zip(unique, blocks_of) for sp in bl]
        blocks: list = []
        i = 0
        while i < len(spans):  # runs of one file
            j = i
            while j < len(spans) and spans[j][0] is spans[i][0]:  # (one Path object per file: above)
                j += 1
            blocks += _blocks(spans[i][0], [sp for _, sp in spans[i:j]])
            i = j
        at = iter(blocks)
        by_range = {r: RangeHash(*r, blocks=[next(at) for _ in bl]) for r, bl in zip(unique, blocks_of)}
        for name, ranges, own in todo:  # a derived tensor: the hash of the stored ranges it comes from (docs above)
            hs = [by_range[r] for r in ranges]
            self._hashes[name] = hs[0] if own else _Combined(hs)

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
    return RangeHash(path, 0, Path(path).stat().st_size).hexdigest()


class _Digested:
    """A block's hasher whose digest was computed elsewhere (:meth:`StreamHash.set_whole`)."""

    def __init__(self, digest: bytes) -> None:
        self._digest = digest

    def digest(self) -> bytes:
        return self._digest


class StreamHash:
    """The block hash of a byte range fed piece by piece, in any order (an output tensor as its chunks are written,
    by several writer threads).

    :meth:`update_at` takes the bytes at ``offset`` into the range. The hash is per block of
    :data:`HASH_BLOCK_BYTES` (as :class:`RangeHash` computes it from a file), so pieces of different blocks are hashed
    as they come; within a block the bytes must be fed in order, so a piece that starts after bytes of its block not
    seen yet is kept (a copy of at most one block's share of it) until they come. :meth:`complete` says whether every
    byte of a range of ``nbytes`` was fed exactly once; overlapping pieces make the hash unknown (:attr:`ok` False:
    the caller hashes the range from the file instead)."""

    def __init__(self) -> None:
        self.pos = 0  # bytes hashed so far (all the range's, once complete)
        self.ok = True
        self._open: dict[int, list] = {}  # block -> [hasher, bytes fed]
        self._done: dict[int, bytes] = {}  # block -> digest of a full block
        self._early: dict[int, bytes] = {}  # offset -> bytes that came before the rest of their block
        self._lock = threading.Lock()

    def update_at(self, offset: int, data) -> None:
        view = memoryview(data).cast("B")
        with self._lock:
            i, n = 0, len(view)
            while i < n and self.ok:
                off = offset + i
                k = min(n - i, HASH_BLOCK_BYTES - off % HASH_BLOCK_BYTES)
                self._feed(off, view[i : i + k])
                i += k

    def _feed(self, off: int, piece) -> None:
        """Bytes ``piece`` at ``off``, all in one block: hashed if they continue it, else kept; then the kept bytes
        that now continue it."""
        while True:
            b, at = divmod(off, HASH_BLOCK_BYTES)
            st = self._open.get(b)
            fed = st[1] if st is not None else (HASH_BLOCK_BYTES if b in self._done else 0)
            if at < fed or (at > fed and off in self._early):  # bytes already fed: overlapping writes
                self.ok = False
                return
            if at > fed:
                self._early[off] = bytes(piece)
                return
            if st is None:
                st = self._open[b] = [new_hasher(), 0]
            st[0].update(piece)
            st[1] += len(piece)
            self.pos += len(piece)
            if st[1] == HASH_BLOCK_BYTES:
                self._done[b] = st[0].digest()
                del self._open[b]
            off += len(piece)
            if off % HASH_BLOCK_BYTES == 0:  # the block is done (a block's first bytes are never kept)
                return
            piece = self._early.pop(off, None)
            if piece is None:
                return

    def set_whole(self, digest: bytes, nbytes: int) -> None:
        """Record the range as one piece of ``nbytes`` (at most :data:`HASH_BLOCK_BYTES`: one block) whose block digest
        ``digest`` was computed elsewhere (:func:`.native_write.write_item`, the XXH3-128 of those bytes, as
        :meth:`update_at` would compute it). Where bytes were fed already (another piece of the range), the hash is
        unknown (:attr:`ok` False), as for overlapping pieces."""
        if not 0 < nbytes <= HASH_BLOCK_BYTES:
            raise ValueError(f"set_whole takes one block's range, not {nbytes} bytes")
        with self._lock:
            if self.pos or self._open or self._done or self._early:
                self.ok = False
                return
            if nbytes == HASH_BLOCK_BYTES:
                self._done[0] = digest
            else:
                self._open[0] = [_Digested(digest), nbytes]
            self.pos = nbytes

    def complete(self, nbytes: int) -> bool:
        """Whether the hash covers exactly bytes ``[0, nbytes)``, each once."""
        with self._lock:
            if not self.ok or self._early or self.pos != nbytes:
                return False
            full, rest = divmod(nbytes, HASH_BLOCK_BYTES)
            return len(self._done) == full and all(b in self._done for b in range(full)) and (rest == 0 or (full in self._open and self._open[full][1] == rest))

    def digest(self) -> bytes:
        """The 16-byte block hash (as :class:`RangeHash` computes it from a file) of the bytes fed, once
        :meth:`complete`."""
        h = new_hasher()
        for b in sorted(self._done):
            h.update(self._done[b])
        for b in sorted(self._open):
            h.update(self._open[b][0].digest())
        return h.digest()


def combine_shard_hash(header: bytes, tensors: list[bytes]) -> str:
    """A shard's content hash: XXH3-128 over the block hashes (16-byte digests) of its header bytes, then of each
    tensor's bytes in file order (the tensors tile the data section, so this covers every byte of the file)."""
    h = new_hasher()
    h.update(header)
    for d in tensors:
        h.update(d)
    return h.hexdigest()


def shard_hash(path: Path) -> str:
    """:func:`combine_shard_hash` of a safetensors file, computed from its bytes (resume checks, reused shards):
    the header and every tensor hashed in parallel on the hashing threads."""
    import json
    import struct

    path = Path(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    start = 8 + n
    ranges = sorted((int(e["data_offsets"][0]), int(e["data_offsets"][1]) - int(e["data_offsets"][0])) for e in header.values())
    head = RangeHash(path, 0, start)
    parts = [RangeHash(path, start + b, k) for b, k in ranges]
    return combine_shard_hash(bytes.fromhex(head.hexdigest()), [bytes.fromhex(p.hexdigest()) for p in parts])
