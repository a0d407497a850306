"""Decoder-layer weights read onto the calibration device while the calibration process is still importing:
:class:`DevicePreload`.

In the calibration process (:mod:`.worker`) the model cannot be built before transformers is imported, and that import
is the longest step of a calibrated run on a GPU machine (seconds, one core, holding the GIL: `worker`'s docstring).
Calibration itself then runs layer by layer at the rate its weights reach the device (the pass of an 8B model reads
16 GB; its layers' compute is a small part of it). A :class:`DevicePreload`, begun as soon as torch is imported, reads
the checkpoint's embedding and decoder-layer tensors in layer order onto the device during that import (``os.preadv``
and the host-to-device copies release the GIL; the import runs on its thread). :class:`~.prefetch.LayerPrefetcher`
then takes a tensor from here (:func:`take`: its bytes on the device, complete) instead of reading it again, so the
pass starts with its first layers, or all of them, already on the device.

Bounded: tensors are chosen in layer order up to ``budget`` bytes of device memory (the calibration process asks for
half the device's free memory, less 8 GiB kept for the converting process and the pass); a tensor is held until the
pass takes it (then the pass's layer owns the memory and frees it with the layer) or :meth:`DevicePreload.close`.
Nothing here decides a result: a taken tensor holds exactly the stored bytes (the pass would have read the same bytes
itself); a tensor this could not read (an unreadable shard, a short file) is simply not offered, and the pass's own
read raises its error, naming the file and tensor, as without a preload. Host memory: two page-locked pieces of
``piece_bytes`` per thread.

Which tensors: those whose names hold ``embed_tokens`` (the pass's first group), then those under ``layers.N.``, by
``N`` then file and offset; none of a quantized checkpoint (its weights reach calibration dequantized, through
:attr:`~ctconvert.checkpoint.safetensors_io.TensorInfo.virtual` readers). A tensor that calibration does not use (a
vision tower's layers) costs device memory until the pass ends, within the budget.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable

import torch

from ..checkpoint.safetensors_io import TensorInfo

__all__ = ["PIECE_BYTES", "DevicePreload", "active", "choose", "install", "take"]

#: bytes of one read (and one host-to-device copy) of a preload thread
PIECE_BYTES = 64 * 2**20
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: the calibration process's preload (:func:`install`), which :func:`take` serves
_ACTIVE: list[DevicePreload] = []


def _key(info: TensorInfo) -> tuple[str, int, int] | None:
    """A stored tensor's identity (file, absolute offset, bytes); None for a derived or computed one."""
    if info.view is not None or info.virtual is not None or info.base is not None:
        return None
    return (os.path.realpath(info.file), info.start, info.nbytes)


def choose(tensors: Iterable[TensorInfo], budget: int) -> list[TensorInfo]:
    """The tensors a preload reads, in order: ``embed_tokens`` tensors, then ``layers.N.`` tensors by ``N`` (then
    file and offset), as many as fit in ``budget`` bytes (a tensor that does not fit ends the choice: later layers
    are the prefetcher's). Stored tensors only (no derived or computed ones)."""
    embed, layers = [], []
    for t in tensors:
        if _key(t) is None:
            continue
        if "embed_tokens" in t.name:
            embed.append(t)
        elif (m := _LAYER.search(t.name)) is not None:
            layers.append((int(m.group(1)), str(t.file), t.start, t))
    order = sorted(embed, key=lambda t: (str(t.file), t.start)) + [t for *_, t in sorted(layers, key=lambda x: x[:3])]
    out, used = [], 0
    for t in order:
        if used + t.nbytes > budget:
            break
        out.append(t)
        used += t.nbytes
    return out


class DevicePreload:
    """Read ``infos`` (stored tensors, :func:`choose`) onto ``device`` on ``threads`` background threads, in order.

    :meth:`take` returns one tensor's bytes (``uint8 [nbytes]`` on ``device``, its copy complete), waiting while it is
    still being read; None for a tensor not chosen, not readable or already taken. On a CUDA device each thread reads
    ``piece_bytes`` at a time into one of its two page-locked buffers and copies it on a stream of its own (the
    device tensor is allocated on the current stream, which that stream waits for; :meth:`take` waits for the
    tensor's copies on the host, so the caller may use it on any stream). On the CPU the bytes are read straight into
    the tensor (tests, and the same path without a device). :meth:`close` stops the threads after their piece in
    flight and drops what was not taken."""

    def __init__(self, infos: list[TensorInfo], device: torch.device, *, threads: int = 4, piece_bytes: int = PIECE_BYTES):
        if threads < 1 or piece_bytes < 1:
            raise ValueError(f"DevicePreload: threads ({threads}) and piece_bytes ({piece_bytes}) must be positive")
        self.device, self.piece_bytes = torch.device(device), piece_bytes
        self._queue = [(k, info) for info in infos if (k := _key(info)) is not None]
        self._state: dict[tuple, object] = {k: None for k, _ in self._queue}  # None: pending; tensor; False: failed
        self._cond = threading.Condition()
        self._next = 0
        self._stop = False
        self.read_bytes = 0  # bytes read so far
        self.taken_bytes = 0  # bytes handed to take() (the calibration's --json ``preloaded_bytes``)
        self._threads = [threading.Thread(target=self._run, name=f"ctconvert-preload-{i}", daemon=True) for i in range(min(threads, max(1, len(self._queue))))]
        for t in self._threads:
            t.start()

    # -- consumer ---------------------------------------------------------------------------------------------
    def take(self, info: TensorInfo) -> torch.Tensor | None:
        k = _key(info)
        with self._cond:
            if k is None or k not in self._state:
                return None
            while self._state[k] is None and not self._stop:
                self._cond.wait()
            got = self._state.pop(k, None)
        if not isinstance(got, tuple):
            return None
        t, ev = got
        if ev is not None:
            ev.synchronize()
        with self._cond:
            self.taken_bytes += info.nbytes
        return t

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._state.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    # -- readers ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        slots = [[torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=True), None] for _ in range(2)] if cuda else []
        turn = 0
        while True:
            with self._cond:
                if self._stop or self._next >= len(self._queue):
                    return
                k, info = self._queue[self._next]
                self._next += 1
            try:
                out = torch.empty(info.nbytes, dtype=torch.uint8, device=self.device)
                ev = None
                if cuda:
                    stream.wait_stream(torch.cuda.current_stream(self.device))  # memory the current stream may still use
                with open(info.file, "rb", buffering=0) as f:
                    for pos in range(0, info.nbytes, self.piece_bytes):
                        if self._stop:
                            return
                        n = min(self.piece_bytes, info.nbytes - pos)
                        if not cuda:
                            _pread_into(f.fileno(), memoryview(out.numpy())[pos : pos + n], info.start + pos)
                            continue
                        slot = slots[turn]
                        turn = 1 - turn
                        if slot[1] is not None:
                            slot[1].synchronize()  # its previous copy is done: the buffer may be refilled
                        _pread_into(f.fileno(), memoryview(slot[0].numpy())[:n], info.start + pos)
                        with torch.cuda.stream(stream):
                            out[pos : pos + n].copy_(slot[0][:n], non_blocking=True)
                            ev = slot[1] = torch.cuda.Event()
                            ev.record(stream)
                got: object = (out, ev)
                with self._cond:
                    self.read_bytes += info.nbytes
            except (OSError, RuntimeError):  # not offered: the pass reads it and reports what is wrong
                got = False
            with self._cond:
                if k in self._state:
                    self._state[k] = got
                self._cond.notify_all()


def _pread_into(fd: int, view: memoryview, pos: int) -> None:
    """Fill ``view`` from ``fd`` at ``pos``; a short file is an :class:`OSError`."""
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], pos + got)
        if k <= 0:
            raise OSError(f"unexpected end of file at {pos + got}")
        got += k


def install(preload: DevicePreload | None) -> None:
    """Make ``preload`` the one :func:`take` serves (None: none); the previous one is closed."""
    for p in _ACTIVE:
        if p is not preload:
            p.close()
    _ACTIVE[:] = [preload] if preload is not None else []


def active() -> DevicePreload | None:
    return _ACTIVE[0] if _ACTIVE else None


def take(info: TensorInfo) -> torch.Tensor | None:
    """``info``'s bytes from the installed preload (see :meth:`DevicePreload.take`), else None."""
    p = active()
    return p.take(info) if p is not None else None
