"""``src.t().contiguous()`` of a strided 2-D CPU tensor, in C (``transpose.c``): the gather of a fused expert's
transposed columns (gpt-oss's ``gate_up_proj [E, H, 2I]``, gate and up interleaved) into the Linear weight
``[I, H]`` that is quantized.

Built on first use (:mod:`ctconvert.cbuild`); without a C compiler or with ``CTCONVERT_NATIVE=0`` the torch copy
in blocks of :data:`TRANSPOSE_BLOCK` rows runs instead. Both move bytes only: the result equals
``src.t().contiguous()`` element for element (the tests compare them, NaN payloads included).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import cbuild

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LIB = cbuild.Library(Path(__file__).with_name("transpose.c"), {"ct_gather_t": ([_p, _i64, _i64, _i64, _i64, _i64, _i32, _p], _i32)})

#: rows of the source a block of the torch fallback copies at a time (each block stays in cache while it is scattered)
TRANSPOSE_BLOCK = 32


def transposed(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src.t().contiguous()`` of a 2-D CPU tensor ``[R, N]`` with any strides (a gate's every other column):
    ``[N, R]``, contiguous, ``src``'s dtype; written into ``out`` where given (contiguous ``[N, R]``, same dtype;
    a view into a batch, say). Output rows are split over the CPU worker threads. gpt-oss-shaped experts ([2048,
    768] of every other column of a bf16 region, one thread, this project's 2-core machine): 0.47 ms in C against ~0.8 ms
    for the torch blocks and ~2.5 ms for one strided copy. Raises ``ValueError`` for a tensor that is not 2-D or not on the CPU, or an ``out``
    of another shape, dtype or layout."""
    if src.dim() != 2 or src.device.type != "cpu":
        raise ValueError(f"transposed takes a 2-D CPU tensor, not {tuple(src.shape)} on {src.device}")
    r, n = src.shape
    if out is None:
        out = torch.empty((n, r), dtype=src.dtype)
    elif out.shape != (n, r) or out.dtype != src.dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"transposed: out must be a contiguous CPU {src.dtype} tensor of shape {(n, r)}")
    if out.numel() == 0:
        return out
    lib = _LIB.get()
    if lib is None or src.element_size() not in (1, 2, 4, 8):
        for r0 in range(0, r, TRANSPOSE_BLOCK):
            out[:, r0 : r0 + TRANSPOSE_BLOCK] = src[r0 : r0 + TRANSPOSE_BLOCK].t()
        return out
    s0, s1, es = src.stride(0), src.stride(1), src.element_size()
    base, dst = src.data_ptr(), out.data_ptr()
    cbuild.parallel_ranges(n, 1, lambda a, b: lib.ct_gather_t(base, s0, s1, r, a, b, es, dst), per=r)
    return out
