"""Low-level safetensors file access: header parsing, ranged reads, planned writes.

The safetensors container (https://github.com/huggingface/safetensors, "Format"):
an 8-byte little-endian u64 ``N``, then ``N`` bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the data section that follows the header) plus an optional ``__metadata__`` map
of strings. Data is little-endian, row-major, and the ranges tile the data
section without gaps or overlaps.

Reading goes through ``os.pread`` into tensors that we own (:func:`read_rows`,
:func:`read_bytes`), so the bytes held in memory are exactly the bytes asked
for, and a row range of a tensor can be read on its own; on the CPU the
executor may instead take row ranges as read-only views of a private mapping
of the file (:func:`map_rows`: no copy, the page cache is the buffer). Writing pre-computes every header from the plan
and then writes each tensor (or row range) at its final offset with
``os.pwrite``: a shard never has to be assembled in memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import BadInputError, CTConvertError, OutputError
from .hashing import RangeHash, StreamHash, combine_shard_hash

#: safetensors dtype string -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),  # Marlin MXFP4 scales (docs/kernel-layouts.md §5.3)
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}
for _name, _dt in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _dt):
        DTYPES[_name] = (getattr(torch, _dt), int(_name[1:]) // 8)
        TORCH_TO_ST[getattr(torch, _dt)] = _name

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself enforces


@dataclass(frozen=True)
class SliceView:
    """How a derived tensor is taken from a stored one when its bytes are not one contiguous range.

    The region is ``rows x cols`` elements, contiguous, at :attr:`TensorInfo.start` (one expert of a
    fused 3-D tensor, say). Not transposed: the derived tensor's row ``n`` is region row
    ``offset + step * n``. Transposed: its row ``n`` is region *column* ``offset + step * n``
    (so the derived tensor is ``region[:, offset::step].T``). Used for fused 3-D MoE experts
    (:mod:`ctconvert.checkpoint.families`)."""

    rows: int
    cols: int
    transpose: bool
    offset: int
    step: int


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype string, shape, absolute byte range.

    A *derived* tensor (a slice of a stored one: one expert of a fused 3-D tensor) has ``base``, the
    stored tensor's name, and, where its bytes are not one contiguous range, a ``view``; ``nbytes`` is
    then its own logical size, and every reader here returns its logical bytes."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int
    base: str | None = None  # derived tensor: the stored tensor it is a slice of
    view: SliceView | None = None  # derived tensor whose bytes are not contiguous
    #: a tensor computed from others (a dequantized weight of a quantized source,
    #: :mod:`ctconvert.sources`): an object with ``rows(r0, r1)`` and
    #: ``read_bytes(offset, nbytes, out)``; the read functions below go through it
    virtual: object | None = field(default=None, compare=False, repr=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of one safetensors file.

    Returns ``(tensors, metadata)``. Raises :class:`BadInputError` naming the
    file (and tensor) when the file is truncated, the header is oversized or
    not JSON, a dtype is unknown, a byte range disagrees with dtype x shape, or
    the ranges do not tile the data section.
    """
    path = Path(path)
    raw, size = _raw_header(path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInputError(f"header is not valid JSON ({e})", file=path) from e
    if not isinstance(header, dict):
        raise BadInputError("header is not a JSON object", file=path)
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + len(raw)
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _entry(path, name, entry, data_start, size)
    pos = 0
    for info in sorted(tensors.values(), key=lambda i: (i.start, i.start + i.nbytes, i.name)):
        if info.start - data_start != pos:
            raise BadInputError(f"byte ranges overlap or leave a gap at offset {pos}", file=path, tensor=info.name)
        pos = info.start - data_start + info.nbytes
    return tensors, metadata


def _raw_header(path: Path) -> tuple[bytes, int]:
    """The JSON bytes of the header and the file size; :class:`BadInputError` for a truncated or corrupt file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadInputError("file is shorter than a safetensors header (truncated?)", file=path)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise BadInputError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt file?)", file=path)
            if 8 + n > size:
                raise BadInputError(f"header length {n} runs past the end of the {size}-byte file (truncated?)", file=path)
            return f.read(n), size
    except OSError as e:
        raise BadInputError(f"cannot read: {e.strerror or e}", file=path) from e


def _entry(path: Path, name: str, entry, data_start: int, size: int) -> TensorInfo:
    """One header entry, checked: known dtype, non-negative shape, byte range of dtype x shape inside the file."""
    try:
        dtype = entry["dtype"]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadInputError("malformed header entry", file=path, tensor=name) from e
    if dtype not in DTYPES:
        raise BadInputError(f"unknown dtype {dtype!r}", file=path, tensor=name)
    if any(d < 0 for d in shape):
        raise BadInputError(f"negative dimension in shape {list(shape)}", file=path, tensor=name)
    expect = math.prod(shape) * DTYPES[dtype][1]
    if end - begin != expect:
        raise BadInputError(f"byte range [{begin}, {end}) holds {end - begin} bytes but {dtype}{list(shape)} needs {expect}", file=path, tensor=name)
    if end > size - data_start:
        raise BadInputError(f"data ends at byte {data_start + end} but the file has {size} bytes (truncated?)", file=path, tensor=name)
    return TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)


def read_bytes(info: TensorInfo, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read ``nbytes`` of a tensor's data starting ``offset`` bytes into it: a uint8 tensor (``out`` when given: a
    contiguous uint8 CPU tensor, e.g. pinned, of at least ``nbytes``). Raises :class:`BadInputError` on a short read."""
    if info.virtual is not None:
        return info.virtual.read_bytes(offset, nbytes, out)
    if info.view is not None:
        row_bytes = info.nbytes // max(1, info.shape[0])
        r0, r1 = offset // row_bytes, -(-(offset + nbytes) // row_bytes)
        data = _view_rows(info, r0, r1).reshape(-1).view(torch.uint8)[offset - r0 * row_bytes :][:nbytes]
        if out is None:
            return data
        out[:nbytes].copy_(data)
        return out[:nbytes]
    return read_span(info, info.start + offset, nbytes, out)


def read_span(info: TensorInfo, pos: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``nbytes`` of ``info``'s file from absolute offset ``pos``, uint8 (into ``out`` when given: contiguous uint8 CPU,
    e.g. pinned): one tensor, or several (fused experts' regions) back to back, by ``preadv``. Raises
    :class:`BadInputError` naming ``info`` on a short read or an I/O error."""
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")[:nbytes]
    fd = os.open(info.file, os.O_RDONLY)
    try:
        got = 0
        while got < nbytes:
            k = os.preadv(fd, [view[got:]], pos + got)
            if k <= 0:
                raise BadInputError("unexpected end of file while reading tensor data (truncated?)", file=info.file, tensor=info.name)
            got += k
    except OSError as e:
        raise BadInputError(f"read failed: {e.strerror or e}", file=info.file, tensor=info.name) from e
    finally:
        os.close(fd)
    return out[:nbytes]


def read_rows(info: TensorInfo, row0: int, row1: int) -> torch.Tensor:
    """Read rows ``[row0, row1)`` of a tensor (dim 0), as a tensor of its dtype.

    Shape ``[row1 - row0, *shape[1:]]``. A 0-D or 1-D tensor is read whole.
    """
    if info.virtual is not None:
        return info.virtual.rows(row0, row1)
    if len(info.shape) < 1:
        raw = read_bytes(info, 0, info.nbytes)
        return raw.view(info.torch_dtype).reshape(info.shape)
    if info.view is not None:
        return _view_rows(info, row0, row1)
    row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
    raw = read_bytes(info, row0 * row_bytes, (row1 - row0) * row_bytes)
    return raw.view(info.torch_dtype).reshape((row1 - row0, *info.shape[1:]))


def _view_rows(info: TensorInfo, row0: int, row1: int) -> torch.Tensor:
    """Rows ``[row0, row1)`` of a derived tensor with a :class:`SliceView`, contiguous, of its dtype.
    Not transposed, only the region rows that hold them are read; transposed, the whole region (read once for
    the members that share it while a conversion runs: :data:`REGIONS`), its columns gathered by :func:`transposed`."""
    v, isz = info.view, info.itemsize
    n = row1 - row0
    if n <= 0:
        return torch.empty((0, *info.shape[1:]), dtype=info.torch_dtype)
    if not v.transpose:
        a0, a1 = v.offset + v.step * row0, v.offset + v.step * (row1 - 1) + 1
        region = read_span(info, info.start + a0 * v.cols * isz, (a1 - a0) * v.cols * isz).view(info.torch_dtype).reshape(a1 - a0, v.cols)
        return region[:: v.step].contiguous().reshape((n, *info.shape[1:]))
    return rows_of_region(info, REGIONS.get(info), row0, row1)


def region_bytes(info: TensorInfo) -> int:
    """The byte size of the whole region of a derived tensor with a :class:`SliceView`."""
    return info.view.rows * info.view.cols * info.itemsize


def read_region(info: TensorInfo, out: torch.Tensor | None = None) -> torch.Tensor:
    """The uint8 bytes of a derived tensor's whole :class:`SliceView` region (``view.rows x view.cols`` elements at
    ``info.start``), into ``out`` when given (contiguous uint8 CPU, e.g. pinned, of at least :func:`region_bytes`),
    for a device that takes the rows out itself (:func:`rows_of_region`). Raises :class:`BadInputError` on a short read."""
    return read_span(info, info.start, region_bytes(info), out)


def rows_of_region(info: TensorInfo, region: torch.Tensor, row0: int, row1: int) -> torch.Tensor:
    """Rows ``[row0, row1)`` of a derived tensor (contiguous, its dtype) from its region's bytes (:func:`read_region`)
    on any device (a GPU gathers a transposed expert's columns itself): the values :func:`read_rows` gives."""
    v = info.view
    r = region[: region_bytes(info)].view(info.torch_dtype).reshape(v.rows, v.cols)
    n = row1 - row0
    if n <= 0:
        return torch.empty((0, *info.shape[1:]), dtype=info.torch_dtype, device=region.device)
    a0, a1 = v.offset + v.step * row0, v.offset + v.step * (row1 - 1) + 1
    if not v.transpose:
        return r[a0 : a1 : v.step].contiguous().reshape((n, *info.shape[1:]))
    cols = r[:, a0 : a1 : v.step]
    return (transposed(cols) if cols.device.type == "cpu" else cols.t().contiguous()).reshape((n, *info.shape[1:]))


#: rows of the source a block of :func:`transposed` copies at a time
TRANSPOSE_BLOCK = 128


def transposed(src: torch.Tensor) -> torch.Tensor:
    """``src.t().contiguous()`` of a 2-D CPU tensor (any strides: a gate's every other column), copied in blocks of
    :data:`TRANSPOSE_BLOCK` source rows, each of which stays in cache while it is scattered: 2-7x faster than one
    strided copy for gpt-oss-sized experts ([2880, 5760] bf16 interleaved, 1 thread: 17 ms against 133 ms)."""
    out = torch.empty((src.shape[1], src.shape[0]), dtype=src.dtype)
    for r0 in range(0, src.shape[0], TRANSPOSE_BLOCK):
        out[:, r0 : r0 + TRANSPOSE_BLOCK] = src[r0 : r0 + TRANSPOSE_BLOCK].t()
    return out


class RegionCache:
    """The last few whole expert regions read for transposed derived tensors (:class:`SliceView`), so that the
    members taken from one region (gpt-oss's gate and up, interleaved in ``gate_up_proj[e]``) read it once
    from the file instead of once each. Only while a conversion runs (:meth:`active`: the executor's run);
    outside one every read goes to the file. Holds at most ``size`` regions; thread-safe. Regions are
    read-only: callers copy out of them."""

    def __init__(self, size: int = 2):
        self.size = size
        self._items: dict[tuple, torch.Tensor] = {}
        self._users = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def active(self):
        """Keep regions while the block runs (blocks may nest and overlap, one per executor); the last one to
        leave drops them, so no region outlives a run or sees a file that changed between runs."""
        with self._lock:
            self._users += 1
        try:
            yield self
        finally:
            with self._lock:
                self._users -= 1
                if not self._users:
                    self._items.clear()

    def __len__(self) -> int:
        """How many regions are kept now."""
        return len(self._items)

    def get(self, info: TensorInfo) -> torch.Tensor:
        """The uint8 bytes of ``info``'s whole region (``view.rows x view.cols`` elements at ``info.start``)."""
        key = (str(info.file), info.start, info.view.rows * info.view.cols * info.itemsize)
        with self._lock:
            hit = self._items.pop(key, None)
            if hit is not None:
                self._items[key] = hit  # most recent last
                return hit
        region = read_span(info, info.start, key[2])
        with self._lock:
            if self._users:
                self._items[key] = region
                while len(self._items) > self.size:
                    self._items.pop(next(iter(self._items)))
        return region


#: the process's region cache (:class:`RegionCache`), active while an executor runs
REGIONS = RegionCache()


def iter_row_chunks(info: TensorInfo, chunk_bytes: int = 64 * 2**20):
    """Yield ``(row0, rows)`` over a tensor in row ranges of about ``chunk_bytes``
    (a 0-D tensor is one chunk, ``row0 = 0``)."""
    if not info.shape:
        yield 0, read_tensor(info)
        return
    step = max(1, chunk_bytes // max(1, info.nbytes // max(1, info.shape[0])))
    for r0 in range(0, info.shape[0], step):
        yield r0, read_rows(info, r0, min(info.shape[0], r0 + step))


def map_rows(info: TensorInfo, row0: int, row1: int) -> torch.Tensor:
    """Rows ``[row0, row1)`` as a read-only view of a private mapping of the file (no copy).

    The mapping covers only these rows and lives as long as the returned tensor; its pages are read in
    before this returns (:func:`populate`). Writing to the tensor is not allowed. Falls back to :func:`read_rows` when
    the range cannot be mapped. Raises :class:`BadInputError` on a short file.
    """
    if len(info.shape) < 1 or info.shape[0] == 0 or info.view is not None or info.virtual is not None:
        return read_rows(info, row0, row1)
    row_bytes = info.nbytes // info.shape[0]
    raw = _map(info, row0 * row_bytes, (row1 - row0) * row_bytes)
    if raw is None:
        return read_rows(info, row0, row1)
    return raw.view(info.torch_dtype).reshape((row1 - row0, *info.shape[1:]))


def map_bytes(info: TensorInfo, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of a tensor's data from ``offset`` (uint8) as a read-only view of a private mapping of just
    that range (no copy; its pages are the page cache's, unmapped with the tensor, so a chunk never stays in a
    malloc arena). Falls back to :func:`read_bytes` for derived tensors and ranges that cannot be mapped."""
    raw = None if info.view is not None or info.virtual is not None else _map(info, offset, nbytes)
    return read_bytes(info, offset, nbytes) if raw is None else raw


def _map(info: TensorInfo, offset: int, nbytes: int) -> torch.Tensor | None:
    """uint8 view of ``nbytes`` of ``info``'s stored data from ``offset``, its pages read in (:func:`populate`), or None
    (an empty or unmappable range)."""
    if nbytes <= 0:
        return None
    start = info.start + offset
    page = mmap.ALLOCATIONGRANULARITY
    base = start - start % page
    try:
        with open(info.file, "rb") as f:
            mm = mmap.mmap(f.fileno(), nbytes + (start - base), access=mmap.ACCESS_COPY, offset=base)
    except (OSError, ValueError):
        return None
    populate(mm)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start - base)


#: Linux 5.14's ``MADV_POPULATE_READ`` (``include/uapi/asm-generic/mman-common.h``): fault a mapping's pages in now
MADV_POPULATE_READ = 22


def populate(mm: mmap.mmap) -> None:
    """Read a mapping's pages into memory now, on the calling thread (``MADV_POPULATE_READ``; where the kernel lacks
    it, ``MADV_WILLNEED`` starts the reads instead), so that with a cold page cache the thread that maps the rows
    (a reader) waits for the disk, not the thread that computes on them. Advice only: a refusal is ignored."""
    for advice in (MADV_POPULATE_READ, getattr(mmap, "MADV_WILLNEED", None)):
        if advice is None or not hasattr(mm, "madvise"):
            return
        try:
            mm.madvise(advice)
            return
        except (OSError, ValueError):
            continue


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Read a whole tensor into a new CPU tensor of its dtype and shape."""
    raw = read_bytes(info, 0, info.nbytes)
    return raw.view(info.torch_dtype).reshape(info.shape)


@dataclass
class PlannedTensor:
    """One output tensor: name, safetensors dtype string and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


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


def _raw_bytes(tensor: torch.Tensor):
    """A CPU tensor's raw bytes (row-major) as a uint8 array (a view where the tensor is contiguous)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``),
    so that the disk works while the conversion goes on and the final fsync has little left; elsewhere nothing."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)


class ShardFile:
    """A safetensors file whose header is fixed up front; data is written in place.

    ``tensors`` gives every tensor the file will hold. The data section is laid
    out largest element size first (so every tensor is aligned to its element
    size, as safetensors' own writer does), then in the given order. The file
    is created at full size; :meth:`write` puts bytes at their final offsets,
    and :meth:`close` checks that every byte range was written.
    """

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None, on_complete=None):
        self.path = Path(path)
        self.on_complete = on_complete
        self.kept = False
        self.closed = False
        self._lock = threading.Lock()
        order = sorted(range(len(tensors)), key=lambda i: -DTYPES[tensors[i].dtype][1])
        existing = metadata == "__existing__"
        header: dict[str, object] = {"__metadata__": {"format": "pt"} if existing or not metadata else dict(metadata)}
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for i in order:
            t = tensors[i]
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            self.offsets[t.name] = (pos, t.nbytes)
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.size = self.data_start + pos
        self.written: dict[str, int] = {t.name: 0 for t in tensors}
        self.remaining = pos
        self._unflushed = 0
        if existing:
            return
        head = struct.pack("<Q", len(raw)) + raw
        self._hashes = {t.name: StreamHash() for t in tensors}  # every tensor hashed as it is written (pieces in any order)
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

    def write_many(self, pieces: list[tuple[str, torch.Tensor, int]]) -> None:
        """Write several pieces ``(name, CPU tensor, byte offset into the tensor)`` (as :meth:`write` each), pieces
        that lie back to back in the file by one ``pwritev`` (a batch of MoE experts: each expert's ``weight_packed``
        and ``weight_scale`` are neighbours in the file, their global scales too), up to :data:`IOV_MAX` buffers a
        call. Raises :class:`OutputError` naming the shard and tensor on an I/O error or a piece that overflows its
        tensor."""
        if self.kept:
            return
        spans = []  # (file offset, bytes, name)
        for name, tensor, byte_offset in pieces:
            start, nbytes = self.offsets[name]
            raw = _raw_bytes(tensor)
            n = len(raw)
            if byte_offset + n > nbytes:
                raise OutputError(f"internal: write of {n} bytes at {byte_offset} overflows {nbytes}", file=self.path, tensor=name)
            if n:
                self._hashes[name].update_at(byte_offset, raw)
                spans.append((self.data_start + start + byte_offset, raw, name))
        spans.sort(key=lambda x: x[0])
        i = 0
        while i < len(spans):  # runs of pieces back to back in the file: one pwritev each
            j, end = i + 1, spans[i][0] + len(spans[i][1])
            while j < len(spans) and j - i < IOV_MAX and spans[j][0] == end:
                end += len(spans[j][1])
                j += 1
            try:
                self._pwritev([raw for _, raw, _ in spans[i:j]], spans[i][0])
            except OSError as e:
                raise OutputError(f"write failed: {e.strerror or e}", file=self.path, tensor=spans[i][2]) from e
            i = j
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
            h = self._hashes[name]
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
            os.close(self.fd)

    def abort(self) -> None:
        """Close the file without flushing or checking (a failed conversion; once)."""
        if not self._mark_closed():
            return
        try:
            os.close(self.fd)
        except OSError:
            pass
