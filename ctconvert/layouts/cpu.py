"""The Marlin weight tiles on the CPU (``tiles.c``): the Triton kernel's bit moves, in C.

Built on first use (:mod:`ctconvert.cbuild`); :func:`available` is False
without a C compiler or with ``CTCONVERT_NATIVE=0``, and callers then use the
torch index math in :mod:`.marlin`. Same bytes as both (the tests compare).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from .. import cbuild

_SRC = Path(__file__).with_name("tiles.c")
_lib = None
_tried = False
_lock = threading.Lock()


def available(t: torch.Tensor) -> bool:
    global _lib, _tried
    if t.device.type != "cpu" or os.environ.get("CTCONVERT_NATIVE", "1") == "0":
        return False
    with _lock:
        if not _tried:
            _tried = True
            _lib = cbuild.build(_SRC)
            if _lib is not None:
                p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
                _lib.ct_marlin_tiles.argtypes = [p, i64, i64, i64, i64, i32, i64, i64, i64, p]
    return _lib is not None


def marlin_tiles(words: torch.Tensor, num_bits: int, size_n: int, size_k: int, padded_n: int, padded_k: int) -> torch.Tensor:
    """As :func:`.gpu.marlin_tiles`, for CPU tensors: int32 ``(B, N, K/pf)`` (any strides) ->
    int32 ``(B, padded_k/16, padded_n*16/pf)``."""
    pf = 32 // num_bits
    b = words.shape[0]
    kt, nt = padded_k // 16, padded_n // 64
    out = torch.empty(b, kt, nt * (1024 // pf), dtype=torch.int32)
    es = words.element_size()
    for i in range(b):
        src, dst = words[i], out[i]

        def run(k0: int, k1: int, src=src, dst=dst) -> None:
            _lib.ct_marlin_tiles(src.data_ptr(), size_n, size_k // pf, src.stride(0), src.stride(1), num_bits, k0, k1, nt, dst.data_ptr())

        assert es == 4
        cbuild.parallel_ranges(kt, 1, run)
    return out
