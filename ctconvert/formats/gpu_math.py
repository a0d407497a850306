"""The exact fp32 arithmetic the Triton kernels of :mod:`.gpu` are built from: division, rounding, E2M1 codes.

Each helper gives the torch reference's values (``fp8.py``, ``integer.py``, ``fp4.py``: fp32 math with IEEE,
correctly rounded, division and RNE casts to the model dtype D) by construction, where its steps differ:

* ``x / s`` for every element of a group with one divisor ``s``: ``r =
  RN(1/s)`` once per group, then ``q = RN(x·r)`` and one correction ``q' =
  RN(q + RN(x − s·q)·r)`` (two FMAs). Markstein's theorem (Markstein 1990;
  Muller et al., *Handbook of Floating-Point Arithmetic*, 2nd ed., §4.7) makes
  ``q'`` the correctly rounded quotient when nothing underflows: for divisors
  in [2^-64, 2^64], ``|x| >= 2^-100`` and quotients of at least 2^-60. A block
  uses this path only when all its divisors lie in that range, else it divides
  with ``div_rn``. Integer codes and E2M1 magnitudes depend only on quotients
  of at least 2^-3; smaller ones round to code 0 whatever their error. The
  NVFP4 sign bit (set where the reference quotient is below zero) comes from
  ``x`` and the divisor exactly (:func:`neg_nonzero_bound`). An FP8 row or
  block takes the path only when each non-zero ``|x|`` also meets the bounds
  above (:func:`fp8_fast`), since E4M3 keeps the sign of a tiny quotient.
  NVFP4 also computes its per-group ``amax / 6`` and ``s / gs`` this way when
  the global scale lies in [2^-55, 2^55] (one test per tensor, no block
  reduction).
  ``tests/formats/test_gpu_math.py`` checks these claims on every bf16
  value.
* rounding to an integer: ``v + 1.5·2^23`` (fp32 addition rounds to the
  nearest integer, ties to even, as ``rint``) instead of a conversion
  instruction; the integer is the low bits of the sum.
* E2M1 codes from the fp32 bit pattern (see :func:`e2m1_mag`) instead of
  seven comparisons.

:data:`HAVE_TRITON` is False where Triton is not installed; the helpers are then not defined.
"""

from __future__ import annotations

import functools

import torch

try:  # Triton is optional: CPU-only installs do not have it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # noqa: BLE001
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON"]

if HAVE_TRITON:

    @triton.jit
    def round_to_d(x, DT: tl.constexpr):
        """Round fp32 to D (RNE) and back."""
        if DT == 0:
            return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        elif DT == 1:
            return x.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
        else:
            return x

    @triton.jit
    def to_d(x, DT: tl.constexpr):
        if DT == 0:
            return x.to(tl.bfloat16, fp_downcast_rounding="rtne")
        elif DT == 1:
            return x.to(tl.float16, fp_downcast_rounding="rtne")
        else:
            return x

    # divisors in [2^-64, 2^64] take the reciprocal path (module docstring)
    LO = tl.constexpr(2.0**-64)
    HI = tl.constexpr(2.0**64)

    @functools.cache
    def rn_recip(q: float) -> float:
        """RN(1/q) in fp32, exactly (an fp32 division)."""
        return (torch.tensor(1.0) / torch.tensor(q)).item()

    R6 = tl.constexpr(rn_recip(6.0))

    @triton.jit
    def in_range(s):
        return (s >= LO) & (s <= HI)

    @triton.jit
    def qdiv(x, s, r):
        """RN(x / s) from r = RN(1/s): one product and one FMA correction (Markstein). A zero x keeps its sign
        (the correction would add +0 to -0: an E4M3 -0.0 is byte 0x80)."""
        q = x * r
        e = tl.fma(-q, s, x)
        return tl.where(x == 0.0, q, tl.fma(e, r, q))

    @triton.jit
    def div(x, s, r, FAST):
        """RN(x / s): by the reciprocal r = RN(1/s) (:func:`qdiv`) where FAST says the block may, else ``div_rn``."""
        if FAST:
            q = qdiv(x, s, r)
        else:
            q = tl.div_rn(x, s)
        return q

    @triton.jit
    def rne_int(v, OFF: tl.constexpr):
        """RNE(v) + OFF as int32, for |v + OFF| < 2^22: the fp32 sum with 1.5 * 2^23 rounds to an integer."""
        return (v + (12582912.0 + OFF)).to(tl.int32, bitcast=True) - 0x4B400000

    @triton.jit
    def e2m1_mag(a):
        """E2M1 code 0..7 of a in [0, 6], round to nearest, ties to even (fp4 values 0 .5 1 1.5 2 3 4 6).

        Below 1 the grid step is 0.5: the code is RNE(2a). From 1 up the code is
        the fp32 pattern's exponent and top mantissa bit, 2 + 2(E - 127) + m,
        which is the pattern minus 0x3F000000 over 2^22, rounded to nearest even;
        a carry out of the mantissa moves to the next binade, as rounding does."""
        lo = (a * 2.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
        y = a.to(tl.int32, bitcast=True) - 0x3F000000
        hi = (y + 0x1FFFFF + ((y >> 22) & 1)) >> 22
        return tl.where(a < 1.0, lo, hi)

    @triton.jit
    def neg_nonzero_bound(d):
        """For positive normal fp32 d: bits B such that, as unsigned integers, bits(x) > B
        exactly when x < 0 and RN(x / d) != 0, i.e. |x| > d * 2^-150 (a quotient of
        2^-150 ties to zero). B is 0x80000000 | bits(RD(d * 2^-150))."""
        db = d.to(tl.int32, bitcast=True)
        ex = db >> 23
        mant = (db & 0x7FFFFF) | 0x800000
        t = tl.where(ex >= 151, db - (150 << 23), mant >> tl.minimum(151 - ex, 31))
        return t.to(tl.uint32, bitcast=True) | 0x80000000

    @triton.jit
    def fp8_fast(s, amin):
        """Whether a row or block may take the reciprocal path: s in [2^-64, 2^64] and every non-zero
        |x| (amin: their least) at least 2^-100 and s * 2^-60. Then every non-zero quotient is a normal
        number >= 2^-60, where the FMA correction is exact; only a zero weight gives a zero quotient,
        and both paths keep its sign (so a tiny negative quotient, which E4M3 keeps as -0, is never rounded)."""
        return in_range(s) & (amin >= 2.0**-100) & (amin >= s * 2.0**-60)

    @triton.jit
    def nz_abs(x):
        """|x|, with zeros as +inf: its minimum is the least non-zero magnitude."""
        return tl.where(x == 0.0, float("inf"), tl.abs(x))
