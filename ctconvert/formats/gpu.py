"""Fused Triton kernels for CUDA tensors: read the weight once, write values and scales once.

Same results, bit for bit, as the torch reference (``fp8.py``,
``integer.py``, ``fp4.py``) and so as compressed-tensors' CPU path
(docs/compressed-tensors-format.md §6): fp32 math with IEEE (correctly rounded)
division, and explicit RNE casts to the model dtype D where the reference
rounds. The tests compare every kernel with the CPU result byte for byte.

The helpers that make the arithmetic exact (reciprocal division, integer
rounding, E2M1 codes), and the argument for each, are in :mod:`.gpu_math`.

:func:`available` is False without CUDA or Triton; callers then use the torch
reference on the GPU.
"""

from __future__ import annotations

import torch

from .common import KERNEL_DTYPES as _DT
from .gpu_math import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .gpu_math import R6, div, e2m1_mag, fp8_fast, in_range, neg_nonzero_bound, nz_abs, rn_recip, rne_int, round_to_d, to_d


def available() -> bool:
    return HAVE_TRITON and torch.cuda.is_available()


#: launch configurations (scripts/tune_gpu.py sweeps them on a large weight)
TUNE = {
    "fp8_row": {"max_single": 16384, "num_warps": 4, "ctas_per_sm": 4, "recip": True},
    "fp8_block": {"num_warps": 4, "recip": True},
    "int_group": {"elems": 4096, "num_warps": 4, "ctas_per_sm": 0},
    "fp4": {"br": 8, "cols": 512, "num_warps": 4, "ctas_per_sm": 4},
}
_EPS = {0: 2.0**-7, 1: 2.0**-10, 2: 2.0**-23}

if HAVE_TRITON:

    @triton.jit
    def _fp8_codes(x, s, r, FAST, DT: tl.constexpr):
        """E4M3 bytes of D(x / s) clamped to ±448 (fp8.py); FAST: :func:`fp8_fast` and r = RN(1/s)."""
        q = div(x, s, r, FAST)
        # clamp (the sign of zero kept, as fp8.py); clamping first lets it run on D pairs
        v = tl.minimum(tl.maximum(round_to_d(q, DT), -448.0), 448.0)
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)

    @triton.jit
    def _fp8_scale(m, DT: tl.constexpr, EPS: tl.constexpr):
        s = round_to_d(tl.div_rn(m, 448.0), DT)
        return tl.where(s == 0.0, EPS, s)

    @triton.jit
    def _fp8_row_kernel(w_ptr, q_ptr, s_ptr, K, DT: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr, RECIP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = row * K
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        amin = tl.full([BLOCK], float("inf"), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(w_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
            if RECIP:
                amin = tl.minimum(amin, nz_abs(x))
        s = _fp8_scale(tl.max(amax, axis=0), DT, EPS)
        tl.store(s_ptr + row, to_d(s, DT))
        r = tl.div_rn(1.0, s)
        fast = fp8_fast(s, tl.min(amin, axis=0)) if RECIP else False
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(w_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)
            tl.store(q_ptr + base + offs, _fp8_codes(x, s, r, fast, DT), mask=offs < K)

    @triton.jit
    def _fp8_row1_kernel(w_ptr, q_ptr, s_ptr, N, K, DT: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr, RECIP: tl.constexpr):
        """Per-channel FP8 for rows that fit one block: read once, write once. Programs loop over rows
        pid, pid + P, ... and load the next row before computing the current one."""
        pid = tl.program_id(0)
        npg = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        m = offs < K
        xn = tl.load(w_ptr + pid.to(tl.int64) * K + offs, mask=m & (offs * 0 + pid < N), other=0.0)
        for r0 in range(pid, N, npg):
            row = tl.cast(r0, tl.int64)
            x = xn.to(tl.float32)
            xn = tl.load(w_ptr + (row + npg) * K + offs, mask=m & (offs * 0 + row + npg < N), other=0.0)
            s = _fp8_scale(tl.max(tl.abs(x), axis=0), DT, EPS)
            tl.store(s_ptr + row, to_d(s, DT))
            fast = fp8_fast(s, tl.min(nz_abs(x), axis=0)) if RECIP else False
            tl.store(q_ptr + row * K + offs, _fp8_codes(x, s, tl.div_rn(1.0, s), fast, DT), mask=m)

    @triton.jit
    def _fp8_block_kernel(w_ptr, q_ptr, s_ptr, N, K, KB, DT: tl.constexpr, EPS: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, RECIP: tl.constexpr):
        br = tl.program_id(0).to(tl.int64)
        bc = tl.program_id(1).to(tl.int64)
        rows = br * BH + tl.arange(0, BH)
        cols = bc * BW + tl.arange(0, BW)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        offs = rows[:, None] * K + cols[None, :]
        x = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = _fp8_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0), DT, EPS)
        tl.store(s_ptr + br * KB + bc, to_d(s, DT))
        fast = fp8_fast(s, tl.min(tl.min(nz_abs(x), axis=1), axis=0)) if RECIP else False
        tl.store(q_ptr + offs, _fp8_codes(x, s, tl.div_rn(1.0, s), fast, DT), mask=mask)

    @triton.jit
    def _int_codes(x, s, r, z, FAST, QMIN: tl.constexpr, QMAX: tl.constexpr, OFF: tl.constexpr, SYM: tl.constexpr, DT: tl.constexpr):
        """RNE(clamp(D(D(x / s) + z))) + OFF as int32 (integer.py; no ``+ z`` when SYM).
        FAST: every s is in [2^-64, 2^64] and r = RN(1/s). The sign of a zero quotient
        does not matter here: it rounds to the integer 0 either way."""
        v = round_to_d(div(x, s, r, FAST), DT)
        if not SYM:
            v = round_to_d(v + z, DT)
        v = tl.minimum(tl.maximum(v, QMIN * 1.0), QMAX * 1.0)
        return rne_int(v, OFF)

    @triton.jit
    def _int_group_tile(x, rows, gi, out_ptr, s_ptr, zp_ptr, N, K, G, BITS, SYM, PACK, DT, EPS, RQ):
        """Quantize one tile x [BR, G/PER, PER] (fp32): group gi of the given rows; store values, scales, zero points.
        RQ: RN(1/Q) in fp32 for the scale's divisor Q ((2^B - 1) / 2 symmetric, 2^B - 1 asymmetric).
        G .. RQ are :func:`_int_group_kernel`'s constexprs (Triton specializes a called function on them)."""
        NG = K // G
        PER: tl.constexpr = 32 // BITS if PACK else 1
        rmask = rows < N
        wi = tl.arange(0, G // PER)
        ei = tl.arange(0, PER)
        QMIN: tl.constexpr = -(1 << (BITS - 1))
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        # the scale divides amax (symmetric) or the range by Q; zero points divide mn by the scale
        Q: tl.constexpr = ((1 << BITS) - 1) / 2.0 if SYM else ((1 << BITS) - 1) * 1.0
        if SYM:
            sc = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
        else:
            mn = tl.minimum(tl.min(tl.min(x, axis=2), axis=1), 0.0)
            sc = round_to_d(tl.maximum(tl.max(tl.max(x, axis=2), axis=1), 0.0) - mn, DT)
        # the reciprocal path for the whole tile when every sc is 0 or in [2^-60, 2^60]: then sc / Q is
        # exact (sc >= 2^-100), every scale is in [2^-64, 2^64], and mn / s is exact where it matters
        # (|mn / s| >= 2^-10; below that QMIN - it rounds to QMIN in D either way)
        fast = tl.min((((sc >= 2.0**-60) & (sc <= 2.0**60)) | (sc == 0.0)).to(tl.int32), axis=0) != 0
        s0 = round_to_d(div(sc, Q, RQ, fast), DT)
        s = tl.where(s0 == 0.0, EPS, s0)
        r = tl.div_rn(1.0, s)
        if SYM:
            z = tl.zeros_like(sc)
        else:
            zf = round_to_d(QMIN - round_to_d(div(mn, s, r, fast), DT), DT)  # s == s0 except where s0 == 0
            # where s0 == 0 the reference divides mn by 0: -inf (mn < 0), so QMIN - it is +inf, clamped to QMAX
            # below; NaN (mn == 0), a zero point of 0
            zf = tl.where(zf != zf, 0.0, zf)
            zf = tl.where(s0 == 0.0, tl.where(mn < 0.0, QMAX * 1.0, 0.0), zf)
            zf = tl.minimum(tl.maximum(zf, QMIN * 1.0), QMAX * 1.0)
            z = rne_int(zf, 0).to(tl.float32)
            tl.store(zp_ptr + rows * NG + gi, z.to(tl.int8), mask=rmask)
        tl.store(s_ptr + rows * NG + gi, to_d(s, DT), mask=rmask)
        OFF: tl.constexpr = (1 << (BITS - 1)) if PACK else 0
        u = _int_codes(x, s[:, None, None], r[:, None, None], z[:, None, None], fast, QMIN, QMAX, OFF, SYM, DT)
        if PACK:  # u in [0, 2^BITS): each value in its own bit field
            word = tl.sum(u.to(tl.uint32) << (ei * BITS).to(tl.uint32)[None, None, :], axis=2)
            W = K // PER
            wcols = gi * (G // PER) + wi
            tl.store(out_ptr + rows[:, None] * W + wcols[None, :], word.to(tl.int32, bitcast=True), mask=rmask[:, None])
        else:
            cols = gi * G + wi[:, None] * PER + ei[None, :]
            tl.store(out_ptr + rows[:, None, None] * K + cols[None, :, :], u.to(tl.int8), mask=rmask[:, None, None])

    @triton.jit
    def _int_group_kernel(
        w_ptr,
        out_ptr,
        s_ptr,
        zp_ptr,
        N,
        K,
        NT,
        G: tl.constexpr,
        BITS: tl.constexpr,
        SYM: tl.constexpr,
        PACK: tl.constexpr,
        DT: tl.constexpr,
        EPS: tl.constexpr,
        RQ: tl.constexpr,
        BR: tl.constexpr,
        LOOP: tl.constexpr,
    ):
        """Tiles of BR rows x one group of G columns, tile t = (row block t // NG, group t % NG), so that
        consecutive tiles read consecutive bytes of the same rows. A tile is loaded as [BR, G/PER, PER]:
        packing PER values into a word is then a reduction over the last axis, in registers.

        LOOP: each program takes tiles pid, pid + P, ... (P programs) and loads the next tile before
        it computes the current one, so that loads stay in flight while it computes. A tile past the
        end has rows >= N and is masked out. Else one program per tile (fewer registers)."""
        NG = K // G
        PER: tl.constexpr = 32 // BITS if PACK else 1
        lcols = tl.arange(0, G // PER)[:, None] * PER + tl.arange(0, PER)[None, :]  # [G/PER, PER] within a group
        pid = tl.program_id(0)
        npg = tl.num_programs(0)
        t = pid.to(tl.int64)
        rows = (t // NG) * BR + tl.arange(0, BR)
        xn = tl.load(w_ptr + rows[:, None, None] * K + ((t % NG) * G + lcols)[None, :, :], mask=(rows < N)[:, None, None], other=0.0)
        if not LOOP:  # one program per tile
            _int_group_tile(xn.to(tl.float32), rows, t % NG, out_ptr, s_ptr, zp_ptr, N, K, G, BITS, SYM, PACK, DT, EPS, RQ)
            return
        for t0 in range(pid, NT, npg):
            t = tl.cast(t0, tl.int64)
            x = xn
            t2 = t + npg
            rows2 = (t2 // NG) * BR + tl.arange(0, BR)
            xn = tl.load(w_ptr + rows2[:, None, None] * K + ((t2 % NG) * G + lcols)[None, :, :], mask=(rows2 < N)[:, None, None], other=0.0)
            rows = (t // NG) * BR + tl.arange(0, BR)
            _int_group_tile(x.to(tl.float32), rows, t % NG, out_ptr, s_ptr, zp_ptr, N, K, G, BITS, SYM, PACK, DT, EPS, RQ)

    @triton.jit
    def _int_channel_kernel(w_ptr, out_ptr, s_ptr, K, BITS: tl.constexpr, DT: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
        """Symmetric per-channel int (W8A8), unpacked int8."""
        row = tl.program_id(0).to(tl.int64)
        base = row * K
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(w_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)))
        s = round_to_d(tl.div_rn(tl.max(amax, axis=0), ((1 << BITS) - 1) / 2.0), DT)
        s = tl.where(s == 0.0, EPS, s)
        tl.store(s_ptr + row, to_d(s, DT))
        r = tl.div_rn(1.0, s)
        fast = in_range(s)
        QMIN: tl.constexpr = -(1 << (BITS - 1))
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(w_ptr + base + offs, mask=offs < K, other=0.0).to(tl.float32)
            u = _int_codes(x, s, r, 0.0, fast, QMIN, QMAX, 0, True, DT)
            tl.store(out_ptr + base + offs, u.to(tl.int8), mask=offs < K)

    @triton.jit
    def _fp4_codes(x, d, r, neg, FAST, NVFP4: tl.constexpr, DT: tl.constexpr):
        """E2M1 codes (sign in bit 3) of x / d clamped to ±6 (fp4.py).

        NVFP4: d is the group's divisor scale / global scale, r = RN(1/d) and
        neg the bound of :func:`neg_nonzero_bound`: the sign bit is set exactly
        where the reference's quotient is below zero (not for -0.0). MXFP4: d is
        2^(127-e), the exact reciprocal of the power-of-two scale, so x * d and
        x / 2^(e-127) are the same real number and round to the same value."""
        if NVFP4:
            v = div(x, d, r, FAST)
            sign = (x.to(tl.uint32, bitcast=True) > neg).to(tl.int32)
        else:
            v = round_to_d(x * d, DT)
            sign = (v < 0.0).to(tl.int32)
        return e2m1_mag(tl.minimum(tl.abs(v), 6.0)) | (sign << 3)

    @triton.jit
    def _fp4_ptrs(w_ptr, t, N, K, G: tl.constexpr, BR: tl.constexpr, BG: tl.constexpr):
        """Tile t = (row block t // NGB, group block t % NGB): rows [BR], groups [BG], byte index within
        the row [BG, G/2], the [BR, BG, G/2, 2] input pointers and their mask."""
        NG = K // G
        NGB = tl.cdiv(NG, BG)
        H: tl.constexpr = G // 2
        rows = (t // NGB) * BR + tl.arange(0, BR)
        groups = (t % NGB) * BG + tl.arange(0, BG)
        pidx = groups[:, None] * H + tl.arange(0, H)[None, :]
        m3 = (rows < N)[:, None, None] & (groups < NG)[None, :, None]
        cols = 2 * pidx[None, :, :, None] + tl.arange(0, 2)[None, None, None, :]
        return rows, groups, pidx, w_ptr + rows[:, None, None, None] * K + cols, m3

    @triton.jit
    def _fp4_kernel(
        w_ptr,
        p_ptr,
        s_ptr,
        gs_ptr,
        N,
        K,
        NT,
        NVFP4: tl.constexpr,
        G: tl.constexpr,
        DT: tl.constexpr,
        BR: tl.constexpr,
        BG: tl.constexpr,
        LOOP: tl.constexpr,
        PER_ROW: tl.constexpr = False,
    ):
        """NVFP4 (G=16, E4M3 scales, global scale) or MXFP4 (G=32, E8M0 scales).

        A tile of BR rows x BG groups is loaded once, contiguously, as [BR, BG,
        G/2, 2] and split into even and odd columns, so the two nibbles of each
        output byte meet without any reshape. LOOP: programs loop over tiles and
        load the next tile before computing the current one (as _int_group_kernel). PER_ROW (NVFP4): gs_ptr holds
        one global scale per row (the rows of several fused sets stacked), else one for every row."""
        pid = tl.program_id(0)
        npg = tl.num_programs(0)
        rows, groups, pidx, ptrs, m = _fp4_ptrs(w_ptr, pid.to(tl.int64), N, K, G, BR, BG)
        xn = tl.load(ptrs, mask=m[:, :, :, None], other=0.0)
        if not LOOP:  # one program per tile
            _fp4_tile(xn.to(tl.float32), rows, groups, pidx, m, p_ptr, s_ptr, gs_ptr, N, K, NVFP4, G, DT, PER_ROW)
            return
        for t0 in range(pid, NT, npg):
            t = tl.cast(t0, tl.int64)
            x = xn
            _r, _g, _p, ptrs, m = _fp4_ptrs(w_ptr, t + npg, N, K, G, BR, BG)
            xn = tl.load(ptrs, mask=m[:, :, :, None], other=0.0)
            rows, groups, pidx, _ptrs, m3 = _fp4_ptrs(w_ptr, t, N, K, G, BR, BG)
            _fp4_tile(x.to(tl.float32), rows, groups, pidx, m3, p_ptr, s_ptr, gs_ptr, N, K, NVFP4, G, DT, PER_ROW)

    @triton.jit
    def _pow2_exponent(b, W: tl.constexpr, M: tl.constexpr, BIAS: tl.constexpr, EMAX: tl.constexpr):
        """The MX power of two of non-negative values from their bit patterns ``b`` in D (W bits wide, M mantissa
        bits, exponent bias BIAS, all-ones exponent EMAX): add a quarter of the exponent's step and drop the mantissa
        (docs/compressed-tensors-format.md §6.5), then ``(exponent - BIAS as int32, exponent is 0, exponent is EMAX)``."""
        ADD: tl.constexpr = 1 << (M - 2)
        MASK: tl.constexpr = ((1 << W) - 1) ^ ((1 << M) - 1)
        b = (b + ADD) & MASK
        return ((b >> M) - BIAS).to(tl.int32), (b >> M) == 0, (b >> M) == EMAX

    @triton.jit
    def _fp4_tile(x, rows, groups, pidx, m3, p_ptr, s_ptr, gs_ptr, N, K, NVFP4: tl.constexpr, G: tl.constexpr, DT: tl.constexpr, PER_ROW: tl.constexpr):
        NG = K // G
        rmask = rows < N
        gmask = groups < NG
        xe, xo = tl.split(x)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))  # [BR, BG]
        m2 = rmask[:, None] & gmask[None, :]
        if NVFP4:
            # gs in [2^-55, 2^55]: every divisor d = s / gs then lies in [2^-64, 2^64] (s is an E4M3 value
            # in [2^-9, 448]), and the two per-group divisions take the reciprocal path too: amax / 6 is
            # exact for amax >= 2^-100, and a smaller amax gives gs * t < 2^-45, an E4M3 zero either way.
            # PER_ROW: the tile takes the reciprocal path when every row's gs allows it (either path gives
            # the same bits: the flag only says where the faster one is exact)
            if PER_ROW:
                gr = tl.load(gs_ptr + rows, mask=rmask, other=1.0)
                fast = tl.min(((gr >= 2.0**-55) & (gr <= 2.0**55)).to(tl.int32), axis=0) != 0
                gs = gr[:, None]
            else:
                gs = tl.load(gs_ptr)
                fast = (gs >= 2.0**-55) & (gs <= 2.0**55)
            t = round_to_d(div(amax, 6.0, R6, fast), DT)
            s = tl.minimum(tl.maximum(gs * t, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
            s = tl.where(s == 0.0, 0.125, s)
            tl.store(s_ptr + rows[:, None] * NG + groups[None, :], s.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=m2)
            d = div(s, gs, tl.div_rn(1.0, gs), fast)
            r = tl.div_rn(1.0, d)
            neg = neg_nonzero_bound(d)[:, :, None]
        else:
            # power of two of amax on D's bit pattern (docs/compressed-tensors-format.md §6.5), all in integers
            if DT == 0:
                E, zero, ovf = _pow2_exponent(amax.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF, 16, 7, 127, 255)
            elif DT == 1:
                E, zero, ovf = _pow2_exponent(amax.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF, 16, 10, 15, 31)
            else:
                E, zero, ovf = _pow2_exponent(amax.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF, 32, 23, 127, 255)
            # the power of two rounds past D's largest: flag it (gs_ptr is an int32 flag for MXFP4)
            tl.store(gs_ptr + tl.zeros_like(E), 1, mask=ovf & m2)
            e = tl.where(zero, 0, E + 125)
            e = tl.minimum(tl.maximum(e, 0), 255)
            if DT == 1:  # 2^(e-127) underflows fp16 below 2^-24: compressed-tensors then uses scale 1
                e = tl.where(e < 103, 127, e)
            tl.store(s_ptr + rows[:, None] * NG + groups[None, :], e.to(tl.uint8), mask=m2)
            # the reciprocal of the scale 2^(e-127): 2^(127-e), fp32 bits (254 - e) << 23 (normal for e <= 253)
            d = ((254 - e) << 23).to(tl.float32, bitcast=True)
            r = d
            neg = 0
            fast = False
        lo = _fp4_codes(xe, d[:, :, None], r[:, :, None], neg, fast, NVFP4, DT)
        hi = _fp4_codes(xo, d[:, :, None], r[:, :, None], neg, fast, NVFP4, DT)
        packed = (lo | (hi << 4)).to(tl.uint8)
        tl.store(p_ptr + rows[:, None, None] * (K // 2) + pidx[None, :, :], packed, mask=m3)


_SMS: dict[int, int] = {}


def _programs(w: torch.Tensor, tiles: int, cfg: dict) -> int:
    """Programs for a tile-looping kernel: ``cfg["ctas_per_sm"]`` per multiprocessor, or one per tile when 0."""
    per_sm = cfg.get("ctas_per_sm", 0)
    if not per_sm:
        return tiles
    i = w.device.index if w.device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return max(1, min(tiles, per_sm * _SMS[i]))


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
        _fp8_row1_kernel[(_programs(w, n, cfg),)](
            w, q, s, n, k, DT=dt, EPS=_EPS[dt], BLOCK=triton.next_power_of_2(k), RECIP=cfg["recip"], num_warps=cfg["num_warps"]
        )
    elif n:
        _fp8_row_kernel[(n,)](w, q, s, k, DT=dt, EPS=_EPS[dt], BLOCK=4096, RECIP=cfg["recip"], num_warps=cfg["num_warps"])
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
        cfg = TUNE["fp8_block"]
        _fp8_block_kernel[(nb, kb)](w, q, s, n, k, kb, DT=dt, EPS=_EPS[dt], BH=bh, BW=bw, RECIP=cfg["recip"], num_warps=cfg["num_warps"])
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
        nt = triton.cdiv(n, br) * ng
        npg = _programs(w, nt, cfg)
        _int_group_kernel[(npg,)](
            w,
            out,
            s,
            zp if zp is not None else s,
            n,
            k,
            nt,
            G=g,
            BITS=num_bits,
            SYM=symmetric,
            PACK=pack,
            DT=dt,
            EPS=_EPS[dt],
            RQ=rn_recip(((1 << num_bits) - 1) / (2 if symmetric else 1)),
            BR=br,
            LOOP=npg < nt,
            num_warps=cfg["num_warps"],
        )
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
        per_row = nvfp4 and gs.numel() > 1
        if per_row and gs.numel() != n:
            raise ValueError(f"NVFP4 global scales: {gs.numel()} for {n} rows")
        gs_t = gs.to(device=w.device, dtype=torch.float32).reshape(-1) if nvfp4 else torch.zeros(1, dtype=torch.int32, device=w.device)
        nt = triton.cdiv(n, br) * triton.cdiv(ng, bg)
        npg = _programs(w, nt, cfg)
        _fp4_kernel[(npg,)](w, packed, s, gs_t, n, k, nt, NVFP4=nvfp4, G=g, DT=dt, BR=br, BG=bg, LOOP=npg < nt, PER_ROW=per_row, num_warps=cfg["num_warps"])
        if not nvfp4 and bool(gs_t):
            from .mx import overflow_error

            raise overflow_error(w, "MXFP4") or ValueError(f"MXFP4 scale overflows {w.dtype}")
    return {"weight_packed": packed, "weight_scale": s.view(torch.float8_e4m3fn) if nvfp4 else s}


def nvfp4(w: torch.Tensor, global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp4.quantize_nvfp4`, on CUDA: ``global_scale`` fp32 ``[1]``, or ``[N, 1]``
    (one per row). Raises ``ValueError`` for per-row scales whose count is not ``N``."""
    return _fp4(w, True, global_scale)


def mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Same as :func:`ctconvert.formats.fp4.quantize_mxfp4`, on CUDA.

    Raises ``ValueError`` when a group's absmax rounds past the largest power of
    two of the weight's dtype (the kernel flags it; one read of the weight)."""
    return _fp4(w, False, None)
