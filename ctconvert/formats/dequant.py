"""Dequantization: compressed tensors of one Linear back to a dense weight.

The arithmetic of each format (its :meth:`~.base.WeightFormat.dequantize`)
reproduces compressed-tensors' ``decompress`` (``_dequantize``: ``(q - zp) *
scale`` in the scale's dtype; NVFP4 as ``e2m1 * (scale / global_scale)`` in
fp32 then bf16; MXFP4 as ``e2m1 * 2^(byte - 127)`` in bf16), so the dense
result is the same bytes the library gives (docs/compressed-tensors-format.md
§10 "Reader", §4).
"""

from __future__ import annotations

import torch

from . import get_format
from .base import WeightArgs

__all__ = ["dequantize_weight"]


def dequantize_weight(tensors: dict[str, torch.Tensor], weights: dict | None, fmt: str) -> torch.Tensor:
    """Dense weight of one module from its compressed tensors.

    ``tensors``: local names (``weight`` | ``weight_packed``, ``weight_scale``,
    ``weight_zero_point``, ``weight_global_scale``, ``weight_shape``);
    ``weights``: the group's QuantizationArgs as a dict; ``fmt``: the
    compressed-tensors format. Returns ``[N, K]`` in the scale's dtype (int and
    FP8 formats) or bf16 (FP4 formats). Raises ``ValueError`` for a format or
    layout it does not know, ``KeyError`` for a missing tensor.
    """
    f = get_format(fmt)
    if f is None:
        raise ValueError(f"cannot dequantize format {fmt!r}")
    return f.dequantize(tensors, WeightArgs.from_dict(weights))
