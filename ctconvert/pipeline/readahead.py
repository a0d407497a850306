"""Read-ahead of the input through the page cache: the disk keeps reading while chunks compute and outputs are written.

The executor's readers fetch a few row chunks ahead of the computing thread (:data:`.executor.READ_AHEAD`,
bounded by process memory); with a cold page cache that leaves the disk idle whenever a chunk computes or the
writers hold the disk, so the run takes about read + write instead of max(read, write). :class:`WindowReadAhead`
asks the kernel to read a window of the input beyond what the readers have reached
(``posix_fadvise(POSIX_FADV_WILLNEED)``, Linux ``mm/fadvise.c``: it starts the reads and returns), on a
thread of its own, so the bytes are in the page cache when a reader asks for them; what it holds is page
cache (reclaimable), never the process's memory, and it never waits for the writers.

The input is walked in the executor's order (:func:`unit_pieces`): every stored byte range the units read
(a derived expert's whole region, the stored tensors a dequantized weight is computed from), cut into
pieces of :data:`PIECE_BYTES`. The readers say where they are with :meth:`WindowReadAhead.reached` (the unit
they read); the hints run at most ``window`` bytes past the start of that unit, or to its end for a
larger unit.
"""

from __future__ import annotations

import bisect
import os
import threading
from pathlib import Path

from ..checkpoint.hashing import stored_ranges

__all__ = ["PIECE_BYTES", "READ_AHEAD_BYTES", "WindowReadAhead", "unit_pieces"]

PIECE_BYTES = 16 * 2**20  # one hint: the range of one fadvise call
READ_AHEAD_BYTES = 512 * 2**20  # the window hinted beyond the start of the unit the readers read


def unit_pieces(ckpt, units, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, Path, int, int]]:
    """``(unit index, file, offset, nbytes)`` of the byte ranges the units read, in order, each at most
    ``piece_bytes``; a range read by an earlier unit is not repeated (tensors shared by units, regions of
    several experts' members)."""
    out, seen = [], set()
    for ui, unit in enumerate(units):
        for name in unit.sources:
            for path, start, nbytes in stored_ranges(ckpt.tensors[name]):
                if (path, start, nbytes) in seen:
                    continue
                seen.add((path, start, nbytes))
                out += [(ui, path, start + b, min(piece_bytes, nbytes - b)) for b in range(0, nbytes, piece_bytes)]
    return out


class WindowReadAhead:
    """Hints the kernel to read ``pieces`` (:func:`unit_pieces`) ahead of the readers, ``window`` bytes at most.

    ``start()`` runs the hints on a daemon thread; :meth:`reached` (any thread) moves the readers' position
    to a unit; :meth:`close` stops the thread (and is safe to call twice). ``advise`` is the hint itself,
    ``(fd, offset, nbytes) -> None`` (``os.posix_fadvise(..., POSIX_FADV_WILLNEED)``; replaceable in tests);
    where the platform has no ``posix_fadvise`` nothing is hinted. Hints are advice: a failing one is ignored."""

    def __init__(self, pieces: list[tuple[int, Path, int, int]], window: int = READ_AHEAD_BYTES, advise=None):
        self.pieces = pieces
        self.window = window
        self.advise = advise or _willneed
        self.hinted = 0  # pieces hinted so far
        self._unit = -1  # the unit the readers have reached
        self._closed = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        # where each unit's pieces start, in bytes of the stream (the window is measured from there)
        self._starts: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        pos = 0
        for ui, _, _, n in pieces:
            self._starts.setdefault(ui, pos)
            pos += n
            self._ends[ui] = pos
        self._units = sorted(self._starts)  # the units that have pieces
        self._offsets: list[int] = []  # stream offset of each piece's end
        pos = 0
        for _, _, _, n in pieces:
            pos += n
            self._offsets.append(pos)

    def start(self) -> WindowReadAhead:
        if self.pieces and (_willneed_available() or self.advise is not _willneed):
            self._thread = threading.Thread(target=self._run, daemon=True, name="ctconvert-readahead")
            self._thread.start()
        return self

    def reached(self, unit: int) -> None:
        """The readers read unit ``unit`` (units come in order; an earlier one changes nothing)."""
        with self._cv:
            if unit > self._unit:
                self._unit = unit
                self._cv.notify_all()

    def limit(self) -> int:
        """The stream offset the hints may run to now: ``window`` past the start of the readers' unit, or that
        unit's end when it is larger (its bytes are read now)."""
        ui = self._unit
        if ui < 0:
            return self.window
        start = self._starts.get(ui)
        if start is None:  # a unit with no bytes of its own: from where the next unit that has some starts
            k = bisect.bisect_right(self._units, ui)
            start = self._starts[self._units[k]] if k < len(self._units) else (self._offsets[-1] if self._offsets else 0)
            return start + self.window
        return max(start + self.window, self._ends[ui])

    def _run(self) -> None:
        fds: dict[Path, int] = {}
        try:
            for k, (_, path, offset, nbytes) in enumerate(self.pieces):
                with self._cv:
                    while not self._closed and self._offsets[k] - self.pieces[k][3] >= self.limit():
                        self._cv.wait(0.5)
                    if self._closed:
                        return
                fd = fds.get(path)
                try:
                    if fd is None:
                        fd = fds[path] = os.open(path, os.O_RDONLY)
                    self.advise(fd, offset, nbytes)
                except OSError:
                    pass  # advice only: the readers read it anyway
                self.hinted = k + 1
        finally:
            for fd in fds.values():
                os.close(fd)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _willneed_available() -> bool:
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_WILLNEED")


def _willneed(fd: int, offset: int, nbytes: int) -> None:
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
