"""The Marlin weight tiles on the CPU (``tiles.c``): the Triton kernel's bit moves, in C.

Built on first use (:mod:`ctconvert.cbuild`); :func:`available` is False
without a C compiler or with ``CTCONVERT_NATIVE=0``, and callers then use the
torch index math in :mod:`.marlin`. Same bytes as both (the tests compare).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import cbuild

_SRC = Path(__file__).with_name("tiles.c")
_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_LIB = cbuild.Library(_SRC, {"ct_marlin_tiles": ([_p, _i64, _i64, _i64, _i64, _i32, _i64, _i64, _i64, _p], None)})


def available(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and _LIB.get() is not None


def marlin_tiles(words: torch.Tensor, num_bits: int, size_n: int, size_k: int, padded_n: int, padded_k: int) -> torch.Tensor:
    """As :func:`.gpu.marlin_tiles`, for CPU tensors: int32 ``(B, N, K/pf)`` (any strides) ->
    int32 ``(B, padded_k/16, padded_n*16/pf)``."""
    pf = 32 // num_bits
    b = words.shape[0]
    kt, nt = padded_k // 16, padded_n // 64
    out = torch.empty(b, kt, nt * (1024 // pf), dtype=torch.int32)
    es = words.element_size()
    lib = _LIB.get()
    for i in range(b):
        src, dst = words[i], out[i]

        def run(k0: int, k1: int, src=src, dst=dst) -> None:
            lib.ct_marlin_tiles(src.data_ptr(), size_n, size_k // pf, src.stride(0), src.stride(1), num_bits, k0, k1, nt, dst.data_ptr())

        assert es == 4
        cbuild.parallel_ranges(kt, 1, run)
    return out
