"""Calibration beside the write stage: :class:`CalibratedFeed`, the calibrated tensors as each decoder layer gives them.

Calibration runs the model one decoder layer at a time; a Linear's static input scale (and an attention module's
``k_scale``/``v_scale``) is final once its layer has run. The feed is the executor's ``calibrated`` mapping
(:attr:`ctconvert.pipeline.executor.ExecOptions.calibrated`, module -> {part: tensor}) while calibration still runs on
its own thread (:class:`BackgroundCalibration`): reading a module that calibration will give waits until its layer is
done. The executor (:class:`~ctconvert.pipeline.calibrated.CalibratedWrites`) asks :meth:`CalibratedFeed.ready` first
and writes a module's calibrated tensors later, at their planned offsets, when its layer is not done yet: the write
stage reads, quantizes and writes every weight while the model runs and waits only at its end. A failed calibration
makes every waiting reader raise its error; a module calibration does not give is answered at once (as an empty
mapping's ``get`` is).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

import torch

__all__ = ["BackgroundCalibration", "CalibratedFeed", "Cancelled"]


class Cancelled(Exception):
    """Raised inside the calibration thread when the run it feeds has stopped (an error or Ctrl-C elsewhere)."""


class CalibratedFeed(Mapping):
    """module -> {part: CPU tensor}, filled by :meth:`put` from the calibration thread, read by the executor's threads.

    ``expected``: the modules calibration will give (the plan's calibrated modules and, with ``--kv-cache``, its
    attention modules). ``get``/``[]`` of an expected module block until :meth:`put` gave it, or raise the error
    :meth:`fail` was given; of any other module they answer at once. ``bool(feed)``: whether any module is expected."""

    def __init__(self, expected):
        self.expected = frozenset(expected)
        self._have: dict[str, dict[str, torch.Tensor]] = {}
        self._error: BaseException | None = None
        self._cv = threading.Condition()

    def put(self, module: str, parts: dict[str, torch.Tensor]) -> None:
        """Give ``module``'s calibrated tensors (final: a module is given once)."""
        with self._cv:
            self._have[module] = parts
            self._cv.notify_all()

    def fail(self, error: BaseException) -> None:
        """Calibration failed (or was cancelled): every reader still waiting, and every later one, raises ``error``."""
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def ready(self, module: str) -> bool:
        """Whether reading ``module`` answers at once: given, not expected, or calibration failed (then it raises)."""
        with self._cv:
            return module not in self.expected or module in self._have or self._error is not None

    def _wait(self, module: str) -> dict[str, torch.Tensor] | None:
        if module not in self.expected:
            return None
        with self._cv:
            while module not in self._have and self._error is None:
                self._cv.wait()
            if module in self._have:
                return self._have[module]
            raise self._error

    def get(self, module, default=None):
        got = self._wait(module)
        return default if got is None else got

    def __getitem__(self, module: str) -> dict[str, torch.Tensor]:
        got = self._wait(module)
        if got is None:
            raise KeyError(module)
        return got

    def __contains__(self, module) -> bool:
        return module in self.expected

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.expected))

    def __len__(self) -> int:
        return len(self.expected)

    def __bool__(self) -> bool:
        return bool(self.expected)


class BackgroundCalibration:
    """``work(feed, check)`` on its own thread, started at once: a calibration that puts each module into ``feed`` as
    its layer is done and returns what it gives the run (a :class:`~ctconvert.calibration.apply.Calibrated`); ``check``
    is the callable it calls between layers, which raises :class:`Cancelled` once :meth:`cancel` was called.

    :meth:`result` waits for the thread and returns ``work``'s value (or raises its error); :meth:`cancel` stops it at
    the next layer and waits for it."""

    def __init__(self, feed: CalibratedFeed, work: Callable):
        self.feed = feed
        self._work = work
        self._stop = threading.Event()
        self._value = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ctconvert-calibrate", daemon=True)
        self._thread.start()

    def _check(self) -> None:
        if self._stop.is_set():
            raise Cancelled("the run stopped")

    def _run(self) -> None:
        try:
            self._value = self._work(self.feed, self._check)
        except BaseException as e:  # noqa: BLE001 - handed to the feed's readers and to result()
            self._error = e
            self.feed.fail(e)

    def result(self):
        """``work``'s value, once the thread has ended; raises what ``work`` raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self, wait: bool = True) -> None:
        """Stop the calibration at its next layer (its error, if any, is dropped), and wait for the thread unless
        ``wait`` is False (the process is being stopped: a daemon thread ends with it)."""
        self._stop.set()
        if wait:
            self._thread.join()
