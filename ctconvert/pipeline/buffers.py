"""The executor's host buffers on a GPU: reusable pinned buffers for reads, and the byte budget of the writers' queues.

:class:`PinnedPool` hands the reader threads pinned host buffers (a host-to-device copy from pageable
memory is ~8x slower) and takes each back with the CUDA event of its copy; :class:`ByteBudget` bounds
the bytes queued for the writer threads (:data:`ctconvert.pipeline.executor.WRITE_BUDGET`). Both are
closed when a run stops, so that a thread waiting on them gives up.
"""

from __future__ import annotations

import queue
import threading

import torch

__all__ = ["ByteBudget", "PinnedPool"]


class PinnedPool:
    """Reusable pinned host buffers for host-to-device copies (pageable copies are ~8x slower)."""

    def __init__(self, count: int):
        self.free: queue.Queue = queue.Queue()
        self.count = count
        self.made = 0
        self.lock = threading.Lock()
        self.closed = False  # set when the run stops: waiting readers give up

    def get(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of at least ``nbytes`` (waiting for one to come back once ``count`` exist). A buffer
        is made with the capacity torch's caching host allocator reserves for it anyway, the next power of two
        (pytorch ``aten/src/ATen/core/CachingHostAllocator.h``, ``allocate``), so that it serves every later read up to
        that size. Raises ``RuntimeError`` once the pool is closed."""
        with self.lock:
            if self.made < self.count:
                self.made += 1
                return _pinned(nbytes)
        while True:
            try:
                buf, event = self.free.get(timeout=0.1)
                break
            except queue.Empty:
                if self.closed:
                    raise RuntimeError("the executor stopped") from None
        if event is not None:
            event.synchronize()
        if buf.numel() < nbytes:
            buf = _pinned(nbytes)
        return buf

    def put(self, buf: torch.Tensor, event) -> None:
        self.free.put((buf, event))


def _pinned(nbytes: int) -> torch.Tensor:
    """A pinned uint8 buffer of the next power of two of at least ``nbytes`` bytes (at least 1)."""
    return torch.empty(1 << max(0, nbytes - 1).bit_length(), dtype=torch.uint8, pin_memory=True)


class ByteBudget:
    """The bytes queued for the writer threads of a GPU run, bounded by ``limit`` (one item may exceed it alone).

    Bounding bytes rather than items keeps the writers busy while the computing thread makes no output (an
    NVFP4 set's absmax pass reads the whole set first): a module's outputs, however many chunks, wait in
    the queues instead of holding the computing thread, and memory stays bounded. Staging buffers are
    taken from torch's caching pinned-memory allocator, so their sizes follow the outputs."""

    def __init__(self, limit: int):
        self.limit, self.used, self.closed = limit, 0, False
        self.cv = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cv:
            while self.used and self.used + n > self.limit:
                if self.closed:
                    raise RuntimeError("the executor stopped")
                self.cv.wait(0.1)
            self.used += n

    def release(self, n: int) -> None:
        with self.cv:
            self.used -= n
            self.cv.notify_all()
