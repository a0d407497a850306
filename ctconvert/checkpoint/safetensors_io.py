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
of the file (:func:`map_rows`: no copy, the page cache is the buffer). Writing is
:mod:`.shard_file`.
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

from ..errors import BadInputError
from .transpose import transposed

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
    offset, nbytes, shape = row_span(info, row0, row1)
    return read_bytes(info, offset, nbytes).view(info.torch_dtype).reshape(shape)


def row_span(info: TensorInfo, row0: int | None, row1: int | None) -> tuple[int, int, tuple[int, ...]]:
    """Where rows ``[row0, row1)`` (dim 0) of a stored tensor lie in its data: ``(byte offset, bytes, shape)``;
    ``row0`` None or a 0-D tensor: the whole tensor."""
    if row0 is None or len(info.shape) < 1:
        return 0, info.nbytes, tuple(info.shape)
    row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
    return row0 * row_bytes, (row1 - row0) * row_bytes, (row1 - row0, *info.shape[1:])


def read_spans(spans: dict, mapped: bool = False) -> dict[str, torch.Tensor]:
    """Read ``name -> (tensor, row0, row1)`` spans (``row0`` None: the whole tensor) as CPU tensors of their dtypes;
    ``mapped``: row ranges are read-only views of the mapped files (:func:`map_rows`: no copy)."""
    return {name: read_tensor(info) if a is None else map_rows(info, a, b) if mapped else read_rows(info, a, b) for name, (info, a, b) in spans.items()}


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
class WholeReads:
    """What :func:`read_whole` read: ``pieces``, each tensor's whole bytes (uint8, its logical bytes, as
    :func:`read_bytes` gives them); ``runs``, the spans of a file read by one ``preadv`` each, as ``(bytes, dtype)``
    with the safetensors dtype string its tensors share (None where they differ; a run may hold bytes of no tensor
    asked for, a region's other columns, all of that dtype); ``run_of``, each piece's run (``-1``: read on its own, a computed
    tensor)."""

    pieces: list[torch.Tensor]
    runs: list[tuple[torch.Tensor, str | None]]
    run_of: list[int]


def read_whole(infos: list[TensorInfo]) -> WholeReads:
    """Whole tensors read together, each span of a file once: tensors (or the regions of :class:`SliceView`
    tensors: gpt-oss's per-expert biases, gate and up sharing one) that lie back to back or overlap in one file are
    one run, read by one ``preadv`` (:func:`read_span`), and each tensor's bytes are taken from its run. A MoE layer's
    per-expert biases are a few hundred small tensors; read one by one, each paid an open, a read and a close, every
    one of them a release of the GIL that a busy computing thread then held for up to the interpreter's switch
    interval (a GPU run's reads of gpt-oss's biases took ~1 ms a tensor, 80-120 ms a read of a layer's, and the
    computing thread waited ~0.4 s of a 4 s call for them). The bytes are :func:`read_bytes`'s. Raises
    :class:`BadInputError` on a short read (naming the run's first tensor)."""
    pieces: list = [None] * len(infos)
    run_of = [-1] * len(infos)
    spans = []  # (file, start, end, index) of each tensor's source span
    for i, info in enumerate(infos):
        if info.virtual is not None:
            pieces[i] = read_bytes(info, 0, info.nbytes)
        else:
            spans.append((str(info.file), info.start, info.start + (region_bytes(info) if info.view is not None else info.nbytes), i))
    spans.sort()
    runs: list[tuple[torch.Tensor, str | None]] = []
    j = 0
    while j < len(spans):
        file, start, end, _ = spans[j]
        k = j + 1
        while k < len(spans) and spans[k][0] == file and spans[k][1] <= end:
            end = max(end, spans[k][2])
            k += 1
        members = [infos[s[3]] for s in spans[j:k]]
        buf = read_span(members[0], start, end - start)
        runs.append((buf, members[0].dtype if len({m.dtype for m in members}) == 1 else None))
        for _, s, e, i in spans[j:k]:
            info = infos[i]
            part = buf[s - start : e - start]
            if info.view is not None:
                part = rows_of_region(info, part, 0, info.shape[0]).reshape(-1).view(torch.uint8)
            pieces[i], run_of[i] = part, len(runs) - 1
        j = k
    return WholeReads(pieces, runs, run_of)
