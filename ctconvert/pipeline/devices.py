"""``--device``: which devices a conversion runs on."""

from __future__ import annotations

import threading

import torch

from ..errors import UsageError
from . import driver

__all__ = ["DevicesAhead", "begin_contexts", "resolve_device", "resolve_devices"]


def resolve_devices(spec: str | None) -> list[torch.device]:
    """Parse ``--device``: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, a list (``cuda:0,1`` or
    ``cuda:0,cuda:1``), or ``all`` (every CUDA device). Raises :class:`UsageError`."""
    s = (spec or "auto").strip().lower()
    if s == "all":
        if not torch.cuda.is_available():
            raise UsageError("--device all needs CUDA devices, and none is available")
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if "," in s:
        parts = [p.strip() for p in s.split(",") if p.strip()]
        out = []
        for p in parts:
            if p.isdigit():
                p = f"cuda:{p}"
            out.append(resolve_device(p))
        if len(set(out)) != len(out) and any(d.type == "cuda" for d in out):
            raise UsageError(f"device {spec!r} names a GPU twice")
        return out
    return [resolve_device(s)]


def resolve_device(spec: str | None) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``."""
    s = (spec or "auto").strip().lower()
    if s == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(s)
    except RuntimeError:
        raise UsageError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {spec!r}; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {spec!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device {spec!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return dev


def begin_contexts(devices: list[torch.device]) -> threading.Thread | None:
    """Open the CUDA context of each CUDA device in ``devices`` on a daemon thread, while the run opens its source,
    plans and opens its output: the executor's first CUDA call (its stream) otherwise opens it on the critical path
    (~0.1-0.4 s on an H100 or H200). torch initialises CUDA once, under a lock, so a call of the executor meanwhile
    waits for this one instead of opening it again; each device's primary context is shared by every thread of the
    process. Returns the thread, or None where no device is a CUDA one. An error here is dropped: the executor's own
    first CUDA call raises it, as it would have."""
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return None

    def work() -> None:
        try:
            for d in cuda:
                torch.empty(1, device=d)  # the first allocation on ``d`` makes its context current
        except Exception:  # noqa: BLE001 - reported by the executor's own first call
            pass

    t = threading.Thread(target=work, daemon=True, name="ctconvert-cuda-init")
    t.start()
    return t


class DevicesAhead:
    """:func:`resolve_devices` of ``spec`` on a daemon thread, then ``then(devices)`` there (the quantize stage's: begin
    Triton's key and the CUDA contexts): asking whether CUDA is there initialises its driver, ~0.2 s of an H100 machine's
    call that the run otherwise spent before it opened its source. The driver and the primary contexts are made first
    through :mod:`.driver` (without the GIL, which torch's initialisation keeps: the plan runs meanwhile; the console
    script began that at its start). ``cpu`` (no driver) is resolved at once, here.
    :meth:`result` joins: the devices, or the :class:`UsageError` (or other error) resolving them raised, re-raised;
    an error ``then`` raises is dropped (the executor's own first CUDA call meets it)."""

    def __init__(self, spec: str | None, then=None, contexts: bool = True) -> None:
        self._contexts = contexts  # make the driver's contexts first (.driver; not for a run that computes nothing here)
        self._got: list[torch.device] | None = None
        self._error: BaseException | None = None
        self._then, self._thread = then, None
        if (spec or "auto").strip().lower() == "cpu":
            self._work(spec)
        else:
            self._thread = threading.Thread(target=self._work, args=(spec,), daemon=True, name="ctconvert-devices")
            self._thread.start()

    def _work(self, spec) -> None:
        if self._contexts and (early := driver.begin(spec)) is not None:  # the driver and contexts first, without the GIL (.driver)
            early.join()
        try:
            self._got = resolve_devices(spec)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e
            return
        if self._then is not None:
            try:
                self._then(self._got)
            except Exception:  # noqa: BLE001 - met again by the executor's first CUDA call
                pass

    def result(self) -> list[torch.device]:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return list(self._got or [])
