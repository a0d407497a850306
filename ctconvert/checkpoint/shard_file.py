"""Writing one safetensors shard in place: :class:`ShardFile`, its :class:`PlannedTensor` list, and writeback.

The header is computed from the plan before any data exists (safetensors, https://github.com/huggingface/safetensors,
"Format": an 8-byte little-endian header length, the JSON header, then the data section), so each tensor, or a row
range of it, is written at its final offset with ``os.pwrite``/``os.pwritev`` as soon as it is computed: a shard
never has to be assembled in memory. Each output tensor is hashed as its pieces come
(:class:`~.hashing.StreamHash`), and the shard's dirty pages are handed to the disk as it fills (by one thread of
the process, :class:`Writeback`, so that no writer waits for the disk's queue).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps(s) of a str s
from pathlib import Path

import numpy as np
import torch

from ..errors import CTConvertError, OutputError
from .hashing import HASH_BLOCK_BYTES, RangeHash, StreamHash, combine_shard_hash
from .native_write import available as native_available
from .native_write import write_item
from .safetensors_io import DTYPES

__all__ = ["IOV_MAX", "WRITEBACK", "WRITEBACK_BYTES", "PlannedTensor", "ShardFile", "Writeback", "start_writeback", "writeback_default"]


@dataclass
class PlannedTensor:
    """One output tensor: name, safetensors dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    #: bytes of its data (computed once: a shard of a MoE plans tens of thousands of tensors)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.nbytes = math.prod(self.shape) * DTYPES[self.dtype][1]


#: written bytes after which a shard's dirty pages are handed to the disk (:func:`start_writeback`): small, so that
#: the final fsync finds little left (with 256 MiB a 2-core run waited 0.12 s for it at the end, with 32 MiB 0.01 s)
WRITEBACK_BYTES = 32 * 2**20


def _libc_sync_file_range():
    try:
        import ctypes
        import ctypes.util

        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return fn
    except (OSError, AttributeError):
        return None


_SYNC_FILE_RANGE = _libc_sync_file_range() if os.uname().sysname == "Linux" else None


#: buffers of one ``pwritev`` call, at most (Linux ``IOV_MAX``)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def host_bytes(tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    """A tensor's raw bytes (row-major) as a 1-D uint8 NumPy array: a view where ``tensor`` is a contiguous CPU tensor
    or already an array (what :meth:`ShardFile.write_many` is given from a batch of MoE experts: one array view a
    piece instead of five torch calls, which took ~5 s of the writer threads for 56,000 pieces on 2 cores), else a
    copy (a device tensor is copied to the host)."""
    if isinstance(tensor, np.ndarray):  # (a strided array is copied: its bytes go by address to native_write)
        return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the disk
    works while the conversion goes on and the final fsync has little left; elsewhere nothing. It does not wait for
    the pages to be written, but it does wait for room in the disk's request queue: with the queue full it blocked
    for seconds (below, :class:`Writeback`)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)


def writeback_default() -> bool:
    """Whether shards hand their dirty pages to the disk on a thread of their own (:class:`Writeback`): yes, unless
    the environment says ``CTCONVERT_WRITEBACK_THREAD=0`` (each writer then starts it itself, as before)."""
    return os.environ.get("CTCONVERT_WRITEBACK_THREAD", "1") != "0"


class Writeback:
    """One thread that starts the writeback of the shards that asked for it (:func:`start_writeback`), so that the
    writer threads never wait in it.

    Started by each writer after every :data:`WRITEBACK_BYTES` of a shard, ``sync_file_range`` blocks while the
    disk's request queue is full: in a slow run of the dense 8B on an H100 the four writers spent 3.0 of their 4.5 s
    there (``scripts/profile_site``), and the computing thread waited for them. Here a request only marks the shard
    (a shard asked twice before its turn is started once) and the thread starts it; a shard that closed meanwhile is
    skipped (its ``fd_lock`` keeps the descriptor open while the thread uses it). Process-wide, started on first
    use; a daemon."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, ShardFile] = {}  # id -> shard, in the order asked
        self._thread: threading.Thread | None = None
        self.started = 0  # writebacks started (tests)

    def request(self, shard: ShardFile) -> None:
        with self._cond:
            self._pending.setdefault(id(shard), shard)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="ctconvert-writeback")
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                key = next(iter(self._pending))
                shard = self._pending.pop(key)
            with shard.fd_lock:
                if not shard.closed:
                    start_writeback(shard.fd)
                    self.started += 1


#: the process's writeback thread (:class:`Writeback`)
WRITEBACK = Writeback()
if hasattr(os, "register_at_fork"):  # a forked child has no such thread: its first request starts its own
    os.register_at_fork(after_in_child=WRITEBACK.__init__)


class ShardFile:
    """A safetensors file whose header is fixed up front; data is written in place.

    ``tensors`` gives every tensor the file will hold. The data section is laid
    out largest element size first (so every tensor is aligned to its element
    size, as safetensors' own writer does), then in the given order. The file
    is created at full size; :meth:`write` (one piece) and :meth:`write_many` put
    bytes at their final offsets, and :meth:`close` checks that every byte range
    was written.
    """

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None, on_complete=None):
        self.path = Path(path)
        self.on_complete = on_complete
        self.kept = False
        self.closed = False
        self._lock = threading.Lock()
        self.fd_lock = threading.Lock()  # held while the writeback thread uses the descriptor, and to close it
        self._writeback = WRITEBACK if writeback_default() else None
        self._native = native_available()  # a write item's hashes and pwritevs in one call without the GIL (native_write)
        order = sorted(range(len(tensors)), key=lambda i: -DTYPES[tensors[i].dtype][1])
        existing = metadata == "__existing__"
        meta = {"format": "pt"} if existing or not metadata else dict(metadata)
        self.offsets: dict[str, tuple[int, int]] = {}
        # the header's JSON, entry by entry (what json.dumps(separators=(",", ":")) writes for the same dict, without
        # building it: a MoE shard holds tens of thousands of tensors); names and dtypes escaped by the C escaper that
        # json.dumps of a str calls (the same text, without json.dumps' own overhead 112,000 times)
        parts = ['{"__metadata__":' + json.dumps(meta, separators=(",", ":"))]
        pos = 0
        for i in order:
            t = tensors[i]
            if t.name in self.offsets or t.name == "__metadata__":
                raise ValueError(f"tensor {t.name!r} planned twice in {self.path.name}")
            shape = ",".join(str(int(d)) for d in t.shape)
            parts.append(f'{_json_str(t.name)}:{{"dtype":{_json_str(t.dtype)},"shape":[{shape}],"data_offsets":[{pos},{pos + t.nbytes}]}}')
            self.offsets[t.name] = (pos, t.nbytes)
            pos += t.nbytes
        raw = (",".join(parts) + "}").encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.size = self.data_start + pos
        self.written: dict[str, int] = {t.name: 0 for t in tensors}
        self.remaining = pos
        self._unflushed = 0
        if existing:
            return
        head = struct.pack("<Q", len(raw)) + raw
        self._hashes: dict[str, StreamHash] = {}  # every tensor hashed as it is written (pieces in any order), from its first piece
        header_hash = StreamHash()
        header_hash.update_at(0, head)
        self._header_digest = header_hash.digest()
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(self.fd, self.size)
            self._pwrite(head, 0)
        except OSError as e:
            raise OutputError(f"cannot create shard: {e.strerror or e}", file=self.path) from e

    @classmethod
    def existing(cls, path: Path, tensors: list[PlannedTensor]) -> ShardFile:
        """A shard finished by an earlier run: writes to it are dropped."""
        f = cls(path, tensors, metadata="__existing__")
        f.kept = True
        f.closed = True
        f.written = {t.name: f.offsets[t.name][1] for t in tensors}
        return f

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def write(self, name: str, tensor: torch.Tensor, byte_offset: int = 0) -> None:
        """Write ``tensor``'s bytes into tensor ``name`` starting ``byte_offset`` bytes in.

        ``tensor`` must be a CPU tensor; its raw bytes (row-major) are written,
        so a row range of a row-major tensor can be written on its own.
        """
        self.write_many([(name, tensor, byte_offset)])

    def write_many(self, pieces: list[tuple[str, torch.Tensor | np.ndarray, int]]) -> None:
        """Write several pieces ``(name, CPU tensor or uint8 array of its bytes, byte offset into the tensor)`` (as
        :meth:`write` each), pieces that lie back to back in the file by one ``pwritev`` (a batch of MoE experts: each
        expert's ``weight_packed`` and ``weight_scale`` are neighbours in the file, their global scales too), up to
        :data:`IOV_MAX` buffers a call. Where :func:`.native_write.available`, the whole small tensors' hashes and
        every ``pwritev`` are one call that lets the GIL go once (a MoE batch's dozens of pieces); else piece by piece.
        Raises :class:`OutputError` naming the shard and tensor on an I/O error or a piece that overflows its tensor."""
        if self.kept:
            return
        spans, whole = [], []  # (file offset, bytes, name); (hash, bytes) of whole one-block tensors, hashed natively
        native = self._native and native_available()  # (CTCONVERT_NATIVE=0 set since this file opened: Python from here)
        for name, tensor, byte_offset in pieces:
            start, nbytes = self.offsets[name]
            raw = host_bytes(tensor)
            n = len(raw)
            if byte_offset + n > nbytes:
                raise OutputError(f"internal: write of {n} bytes at {byte_offset} overflows {nbytes}", file=self.path, tensor=name)
            if n:
                h = self._hashes.get(name)
                claimed = False
                if h is None:  # setdefault: writers of one file share it (atomic under the GIL)
                    new = StreamHash()
                    h = self._hashes.setdefault(name, new)
                    claimed = h is new
                if native and claimed and n == nbytes and n <= HASH_BLOCK_BYTES:  # the tensor's one piece
                    whole.append((h, raw))
                else:
                    h.update_at(byte_offset, raw)
                spans.append((self.data_start + start + byte_offset, raw, name))
        spans.sort(key=lambda x: x[0])
        runs, i = [], 0
        while i < len(spans):  # runs of pieces back to back in the file: one pwritev each
            j, end = i + 1, spans[i][0] + len(spans[i][1])
            while j < len(spans) and j - i < IOV_MAX and spans[j][0] == end:
                end += len(spans[j][1])
                j += 1
            runs.append((i, j))
            i = j
        try:
            if native and spans:
                digests = write_item(self.fd, [raw for _, raw in whole], [(spans[a][0], [raw for _, raw, _ in spans[a:b]]) for a, b in runs])
                for (h, raw), d in zip(whole, digests):
                    h.set_whole(d, len(raw))
            else:
                for k, (a, b) in enumerate(runs):
                    try:
                        self._pwritev([raw for _, raw, _ in spans[a:b]], spans[a][0])
                    except OSError as e:
                        e.run = k  # (as write_item's error says which run failed)
                        raise
        except OSError as e:
            raise OutputError(f"write failed: {e.strerror or e}", file=self.path, tensor=spans[runs[getattr(e, "run", 0)][0]][2]) from e
        total = sum(len(raw) for _, raw, _ in spans)
        with self._lock:
            for _, raw, name in spans:
                self.written[name] += len(raw)
            self.remaining -= total
            self._unflushed += total
            kick = self._unflushed >= WRITEBACK_BYTES and self.remaining > 0
            if kick:
                self._unflushed = 0
            done = self.remaining == 0 and self.on_complete is not None
        if kick:
            if self._writeback is not None:
                self._writeback.request(self)
            else:
                start_writeback(self.fd)
        if done:
            self.on_complete(self)

    def _pwritev(self, bufs: list, offset: int) -> None:
        """All of ``bufs`` (uint8 arrays) back to back from ``offset``: one ``pwritev``, the rest of a short write piece
        by piece."""
        if len(bufs) == 1:
            self._pwrite(bufs[0], offset)
            return
        done = os.pwritev(self.fd, bufs, offset)
        for b in bufs:  # a short write (rare): the rest, from where it stopped
            n = len(b)
            if done < n:
                self._pwrite(memoryview(b).cast("B")[done:], offset + done)
                done = n
            offset += n
            done -= n

    def content_hash(self) -> str:
        """The shard's content hash (:func:`.hashing.combine_shard_hash`) from the hashes taken as its tensors were
        written (in any order); a tensor whose pieces overlapped is hashed from the file. Call once every byte is written."""
        digests = []
        for name in sorted(self.offsets, key=lambda k: self.offsets[k]):
            h = self._hashes.get(name) or StreamHash()  # an empty tensor: nothing was written
            if h.complete(self.offsets[name][1]):
                digests.append(h.digest())
            else:
                b, k = self.offsets[name]
                digests.append(bytes.fromhex(RangeHash(self.path, self.data_start + b, k).hexdigest()))
        return combine_shard_hash(self._header_digest, digests)

    def _mark_closed(self) -> bool:
        """Mark the file closed; False when it already was (close and abort run once, whichever comes first)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def close(self) -> None:
        """Flush to disk and check that every tensor got all its bytes (once)."""
        if not self._mark_closed():
            return
        try:
            missing = [n for n, k in self.written.items() if k != self.offsets[n][1]]
            if missing:
                # ctconvert's own inconsistency (a planned tensor no task wrote), not the disk's: exit 1
                raise CTConvertError(f"internal: {len(missing)} tensors incompletely written, e.g. {missing[0]}", file=self.path)
            os.fsync(self.fd)
        except OSError as e:
            raise OutputError(f"cannot flush: {e.strerror or e}", file=self.path) from e
        finally:
            with self.fd_lock:
                os.close(self.fd)

    def abort(self) -> None:
        """Close the file without flushing or checking (a failed conversion; once)."""
        if not self._mark_closed():
            return
        try:
            with self.fd_lock:
                os.close(self.fd)
        except OSError:
            pass
