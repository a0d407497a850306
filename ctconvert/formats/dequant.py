"""Dequantization: compressed tensors of one Linear back to a dense weight.

The arithmetic reproduces compressed-tensors' ``decompress`` (its
``_dequantize``: ``(q - zp) * scale`` in the scale's dtype; NVFP4 as
``e2m1 * (scale / global_scale)`` in fp32 then bf16; MXFP4 as
``e2m1 * 2^(byte - 127)`` in bf16) so the dense result is the same bytes the
library gives (compressed-tensors-format.md §10 "Reader", §4).
"""

from __future__ import annotations


import torch

from .fp4 import unpack_e2m1
from .integer import unpack_int32


def _expand(scale: torch.Tensor, n: int, k: int, strategy: str, group_size: int | None, block: list[int] | None) -> torch.Tensor:
    """Broadcast a per-tensor/channel/group/block scale to ``[n, k]`` (fp32)."""
    s = scale.to(torch.float32)
    if strategy == "tensor" or s.numel() == 1:
        return s.reshape(1, 1).expand(n, k)
    if strategy == "channel":
        return s.reshape(n, 1).expand(n, k)
    if strategy in ("group", "tensor_group"):
        return s.repeat_interleave(group_size, dim=1)[:, :k]
    if strategy == "block":
        bh, bw = block
        return s.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]
    raise ValueError(f"unknown strategy {strategy!r}")


def dequantize_weight(tensors: dict[str, torch.Tensor], weights: dict, fmt: str) -> torch.Tensor:
    """Dense weight of one module from its compressed tensors.

    ``tensors``: local names (``weight`` | ``weight_packed``, ``weight_scale``,
    ``weight_zero_point``, ``weight_global_scale``, ``weight_shape``);
    ``weights``: the group's QuantizationArgs as a dict; ``fmt``: the
    compressed-tensors format. Returns ``[N, K]`` in the scale's dtype (int and
    FP8 formats) or bf16 (FP4 formats). Raises ``ValueError`` for a format or
    layout it does not know.
    """
    strategy = weights.get("strategy") or ("group" if weights.get("group_size") else "channel")
    g = weights.get("group_size")
    block = weights.get("block_structure")
    if isinstance(block, str):
        block = [int(x) for x in block.lower().split("x")]
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        packed = tensors["weight_packed"]
        vals = unpack_e2m1(packed)
        n, k = vals.shape
        if fmt == "nvfp4-pack-quantized":
            gs = tensors["weight_global_scale"].to(torch.float32).reshape(1, 1)
            s = tensors["weight_scale"].to(torch.float32) / gs
            return (vals * _expand(s, n, k, "group", g or 16, None)).to(torch.bfloat16)
        e = tensors["weight_scale"].to(torch.int32) - 127
        s = torch.pow(2.0, e.to(torch.float32)).to(torch.bfloat16).to(torch.float32)
        return (vals * _expand(s, n, k, "group", g or 32, None)).to(torch.bfloat16)
    scale = tensors["weight_scale"]
    d = scale.dtype if scale.dtype.is_floating_point else torch.float16
    if fmt == "pack-quantized":
        bits = int(weights["num_bits"])
        shape = [int(x) for x in tensors["weight_shape"].tolist()] if "weight_shape" in tensors else None
        packed = tensors["weight_packed"]
        n = packed.shape[0]
        k = shape[1] if shape else packed.shape[1] * 32 // bits
        q = unpack_int32(packed, bits, k).to(torch.float32)
        zp = tensors.get("weight_zero_point")
        if zp is not None and zp.dtype == torch.int32:
            zp = unpack_int32(zp.t().contiguous(), bits, n).t()
    elif fmt in ("int-quantized", "float-quantized", "naive-quantized"):
        w = tensors["weight"]
        q = w.to(torch.float32)
        n, k = w.shape
        zp = tensors.get("weight_zero_point")
    else:
        raise ValueError(f"cannot dequantize format {fmt!r}")
    if zp is not None:
        q = q - _expand(zp.to(torch.float32), n, k, strategy, g, block)
    return (q * _expand(scale, n, k, strategy, g, block)).to(d)


def logical_shape(tensors: dict[str, tuple], weights: dict, fmt: str, weight_shape: list[int] | None = None) -> tuple[int, int]:
    """The dense ``[N, K]`` of a compressed module from its tensor shapes (``weight_shape`` values when given)."""
    if weight_shape is not None:
        return tuple(weight_shape)
    if "weight" in tensors:
        return tuple(tensors["weight"])
    n, w = tensors["weight_packed"]
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        return (n, 2 * w)
    return (n, w * 32 // int(weights["num_bits"]))


__all__ = ["dequantize_weight", "logical_shape"]
