"""Integer weights (INT4/INT8 ...), symmetric or asymmetric, per-group or per-channel.

Format facts (docs/compressed-tensors-format.md): math §6.3 and §6.1 (divisor
``(2^B - 1) / 2`` for symmetric scales, ``(2^B - 1)`` for asymmetric, each step
rounded to the model dtype D, zero scales replaced by ``eps(D)``, round half to
even), layouts §4.2 (``int-quantized``: unpacked I8) and §4.3
(``pack-quantized``: I32 words, §5.1 bit order).
"""

from __future__ import annotations

import math

import torch

from .base import CompressionFormat, WeightFormat, byte_values, dequantize_unpacked, unpacked_spec
from .common import dtype_eps, group_absmax, group_minmax, ranges_absmax, rd, sdiv, smallest_subnormal

__all__ = ["IntQuantized", "PackQuantized", "int_range", "pack_int32", "pack_int32_dim0", "quantize_int", "unpack_int32"]


def int_range(num_bits: int) -> tuple[int, int]:
    """``(qmin, qmax) = (-2^(B-1), 2^(B-1) - 1)``."""
    return -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1


def quantize_int(w: torch.Tensor, num_bits: int, group_size: int | None, symmetric: bool = True, ranges=None) -> dict[str, torch.Tensor]:
    """Quantize ``w`` ``[N, K]`` (bf16/fp16/fp32) to signed B-bit integers.

    ``group_size=None`` means one scale per output channel. Requires
    ``K % group_size == 0`` (the caller checks and reports it). ``ranges``: an
    observer's per-group ``(min, max)`` (D ``[N, K/G]``) the scales and zero
    points are computed from instead of ``w``'s own (clamped to include 0, as
    ``calculate_qparams`` does). Returns
    ``weight`` int8 ``[N, K]`` (values in ``[qmin, qmax]``), ``weight_scale`` D
    ``[N, K/G]`` (or ``[N, 1]``) and, when asymmetric, ``weight_zero_point``
    int8 of the scale's shape.
    """
    d = w.dtype
    n, k = w.shape
    g = k if group_size is None else group_size
    qmin, qmax = int_range(num_bits)
    out: dict[str, torch.Tensor] = {}
    if symmetric:
        amax = group_absmax(w, g) if ranges is None else ranges_absmax(*ranges)
        s = rd(sdiv(amax, (2**num_bits - 1) / 2), d)
        zp = None
    else:
        if ranges is None:
            mn, mx = group_minmax(w, g)
        else:
            mn, mx = (r.to(torch.float32) for r in ranges)
            mn, mx = mn.clamp_max(0), mx.clamp_min(0)
        s = rd(sdiv(rd(mx - mn, d), 2**num_bits - 1), d)
        zpf = rd(qmin - rd(mn / s, d), d).clamp(qmin, qmax)
        zpf = torch.nan_to_num(zpf, nan=0.0)
        zp = torch.round(zpf)
    s = torch.where(s == 0, torch.full_like(s, dtype_eps(d)), s)
    x = rd(w.to(torch.float32).reshape(n, k // g, g) / s.unsqueeze(-1), d)
    if zp is not None:
        x = rd(x + zp.unsqueeze(-1), d)
    q = torch.round(x.clamp_(qmin, qmax)).to(torch.int8).reshape(n, k)
    out["weight"] = q
    out["weight_scale"] = s.to(d)
    if zp is not None:
        out["weight_zero_point"] = zp.to(torch.int8)
    return out


def pack_int32(q: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Pack signed B-bit values (int8 ``[R, C]``) into int32 words along the last dim.

    Each value is offset to unsigned (``u = q + 2^(B-1)``) and placed at bit
    ``i*B`` of the row, LSB first, spilling into the next word when it crosses a
    word boundary; rows are padded with ``u = 0`` (format spec §5.1). Returns
    int32 ``[R, ceil(C*B/32)]``.
    """
    r, c = q.shape
    words = math.ceil(c * num_bits / 32)
    u = q.to(torch.int64) + (1 << (num_bits - 1))
    pad = -c % 32
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(r, -1, 32)  # 32 values fill exactly B words
    if 32 % num_bits == 0:
        per = 32 // num_bits
        shifts = torch.arange(per, device=q.device, dtype=torch.int64) * num_bits
        acc = (u.reshape(r, -1, per) << shifts).sum(-1)  # [R, words_padded]
    else:
        bit = torch.arange(32, device=q.device, dtype=torch.int64) * num_bits
        word, off = bit // 32, bit % 32
        lo = (u << off) & 0xFFFFFFFF
        acc = torch.zeros(r, u.shape[1], num_bits, dtype=torch.int64, device=q.device)
        acc.index_add_(2, word, lo)
        spill = off + num_bits > 32
        if bool(spill.any()):
            hi = u[..., spill] >> (32 - off[spill])
            acc.index_add_(2, word[spill] + 1, hi)
        acc = acc.reshape(r, -1)
    acc = acc[:, :words]
    acc = torch.where(acc >= 2**31, acc - 2**32, acc)
    return acc.to(torch.int32).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 ``[R, W]`` -> int8 ``[R, length]``."""
    r, wcount = packed.shape
    if num_bits in (4, 8) and packed.is_contiguous():
        # whole bytes: value j of a word sits in little-endian byte j*B/8 (low nibble first for 4 bits)
        b = packed.view(torch.uint8)
        if num_bits == 4:
            b = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(r, -1)
        return (b[:, :length].to(torch.int16) - (1 << (num_bits - 1))).to(torch.int8)
    p = packed.to(torch.int64) & 0xFFFFFFFF
    bit = torch.arange(length, device=packed.device, dtype=torch.int64) * num_bits
    word, off = bit // 32, bit % 32
    lo = p[:, word] >> off
    nxt = torch.clamp(word + 1, max=wcount - 1)
    hi = torch.where(off + num_bits > 32, p[:, nxt] << (32 - off), torch.zeros_like(lo))
    u = (lo | hi) & ((1 << num_bits) - 1)
    return (u - (1 << (num_bits - 1))).to(torch.int8)


def pack_int32_dim0(q: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Pack along dim 0 (zero points, §4.3): int8 ``[R, C]`` -> int32 ``[ceil(R*B/32), C]``."""
    return pack_int32(q.t().contiguous(), num_bits).t().contiguous()


class _Integer(WeightFormat):
    """What the two integer formats share: ``(2^B - 1)/2`` or ``2^B - 1`` divisors per group or channel."""

    takes_ranges = True

    def row_align(self, args):
        return 1 if args.symmetric else 32  # asymmetric zero points are packed along dim 0: 32 rows -> B words

    def scale_flags_nonfinite(self, args):
        return args.symmetric  # amax / Q; the asymmetric range (max - min) can be finite around a NaN

    def zero_scale(self, args, dtype):
        return dtype_eps(dtype)  # zero scales -> eps(D) (module docstring)

    def zero_row_floor(self, args, dtype, global_scale=None):
        # all zero only when every group's scale underflows: amax / ((2^B - 1) / 2) (symmetric), (max - min) / (2^B - 1)
        # (asymmetric) below tiny(D) / 2; beside a larger per-tensor scale, values under half a step
        levels = 2**args.num_bits - 1
        return levels * smallest_subnormal(dtype), (2.0 / levels if args.strategy == "tensor" else 0.0)


class IntQuantized(_Integer):
    """``int-quantized``: unpacked int8 ``weight [N, K]``, D ``weight_scale [N, G]`` and, when
    asymmetric, int8 ``weight_zero_point [N, G]`` (docs/compressed-tensors-format.md §4.2)."""

    name = CompressionFormat.INT_QUANTIZED
    required = ("weight", "weight_scale")

    def outputs(self, shape, dtype, args):
        n, k = shape
        g = 1 if args.group_size is None else k // args.group_size
        out = {"weight": (torch.int8, (n, k)), "weight_scale": (dtype, (n, g))}
        if not args.symmetric:
            out["weight_zero_point"] = (torch.int8, (n, g))
        return out

    def _reference(self, w, args, global_scale):
        return quantize_int(w, args.num_bits, args.group_size, args.symmetric)

    def _reference_ranges(self, w, args, global_scale, ranges):
        return quantize_int(w, args.num_bits, args.group_size, args.symmetric, ranges)

    def _fused(self, kernels, w, args, global_scale):
        return kernels.int_quant(w, args.num_bits, args.group_size, args.symmetric, False)

    def _dequantize_reference(self, tensors, args):
        return dequantize_unpacked(tensors, args)

    def dequant_spec(self, tensors, args):
        return unpacked_spec(tensors, args)


class PackQuantized(_Integer):
    """``pack-quantized``: B-bit values in int32 ``weight_packed [N, ceil(K*B/32)]`` (§5.1 bit
    order), D ``weight_scale [N, G]``, int64 ``weight_shape [2]`` and, when asymmetric, int32
    ``weight_zero_point [ceil(N*B/32), G]`` packed along dim 0 (docs/compressed-tensors-format.md §4.3)."""

    name = CompressionFormat.PACK_QUANTIZED
    required = ("weight_packed", "weight_scale", "weight_shape")

    def outputs(self, shape, dtype, args):
        n, k = shape
        bits = args.num_bits
        g = 1 if args.group_size is None else k // args.group_size
        out = {"weight_packed": (torch.int32, (n, math.ceil(k * bits / 32))), "weight_scale": (dtype, (n, g)), "weight_shape": (torch.int64, (2,))}
        if not args.symmetric:
            out["weight_zero_point"] = (torch.int32, (math.ceil(n * bits / 32), g))
        return out

    def dense_shape(self, shapes, args, weight_shape=None):
        if weight_shape is not None:
            return tuple(int(x) for x in weight_shape)
        n, words = shapes["weight_packed"]
        if args.strategy == "group" and args.group_size and "weight_scale" in shapes:
            return n, shapes["weight_scale"][1] * args.group_size
        return n, words * 32 // args.num_bits

    def whole_tensor_outputs(self, shape, global_scale):
        return {"weight_shape": torch.tensor(list(shape), dtype=torch.int64)}

    def _reference(self, w, args, global_scale, ranges=None):
        r = quantize_int(w, args.num_bits, args.group_size, args.symmetric, ranges)
        out = {"weight_packed": pack_int32(r["weight"], args.num_bits), "weight_scale": r["weight_scale"]}
        if not args.symmetric:
            out["weight_zero_point"] = pack_int32_dim0(r["weight_zero_point"], args.num_bits)
        return out

    def _reference_ranges(self, w, args, global_scale, ranges):
        return self._reference(w, args, global_scale, ranges)

    def _fused(self, kernels, w, args, global_scale):
        out = kernels.int_quant(w, args.num_bits, args.group_size, args.symmetric, True)
        if not args.symmetric:
            out["weight_zero_point"] = pack_int32_dim0(out["weight_zero_point"], args.num_bits)
        return out

    def _dequantize_reference(self, tensors, args):
        unpacked, k = self._unpack_rest(tensors, args)
        unpacked["weight"] = unpack_int32(tensors["weight_packed"], args.num_bits, k)
        return dequantize_unpacked(unpacked, args)

    def dequant_spec(self, tensors, args):
        """4- and 8-bit values are read from the words' bytes (little endian: value ``j`` of a word in byte
        ``j * B / 8``, low nibble first, offset by ``2^(B-1)``); other widths are unpacked by torch first."""
        bits, packed = args.num_bits, tensors["weight_packed"]
        unpacked, k = self._unpack_rest(tensors, args)
        if packed.dim() != 2 or packed.dtype != torch.int32:
            return None
        if bits in (4, 8):
            if k > packed.shape[1] * 32 // bits:
                return None
            lut = torch.arange(1 << bits, dtype=torch.float32) - (1 << (bits - 1))
            return unpacked_spec(unpacked, args, packed.contiguous().view(torch.uint8), bits == 4, lut, k)
        q = unpack_int32(packed, bits, k)
        return unpacked_spec(unpacked, args, q.view(torch.uint8), False, byte_values(torch.int8), k)

    def _unpack_rest(self, tensors, args):
        """``({weight_scale, weight_zero_point (unpacked)}, dense K)`` of the reference's unpacking."""
        bits = args.num_bits
        packed = tensors["weight_packed"]
        shape = [int(x) for x in tensors["weight_shape"].tolist()] if "weight_shape" in tensors else None
        n = packed.shape[0]
        k = shape[1] if shape else packed.shape[1] * 32 // bits
        unpacked = {"weight_scale": tensors["weight_scale"]}
        zp = tensors.get("weight_zero_point")
        if zp is not None:
            unpacked["weight_zero_point"] = unpack_int32(zp.t().contiguous(), bits, n).t() if zp.dtype == torch.int32 else zp
        return unpacked, k
