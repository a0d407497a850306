"""FP4 E2M1 weights: NVFP4 (E4M3 scales per 16 + fp32 global scale) and MXFP4 (E8M0 per 32).

Format facts (docs/compressed-tensors-format.md): E2M1 codes and nibble order §5.2
(even column in the low nibble; a negative value that rounds to zero keeps its
sign bit, 0x8); NVFP4 layout §4.4 and math §6.4 (``gs = D(D(1/amax) * 2688)``
as an fp32 divisor, ``s = e4m3(clamp(gs * D(amax_g / 6), ±448))`` with 0 ->
0.125, elements ``w / (s / gs)`` in fp32, E2M1 ties to even); MX layout §4.5 and
math §6.5 (the E8M0 group scale of :mod:`.mx`).
NVFP4: NVIDIA, "Introducing NVFP4" (2025); MX: OCP Microscaling Formats v1.0.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .base import CompressionFormat, DequantSpec, WeightArgs, WeightFormat, expand_scale, factor_layout
from .common import FP4_MAX, FP8_MAX, group_absmax, ranges_absmax, rd, sdiv
from .mx import E2M1_OFFSET, MX_GROUP, e8m0_scale, mx_scale

__all__ = [
    "MXFP4PackQuantized",
    "NVFP4PackQuantized",
    "e2m1_codes",
    "e2m1_values",
    "nvfp4_global_scale",
    "pack_nibbles",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "unpack_e2m1",
]

NVFP4_GROUP = 16
MXFP4_GROUP = MX_GROUP
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` (already scaled) to E2M1 and return 4-bit codes (uint8).

    Magnitude thresholds (ties to the even mantissa): <=0.25 -> 0, <0.75 -> 0.5,
    <=1.25 -> 1, <1.75 -> 1.5, <=2.5 -> 2, <3.5 -> 3, <=5 -> 4, else 6; values
    beyond ±6 saturate. Bit 3 is set for ``x < 0`` (so -0.0 encodes as 0x0).
    """
    a = x.abs()
    code = (a > 0.25).to(torch.uint8)
    code += a >= 0.75
    code += a > 1.25
    code += a >= 1.75
    code += a > 2.5
    code += a >= 3.5
    code += a > 5.0
    code |= (x < 0).to(torch.uint8) << 3
    return code


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` (K even) -> bytes ``[N, K/2]``, element 2j in the low nibble."""
    n, k = codes.shape
    c = codes.reshape(n, k // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def e2m1_values(device=None) -> torch.Tensor:
    """fp32 ``[16]``: the value of each E2M1 code (bit 3 the sign)."""
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=device)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[N, K/2]`` -> fp32 E2M1 values ``[N, K]`` (inverse of the two above)."""
    lut = e2m1_values(packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return lut[codes.long()]


def nvfp4_global_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NVFP4 ``weight_global_scale`` from the absmax of a tensor or fused set.

    ``amax``: fp32 0-d holding a value of dtype D (or ``[n]`` of them: the scales of
    ``n`` sets, elementwise, each the bits a 0-d absmax gives). Computes
    ``D(D(1 / max(amax, tiny(D))) * 2688)``; NaN/inf become 1.0 (an all-zero
    tensor gets 1.0). Returns fp32 ``[1]`` (``[n]``). docs/compressed-tensors-format.md §6.4. A 0-d CPU
    ``amax`` is computed on a NumPy fp32 scalar (:func:`_global_scale_1`), with the same bits.
    """
    if amax.device.type == "cpu" and amax.dim() == 0:  # one set's scale: the same steps on a NumPy fp32 scalar
        return torch.tensor([_global_scale_1(float(amax), dtype)], dtype=torch.float32)
    a = torch.clamp(amax.to(torch.float32), min=torch.finfo(dtype).tiny)
    gs = rd(rd(torch.ones_like(a) / a, dtype) * (FP8_MAX * FP4_MAX), dtype)
    gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.reshape(-1).to(torch.float32)


def _round_scalar(x: np.float32, dtype: torch.dtype) -> np.float32:
    """:func:`~.common.rd` of one fp32 value: rounded to ``dtype`` (RNE; beyond its range: inf) and back to fp32. bf16
    by rounding the fp32 bits (the rule of c10's ``round_to_nearest_even``: add ``0x7FFF`` plus the lowest kept
    bit, drop the low 16 bits; NaN stays NaN), fp16 by NumPy's IEEE conversion."""
    if dtype == torch.float32:
        return x
    if dtype == torch.float16:
        return np.float32(np.float16(x))
    if x != x:
        return x
    u = int(np.array(x, dtype=np.float32).view(np.uint32))
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return np.array(u, dtype=np.uint32).view(np.float32)[()]


def _global_scale_1(amax: float, dtype: torch.dtype) -> float:
    """:func:`nvfp4_global_scale` of one absmax (a Python float holding an fp32 value), the same fp32 steps without a
    torch operation: a set's scale is made once per tensor, and seven 0-d torch operations took ~35 us on one core
    (far more beside the run's reader and writer threads, which each operation lets take the GIL)."""
    with np.errstate(all="ignore"):
        a = np.float32(amax)
        tiny = np.float32(torch.finfo(dtype).tiny)
        a = tiny if a < tiny else a  # torch.clamp(min=tiny): NaN stays NaN
        gs = _round_scalar(_round_scalar(np.float32(1.0) / a, dtype) * np.float32(FP8_MAX * FP4_MAX), dtype)
    return 1.0 if not np.isfinite(gs) else float(gs)


def nvfp4_global_scale_overflows(amax: float, dtype: torch.dtype) -> bool:
    """Whether :func:`nvfp4_global_scale` of absmax ``amax`` (a Python float of a ``dtype`` value) is beyond the range
    of ``dtype``, so that it is stored as 1.0 instead (fp16 sets whose largest |value| is under ~0.04: 2688 / amax >
    65504); the same roundings, without the substitution."""
    inv = 1.0 / torch.tensor(max(amax, torch.finfo(dtype).tiny), dtype=torch.float32)
    return not bool(torch.isfinite(rd(rd(inv, dtype) * (FP8_MAX * FP4_MAX), dtype)))


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor, ranges=None) -> dict[str, torch.Tensor]:
    """NVFP4 weight with a given global scale (shared by the fused set).

    ``w``: ``[N, K]`` bf16/fp16/fp32 with ``K % 16 == 0``; ``global_scale``: fp32
    ``[1]`` from :func:`nvfp4_global_scale`, or ``[N, 1]``, one per row (the rows of several
    sets stacked: each row's bits are those of its set alone); ``ranges``: an observer's per-group
    ``(min, max)`` (D ``[N, K/16]``) the group scales are computed from instead of
    ``w``'s own absmax. Returns ``weight_packed`` uint8
    ``[N, K/2]`` and ``weight_scale`` float8_e4m3fn ``[N, K/16]``.
    """
    d = w.dtype
    n, k = w.shape
    if global_scale.numel() not in (1, n):
        raise ValueError(f"NVFP4 global scales: {global_scale.numel()} for {n} rows")
    gs = (
        global_scale.to(device=w.device, dtype=torch.float32).reshape(-1, 1)
        if global_scale.numel() > 1
        else global_scale.to(device=w.device, dtype=torch.float32)
    )
    amax = group_absmax(w, NVFP4_GROUP) if ranges is None else ranges_absmax(*ranges).to(w.device)
    s = (gs * rd(sdiv(amax, FP4_MAX), d)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    s = torch.where(s == 0, torch.full_like(s, 0.125), s)
    eff = s / gs
    x = w.to(torch.float32).reshape(n, k // NVFP4_GROUP, NVFP4_GROUP) / eff.unsqueeze(-1)
    codes = e2m1_codes(x.clamp_(-FP4_MAX, FP4_MAX).reshape(n, k))
    return {"weight_packed": pack_nibbles(codes), "weight_scale": s.to(torch.float8_e4m3fn)}


def quantize_mxfp4(w: torch.Tensor, ranges=None) -> dict[str, torch.Tensor]:
    """MXFP4 weight: E2M1 values with one E8M0 scale per 32 (OCP MX v1.0).

    ``w``: ``[N, K]`` bf16/fp16/fp32 with ``K % 32 == 0``; ``ranges``: an observer's
    per-group ``(min, max)`` (D ``[N, K/32]``) the scales come from instead of ``w``'s. Returns
    ``weight_packed`` uint8 ``[N, K/2]`` and ``weight_scale`` uint8 ``[N, K/32]``
    (the biased exponent: scale = 2^(byte - 127)); the scale is :func:`.mx.mx_scale`'s.
    Raises ``ValueError`` when a group's power-of-two scale overflows D (fp16
    absmax >= 57344: :class:`~.mx.GroupOverflow`), where compressed-tensors would silently write an all-zero group.
    """
    n, k = w.shape
    scale, byte = mx_scale(w, E2M1_OFFSET, "MXFP4", None if ranges is None else ranges_absmax(*ranges))
    x = rd(w.to(torch.float32).reshape(n, k // MXFP4_GROUP, MXFP4_GROUP) / scale.unsqueeze(-1), w.dtype)
    codes = e2m1_codes(x.clamp_(-FP4_MAX, FP4_MAX).reshape(n, k))
    return {"weight_packed": pack_nibbles(codes), "weight_scale": byte}


class _FP4(WeightFormat):
    """E2M1 values, two per byte (element 2j in the low nibble), ``weight_packed [N, K/2]`` uint8; dense
    ``E2M1 * factor`` (:meth:`_factor` per group of :meth:`_group_args`) in fp32, then bf16."""

    takes_ranges = True

    def _factor(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _group_args(self, args: WeightArgs) -> WeightArgs:
        raise NotImplementedError

    def dequant_spec(self, tensors, args):
        packed = tensors["weight_packed"]
        if packed.dim() != 2 or packed.dtype != torch.uint8:
            return None
        n, k = packed.shape[0], 2 * packed.shape[1]
        fl = factor_layout(self._factor(tensors), n, k, self._group_args(args))
        return None if fl is None else DequantSpec(packed.contiguous(), True, k, e2m1_values(), fl[0], None, fl[1], torch.bfloat16)

    def dense_shape(self, shapes, args, weight_shape=None):
        if weight_shape is not None:
            return tuple(int(x) for x in weight_shape)
        n, w = shapes["weight_packed"]
        return n, 2 * w


class NVFP4PackQuantized(_FP4):
    """``nvfp4-pack-quantized``: E4M3 ``weight_scale [N, K/16]`` and fp32 ``weight_global_scale [1]``,
    one absmax over the fused set (docs/compressed-tensors-format.md §4.4, §9.1)."""

    name = CompressionFormat.NVFP4_PACK_QUANTIZED
    required = ("weight_packed", "weight_scale", "weight_global_scale")
    needs_global_scale = True

    def outputs(self, shape, dtype, args):
        n, k = shape
        return {
            "weight_packed": (torch.uint8, (n, k // 2)),
            "weight_scale": (torch.float8_e4m3fn, (n, k // NVFP4_GROUP)),
            "weight_global_scale": (torch.float32, (1,)),
        }

    def whole_tensor_outputs(self, shape, global_scale):
        return {"weight_global_scale": global_scale.reshape(1)}

    def zero_scale(self, args, dtype):
        return 0.125  # an E4M3 group scale of 0 -> 0.125 (module docstring)

    def zero_row_floor(self, args, dtype, global_scale=None):
        # all zero only when every group scale e4m3(gs * amax_g / 6) rounds to 0 (below 2^-10): amax_g < 2^-10 * 6 / gs
        # (2.2e-6 of the fused set's absmax); then w / (0.125 / gs) is below 0.05, which E2M1 rounds to 0
        return (2.0**-9 * FP4_MAX / global_scale if global_scale else 0.0), 0.0

    def _reference(self, w, args, global_scale):
        return quantize_nvfp4(w, global_scale)

    def _reference_ranges(self, w, args, global_scale, ranges):
        if global_scale is None:
            raise ValueError("NVFP4 ranges need the fused set's global scale (from its searched ranges)")
        return quantize_nvfp4(w, global_scale, ranges)

    def _fused(self, kernels, w, args, global_scale):
        return kernels.nvfp4(w, global_scale)

    def _dequantize_reference(self, tensors, args):
        vals = unpack_e2m1(tensors["weight_packed"])
        n, k = vals.shape
        return (vals * expand_scale(self._factor(tensors), n, k, self._group_args(args))).to(torch.bfloat16)

    def _factor(self, tensors):
        """``scale / global_scale`` in fp32 (per group), as compressed-tensors' ``decompress`` divides."""
        gs = tensors["weight_global_scale"].to(torch.float32).reshape(1, 1)
        return tensors["weight_scale"].to(torch.float32) / gs

    def _group_args(self, args):
        return replace(args, strategy="group", group_size=args.group_size or NVFP4_GROUP)


class MXFP4PackQuantized(_FP4):
    """``mxfp4-pack-quantized``: E8M0 ``weight_scale [N, K/32]`` uint8, scale = 2^(byte - 127)
    (docs/compressed-tensors-format.md §4.5; OCP Microscaling Formats v1.0)."""

    name = CompressionFormat.MXFP4_PACK_QUANTIZED
    reads_back = True  # the power of two's overflow (formats/gpu.py: _fp4, formats/mx.py: mx_scale)
    required = ("weight_packed", "weight_scale")

    def outputs(self, shape, dtype, args):
        n, k = shape
        return {"weight_packed": (torch.uint8, (n, k // 2)), "weight_scale": (torch.uint8, (n, k // MXFP4_GROUP))}

    def _reference(self, w, args, global_scale):
        return quantize_mxfp4(w)

    def _reference_ranges(self, w, args, global_scale, ranges):
        return quantize_mxfp4(w, ranges)

    def zero_scale(self, args, dtype):
        # the exponent clamps at byte 0; 2^-127 is zero only in fp16, where it becomes eps = 1 (byte 127)
        return 127.0 if dtype == torch.float16 else 0.0

    def zero_row_floor(self, args, dtype, global_scale=None):
        # the scale clamps at 2^-127 (values under 2^-129 round to 0); in fp16 a group absmax below 0.75 x 2^-14 (a
        # subnormal that round_pow2_bits rounds to 0: every such row came out zero, measured by bisection) gives scale 0,
        # replaced by 1 (byte 127), which rounds values under 0.25 to 0: twice 2^-14 (a new user's fp16 Llama: 1.4e-05)
        return (2.0**-13 if dtype == torch.float16 else 2.0**-128), 0.0

    def _fused(self, kernels, w, args, global_scale):
        return kernels.mxfp4(w)

    def _dequantize_reference(self, tensors, args):
        vals = unpack_e2m1(tensors["weight_packed"])
        n, k = vals.shape
        return (vals * expand_scale(self._factor(tensors), n, k, self._group_args(args))).to(torch.bfloat16)

    def _factor(self, tensors):
        return e8m0_scale(tensors["weight_scale"])

    def _group_args(self, args):
        return replace(args, strategy="group", group_size=args.group_size or MXFP4_GROUP)
