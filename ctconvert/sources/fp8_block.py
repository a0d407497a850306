"""Hugging Face FP8 block checkpoints as a source (``quant_method: "fp8"``, ``weight_block_size``, ``weight_scale_inv``).

The DeepSeek-V3/R1 and Qwen3-FP8 layout, MoE experts and the MTP layer included: every module with a
``weight_scale_inv`` is one E4M3 weight with one fp32 scale per ``bh x bw`` block, dequantized as
compressed-tensors 0.20 ``converters/fp8block_dequantizer.py`` does
(:func:`ctconvert.formats.foreign.fp8_block_dequantize`). Nothing converts losslessly.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..checkpoint.modules import ACT_PARTS
from ..checkpoint.naming import FLOAT_DTYPES
from ..errors import BadInputError, UnsupportedError
from ..formats.foreign import fp8_block_dequantize
from .base import SourceFormat, SourceModule, at, shape_is

__all__ = ["FP8_BLOCK", "FP8BlockFormat", "FP8BlockModule"]


class FP8BlockModule(SourceModule):
    """One E4M3 ``weight`` with its ``weight_scale_inv`` (``args["block"]``: ``(bh, bw)``)."""

    kind: ClassVar[str] = "fp8-block"
    bits = 8  # E4M3
    group_size = None  # block scales (:attr:`block`)

    @property
    def block(self) -> list[int] | None:
        return list(self.args["block"])

    on_device: ClassVar[bool] = True  # fp32 products of exact conversions, rounded once: the same on any device

    def dense(self, r0: int, r1: int) -> torch.Tensor:
        return self.dense_from(self.stored_rows(r0, r1), r0, r1)

    def stored_spans(self, r0: int, r1: int) -> dict:
        bh, _ = self.args["block"]
        return {"weight": (self.parts["weight"], r0, r1), "weight_scale_inv": (self.parts["weight_scale_inv"], r0 // bh, math.ceil(r1 / bh))}

    def dense_from(self, parts: dict[str, torch.Tensor], r0: int, r1: int) -> torch.Tensor:
        return fp8_block_dequantize(parts["weight"], parts["weight_scale_inv"], tuple(self.args["block"]))


class FP8BlockFormat(SourceFormat):
    """``quant_method: "fp8"`` with a two-value ``weight_block_size``."""

    def read(self, ckpt, qcfg, where, groups):
        block = qcfg.get("weight_block_size")
        if not block or len(block) != 2:
            raise UnsupportedError("quant_method 'fp8' without a two-value weight_block_size (per-tensor FP8) is not read", file=where)
        bh, bw = (int(x) for x in block)
        out, dropped = [], {}
        for mod, parts in groups.items():
            w = parts.get("weight")
            if "weight_scale_inv" not in parts:
                if w is not None and w.dtype in ("F8_E4M3", "F8_E5M2"):
                    raise BadInputError("FP8 weight without weight_scale_inv (scales missing)", **at(w))
                continue
            s = parts["weight_scale_inv"]
            if w is None:
                raise BadInputError("weight_scale_inv without a weight (tensor missing)", **at(s))
            if w.dtype != "F8_E4M3":
                raise BadInputError(f"weight is {w.dtype}; a weight with weight_scale_inv must be F8_E4M3", **at(w))
            if len(w.shape) != 2:
                raise UnsupportedError(f"{len(w.shape)}-D FP8 weight; only 2-D Linear weights are read", **at(w))
            n, k = w.shape
            shape_is(s, (math.ceil(n / bh), math.ceil(k / bw)), f"weight {list(w.shape)} with {bh}x{bw} blocks")
            if s.dtype not in FLOAT_DTYPES:
                raise BadInputError(f"weight_scale_inv is {s.dtype}, not a float", **at(s))
            for p in ACT_PARTS:
                if p in parts:
                    dropped[parts[p].name] = "activation scale of the source's quantization"
            label = f"fp8 block {bh}x{bw} (weight_scale_inv)"
            out.append(FP8BlockModule(mod, label, {"weight": w, "weight_scale_inv": s}, (n, k), "BF16", math.lcm(128, bh), {"block": (bh, bw)}))
        return out, dropped


#: the registered object (:mod:`ctconvert.sources`)
FP8_BLOCK = FP8BlockFormat("fp8-block", "fp8")
