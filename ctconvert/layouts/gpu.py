"""Triton kernel for the Marlin weight tiles (kernel-layouts.md §3.1) on CUDA.

One program builds a row of output tiles: every output word gathers its
``pf`` values (4-bit nibbles or bytes) from the GPTQ words of one 16 x 64
tile, at the tile-local positions :func:`ctconvert.layouts.marlin._tile_src_index`
gives, so the weight is read once and written once. Same bytes as the torch
path in :mod:`.marlin` (the tests compare them).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    _HAVE = True
except Exception:  # noqa: BLE001
    _HAVE = False


def available(t: torch.Tensor) -> bool:
    return _HAVE and t.is_cuda


if _HAVE:

    @triton.jit
    def _marlin_tiles_kernel(q_ptr, out_ptr, src_ptr, NP, NT, BITS: tl.constexpr, PF: tl.constexpr, T: tl.constexpr,
                             NT_B: tl.constexpr):
        kt = tl.program_id(0).to(tl.int64)
        ntb = tl.program_id(1).to(tl.int64)
        w = tl.arange(0, T)
        j = tl.arange(0, PF)
        src = tl.load(src_ptr + w[:, None] * PF + j[None, :])  # tile-local r*64 + c, [T, PF]
        r = src // 64
        c = src % 64
        row = kt * 16 + r
        for i in range(NT_B):
            nt = ntb * NT_B + i
            if nt < NT:
                col = nt * 64 + c
                word = tl.load(q_ptr + (row // PF) * NP + col)
                val = (word >> ((row % PF) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
                packed = tl.sum(val.to(tl.uint32) << (j * BITS).to(tl.uint32)[None, :], axis=1)
                tl.store(out_ptr + (kt * NT + nt) * T + w, packed.to(tl.int32, bitcast=True))


def marlin_tiles(q_w_padded: torch.Tensor, num_bits: int, src: torch.Tensor) -> torch.Tensor:
    """GPTQ int32 ``(Kp/pf, Np)`` (already padded) -> Marlin int32 ``(Kp/16, Np*16/pf)``."""
    pf = 32 // num_bits
    rows, np_ = q_w_padded.shape
    kp = rows * pf
    kt, nt = kp // 16, np_ // 64
    t = 1024 // pf
    out = torch.empty(kt, nt * t, dtype=torch.int32, device=q_w_padded.device)
    src_dev = src.to(device=q_w_padded.device, dtype=torch.int32).contiguous()
    ntb = 4
    if kt and nt:
        _marlin_tiles_kernel[(kt, triton.cdiv(nt, ntb))](q_w_padded.contiguous(), out, src_dev, np_, nt, BITS=num_bits, PF=pf, T=t,
                                                      NT_B=ntb, num_warps=4)
    return out
