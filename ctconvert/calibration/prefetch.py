"""Read a model's checkpoint tensors a group at a time (a decoder layer's), in background threads, one group ahead.

Calibration runs one decoder layer at a time; while layer ``i`` runs, :class:`LayerPrefetcher` reads layer ``i + 1``'s
tensors from the safetensors files into one staging buffer (page-locked memory when the layer goes to a GPU, so that
its copies to the device are asynchronous DMA, ``copy_(non_blocking=True)``). Each group is one buffer: every tensor of
it at an offset aligned to :data:`ALIGN` bytes, a large tensor read as :data:`PIECE_BYTES` pieces by ``threads``
threads at once (``os.preadv`` releases the GIL; the page cache is read at the machine's rate, not one thread's).

Lookahead is bounded: a group is read only while at most ``ahead`` groups are staged and not yet released (taken and
copied to the device: :meth:`StagedGroup.release`), so host memory holds about ``ahead`` + 1 layers at any time (with
``ahead=1``: the layer being copied, or running, and the next one). Groups come in order; an error of a read (a
truncated file, an unreadable shard) is raised by :meth:`LayerPrefetcher.take` of the group that needed the tensor,
as the reader raised it (:class:`~ctconvert.errors.BadInputError`, naming the file and the tensor), so a run fails at
the same layer, with the same error, as when it read the layer itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ..checkpoint.safetensors_io import TensorInfo, read_bytes
from ..errors import BadInputError
from . import preload

__all__ = ["ALIGN", "PIECE_BYTES", "LayerPrefetcher", "StagedGroup", "default_threads"]

#: byte alignment of every tensor in a staging buffer (any dtype's itemsize divides it; a page, for DMA)
ALIGN = 4096
#: a tensor larger than this is read as pieces of this size by several threads
PIECE_BYTES = 16 * 2**20


def default_threads(device: torch.device) -> int:
    """Reader threads for a calibration on ``device``: up to 8 for a GPU (its host threads are otherwise idle), one
    for the CPU (whose cores run the layer: the one thread overlaps the next layer's reads with this one's compute)."""
    return max(1, min(8, os.cpu_count() or 1)) if device.type == "cuda" else 1


class StagedGroup:
    """One group's tensors, read: ``tensors`` maps each checkpoint tensor name to a CPU tensor of its dtype and shape
    (a view of the group's one staging buffer, page-locked when ``pinned``). :meth:`release` hands the buffer back
    (after the copies that read it are issued: a page-locked block is reused only once they are done, which
    PyTorch's host allocator tracks); the next group may then be read."""

    def __init__(self, index: int, tensors: dict[str, torch.Tensor], nbytes: int, pinned: bool, on_release):
        self.index, self.tensors, self.nbytes, self.pinned = index, tensors, nbytes, pinned
        self._on_release = on_release

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def release(self) -> None:
        """Drop the buffer and let the reader go on (idempotent)."""
        if self._on_release is not None:
            self.tensors = {}
            self._on_release, release = None, self._on_release
            release()


class LayerPrefetcher:
    """Reads ``groups`` (each a sequence of :class:`TensorInfo`) in order, in a background thread, at most ``ahead``
    groups beyond those released; :meth:`take` returns the next :class:`StagedGroup` (waiting for it), or raises the
    error its reading raised. ``pin_memory``: stage in page-locked memory (for a CUDA device; per group, by index in
    ``unpinned``, a group that is read once, such as the embedding, may be left in pageable memory). ``threads``: how
    many threads read one group's tensors (:func:`default_threads`). Use as a context manager, or call :meth:`close`:
    the reader stops after the read in flight.

    Example::

        with LayerPrefetcher([[ckpt.tensors[n] for n in layer] for layer in layers], pin_memory=True) as pf:
            for _ in layers:
                g = pf.take()
                ...  # t.copy_(g.tensors[name], non_blocking=True) for each tensor
                g.release()
    """

    def __init__(
        self,
        groups: Sequence[Sequence[TensorInfo]],
        *,
        pin_memory: bool = False,
        unpinned: Sequence[int] = (),
        ahead: int = 1,
        threads: int = 1,
        piece_bytes: int = PIECE_BYTES,
    ):
        if ahead < 1 or threads < 1 or piece_bytes < 1:
            raise ValueError(f"LayerPrefetcher: ahead ({ahead}), threads ({threads}) and piece_bytes ({piece_bytes}) must be positive")
        self.groups = [list(g) for g in groups]
        self.pin_memory, self.unpinned, self.piece_bytes = pin_memory, set(unpinned), piece_bytes
        self._slots = threading.Semaphore(ahead)
        self._cond = threading.Condition()
        self._ready: dict[int, StagedGroup | BaseException] = {}
        self._next = 0  # the index the next take() returns
        self._held: StagedGroup | None = None
        self._stop = False
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ctconvert-calibration-read") if threads > 1 else None
        self._thread = threading.Thread(target=self._run, name="ctconvert-calibration-prefetch", daemon=True)
        self._thread.start()

    # -- consumer ---------------------------------------------------------------------------------------------
    def take(self) -> StagedGroup:
        """The next group, read (waits for the reader); releases the group taken before if it was not released.
        Raises what reading it raised, :class:`IndexError` past the last group."""
        if self._held is not None:
            self._held.release()
        i = self._next
        if i >= len(self.groups):
            raise IndexError(f"LayerPrefetcher: all {len(self.groups)} groups were taken")
        with self._cond:
            while i not in self._ready:
                self._cond.wait()
            got = self._ready.pop(i)
        self._next = i + 1
        if isinstance(got, BaseException):
            self._held = None
            raise got
        self._held = got
        return got

    def close(self) -> None:
        """Stop the reader (after the group in flight) and drop what is staged."""
        self._stop = True
        self._slots.release()  # wake a reader waiting for a slot
        self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._cond:
            self._ready.clear()
        self._held = None

    def __enter__(self) -> LayerPrefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reader -----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        for i, infos in enumerate(self.groups):
            self._slots.acquire()
            if self._stop:
                return
            try:
                got: StagedGroup | BaseException = self._read(i, infos)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised by its take()
                got = e
            with self._cond:
                self._ready[i] = got
                self._cond.notify_all()
            if isinstance(got, BaseException):
                return

    def _read(self, index: int, infos: list[TensorInfo]) -> StagedGroup:
        """Read one group into one buffer: its tensors' views, keyed by name; a tensor the calibration process's
        :mod:`.preload` already put on the device is taken from there instead (its bytes, not read again)."""
        preloaded = {}
        for info in infos:
            if (t := preload.take(info)) is not None:
                preloaded[info.name] = t.view(info.torch_dtype).reshape(info.shape)
        infos = [info for info in infos if info.name not in preloaded]
        offsets, total = [], 0
        for info in infos:
            offsets.append(total)
            total += -(-info.nbytes // ALIGN) * ALIGN
        pinned = self.pin_memory and index not in self.unpinned
        raw = torch.empty(total + ALIGN, dtype=torch.uint8, pin_memory=pinned)
        shift = -raw.data_ptr() % ALIGN
        buf = raw[shift : shift + total]
        jobs = []
        for info, off in zip(infos, offsets):
            whole = info.view is not None or info.virtual is not None or info.nbytes <= self.piece_bytes
            step = info.nbytes if whole else self.piece_bytes
            jobs += [(info, p, min(step, info.nbytes - p), buf[off + p : off + min(p + step, info.nbytes)]) for p in range(0, info.nbytes, max(1, step))]
        if self._pool is None:
            for job in jobs:
                _read_piece(*job)
        else:
            for f in [self._pool.submit(_read_piece, *job) for job in jobs]:
                f.result()  # the first failure in reading order
        tensors = {info.name: buf[off : off + info.nbytes].view(info.torch_dtype).reshape(info.shape) for info, off in zip(infos, offsets)}
        tensors.update(preloaded)
        return StagedGroup(index, tensors, total, pinned, self._slots.release)


def _read_piece(info: TensorInfo, offset: int, nbytes: int, out: torch.Tensor) -> None:
    """``nbytes`` of ``info`` from ``offset`` into ``out``; an OS error (a shard that cannot be opened) is a
    :class:`BadInputError` naming the file and the tensor, as every other read error is."""
    try:
        read_bytes(info, offset, nbytes, out)
    except OSError as e:
        raise BadInputError(f"read failed: {e.strerror or e}", file=info.file, tensor=info.name) from e
