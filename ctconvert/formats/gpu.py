"""Fused Triton kernels for CUDA tensors: read the weight once, write values and scales once.

Same arithmetic, step for step, as the torch reference (``fp8.py``,
``integer.py``, ``fp4.py``) and so as compressed-tensors' CPU path
(compressed-tensors-format.md §6): fp32 math with ``div_rn`` (IEEE division,
not the fast approximate one), and explicit RNE casts to the model dtype D
where the reference rounds. The tests compare every kernel with the CPU
result byte for byte.

:func:`available` is False without CUDA or Triton; callers then use the torch
reference on the GPU.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs do not have it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    _HAVE_TRITON = True
except Exception:  # noqa: BLE001
    _HAVE_TRITON = False


def available() -> bool:
    return _HAVE_TRITON and torch.cuda.is_available()


_DT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

#: launch configurations (scripts/tune_gpu.py sweeps them on a large weight)
TUNE = {
    "fp8_row": {"max_single": 0, "num_warps": 8},
    "fp8_block": {"num_warps": 16},
    "int_group": {"elems": 4096, "num_warps": 4},
    "fp4": {"br": 8, "cols": 512, "num_warps": 4},
}
_EPS = {0: 2.0**-7, 1: 2.0**-10, 2: 2.0**-23}

if _HAVE_TRITON:

    @triton.jit
    def _rd(x, DT: tl.constexpr):
        """Round fp32 to D (RNE) and back."""
        if DT == 0:
            return x.to(tl.bfloat16).to(tl.float32)
        elif DT == 1:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _to_d(x, DT: tl.constexpr):
        if DT == 0:
            return x.to(tl.bfloat16)
        elif DT == 1:
            return x.to(tl.float16)
        else:
            return x

    @triton.jit
    def _e2m1(x):
        a = tl.abs(x)
        c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32) \
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
        return c | ((x < 0.0).to(tl.int32) << 3)

    @triton.jit
    def _fp8_row_kernel(w_ptr, q_ptr, s_ptr, K, DT: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = row * K
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(w_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        m = tl.max(amax, axis=0)
        s = _rd(tl.div_rn(m, 448.0), DT)
        s = tl.where(s == 0.0, EPS, s)
        tl.store(s_ptr + row, _to_d(s, DT))
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(w_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)
            v = _rd(tl.div_rn(x, s), DT) + 0.0
            v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            tl.store(q_ptr + base + offs, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=offs < K)

    @triton.jit
    def _fp8_row1_kernel(w_ptr, q_ptr, s_ptr, K, DT: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
        """Per-channel FP8 for rows that fit one block: read once, write once."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x = tl.load(w_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        s = _rd(tl.div_rn(tl.max(tl.abs(x), axis=0), 448.0), DT)
        s = tl.where(s == 0.0, EPS, s)
        tl.store(s_ptr + row, _to_d(s, DT))
        v = _rd(tl.div_rn(x, s), DT) + 0.0
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(q_ptr + row * K + offs, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=offs < K)

    @triton.jit
    def _fp8_block_kernel(w_ptr, q_ptr, s_ptr, N, K, KB, DT: tl.constexpr, EPS: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr):
        br = tl.program_id(0).to(tl.int64)
        bc = tl.program_id(1).to(tl.int64)
        rows = br * BH + tl.arange(0, BH)
        cols = bc * BW + tl.arange(0, BW)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        offs = rows[:, None] * K + cols[None, :]
        x = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        s = _rd(tl.div_rn(m, 448.0), DT)
        s = tl.where(s == 0.0, EPS, s)
        tl.store(s_ptr + br * KB + bc, _to_d(s, DT))
        v = _rd(tl.div_rn(x, s), DT) + 0.0
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(q_ptr + offs, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)

    @triton.jit
    def _int_group_kernel(w_ptr, out_ptr, s_ptr, zp_ptr, N, K, G: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr,
                          PACK: tl.constexpr, DT: tl.constexpr, EPS: tl.constexpr, BR: tl.constexpr):
        """One group of G columns for BR rows, loaded as [BR, G/PER, PER] so that packing PER values into
        a word is a reduction over the last axis (no reshape, no shared-memory shuffle)."""
        pr = tl.program_id(0).to(tl.int64)
        gi = tl.program_id(1).to(tl.int64)
        NG = K // G
        PER: tl.constexpr = 32 // BITS if PACK else 1
        rows = pr * BR + tl.arange(0, BR)
        rmask = rows < N
        wi = tl.arange(0, G // PER)
        ei = tl.arange(0, PER)
        cols = gi * G + wi[:, None] * PER + ei[None, :]  # [G/PER, PER]
        x = tl.load(w_ptr + rows[:, None, None] * K + cols[None, :, :], mask=rmask[:, None, None], other=0.0).to(tl.float32)
        QMIN: tl.constexpr = -(1 << (BITS - 1))
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        if SYM:
            amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
            s = _rd(tl.div_rn(amax, ((1 << BITS) - 1) / 2.0), DT)
            z = tl.zeros([BR], dtype=tl.float32)
        else:
            mn = tl.minimum(tl.min(tl.min(x, axis=2), axis=1), 0.0)
            mx = tl.maximum(tl.max(tl.max(x, axis=2), axis=1), 0.0)
            s = _rd(tl.div_rn(_rd(mx - mn, DT), ((1 << BITS) - 1) * 1.0), DT)
            zf = _rd(QMIN - _rd(tl.div_rn(mn, s), DT), DT)
            zf = tl.where(zf != zf, 0.0, zf)
            zf = tl.minimum(tl.maximum(zf, QMIN * 1.0), QMAX * 1.0)
            z = libdevice.rint(zf)
            tl.store(zp_ptr + rows * NG + gi, z.to(tl.int8), mask=rmask)
        s = tl.where(s == 0.0, EPS, s)
        tl.store(s_ptr + rows * NG + gi, _to_d(s, DT), mask=rmask)
        v = _rd(tl.div_rn(x, s[:, None, None]), DT)
        if not SYM:
            v = _rd(v + z[:, None, None], DT)
        v = tl.minimum(tl.maximum(v, QMIN * 1.0), QMAX * 1.0)
        q = libdevice.rint(v).to(tl.int32)
        if PACK:
            u = (q + (1 << (BITS - 1))).to(tl.uint32)
            word = tl.sum(u << (ei * BITS).to(tl.uint32)[None, None, :], axis=2)
            W = K // PER
            wcols = gi * (G // PER) + wi
            tl.store(out_ptr + rows[:, None] * W + wcols[None, :], word.to(tl.int32, bitcast=True), mask=rmask[:, None])
        else:
            tl.store(out_ptr + rows[:, None, None] * K + cols[None, :, :], q.to(tl.int8), mask=rmask[:, None, None])

    @triton.jit
    def _int_channel_kernel(w_ptr, out_ptr, s_ptr, K, BITS: tl.constexpr, DT: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
        """Symmetric per-channel int (W8A8), unpacked int8."""
        row = tl.program_id(0).to(tl.int64)
        base = row * K
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(w_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)))
        s = _rd(tl.div_rn(tl.max(amax, axis=0), ((1 << BITS) - 1) / 2.0), DT)
        s = tl.where(s == 0.0, EPS, s)
        tl.store(s_ptr + row, _to_d(s, DT))
        QMIN: tl.constexpr = -(1 << (BITS - 1))
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(w_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(_rd(tl.div_rn(x, s), DT), QMIN * 1.0), QMAX * 1.0)
            tl.store(out_ptr + base + offs, libdevice.rint(v).to(tl.int8), mask=offs < K)

    @triton.jit
    def _fp4_codes(x, d, NVFP4: tl.constexpr, DT: tl.constexpr):
        if NVFP4:
            v = tl.div_rn(x, d)
        else:
            # d is 2^(127-e), the exact reciprocal of the power-of-two scale: x * d and x / 2^(e-127)
            # are the same real number, so they round to the same fp32 value
            v = _rd(x * d, DT)
        return _e2m1(tl.minimum(tl.maximum(v, -6.0), 6.0))

    @triton.jit
    def _fp4_kernel(w_ptr, p_ptr, s_ptr, gs_ptr, N, K, NVFP4: tl.constexpr, G: tl.constexpr, DT: tl.constexpr,
                    BR: tl.constexpr, BG: tl.constexpr):
        """NVFP4 (G=16, E4M3 scales, global scale) or MXFP4 (G=32, E8M0 scales).

        The weight is loaded once, contiguously, as [BR, BG, G/2, 2] and split
        into even and odd columns, so the two nibbles of each output byte meet
        without any reshape."""
        pr = tl.program_id(0).to(tl.int64)
        pg = tl.program_id(1).to(tl.int64)
        NG = K // G
        H: tl.constexpr = G // 2
        rows = pr * BR + tl.arange(0, BR)
        groups = pg * BG + tl.arange(0, BG)
        pidx = groups[:, None] * H + tl.arange(0, H)[None, :]  # byte index within the row, [BG, H]
        rmask = rows < N
        gmask = groups < NG
        m3 = rmask[:, None, None] & gmask[None, :, None]
        # one contiguous load of [BR, BG, H, 2], split into even and odd columns in registers
        cols = 2 * pidx[None, :, :, None] + tl.arange(0, 2)[None, None, None, :]
        x = tl.load(w_ptr + rows[:, None, None, None] * K + cols, mask=m3[:, :, :, None], other=0.0).to(tl.float32)
        xe, xo = tl.split(x)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))  # [BR, BG]
        m2 = rmask[:, None] & gmask[None, :]
        if NVFP4:
            gs = tl.load(gs_ptr)
            t = _rd(tl.div_rn(amax, 6.0), DT)
            s = tl.minimum(tl.maximum(gs * t, -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
            s = tl.where(s == 0.0, 0.125, s)
            tl.store(s_ptr + rows[:, None] * NG + groups[None, :], s.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m2)
            d = tl.div_rn(s, gs)
        else:
            # power of two of amax on D's bit pattern (compressed-tensors-format.md §6.5), all in integers
            if DT == 0:
                b = amax.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                b = (b + 32) & 0xFF80
                E = (b >> 7) - 127
                zero = (b >> 7) == 0
            elif DT == 1:
                b = amax.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                b = (b + 256) & 0xFC00
                E = (b >> 10) - 15
                zero = (b >> 10) == 0
            else:
                b = amax.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
                b = (b + 2097152) & 0xFF800000
                E = ((b >> 23) - 127).to(tl.int32)
                zero = (b >> 23) == 0
            e = tl.where(zero, 0, E + 125)
            e = tl.minimum(tl.maximum(e, 0), 255)
            if DT == 1:  # 2^(e-127) underflows fp16 below 2^-24: compressed-tensors then uses scale 1
                e = tl.where(e < 103, 127, e)
            tl.store(s_ptr + rows[:, None] * NG + groups[None, :], e.to(tl.uint8), mask=m2)
            # the reciprocal of the scale 2^(e-127): 2^(127-e), fp32 bits (254 - e) << 23 (normal for e <= 253)
            d = ((254 - e) << 23).to(tl.float32, bitcast=True)
        lo = _fp4_codes(xe, d[:, :, None], NVFP4, DT)
        hi = _fp4_codes(xo, d[:, :, None], NVFP4, DT)
        packed = (lo | (hi << 4)).to(tl.uint8)
        tl.store(p_ptr + rows[:, None, None] * (K // 2) + pidx[None, :, :], packed, mask=m3)


def _prep(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    if w.device.type != "cuda" or w.dtype not in _DT or w.dim() != 2:
        raise ValueError("GPU kernels take a 2-D CUDA bf16/fp16/fp32 tensor")
    return w.contiguous(), _DT[w.dtype]


def fp8_channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp8.quantize_fp8_channel`, on CUDA."""
    w, dt = _prep(w)
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    s = torch.empty(n, 1, dtype=w.dtype, device=w.device)
    cfg = TUNE["fp8_row"]
    if n and k <= cfg["max_single"]:
        _fp8_row1_kernel[(n,)](w, q, s, k, DT=dt, EPS=_EPS[dt], BLOCK=triton.next_power_of_2(k), num_warps=cfg["num_warps"])
    elif n:
        _fp8_row_kernel[(n,)](w, q, s, k, DT=dt, EPS=_EPS[dt], BLOCK=4096, num_warps=cfg["num_warps"])
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale": s}


def fp8_block(w: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp8.quantize_fp8_block`, on CUDA."""
    w, dt = _prep(w)
    n, k = w.shape
    bh, bw = block
    nb, kb = -(-n // bh), -(-k // bw)
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    s = torch.empty(nb, kb, dtype=w.dtype, device=w.device)
    if n and k:
        _fp8_block_kernel[(nb, kb)](w, q, s, n, k, kb, DT=dt, EPS=_EPS[dt], BH=bh, BW=bw, num_warps=TUNE["fp8_block"]["num_warps"])
    return {"weight": q.view(torch.float8_e4m3fn), "weight_scale": s}


def int_quant(w: torch.Tensor, num_bits: int, group_size: int | None, symmetric: bool, pack: bool) -> dict[str, torch.Tensor]:
    """Same outputs as :func:`ctconvert.formats.native.int_quant`, on CUDA.

    Supports groups of 16..1024 (power of two) with B in {4, 8} when packing,
    and symmetric per-channel unpacked (W8A8). Raises ``NotImplementedError``
    otherwise (callers fall back to the torch reference).
    """
    w, dt = _prep(w)
    n, k = w.shape
    if group_size is None:
        if pack or not symmetric:
            raise NotImplementedError("per-channel packed/asymmetric int on the GPU")
        out = torch.empty(n, k, dtype=torch.int8, device=w.device)
        s = torch.empty(n, 1, dtype=w.dtype, device=w.device)
        if n:
            _int_channel_kernel[(n,)](w, out, s, k, BITS=num_bits, DT=dt, EPS=_EPS[dt], BLOCK=1024, num_warps=4)
        return {"weight": out, "weight_scale": s}
    g = group_size
    if (pack and num_bits not in (4, 8)) or g & (g - 1) or not 16 <= g <= 1024:
        raise NotImplementedError(f"int{num_bits} group {g} on the GPU")
    ng = k // g
    out = torch.empty(n, k * num_bits // 32, dtype=torch.int32, device=w.device) if pack else torch.empty(n, k, dtype=torch.int8, device=w.device)
    s = torch.empty(n, ng, dtype=w.dtype, device=w.device)
    zp = None if symmetric else torch.empty(n, ng, dtype=torch.int8, device=w.device)
    cfg = TUNE["int_group"]
    br = max(1, min(128, cfg["elems"] // g))
    if n and ng:
        _int_group_kernel[(triton.cdiv(n, br), ng)](w, out, s, zp if zp is not None else s, n, k, G=g, BITS=num_bits, SYM=symmetric,
                                                    PACK=pack, DT=dt, EPS=_EPS[dt], BR=br, num_warps=cfg["num_warps"])
    res = {"weight_packed" if pack else "weight": out, "weight_scale": s}
    if zp is not None:
        res["weight_zero_point"] = zp
    return res


def _fp4(w: torch.Tensor, nvfp4: bool, gs: torch.Tensor | None) -> dict[str, torch.Tensor]:
    w, dt = _prep(w)
    n, k = w.shape
    g = 16 if nvfp4 else 32
    ng = k // g
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    s = torch.empty(n, ng, dtype=torch.uint8, device=w.device)
    cfg = TUNE["fp4"]
    br, bg = cfg["br"], max(1, cfg["cols"] // g)
    if n and ng:
        gs_t = gs.to(device=w.device, dtype=torch.float32).reshape(1) if nvfp4 else s
        _fp4_kernel[(triton.cdiv(n, br), triton.cdiv(ng, bg))](w, packed, s, gs_t, n, k, NVFP4=nvfp4, G=g, DT=dt, BR=br, BG=bg,
                                                              num_warps=cfg["num_warps"])
    return {"weight_packed": packed, "weight_scale": s.view(torch.float8_e4m3fn) if nvfp4 else s}


def nvfp4(w: torch.Tensor, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp4.quantize_nvfp4`, on CUDA."""
    return _fp4(w, True, global_scale)


def mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp4.quantize_mxfp4`, on CUDA (raises ``ValueError`` on scale overflow)."""
    from .common import tensor_absmax
    from .fp4 import _round_pow2_bits

    # rounding to a power of two is monotonic: the largest group overflows first
    if w.numel() and bool(torch.isinf(_round_pow2_bits(tensor_absmax(w).to(w.dtype).reshape(1)))):
        raise ValueError(f"MXFP4 scale overflows {w.dtype}: a group absmax rounds past the largest power of two of {w.dtype}")
    return _fp4(w, False, None)
