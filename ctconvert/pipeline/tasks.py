"""Whole-checkpoint rewrites that are not a quantization: ``repack``, ``decompress`` and ``convert``.

Such a command plans a list of tasks, one per output tensor (or batch of
modules): copy a tensor's bytes, cast a floating-point tensor to another dtype
by row chunks, or compute tensors (a repack, a dequantization) and write what
the computation yields. :func:`run_tasks` runs them, in order, on the calling
thread, and hands every chunk to writer threads (:data:`WRITERS`, each with a
short queue: :data:`WRITE_BEHIND`) that ``pwrite`` it into its shard, so the
next chunk is read and computed while the last ones go to the page cache.
Chunks are dealt to the writers in turn, so the chunks of one large tensor are
written in parallel (the shard hashes each tensor's pieces as they come, in any
order: :class:`~ctconvert.checkpoint.hashing.StreamHash`). Memory is a few chunks: the one being computed
and those queued. :class:`ChunkBuffers` lets a computing task reuse its output
buffers once they are written (a fresh large allocation costs a page fault per
4 KiB page).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..checkpoint.safetensors_io import TensorInfo, iter_row_chunks, read_bytes
from ..checkpoint.shard_file import ShardFile

__all__ = ["WRITERS", "WRITE_BEHIND", "CastTensor", "ChunkBuffers", "Compute", "CopyTensor", "run_tasks"]

WRITERS = 2  # writer threads (pwrite releases the GIL)
WRITE_BEHIND = 2  # chunks queued per writer
COPY_CHUNK_BYTES = 16 * 2**20

#: what a computing task yields: (output tensor name, data, byte offset in the tensor)
Write = tuple[str, torch.Tensor, int]


@dataclass
class CopyTensor:
    """Copy ``info``'s bytes unchanged (same name)."""

    info: TensorInfo


@dataclass
class CastTensor:
    """Write ``info`` cast to ``dtype`` (same name), by row chunks."""

    info: TensorInfo
    dtype: torch.dtype


@dataclass
class Compute:
    """Write what ``run()`` yields: ``(name, tensor, byte offset)``, on any device (copied to the host)."""

    run: Callable[[], Iterator[Write]]


class ChunkBuffers:
    """Reusable host buffers for the chunks a computing task yields: :meth:`take` gives a tensor backed by a free
    buffer (grown when too small), and the writer gives the buffer back once the chunk is written
    (:func:`run_tasks` ``buffers``). At most ``count`` exist; :meth:`take` waits for one to be given back."""

    def __init__(self, count: int = WRITERS * (WRITE_BEHIND + 1) + 1):
        self.count = count
        self.made = 0
        self.free: queue.Queue = queue.Queue()
        self.owned: dict[int, torch.Tensor] = {}  # storage address -> buffer
        self.lock = threading.Lock()
        self.closed = False

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` on a pooled buffer. Raises
        ``RuntimeError`` once the run has stopped."""
        numel = torch.Size(shape).numel()
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = None
        with self.lock:
            if self.made < self.count:
                self.made += 1
                buf = torch.empty(0, dtype=torch.uint8)
        while buf is None:
            try:
                buf = self.free.get(timeout=0.1)
            except queue.Empty:
                if self.closed:
                    raise RuntimeError("the writers stopped") from None
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            self.owned[buf.untyped_storage().data_ptr()] = buf
        return buf[:nbytes].view(dtype).view(shape)

    def give_back(self, t: torch.Tensor) -> None:
        """Return the buffer behind ``t`` (if it is one of these) for reuse."""
        with self.lock:
            buf = self.owned.pop(t.untyped_storage().data_ptr(), None)
        if buf is not None:
            self.free.put(buf)


def run_tasks(tasks: list, shards: dict[str, ShardFile], progress=None, total: int = 0, buffers: ChunkBuffers | None = None) -> None:
    """Run every task, in order, writing into ``shards`` (output tensor name -> its open shard).

    ``progress``: a callable ``(total_bytes) -> context manager with .update(n)`` (the CLI's bar), told
    every output byte handed to the writers; ``total``: the output bytes (the bar's end); ``buffers``: the
    pool the computing tasks take their outputs from (:class:`ChunkBuffers`), given each chunk back once it
    is written. A write error (disk full ...) is raised here, after the writers stopped."""
    bar_cm = progress(total) if progress is not None else contextlib.nullcontext()
    wqs: list[queue.Queue] = [queue.Queue(maxsize=WRITE_BEHIND) for _ in range(WRITERS)]
    errors: list[BaseException] = []

    def writer(wq: queue.Queue) -> None:
        while True:
            item = wq.get()
            if item is None:
                return
            name, t, pos = item
            try:
                if not errors:
                    shards[name].write(name, t, pos)
            except BaseException as e:  # noqa: BLE001 - re-raised by run_tasks
                errors.append(e)
            finally:
                if buffers is not None:
                    buffers.give_back(t)

    threads = [threading.Thread(target=writer, args=(wq,), daemon=True, name=f"ctconvert-writer-{i}") for i, wq in enumerate(wqs)]
    for th in threads:
        th.start()

    turn = itertools.count()  # chunks dealt to the writers in turn (the shard hashes pieces in any order)

    def write(name: str, t: torch.Tensor, pos: int) -> None:
        if errors:
            raise errors[0]
        wqs[next(turn) % len(wqs)].put((name, t, pos))

    try:
        with torch.inference_mode(), bar_cm as bar:
            done = (lambda n: bar.update(n)) if bar is not None else (lambda n: None)
            for task in tasks:
                if isinstance(task, CopyTensor):
                    info = task.info
                    for b0 in range(0, info.nbytes, COPY_CHUNK_BYTES):
                        data = read_bytes(info, b0, min(COPY_CHUNK_BYTES, info.nbytes - b0))
                        write(info.name, data, b0)
                        done(data.numel())
                elif isinstance(task, CastTensor):
                    name, pos = task.info.name, 0
                    for _, t in iter_row_chunks(task.info, COPY_CHUNK_BYTES):
                        t = t.to(task.dtype)
                        write(name, t, pos)
                        pos += t.numel() * t.element_size()
                        done(t.numel() * t.element_size())
                else:
                    for name, t, pos in task.run():
                        write(name, t.cpu(), pos)
                        done(t.numel() * t.element_size())
    finally:
        if buffers is not None:
            buffers.closed = True
        for wq in wqs:
            wq.put(None)
        for th in threads:
            th.join()
    if errors:
        raise errors[0]
