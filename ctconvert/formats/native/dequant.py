"""The fused CPU dequantization kernel (``dequant.c``), compiled on first use and called through ctypes.

One kernel serves every format: stored codes (one per byte, or two per byte as nibbles, low
first) are looked up in a value table built with torch's own conversions, the zero point is
subtracted and the scale factor multiplied in fp32, and the product is rounded to the dtype
compressed-tensors' ``decompress`` returns, then to the dtype asked for. Which codes, tables
and factors a format has is the format's business (:class:`ctconvert.formats.base.DequantSpec`);
this module only runs the kernel over row ranges on the CPU threads (:func:`ctconvert.cbuild.parallel_ranges`).

:func:`available` is False without a compiler or with ``CTCONVERT_NATIVE=0``; callers then use
the torch reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ... import cbuild
from ..common import KERNEL_DTYPES

__all__ = ["available", "dequant"]

_SRC = Path(__file__).with_name("dequant.c")
_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LIB = cbuild.Library(_SRC, {"ct_dequant": ([_p, _i32, _i64, _i64, _i64, _i64, _p, _p, _p, _i64, _i64, _i64, _i32, _i32, _p], _i64)})


def available() -> bool:
    """Whether the compiled kernel can be used (builds it on first call)."""
    return _LIB.get() is not None


def dequant(
    codes: torch.Tensor,
    nibbles: bool,
    k: int,
    lut: torch.Tensor,
    factor: torch.Tensor,
    zero_point: torch.Tensor | None,
    layout: tuple[int, int, int],
    mid: torch.dtype,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Dense ``[n, k]`` of ``out_dtype`` from stored codes, or None when a product is NaN (recompute with torch).

    ``codes``: uint8 ``[n, row bytes]`` (CPU; one code per byte, or with ``nibbles`` two per byte, element
    ``2j`` in the low nibble); ``lut``: fp32 ``[256]`` or ``[16]``, code -> value; ``factor`` and
    ``zero_point``: contiguous fp32, element ``(r // rdiv) * stride + c // g`` for ``layout = (stride, rdiv,
    g)``; ``mid``: the dtype the product is rounded to first; both dtypes bf16, fp16 or fp32; ``out``: a
    contiguous CPU ``[n, k]`` tensor of ``out_dtype`` to write into (else a new one). Raises ``RuntimeError``
    when the kernel is not available, ``ValueError`` for arguments it does not take.
    """
    lib = _LIB.get()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (no C compiler, or CTCONVERT_NATIVE=0)")
    if mid not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES or codes.dtype != torch.uint8 or codes.dim() != 2 or codes.device.type != "cpu":
        raise ValueError("native dequantization takes uint8 CPU codes [n, bytes] and bf16/fp16/fp32 dtypes")
    stride, rdiv, g = layout
    codes = codes.contiguous()
    n = codes.shape[0]
    if out is not None and (out.shape != (n, k) or out.dtype != out_dtype or not out.is_contiguous() or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous CPU [{n}, {k}] {out_dtype} tensor")
    if n * k == 0:
        return out if out is not None else torch.empty(n, k, dtype=out_dtype)
    if (k + 1) // 2 > codes.shape[1] if nibbles else k > codes.shape[1]:
        raise ValueError(f"codes [{n}, {codes.shape[1]}] do not hold {k} columns")
    lut = lut.to(torch.float32).contiguous()
    factor = factor.to(torch.float32).contiguous()
    zp = zero_point.to(torch.float32).contiguous() if zero_point is not None else None
    if out is None:
        out = torch.empty(n, k, dtype=out_dtype)
    nan = []
    row_bytes = codes.stride(0)
    m, od = KERNEL_DTYPES[mid], KERNEL_DTYPES[out_dtype]

    def run(a: int, b: int) -> None:
        c = lib.ct_dequant(
            codes.data_ptr(),
            int(nibbles),
            a,
            b,
            k,
            row_bytes,
            lut.data_ptr(),
            factor.data_ptr(),
            zp.data_ptr() if zp is not None else None,
            stride,
            rdiv,
            g,
            m,
            od,
            out.data_ptr(),
        )
        if c:
            nan.append(c)

    cbuild.parallel_ranges(n, 1, run, per=k)
    return None if nan else out
