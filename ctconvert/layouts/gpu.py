"""Triton kernels for the Marlin layouts on CUDA (docs/kernel-layouts.md §3.1, §4, §5.2).

* :func:`marlin_tiles`: compressed-tensors (or GPTQ) words -> Marlin weight tiles,
  for a batch of same-shaped modules in one launch. The source is addressed
  through strides, so ``weight_packed (N, K/pf)`` and its transpose (the GPTQ
  ``(K/pf, N)`` layout) are read in place: no transpose copy, no padding copy
  (rows and columns past K and N read as zero, which is vLLM's tile padding,
  §3.4). Each program owns one 64-column tile strip over ``BKT`` k-tiles: it
  reads the source words of columns ``c`` and ``c + 8`` (contiguous along K),
  builds the four (4-bit) or eight (8-bit) tile words they feed by bit moves
  alone, and reorders them in registers so that each tile is stored as one
  contiguous run: every input word is read once and every output word
  written once, both coalesced.
* :func:`permute_scales`: the scale / zero-pad / ``scale_perm`` gather of §4
  (plus, for NVFP4, the ``[0,2,1,3]`` reorder and the S0E5M3 encoding of §5.2
  step 3) in one pass over a batch.

Same bytes as the torch paths in :mod:`.marlin`, :mod:`.marlin_fp8` and :mod:`.marlin_nvfp4` (the
tests compare them on CUDA).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    _HAVE = True
except Exception:  # noqa: BLE001
    _HAVE = False


#: launch configurations (scripts/bench_repack.py --tune): marlin_tiles k-tiles per program and warps; permute_scales block
TUNE = {"bkt": 16, "num_warps": 4, "scale_bg": 64, "scale_bp": 128}


def available(t: torch.Tensor) -> bool:
    return _HAVE and t.is_cuda


if _HAVE:

    @triton.jit
    def _word4(xa, xb, ya, yb):
        # nibbles a0 a2 b0 b2 a1 a3 b1 b3 (§3.1): low/high nibble of a byte = rows 2i / 2i+1
        return (
            (xa & 15) | ((xb & 15) << 4) | ((ya & 15) << 8) | ((yb & 15) << 12) | ((xa >> 4) << 16) | ((xb >> 4) << 20) | ((ya >> 4) << 24) | ((yb >> 4) << 28)
        )

    @triton.jit
    def _word8(lo, hi, sh):
        # bytes a0 a2 a1 a3 (§3.1): rows 2i, 2i+8, 2i+1, 2i+9 of one column
        a = (lo >> sh) & 0xFFFF
        c = (hi >> sh) & 0xFFFF
        return (a & 0xFF) | ((c & 0xFF) << 8) | ((a >> 8) << 16) | ((c >> 8) << 24)

    @triton.jit
    def _marlin_tiles_kernel(w_ptr, out_ptr, N, KW, KT, s_b, s_n, s_k, o_b, o_k, BITS: tl.constexpr, BKT: tl.constexpr):
        WPT: tl.constexpr = BITS // 2  # source words per k-tile and column: 16 rows / pf
        nt = tl.program_id(1)
        bb = tl.program_id(2).to(tl.int64)
        kt = tl.program_id(0) * BKT + tl.arange(0, BKT)
        cb = tl.arange(0, 32)  # 4*i + warp: tile columns c = 16*warp + i and c + 8, i < 8
        n0 = nt * 64 + 16 * (cb % 4) + cb // 4
        # (32, BKT*WPT) words, one contiguous run along K per column (wide loads), then (32, BKT, WPT)
        kw = tl.program_id(0) * (BKT * WPT) + tl.arange(0, BKT * WPT)
        base = w_ptr + bb * s_b + kw[None, :].to(tl.int64) * s_k
        mk = (kw < KW)[None, :]
        x = tl.load(base + n0[:, None].to(tl.int64) * s_n, mask=(n0 < N)[:, None] & mk, other=0)
        y = tl.load(base + (n0 + 8)[:, None].to(tl.int64) * s_n, mask=(n0 + 8 < N)[:, None] & mk, other=0)
        x = tl.reshape(x, (32, BKT, WPT))
        y = tl.reshape(y, (32, BKT, WPT))
        if BITS == 4:
            x0, x1 = tl.split(x)
            y0, y1 = tl.split(y)
            w0 = _word4(x0 & 0xFF, x1 & 0xFF, y0 & 0xFF, y1 & 0xFF)
            w1 = _word4((x0 >> 8) & 0xFF, (x1 >> 8) & 0xFF, (y0 >> 8) & 0xFF, (y1 >> 8) & 0xFF)
            w2 = _word4((x0 >> 16) & 0xFF, (x1 >> 16) & 0xFF, (y0 >> 16) & 0xFF, (y1 >> 16) & 0xFF)
            w3 = _word4((x0 >> 24) & 0xFF, (x1 >> 24) & 0xFF, (y0 >> 24) & 0xFF, (y1 >> 24) & 0xFF)
            t = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # (32, BKT, u, v): byte b = 2v + u
            t = tl.reshape(t, (8, 4, BKT, 2, 2))  # (i, warp, kt, u, v)
            t = tl.permute(t, (2, 0, 4, 3, 1))  # tile word 16*i + 4*b + warp (4*th + warp, th = 4*i + b)
            T: tl.constexpr = 128
        else:
            xe, xo = tl.split(tl.reshape(x, (32, BKT, 2, 2)))  # j = 2u + v: xe = j in {0, 2}, xo = j in {1, 3}
            x0, x2 = tl.split(xe)
            x1, x3 = tl.split(xo)
            ye, yo = tl.split(tl.reshape(y, (32, BKT, 2, 2)))
            y0, y2 = tl.split(ye)
            y1, y3 = tl.split(yo)
            h0 = tl.join(_word8(x0, x2, 0), _word8(y0, y2, 0))
            h1 = tl.join(_word8(x0, x2, 16), _word8(y0, y2, 16))
            h2 = tl.join(_word8(x1, x3, 0), _word8(y1, y3, 0))
            h3 = tl.join(_word8(x1, x3, 16), _word8(y1, y3, 16))
            t = tl.join(tl.join(h0, h1), tl.join(h2, h3))  # (32, BKT, h, u, v): b = 2v + u
            t = tl.reshape(t, (8, 4, BKT, 2, 2, 2))  # (i, warp, kt, h, u, v)
            t = tl.permute(t, (2, 0, 5, 4, 1, 3))  # tile word 32*i + 8*b + 2*warp + h
            T: tl.constexpr = 256
        t = tl.reshape(t, (BKT, T))
        offs = bb * o_b + kt[:, None].to(tl.int64) * o_k + nt * T + tl.arange(0, T)[None, :]
        tl.store(out_ptr + offs, t, mask=(kt < KT)[:, None])

    @triton.jit
    def _e4m3_top_kernel(s_ptr, out_ptr, L, s_b, BLOCK: tl.constexpr):
        bb = tl.program_id(1).to(tl.int64)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(s_ptr + bb * s_b + i, mask=i < L, other=0).to(tl.int32)
        v = tl.where(v < 0x7F, v, 0)
        tl.atomic_max(out_ptr + bb, tl.max(v, axis=0))

    @triton.jit
    def _permute_scales_kernel(
        s_ptr, out_ptr, idx_ptr, sf_ptr, N, G, GP, NP, s_b, s_n, s_g, o_b, R: tl.constexpr, BG: tl.constexpr, BP: tl.constexpr, ENCODE: tl.constexpr
    ):
        bb = tl.program_id(2).to(tl.int64)
        g = tl.program_id(0) * BG + tl.arange(0, BG)
        p = tl.program_id(1) * BP + tl.arange(0, BP)
        n = (p // R) * R + tl.load(idx_ptr + p % R)
        m = (n < N)[:, None] & (g < G)[None, :]
        v = tl.load(s_ptr + bb * s_b + n[:, None].to(tl.int64) * s_n + g[None, :].to(tl.int64) * s_g, mask=m, other=0)  # (BP, BG)
        if ENCODE:
            # e4m3 byte -> fp32 (exact), * sf, -> fp16, * 128 in fp16, flush < 2, S0E5M3 code = bits >> 7 (§5.2 step 3)
            v = v.to(tl.int32) & 0xFF
            e = (v >> 3) & 15
            mant = v & 7
            mag = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, ((e + 120) << 23 | (mant << 20)).to(tl.float32, bitcast=True))
            mag = tl.where((e == 15) & (mant == 7), float("nan"), mag)
            x = tl.where((v & 0x80) != 0, -mag, mag)
            sf = tl.load(sf_ptr + bb)
            h = (x * sf).to(tl.float16)
            h = (h.to(tl.float32) * 128.0).to(tl.float16)
            h = tl.where(h < 2.0, 0.0, h.to(tl.float32)).to(tl.float16)
            v = ((h.to(tl.int16, bitcast=True).to(tl.int32) >> 7) & 0xFF).to(tl.uint8)
        om = (p < NP)[:, None] & (g < GP)[None, :]
        tl.store(out_ptr + bb * o_b + g[None, :].to(tl.int64) * NP + p[:, None], v, mask=om)


def e4m3_top(s: torch.Tensor) -> torch.Tensor:
    """Largest positive finite e4m3 value of each module: ``(B, ...)`` float8_e4m3fn / uint8 -> ``(B,)`` float8_e4m3fn (0 if none).

    Non-negative e4m3 bytes 0x00..0x7E order as their values (0x7F is NaN,
    0x80 and up are negative), so this is an integer max over those bytes.
    """
    b = s.shape[0]
    flat = s.reshape(b, -1).view(torch.uint8)
    out = torch.zeros(b, dtype=torch.int32, device=s.device)
    n = flat.shape[1]
    block = 8192
    if b and n:
        _e4m3_top_kernel[(triton.cdiv(n, block), b)](flat, out, n, flat.stride(0), BLOCK=block, num_warps=8)
    return out.to(torch.uint8).view(torch.float8_e4m3fn)


def marlin_tiles(words: torch.Tensor, num_bits: int, size_n: int, size_k: int, padded_n: int, padded_k: int) -> torch.Tensor:
    """Marlin weight tiles (``gptq_marlin_repack`` with vLLM's zero padding, §3.1, §3.4) for a batch.

    Args:
        words: int32 ``(B, N, K/pf)`` compressed-tensors ``weight_packed`` (pack
            along K, low bits first), any strides (so a ``(B, K/pf, N)`` GPTQ
            tensor passed as ``.transpose(1, 2)`` is read in place); CUDA.
        num_bits: 4 or 8; size_n, size_k: N and K; padded_n, padded_k: the
            padded sizes (multiples of 64 and 16).

    Returns:
        int32 ``(B, padded_k/16, padded_n*16/pf)``, contiguous.
    """
    pf = 32 // num_bits
    b = words.shape[0]
    kt, nt = padded_k // 16, padded_n // 64
    out = torch.empty(b, kt, nt * (1024 // pf), dtype=torch.int32, device=words.device)
    bkt = TUNE["bkt"]
    if b and kt and nt:
        _marlin_tiles_kernel[(triton.cdiv(kt, bkt), nt, b)](
            words,
            out,
            size_n,
            size_k // pf,
            kt,
            *words.stride(),
            *out.stride()[:2],
            BITS=num_bits,
            BKT=bkt,
            num_warps=TUNE["num_warps"],
        )
    return out


def permute_scales(s: torch.Tensor, padded_g: int, padded_n: int, idx: torch.Tensor, sf: torch.Tensor | None = None) -> torch.Tensor:
    """Zero-pad and ``scale_perm``-gather a batch of transposed scales (§4); with ``sf``, S0E5M3-encode them (§5.2).

    Args:
        s: ``(B, N, G)`` checkpoint scales (any strides), 16-bit (moved as bits)
            or, with ``sf``, float8_e4m3fn / uint8.
        padded_g, padded_n: output sizes.
        idx: int ``(R,)`` column gather within each run of R (64 or 32).
        sf: float32 ``(B,)`` NVFP4 scale factors, or None.

    Returns:
        ``(B, padded_g, padded_n)``: s's dtype, or uint8 codes with ``sf``.
    """
    b, n, g = s.shape
    bits = s.view(torch.uint8) if s.element_size() == 1 else s.view(torch.int16)
    out = torch.empty(b, padded_g, padded_n, dtype=bits.dtype, device=s.device)
    r = idx.numel()
    bg, bp = TUNE["scale_bg"], TUNE["scale_bp"]
    idx = idx.to(device=s.device, dtype=torch.int32)
    sf_arg = sf if sf is not None else idx
    if b and padded_g and padded_n:
        _permute_scales_kernel[(triton.cdiv(padded_g, bg), triton.cdiv(padded_n, bp), b)](
            bits,
            out,
            idx,
            sf_arg,
            n,
            g,
            padded_g,
            padded_n,
            *bits.stride(),
            out.stride(0),
            R=r,
            BG=bg,
            BP=bp,
            ENCODE=sf is not None,
            num_warps=4,
        )
    return out if sf is not None else out.view(s.dtype)
