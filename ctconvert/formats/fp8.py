"""FP8 E4M3 weights with symmetric scales: per-channel, per-block, and MX (an E8M0 scale per 32).

Format facts (docs/compressed-tensors-format.md): layout §4.2 (``weight`` F8_E4M3
``[N, K]``, ``weight_scale`` in the model dtype D), math §6.2 and §6.1:
``scale = D(amax / 448)``, zero scales replaced by ``eps(D)``,
``q = e4m3_rne(clamp(D(w / scale), ±448))`` (``-0.0`` stays ``0x80``) (the double rounding fp32 -> D ->
E4M3 is part of the format). Block scales are computed on the zero-padded
weight, and the stored weight is cut back to ``[N, K]`` (§4.2). MXFP8
(``mxfp8-quantized``, §4.5, §6.5): the same element rounding with the power-of-two
group scale of :mod:`.mx` (offset 8 = floor(log2 448)), stored as E8M0 bytes.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .base import CompressionFormat, DequantSpec, WeightFormat, byte_values, dequantize_unpacked, expand_scale, factor_layout, unpacked_spec
from .common import FP8_MAX, dtype_eps, group_absmax, ranges_absmax, rd, sdiv, smallest_subnormal
from .mx import E4M3_OFFSET, MX_GROUP, e8m0_scale, mx_scale

__all__ = [
    "FloatQuantized",
    "MXFP8Quantized",
    "NaiveQuantized",
    "fp8_quantize_values",
    "fp8_scale",
    "quantize_fp8_block",
    "quantize_fp8_channel",
    "quantize_mxfp8",
]


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale from an fp32 absmax: ``D(amax / 448)``, zeros -> ``eps(D)``; returns fp32."""
    s = rd(sdiv(amax, FP8_MAX), dtype)
    return torch.where(s == 0, torch.full_like(s, dtype_eps(dtype)), s)


def fp8_quantize_values(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(D(w / scale), ±448))`` with ``scale`` (fp32) broadcastable to ``w``.

    The sign of zero is kept: an exact ``-0.0`` weight (every dequantized FP8 source holds some) is byte
    ``0x80``. compressed-tensors 0.20.1 ``quantization/lifecycle/forward_helpers.py:_quantize`` adds the zero
    point only when one is given, and symmetric weights have none: llm-compressor 0.14's model-free path
    initializes them with ``force_zero_point=False`` (``entrypoints/model_free/lifecycle.py:
    initialize_quantized_linear``) and the compressors drop a symmetric zero point
    (``compressors/base.py:_remove_symmetric_zp``)."""
    x = rd(w.to(torch.float32) / scale, w.dtype)
    return x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_channel(w: torch.Tensor, ranges=None) -> dict[str, torch.Tensor]:
    """Per-output-channel FP8. ``w``: ``[N, K]`` bf16/fp16/fp32; ``ranges``: an observer's per-row
    ``(min, max)`` (D ``[N, 1]``) the scales are computed from instead of ``w``'s own absmax.

    Returns ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale`` D ``[N, 1]``.
    """
    s = fp8_scale(group_absmax(w, w.shape[1]) if ranges is None else ranges_absmax(*ranges).reshape(-1, 1), w.dtype)
    return {"weight": fp8_quantize_values(w, s), "weight_scale": s.to(w.dtype)}


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """Per-block FP8 with ``block = (bh, bw)``.

    ``w``: ``[N, K]``; any N, K (the padding is zeros, which never changes an
    absmax). Returns ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale`` D
    ``[ceil(N/bh), ceil(K/bw)]``.
    """
    bh, bw = block
    n, k = w.shape
    pn, pk = -n % bh, -k % bw
    wp = torch.nn.functional.pad(w, (0, pk, 0, pn)) if (pn or pk) else w
    nb, kb = wp.shape[0] // bh, wp.shape[1] // bw
    # [nb, bh, kb, bw] -> absmax over each bh x bw block
    blocks = wp.reshape(nb, bh, kb, bw).transpose(1, 2).reshape(nb * kb, bh * bw)
    s = fp8_scale(group_absmax(blocks, bh * bw).reshape(nb, kb), w.dtype)
    s_full = s.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]
    return {"weight": fp8_quantize_values(w, s_full), "weight_scale": s.to(w.dtype)}


def quantize_mxfp8(w: torch.Tensor, ranges=None) -> dict[str, torch.Tensor]:
    """MXFP8 weight: E4M3 values with one E8M0 scale per 32 (OCP MX v1.0).

    ``w``: ``[N, K]`` bf16/fp16/fp32 with ``K % 32 == 0``; ``ranges``: an observer's per-group ``(min, max)``
    (D ``[N, K/32]``) the scales come from instead of ``w``'s. Returns ``weight``
    float8_e4m3fn ``[N, K]`` and ``weight_scale`` uint8 ``[N, K/32]`` (the biased
    exponent: scale = 2^(byte - 127)), as compressed-tensors 0.20.1's
    ``MXFP8QuantizationCompressor.compress`` writes them. Raises ``ValueError`` when a
    group's power-of-two scale overflows D (:func:`.mx.mx_scale`).
    """
    n, k = w.shape
    scale, byte = mx_scale(w, E4M3_OFFSET, "MXFP8", None if ranges is None else ranges_absmax(*ranges))
    q = fp8_quantize_values(w.reshape(n, k // MX_GROUP, MX_GROUP), scale.unsqueeze(-1))
    return {"weight": q.reshape(n, k), "weight_scale": byte}


class FloatQuantized(WeightFormat):
    """``float-quantized``: E4M3 ``weight [N, K]`` and a D ``weight_scale`` per channel ``[N, 1]``
    or per block ``[ceil(N/bh), ceil(K/bw)]`` (docs/compressed-tensors-format.md §4.2)."""

    takes_ranges = True

    name = CompressionFormat.FLOAT_QUANTIZED
    required = ("weight", "weight_scale")

    def outputs(self, shape, dtype, args):
        n, k = shape
        if args.strategy == "block":
            bh, bw = args.block_structure
            return {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (dtype, (math.ceil(n / bh), math.ceil(k / bw)))}
        if args.strategy == "channel":
            return {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (dtype, (n, 1))}
        if args.strategy == "tensor":
            return {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (dtype, (1,))}
        raise NotImplementedError(f"float-quantized strategy {args.strategy!r} is not written by ctconvert")

    def row_align(self, args):
        return args.block_structure[0] if args.strategy == "block" else 1

    def k_multiple(self, args):
        return args.block_structure[1] if args.strategy == "block" else 1

    def n_multiple(self, args):
        return args.block_structure[0] if args.strategy == "block" else 1

    def zero_scale(self, args, dtype):
        return dtype_eps(dtype)  # fp8_scale: zeros -> eps(D)

    def zero_row_floor(self, args, dtype, global_scale=None):
        # all zero only when D(amax / 448) underflows (amax < 224 tiny(D)) and every value / eps(D) is below half
        # the smallest E4M3 subnormal 2^-9; beside a larger per-tensor or block scale, values under 2^-10 / 448 of its absmax
        absolute = min(2 * FP8_MAX * smallest_subnormal(dtype), dtype_eps(dtype) * 2.0**-9)
        return absolute, (2.0**-9 / FP8_MAX if args.strategy in ("tensor", "block") else 0.0)

    def scale_flags_nonfinite(self, args):
        return args.strategy != "tensor"

    def _reference(self, w, args, global_scale):
        if args.strategy == "tensor":
            # the FP8 preset: one scale for the whole tensor, known before any chunk (``global_scale`` here:
            # ``fp8_scale`` of the tensor's absmax, written as ``weight_scale [1]`` by the caller); without it
            # ``w`` is the whole tensor, and its scale is returned with it
            if global_scale is None:
                s = fp8_scale(group_absmax(w.reshape(1, -1), w.numel()), w.dtype).reshape(1)
                return {"weight": fp8_quantize_values(w, s), "weight_scale": s.to(w.dtype)}
            return {"weight": fp8_quantize_values(w, global_scale.to(torch.float32).to(w.device))}
        if args.strategy == "block":
            return quantize_fp8_block(w, args.block_structure)
        return quantize_fp8_channel(w)

    def _reference_ranges(self, w, args, global_scale, ranges):
        if args.strategy == "channel":
            return quantize_fp8_channel(w, ranges)
        if args.strategy == "tensor":
            # one range for the whole tensor: the caller passes its scale (``fp8_scale`` of the ranges' absmax)
            if global_scale is None:
                s = fp8_scale(ranges_absmax(*ranges).reshape(1), w.dtype)
                return {"weight": fp8_quantize_values(w, s), "weight_scale": s.to(w.dtype)}
            return self._reference(w, args, global_scale)
        raise ValueError(f"float-quantized strategy {args.strategy!r} does not take an observer's ranges")

    def _fused(self, kernels, w, args, global_scale):
        if args.strategy == "tensor":
            return self._reference(w, args, global_scale)
        if args.strategy == "block":
            return kernels.fp8_block(w, args.block_structure)
        return kernels.fp8_channel(w)

    def _dequantize_reference(self, tensors, args):
        return dequantize_unpacked(tensors, args)

    def dequant_spec(self, tensors, args):
        return unpacked_spec(tensors, args)


class NaiveQuantized(WeightFormat):
    """``naive-quantized``: an unpacked ``weight`` with its scale (and zero point); read only."""

    name = CompressionFormat.NAIVE_QUANTIZED
    required = ("weight", "weight_scale")
    writes = False

    def _dequantize_reference(self, tensors, args):
        return dequantize_unpacked(tensors, args)

    def dequant_spec(self, tensors, args):
        return unpacked_spec(tensors, args)


class MXFP8Quantized(WeightFormat):
    """``mxfp8-quantized``: E4M3 ``weight [N, K]`` and E8M0 ``weight_scale [N, K/32]`` uint8,
    scale = 2^(byte - 127) (docs/compressed-tensors-format.md §4.5; compressed-tensors 0.20.1
    ``compressors/mxfp8/base.py``; vLLM 0.33 ``CompressedTensorsW8A8Mxfp8``)."""

    takes_ranges = True
    reads_back = True  # the power of two's overflow (formats/mx.py: mx_scale)

    name = CompressionFormat.MXFP8_QUANTIZED
    required = ("weight", "weight_scale")

    def outputs(self, shape, dtype, args):
        n, k = shape
        return {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (torch.uint8, (n, k // MX_GROUP))}

    def k_multiple(self, args):
        return MX_GROUP

    def _reference(self, w, args, global_scale):
        return quantize_mxfp8(w)

    def _reference_ranges(self, w, args, global_scale, ranges):
        return quantize_mxfp8(w, ranges)

    def zero_scale(self, args, dtype):
        # as MXFP4: the exponent clamps at byte 0; 2^-127 is zero only in fp16, where it becomes 1 (byte 127)
        return 127.0 if dtype == torch.float16 else 0.0

    def zero_row_floor(self, args, dtype, global_scale=None):
        # the scale clamps at 2^-127 (values under 2^-137 round to 0); in fp16 a group absmax below 0.75 x 2^-14 (a
        # subnormal that round_pow2_bits rounds to 0: measured by bisection) gives scale 0, replaced by 1 (byte 127),
        # which rounds values under 2^-10 to 0: twice 2^-14 (a new user's fp16 Llama: 2.3e-05)
        return (2.0**-13 if dtype == torch.float16 else 2.0**-136), 0.0

    def _fused(self, kernels, w, args, global_scale):
        fn = getattr(kernels, "mxfp8", None)
        if fn is None:  # no Triton kernel: the torch reference runs on the CUDA tensor (same bytes)
            raise NotImplementedError("no fused MXFP8 kernel here")
        return fn(w)

    def _dequantize_reference(self, tensors, args):
        """bf16 ``e4m3 * 2^(byte - 127)``, as ``MXFP8QuantizationCompressor.decompress`` (bf16 scale) computes it."""
        q = tensors["weight"].to(torch.float32)
        n, k = q.shape
        s = expand_scale(e8m0_scale(tensors["weight_scale"]), n, k, replace(args, strategy="group", group_size=MX_GROUP))
        return (q * s).to(torch.bfloat16)

    def dequant_spec(self, tensors, args):
        w = tensors["weight"]
        if w.dim() != 2 or w.dtype != torch.float8_e4m3fn:
            return None
        n, k = w.shape
        fl = factor_layout(e8m0_scale(tensors["weight_scale"]), n, k, replace(args, strategy="group", group_size=MX_GROUP))
        return None if fl is None else DequantSpec(w.contiguous().view(torch.uint8), False, k, byte_values(w.dtype), fl[0], None, fl[1], torch.bfloat16)
