"""CUDA's driver initialised ahead, on a thread that does not hold the GIL (torch-free).

torch initialises the driver (``cuInit``) and a device's primary context inside calls that keep Python's GIL, so a
thread that makes them (:class:`ctconvert.pipeline.devices.DevicesAhead`) stops every other Python thread meanwhile:
planning a MoE checkpoint beside it took twice its time on an H100. Here the same two driver calls are made through
:mod:`ctypes`, which releases the GIL for the length of a foreign call, so they run beside the console script's import
of torch; torch's own calls then find the driver initialised and the primary context made (the driver keeps both
per process, and the runtime torch uses takes a device's primary context: NVIDIA's CUDA Driver API reference,
``cuInit``, ``cuDevicePrimaryCtxRetain``; CUDA Runtime API, "Interactions with the CUDA Driver API").

Nothing here reports an error: where ``libcuda.so.1`` cannot be loaded or a call fails, torch's own first call meets
the same problem and says so, as it would have.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["begin", "device_spec", "ordinals"]

_LOCK = threading.Lock()
_THREAD: threading.Thread | None = None


def device_spec(argv: list[str]) -> str:
    """The value of ``--device`` on command line ``argv`` (``--device X`` or ``--device=X``; the last one), else ``auto``."""
    spec = "auto"
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            spec = argv[i + 1]
        elif a.startswith("--device="):
            spec = a.partition("=")[2]
    return spec


def ordinals(spec: str | None) -> list[int] | None:
    """The CUDA device ordinals ``--device`` ``spec`` names (:func:`ctconvert.pipeline.devices.resolve_devices`'
    grammar): ``[0]`` for ``auto``/``cuda`` (the device a new process's torch uses first), ``[N]`` for ``cuda:N``, each
    of a list, where a bare ``N`` is ``cuda:N`` too; None for ``all`` (every device); ``[]`` for ``cpu`` or a word that
    is not a device (the run's own parse refuses it)."""
    s = (spec or "auto").strip().lower()
    if s == "all":
        return None
    out = []
    parts = [p.strip() for p in s.split(",")]
    for p in parts:
        if p in ("auto", "cuda"):
            out.append(0)
        elif p.startswith("cuda:") and p[5:].isdigit():
            out.append(int(p[5:]))
        elif p.isdigit() and len(parts) > 1:  # a bare ordinal only inside a list (resolve_devices)
            out.append(int(p))
    return list(dict.fromkeys(out))


def _init(devices: list[int] | None) -> None:
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        if cu.cuInit(0) != 0:
            return
        if devices is None:
            count = ctypes.c_int(0)
            if cu.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return
            devices = list(range(count.value))
        for n in devices:
            dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
            if cu.cuDeviceGet(ctypes.byref(dev), n) == 0:
                cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)  # kept for the process, as torch keeps it
    except (OSError, AttributeError):  # no driver library here: torch says so where it matters
        pass


def begin(spec: str | None) -> threading.Thread | None:
    """Initialise CUDA's driver and the primary context of each device ``spec`` (``--device``) names on a daemon
    thread, once per process; the thread, or None where ``spec`` names no CUDA device. Join it to wait."""
    global _THREAD
    devices = ordinals(spec)
    if devices == []:
        return None
    with _LOCK:
        if _THREAD is None:
            _THREAD = threading.Thread(target=_init, args=(devices,), daemon=True, name="ctconvert-cuda-driver")
            _THREAD.start()
        return _THREAD
