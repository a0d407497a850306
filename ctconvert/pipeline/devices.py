"""``--device``: which devices a conversion runs on."""

from __future__ import annotations

import threading

import torch

from ..errors import UsageError

__all__ = ["begin_contexts", "resolve_device", "resolve_devices"]


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
