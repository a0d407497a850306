"""Fused CPU kernels (``quant.c``), compiled on first use and called through ctypes.

The C file is built once per machine (:mod:`ctconvert.cbuild`). Each function here has
the same signature and returns the same bytes as its torch reference in
:mod:`ctconvert.formats` (the tests compare them); rows are split over
threads, since ctypes releases the GIL.

:func:`available` is False when there is no compiler or
``CTCONVERT_NATIVE=0``; callers then use the torch reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ... import cbuild
from ..common import KERNEL_DTYPES as _DT

_SRC = Path(__file__).with_name("quant.c")
_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LIB = cbuild.Library(
    _SRC,
    {
        "ct_fp8_channel": ([_p, _i32, _i64, _i64, _p, _p], None),
        "ct_fp8_block": ([_p, _i32, _i64, _i64, _i64, _i64, _p, _p], None),
        "ct_int": ([_p, _i32, _i64, _i64, _i64, _i32, _i32, _i32, _p, _p, _p, _p], None),
        "ct_nvfp4": ([_p, _i32, _i64, _i64, ctypes.c_float, _p, _p], None),
        "ct_mxfp4": ([_p, _i32, _i64, _i64, _p, _p], _i32),
        "ct_mxfp8": ([_p, _i32, _i64, _i64, _p, _p], _i32),
        "ct_absmax": ([_p, _i32, _i64, _p], _i64),
    },
)


def available() -> bool:
    """Whether the compiled kernels can be used (builds them on first call)."""
    return _LIB.get() is not None


def _L() -> ctypes.CDLL:
    lib = _LIB.get()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (no C compiler, or CTCONVERT_NATIVE=0)")
    return lib


def _ptr(t: torch.Tensor, row0: int = 0) -> int:
    return t.data_ptr() + row0 * (t.stride(0) if t.dim() else 0) * t.element_size()


def _check(w: torch.Tensor) -> int:
    if w.device.type != "cpu" or w.dtype not in _DT or w.dim() != 2:
        raise ValueError("native kernels take a 2-D CPU bf16/fp16/fp32 tensor")
    return _DT[w.dtype]


def fp8_channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp8.quantize_fp8_channel`."""
    dt, w = _check(w), w.contiguous()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    s = torch.empty(n, 1, dtype=w.dtype)
    cbuild.parallel_ranges(n, 1, lambda a, b: _L().ct_fp8_channel(_ptr(w, a), dt, b - a, k, _ptr(q, a), _ptr(s, a)), per=k)
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale": s}


def fp8_block(w: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp8.quantize_fp8_block`."""
    dt, w = _check(w), w.contiguous()
    n, k = w.shape
    bh, bw = block
    q = torch.empty(n, k, dtype=torch.uint8)
    s = torch.empty(-(-n // bh), -(-k // bw), dtype=w.dtype)
    cbuild.parallel_ranges(n, bh, lambda a, b: _L().ct_fp8_block(_ptr(w, a), dt, b - a, k, bh, bw, _ptr(q, a), _ptr(s, a // bh)), per=k)
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale": s}


def int_quant(w: torch.Tensor, num_bits: int, group_size: int | None, symmetric: bool, pack: bool) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.integer.quantize_int`, plus :func:`pack_int32` when ``pack``.

    Returns ``weight`` (int8 ``[N, K]``) or ``weight_packed`` (int32), ``weight_scale``
    and, when asymmetric, the unpacked int8 ``weight_zero_point``.
    """
    dt, w = _check(w), w.contiguous()
    n, k = w.shape
    g = k if group_size is None else group_size
    words = -(-k * num_bits // 32)
    out = torch.empty(n, words, dtype=torch.int32) if pack else torch.empty(n, k, dtype=torch.int8)
    s = torch.empty(n, k // g, dtype=w.dtype)
    zp = None if symmetric else torch.empty(n, k // g, dtype=torch.int8)

    def run(a, b):
        tmp = torch.empty(k, dtype=torch.int8)
        _L().ct_int(
            _ptr(w, a), dt, b - a, k, g, num_bits, int(symmetric), int(pack), _ptr(out, a), _ptr(s, a), _ptr(zp, a) if zp is not None else None, tmp.data_ptr()
        )

    cbuild.parallel_ranges(n, 1, run, per=k)
    res = {"weight_packed" if pack else "weight": out, "weight_scale": s}
    if zp is not None:
        res["weight_zero_point"] = zp
    return res


def nvfp4(w: torch.Tensor, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp4.quantize_nvfp4`: ``global_scale`` fp32 ``[1]``, or ``[N, 1]`` (one per
    row: each run of rows with one scale is a kernel call of its own). Raises ``ValueError`` for per-row scales
    whose count is not ``N``."""
    dt, w = _check(w), w.contiguous()
    n, k = w.shape
    g = global_scale.reshape(-1).to(torch.float32)
    if g.numel() != 1 and g.numel() != n:
        raise ValueError(f"NVFP4 global scales: {g.numel()} for {n} rows")
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    s = torch.empty(n, k // 16, dtype=torch.uint8)
    cuts = [0, n] if g.numel() == 1 else [0, *((g[1:] != g[:-1]).nonzero().flatten() + 1).tolist(), n]
    for r0, r1 in zip(cuts, cuts[1:]):
        if r1 <= r0:
            continue
        gs = float(g[r0 if g.numel() > 1 else 0])
        cbuild.parallel_ranges(
            r1 - r0, 1, lambda a, b, r0=r0, gs=gs: _L().ct_nvfp4(_ptr(w, r0 + a), dt, b - a, k, gs, _ptr(packed, r0 + a), _ptr(s, r0 + a)), per=k
        )
    return {"weight_packed": packed, "weight_scale": s.view(torch.float8_e4m3fn)}


def _mx(kernel: str, name: str, w: torch.Tensor, q_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the MX kernel ``kernel`` over row ranges: ``(q [n, q_cols] uint8, E8M0 scale [n, k/32] uint8)``;
    ``ValueError`` when a group's power-of-two scale overflows ``w.dtype``."""
    dt, w = _check(w), w.contiguous()
    n, k = w.shape
    q = torch.empty(n, q_cols, dtype=torch.uint8)
    s = torch.empty(n, k // 32, dtype=torch.uint8)
    errs = []
    fn = getattr(_L(), kernel)

    def run(a, b):
        if fn(_ptr(w, a), dt, b - a, k, _ptr(q, a), _ptr(s, a)):
            errs.append((a, b))

    cbuild.parallel_ranges(n, 1, run, per=k)
    if errs:
        from ..mx import overflow_error

        raise overflow_error(w, name) or ValueError(f"{name} scale overflows {w.dtype}")
    return q, s


def mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp4.quantize_mxfp4` (raises ``ValueError`` on scale overflow)."""
    packed, s = _mx("ct_mxfp4", "MXFP4", w, w.shape[1] // 2)
    return {"weight_packed": packed, "weight_scale": s}


def mxfp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp8.quantize_mxfp8` (raises ``ValueError`` on scale overflow)."""
    q, s = _mx("ct_mxfp8", "MXFP8", w, w.shape[1])
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale": s}


#: elements per thread of :func:`absmax`, which reads ~10 elements a nanosecond on one core: below 4 Mi elements a
#: second thread costs more than it saves (768 x 2048 bf16: 155 us on one thread, 175 us on two)
ABSMAX_GRAIN = 1 << 22


def absmax(w: torch.Tensor) -> tuple[float, int]:
    """``(max |x|, number of non-finite elements)`` of a CPU tensor."""
    dt, w = _check(w.reshape(1, -1) if w.dim() != 2 else w), w.contiguous()
    res: list[tuple[float, int]] = []
    flat = w.reshape(-1)

    def run(a, b):
        out = ctypes.c_float(0.0)
        bad = _L().ct_absmax(flat.data_ptr() + a * flat.element_size(), dt, b - a, ctypes.byref(out))
        res.append((out.value, bad))

    cbuild.parallel_ranges(flat.numel(), 4096, run, per=1, grain=ABSMAX_GRAIN)
    if not res:
        return 0.0, 0
    return max(r[0] for r in res), sum(r[1] for r in res)
