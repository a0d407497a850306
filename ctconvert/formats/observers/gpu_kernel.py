"""The Triton kernel of the MSE observers' search: every grid step of every group, each error as exact bounds.

One program takes ``BLOCK`` groups of ``G`` elements (a grouped weight ``[R, G]``, D = bf16 or fp16) into
registers and runs every grid step on them (no early stop). Each step is ``observe.c``'s (and so the torch
reference's) arithmetic on the same values: fp32 operations with IEEE division, each rounded to D where torch
rounds (:func:`_rd`); ``|q - x|`` is then exact, a D value. Two results are not reproduced operation for
operation, as in ``observe.c``:

* ``|d| ** norm``: looked up in a table of torch's own results for every D value (``gpu_search.PowTable``;
  lo == hi there, except for a value whose vectorized and scalar torch ``pow`` round differently);
* the group sum, which torch accumulates in fp32 in an order of its own: here an fp32 sum of the table's values
  in the kernel's own order, then ``RN(s * (1 -/+ m))`` with ``m = G * 2^-23``, rounded to D. Why that bounds
  torch's sum ``t``: any fp32 summation order of ``G`` non-negative terms is within ``(G - 1) u`` (``u = 2^-24``,
  to first order) of the exact sum ``S``, so ours ``s`` and torch's ``t`` both are, and ``t >= S (1 - (G-1)u) >=
  s (1 - 2(G-1)u)``; one more rounding of ``s * (1 - m)`` costs ``u``, and ``m = 2G u >= (2G - 1) u`` plus the
  second-order terms (``< G^2 u^2``, below ``2^-34``); the same for the upper bound. Rounding to D is monotone,
  so torch's D error lies in ``[lo, hi]`` (``observe.c``'s ``m``, there over an fp64 sum). Where our sum
  overflows, ``S >= FLT_MAX / (1 + (G-1)u)``, so ``t >= FLT_MAX (1 - m)``: ``lo`` is taken from ``FLT_MAX``.

A step is *decided* when ``hi < best_lo`` (the candidate is below the best so far, whatever torch's sums are:
an improvement) or ``lo >= best_hi`` (it is not); a group with an undecided step is flagged ``unsure``, its
steps from there on are not vouched for, and the caller settles it (``gpu_search``). With ``DUMP`` the kernel
writes every step's ``[lo, hi]`` of the groups ``idx`` instead of deciding.

``HW``: round with the GPU's conversion instructions (``cvt.rn``); without it (Triton's interpreter, whose
bf16 and fp8 conversions do not round to nearest even) the same roundings are done on the bits.
"""

from __future__ import annotations

from ..gpu_math import HAVE_TRITON

__all__ = ["HAVE_TRITON"]

KIND_INT, KIND_FP8, KIND_FP4 = 0, 1, 2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..gpu_math import qdiv

    __all__ += ["mse_search_kernel"]

    @triton.jit
    def _rd(x, DT: tl.constexpr, HW: tl.constexpr):
        """fp32 -> D, round to nearest even, -> fp32."""
        if DT == 0:
            if HW:
                y = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
            else:
                u = x.to(tl.int32, bitcast=True)
                y = ((u + 0x7FFF + ((u >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.float16).to(tl.float32)  # the default fp32 -> fp16 conversion rounds to nearest even
        return y

    @triton.jit
    def _mag_bits(d, DT: tl.constexpr):
        """The 15 magnitude bits of the D value held by fp32 ``d``: the pow table's index."""
        if DT == 0:
            b = (d.to(tl.int32, bitcast=True) >> 16) & 0x7FFF
        else:
            b = d.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
        return b

    @triton.jit
    def _rint(t):
        """Round to the nearest integer, ties to even (``torch.round``, ``nearbyintf``), for ``|t| < 2^22``."""
        return (t + 12582912.0) - 12582912.0

    @triton.jit
    def _e4m3(t, HW: tl.constexpr):
        """E4M3FN rounding (nearest even) of ``|t| <= 448``, back in fp32: ``t.to(float8_e4m3fn).to(D)``."""
        if HW:
            y = t.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
        else:
            a = tl.abs(t)
            u = a.to(tl.int32, bitcast=True)
            nrm = ((u + 0x7FFFF + ((u >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
            sub = _rint(a * 512.0) * 0.001953125  # multiples of 2^-9 below 2^-6
            y = tl.where(a < 0.015625, sub, nrm)
            y = tl.where(t < 0.0, -y, y)
        return y

    @triton.jit
    def _e2m1(a):
        """E2M1 magnitude of ``a >= 0`` by compressed-tensors' ``cast_to_fp4`` thresholds (above 5: 6)."""
        lv = 0.5 * ((a > 0.25).to(tl.float32) + (a >= 0.75).to(tl.float32) + (a > 1.25).to(tl.float32) + (a >= 1.75).to(tl.float32))
        return lv + (a > 2.5).to(tl.float32) + (a >= 3.5).to(tl.float32) + 2.0 * (a > 5.0).to(tl.float32)

    @triton.jit
    def _mx_scale(a, DT: tl.constexpr, HW: tl.constexpr, MX_OFF: tl.constexpr):
        """The E8M0 candidate scale of an MX scheme from the group's absmax ``a`` (a D value), as ``observe.c``'s
        ``mx_candidate``: round_to_power_2 on D's bits, ``e = clamp(127 + log2(p2) - off, 0, 255)``, ``2^(e - 127)``
        rounded to D, 0 -> 1."""
        if DT == 0:
            b = (a.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
            r = (b + 32) & 0xFF80
            ex = (r >> 7) & 0xFF
            e = tl.where(ex == 0xFF, 255, tl.minimum(tl.maximum(ex - MX_OFF, 0), 255))
        else:
            b = a.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            r = (b + 256) & 0xFC00
            ex = (r >> 10) & 0x1F
            e = tl.where(ex == 0x1F, 255, tl.minimum(tl.maximum(ex + (127 - 15) - MX_OFF, 0), 255))
        e = tl.where(ex == 0, 0, e)
        s = _rd(tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True), DT, HW)
        return tl.where(s == 0.0, 1.0, s)

    @triton.jit
    def _scale_zp(cmn, cmx, qmin, qmax, half, rng, eps, DT: tl.constexpr, SYM: tl.constexpr, MX_OFF: tl.constexpr, HW: tl.constexpr):
        """``calculate_qparams`` of one candidate range per group: (scale, zero point), fp32 holding D values."""
        cmn = tl.minimum(cmn, 0.0)
        cmx = tl.maximum(cmx, 0.0)
        if SYM:
            a = tl.maximum(tl.abs(cmn), tl.abs(cmx))
            if MX_OFF:
                scale = _mx_scale(a, DT, HW, MX_OFF)
            else:
                scale = _rd(tl.div_rn(a, half), DT, HW)
            zp = tl.zeros_like(scale)
        else:
            scale = _rd(tl.div_rn(_rd(cmx - cmn, DT, HW), rng), DT, HW)
            z = _rd(qmin - _rd(tl.div_rn(cmn, scale), DT, HW), DT, HW)
            z = tl.where(z != z, 0.0, z)  # 0/0 of an all-zero group: torch's int8 cast gives 0
            z = tl.minimum(tl.maximum(z, qmin), qmax)
            zp = _rint(tl.minimum(tl.maximum(z, -128.0), 127.0))
        return tl.where(scale == 0.0, eps, scale), zp

    @triton.jit
    def _abs_err(x, scale, zp, qmin, qmax, FAST, DT: tl.constexpr, KIND: tl.constexpr, SYM: tl.constexpr, HW: tl.constexpr):
        """``|fake_quant(x) - x|`` per element (a D value), ``scale``/``zp`` ``[BLOCK]``; FP4 takes ``x = |w|``."""
        s = tl.broadcast_to(scale[:, None], x.shape)
        if FAST:  # gpu_math: Markstein's division, the correctly rounded quotient here (mse_search_kernel)
            t = qdiv(x, s, tl.broadcast_to(tl.div_rn(1.0, scale)[:, None], x.shape))
        else:
            t = tl.div_rn(x, s)
        t = _rd(t, DT, HW)
        if KIND == 2:
            q = _rd(_e2m1(t) * s, DT, HW)
        else:
            if not SYM:
                t = _rd(t + zp[:, None], DT, HW)
            t = tl.minimum(tl.maximum(t, qmin), qmax)
            if KIND == 0:
                r = _rint(t)
            else:
                r = _e4m3(t, HW)
            if not SYM:
                r = _rd(r - zp[:, None], DT, HW)
            q = _rd(r * s, DT, HW)
        return tl.abs(_rd(q - x, DT, HW))

    @triton.jit
    def _bits_of(better, i):
        """``better`` (bool ``[BLOCK]``) at bit ``i % 64`` of an int64, for the word ``i // 64``: (word 0, word 1)."""
        b = better.to(tl.int64) << (i % 64)
        return tl.where(i < 64, b, 0), tl.where(i >= 64, b, 0)

    @triton.jit
    def _or(a, b):
        return a | b

    @triton.jit
    def mse_search_kernel(
        w_ptr, idx_ptr, pstep_ptr, cols_ptr, p_ptr, tlo_ptr, thi_ptr, d_ptr,
        step_ptr, mn_ptr, mx_ptr, hits_ptr, unsure_ptr, counted_ptr, lo_ptr, hi_ptr,
        R, qmin, qmax, half, rng, expand, dmax, eps, m_lo, m_hi,
        S: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, KIND: tl.constexpr, SYM: tl.constexpr,
        MX_OFF: tl.constexpr, TWO: tl.constexpr, DUMP: tl.constexpr, HW: tl.constexpr,
    ):  # fmt: skip
        """Groups ``[pid * BLOCK, +BLOCK)`` of ``w`` ``[R, G]`` (with ``DUMP``: groups ``idx[...]``), ``S`` steps of
        shrink factors ``p``; ``cols``: int32 ``0 .. GP-1``; tables ``tlo``/``thi`` (``TWO``: they differ somewhere, else ``thi`` is not read).
        ``m_lo``/``m_hi``: ``1 -/+ G * 2^-23`` (exact in fp32), the widening of the sums. Writes per group the
        best step (int16, -1 none), its range (D), the improvements as bits (int64 word 0,
        steps < 64), ``unsure`` (uint8) and per program the OR of the decided improvements (int64 x 2); with
        ``DUMP`` 1 every step's ``[lo, hi]`` (fp32 ``[R, S]``); with ``DUMP`` 2 row ``r``'s ``|q - x|`` (D ``[R, G]``)
        of group ``idx[r]`` at step ``pstep[r]``, the elements whose ``pow`` and sum torch then takes."""
        pid = tl.program_id(0)
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < R
        grp = tl.load(idx_ptr + rows, mask=rmask, other=0) if DUMP else rows.to(tl.int64)
        # the column index is loaded (``cols``: 0 .. GP-1), not tl.arange: one the compiler cannot see as contiguous gives
        # x the layout of the table gathers (one element a thread), so that no step converts layouts through shared memory
        cols = tl.load(cols_ptr + tl.arange(0, GP))
        mask = rmask[:, None] & (cols[None, :] < G)
        x = tl.load(w_ptr + grp[:, None] * G + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mn0 = _rd(tl.min(tl.where(mask, x, float("inf")), axis=1) * expand, DT, HW)
        mx0 = _rd(tl.max(tl.where(mask, x, float("-inf")), axis=1) * expand, DT, HW)
        # Markstein's division is exact for divisors in [2^-64, 2^64] (gpu_math): every candidate scale of a group
        # whose unshrunk absmax A is 0 (scale eps) or within [2^-40, 2^40] at every shrink factor lies there
        big = tl.maximum(tl.abs(mn0), tl.abs(mx0))
        small = big * tl.load(p_ptr + S - 1)
        ok = (big == 0.0) | ((small >= 2.0**-40) & (big <= 2.0**40)) | ~rmask
        fast = tl.min(ok.to(tl.int32), axis=0) == 1
        if KIND == 2:
            x = tl.abs(x)
        if DUMP == 2:
            pr = tl.load(p_ptr + tl.load(pstep_ptr + rows, mask=rmask, other=0))
            scale, zp = _scale_zp(_rd(mn0 * pr, DT, HW), _rd(mx0 * pr, DT, HW), qmin, qmax, half, rng, eps, DT, SYM, MX_OFF, HW)
            d = _abs_err(x, scale, zp, qmin, qmax, fast, DT, KIND, SYM, HW)
            tl.store(d_ptr + rows.to(tl.int64)[:, None] * G + cols[None, :], d.to(d_ptr.dtype.element_ty), mask=mask)
            return
        best_lo = tl.full([BLOCK], dmax, tl.float32)
        best_hi = best_lo
        bs = tl.full([BLOCK], -1, tl.int32)
        sure = rmask
        h0 = tl.zeros([BLOCK], tl.int64)
        c0 = h0
        c1 = h0
        for i in range(0, S):
            pi = tl.load(p_ptr + i)
            scale, zp = _scale_zp(_rd(mn0 * pi, DT, HW), _rd(mx0 * pi, DT, HW), qmin, qmax, half, rng, eps, DT, SYM, MX_OFF, HW)
            bits = _mag_bits(_abs_err(x, scale, zp, qmin, qmax, fast, DT, KIND, SYM, HW), DT)
            slo = tl.sum(tl.where(mask, tl.load(tlo_ptr + bits), 0.0), axis=1)
            shi = tl.sum(tl.where(mask, tl.load(thi_ptr + bits), 0.0), axis=1) if TWO else slo
            lo = _rd(tl.minimum(slo, 3.4028234663852886e38) * m_lo, DT, HW)
            hi = tl.where(shi > 1e30, float("inf"), _rd(shi * m_hi, DT, HW))
            if DUMP == 1:
                tl.store(lo_ptr + rows.to(tl.int64) * S + i, lo, mask=rmask)
                tl.store(hi_ptr + rows.to(tl.int64) * S + i, hi, mask=rmask)
            else:
                better = (hi < best_lo) & rmask
                b0, b1 = _bits_of(better & sure, i)
                c0 |= b0
                c1 |= b1
                g0, _g1 = _bits_of(better, i)
                h0 |= g0
                sure = sure & (better | (lo >= best_hi))
                best_lo = tl.where(better, lo, best_lo)
                best_hi = tl.where(better, hi, best_hi)
                bs = tl.where(better, i, bs)
        if DUMP == 0:
            pb = tl.load(p_ptr + tl.maximum(bs, 0))
            mn = tl.where(bs < 0, mn0, _rd(mn0 * pb, DT, HW))
            mx = tl.where(bs < 0, mx0, _rd(mx0 * pb, DT, HW))
            tl.store(step_ptr + rows, bs.to(tl.int16), mask=rmask)
            tl.store(mn_ptr + rows, mn.to(mn_ptr.dtype.element_ty), mask=rmask)
            tl.store(mx_ptr + rows, mx.to(mx_ptr.dtype.element_ty), mask=rmask)
            tl.store(hits_ptr + rows, h0, mask=rmask)
            tl.store(unsure_ptr + rows, (rmask & ~sure).to(tl.uint8), mask=rmask)
            tl.store(counted_ptr + 2 * pid, tl.reduce(c0, 0, _or))
            tl.store(counted_ptr + 2 * pid + 1, tl.reduce(c1, 0, _or))
