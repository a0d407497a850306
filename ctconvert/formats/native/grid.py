"""The CPU kernel of verify's value-by-value check (``grid.c``), compiled on first use and called through ctypes.

For stored codes (one per byte, or two per byte as nibbles, low first), a reference in fp32, each code's rounding
interval (from :mod:`ctconvert.checkpoint.grid`) and the format's factors and zero points placed as in the
dequantization kernel (``(stride, rdiv, g)``), it counts the values that are not the nearest to the reference over
their factor. :func:`available` is False without a compiler or with ``CTCONVERT_NATIVE=0``; the caller then runs
the same comparisons with torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ... import cbuild

__all__ = ["available", "grid_check"]

_SRC = Path(__file__).with_name("grid.c")
_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_LIB = cbuild.Library(_SRC, {"ct_grid_check": ([_p, _i32, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _i64, _i64, _i64, _f32, _p, _p], _i64)})


def available() -> bool:
    """Whether the compiled kernel can be used (builds it on first call)."""
    return _LIB.get() is not None


def grid_check(
    codes: torch.Tensor,
    nibbles: bool,
    want: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    factor: torch.Tensor,
    zero_point: torch.Tensor | None,
    layout: tuple[int, int, int],
    tie: float,
) -> tuple[int, int, int | None]:
    """``(values judged, values off the grid, flat index r * k + c of the first off-grid value or None)``.

    ``codes``: uint8 ``[n, row bytes]`` (CPU); ``want``: fp32 ``[n, k]`` (the reference); ``lower``/``upper``: fp32
    ``[256]`` or ``[16]`` (nibbles), each code's rounding interval in the format's units; ``factor``/``zero_point``:
    fp32, element ``(r // rdiv) * stride + c // g`` for ``layout``; ``tie``: the share of a quotient's magnitude within
    which either neighbour of a midpoint is accepted. Raises ``RuntimeError`` when the kernel is not available,
    ``ValueError`` for arguments it does not take."""
    lib = _LIB.get()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (no C compiler, or CTCONVERT_NATIVE=0)")
    n, k = want.shape
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[0] != n or ((k + 1) // 2 if nibbles else k) > codes.shape[1]:
        raise ValueError(f"codes {tuple(codes.shape)} {codes.dtype} do not hold [{n}, {k}]")
    codes, want = codes.contiguous(), want.to(torch.float32).contiguous()
    lower, upper = lower.to(torch.float32).contiguous(), upper.to(torch.float32).contiguous()
    factor = factor.to(torch.float32).contiguous()
    zp = zero_point.to(torch.float32).contiguous() if zero_point is not None else None
    stride, rdiv, g = layout
    results: list[tuple[int, int, int]] = []

    def run(a: int, b: int) -> None:
        judged, first = ctypes.c_int64(0), ctypes.c_int64(-1)
        off = lib.ct_grid_check(
            codes.data_ptr(),
            int(nibbles),
            a,
            b,
            k,
            codes.stride(0),
            want.data_ptr(),
            lower.data_ptr(),
            upper.data_ptr(),
            factor.data_ptr(),
            zp.data_ptr() if zp is not None else None,
            stride,
            rdiv,
            g,
            tie,
            ctypes.byref(judged),
            ctypes.byref(first),
        )
        results.append((judged.value, off, first.value))

    if n * k:
        cbuild.parallel_ranges(n, max(1, rdiv), run)
    firsts = [f for _, _, f in results if f >= 0]
    return sum(r[0] for r in results), sum(r[1] for r in results), min(firsts) if firsts else None
