"""MX (OCP Microscaling) group scales: one E8M0 power of two per 32 values, shared by MXFP4 and MXFP8.

Format facts (docs/compressed-tensors-format.md §4.5, §6.5; compressed-tensors
0.20.1 ``quantization/utils/mxfp_utils.py``, ``generate_mx_scales`` and
``round_to_power_2``, and ``compressors/mx_utils.py``, ``compress_mx_scale``):
the group absmax, in the model dtype D, is rounded to a power of two on its bit
pattern with the E2M1 mantissa width (for FP4 *and* FP8 elements), the biased
exponent is ``clamp(127 + floor(log2 p2) - off, 0, 255)`` with ``off =
floor(log2(element max))`` (2 for E2M1, 8 for E4M3), the scale is
``D(2^(byte - 127))`` with a zero scale replaced by 1 (``eps`` of uint8), and
the stored byte is ``127 + floor(log2(scale))``. OCP Microscaling Formats v1.0.
"""

from __future__ import annotations

import torch

from .common import dtype_eps, group_absmax, rd

__all__ = ["E2M1_OFFSET", "E4M3_OFFSET", "MX_GROUP", "GroupOverflow", "e8m0_scale", "mx_scale", "overflow_error", "round_pow2_bits"]

MX_GROUP = 32
E2M1_OFFSET = 2  # floor(log2(6))
E4M3_OFFSET = 8  # floor(log2(448))
_E2M1_MANTISSA = 1  # compressed-tensors rounds with the E2M1 mantissa width for FP4 and FP8 elements (§6.5)


def round_pow2_bits(amax_d: torch.Tensor) -> torch.Tensor:
    """Round positive D values to a power of two on their bit pattern (§6.5).

    ``amax_d``: bf16/fp16/fp32. Adds half of the E2M1 mantissa step
    (``1 << (m_D - 1 - 1)``) and clears the mantissa bits; a value whose
    rounding passes D's largest power of two becomes inf. Returns fp32.
    """
    d = amax_d.dtype
    if d == torch.float32:
        bits, mant, exp = amax_d.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, 23, 8
    else:
        bits = amax_d.view(torch.int16).to(torch.int64) & 0xFFFF
        mant, exp = (7, 8) if d == torch.bfloat16 else (10, 5)
    add = 1 << (mant - _E2M1_MANTISSA - 1)
    mask = ((1 << (exp + 1)) - 1) << mant
    r = (bits + add) & mask
    if d == torch.float32:
        r = torch.where(r >= 2**31, r - 2**32, r).to(torch.int32).view(torch.float32)
    else:
        r = torch.where(r >= 2**15, r - 2**16, r).to(torch.int16).view(d).to(torch.float32)
    return r


class GroupOverflow(ValueError):
    """A group whose MX power-of-two scale overflows the weight's dtype: ``name`` (the format), ``dtype``, ``row`` (in the
    quantized rows), ``col`` (the group's first column) and its ``absmax``; :meth:`shifted` moves the row (a chunk's
    rows start at ``r0`` of the tensor)."""

    def __init__(self, name: str, dtype: torch.dtype, row: int, col: int, absmax: float):
        self.name, self.dtype, self.row, self.col, self.absmax = name, dtype, row, col, absmax
        emax = 15 if dtype == torch.float16 else 127  # the largest power of two of D; 1.75 of it rounds past it (§6.5)
        super().__init__(
            f"{name} scale overflows {dtype} at row {row}, columns {col}-{col + MX_GROUP - 1}: the group's absmax {absmax:g} "
            f"rounds past the largest power of two of {dtype} (an absmax of {1.75 * 2.0**emax:g} or more does)"
        )

    def shifted(self, r0: int) -> GroupOverflow:
        return GroupOverflow(self.name, self.dtype, self.row + r0, self.col, self.absmax)


def overflow_error(w: torch.Tensor, name: str, amax: torch.Tensor | None = None) -> GroupOverflow | None:
    """The :class:`GroupOverflow` of the first group (row-major) of ``w`` ``[N, K]`` whose power of two overflows D, or
    None; ``amax``: the group absmax ``[N, K/32]`` in D when known. For the kernels' flag, found again here."""
    amax = (group_absmax(w, MX_GROUP) if amax is None else amax).to(w.dtype)
    bad = torch.isinf(round_pow2_bits(amax))
    if not bool(bad.any()):
        return None
    r, g = (int(i) for i in bad.nonzero()[0])
    return GroupOverflow(name, w.dtype, r, g * MX_GROUP, float(amax[r, g]))


def mx_scale(w: torch.Tensor, offset: int, name: str, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MX group scales of ``w`` ``[N, K]`` (bf16/fp16/fp32, ``K % 32 == 0``).

    ``offset``: :data:`E2M1_OFFSET` or :data:`E4M3_OFFSET`; ``name``: the format, for the error;
    ``amax``: the group absmax to take the scales from (fp32 ``[N, K/32]`` holding values of D, e.g.
    an observer's ranges), in place of ``w``'s own.
    Returns ``(scale, byte)``: the scale as fp32 ``[N, K/32]`` holding a value of D (what the
    elements are divided by) and the stored E8M0 byte, uint8 ``[N, K/32]``. Raises ``ValueError``
    when a group's power of two overflows D (:class:`GroupOverflow`; an fp16 absmax >= 57344), where
    compressed-tensors would write an undefined byte and an all-zero group.
    """
    d = w.dtype
    amax = (group_absmax(w, MX_GROUP) if amax is None else amax).to(d)
    p2 = round_pow2_bits(amax)
    if bool(torch.isinf(p2).any()):
        raise overflow_error(w, name, amax)
    e = torch.floor(torch.log2(p2)) + (127 - offset)
    e = torch.round(e.clamp(0, 255))  # -inf (amax 0) -> 0
    scale = rd(torch.exp2(e - 127), d)
    scale = torch.where(scale == 0, torch.full_like(scale, dtype_eps(torch.uint8)), scale)
    byte = (127 + torch.floor(torch.log2(scale))).to(torch.int32).to(torch.uint8)
    return scale, byte


def e8m0_scale(byte: torch.Tensor) -> torch.Tensor:
    """Stored E8M0 bytes -> the bf16 scale ``2^(byte - 127)`` compressed-tensors decompresses with, as fp32
    (``compressors/mx_utils.py``, ``decompress_mx_scale``, 0.20.1)."""
    e = byte.to(torch.int32) - 127
    return torch.pow(2.0, e.to(torch.float32)).to(torch.bfloat16).to(torch.float32)
