"""compressed-tensors checkpoints as a source: every format of :data:`ctconvert.formats.FORMATS`.

float-quantized FP8 channel/tensor/block, int- and pack-quantized sym/asym, naive-quantized, nvfp4- and
mxfp4-pack-quantized, mxfp8-quantized: each module dequantized as compressed-tensors' ``decompress``
does (:func:`ctconvert.checkpoint.modules.dense_rows`; docs/compressed-tensors-format.md §10). Nothing
converts losslessly (it is compressed-tensors already); ``quantize`` requantizes it.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..checkpoint.modules import ACT_PARTS, QUANT_PARTS, dense_rows, dense_shape, module_spans, modules_of
from ..checkpoint.naming import FLOAT_DTYPES
from ..errors import BadInputError, UnsupportedError
from ..formats import CompressionFormat, WeightArgs, get_format
from .base import SourceFormat, SourceModule, at, drop_kv_scales

__all__ = ["COMPRESSED_TENSORS", "CompressedTensorsFormat", "CompressedTensorsModule"]

_FP4 = (CompressionFormat.NVFP4_PACK_QUANTIZED.value, CompressionFormat.MXFP4_PACK_QUANTIZED.value)


class CompressedTensorsModule(SourceModule):
    """A compressed-tensors module (``args["module"]``: its :class:`ctconvert.checkpoint.modules.Module`)."""

    kind: ClassVar[str] = "compressed-tensors"

    @property
    def bits(self) -> int:
        return int((self.args["module"].weights or {}).get("num_bits") or 8)

    @property
    def group_size(self) -> int | None:
        return (self.args["module"].weights or {}).get("group_size")

    def dense(self, r0: int, r1: int) -> torch.Tensor:
        return dense_rows(self.args["module"], r0, r1, self.shape[1])

    @property
    def on_device(self) -> bool:
        """FP8 (``float-quantized``, every strategy): exact E4M3 -> fp32 conversions, one fp32 product with the
        expanded scale, one rounding to the scale's dtype (``formats/base.py: dequantize_unpacked``), the same bytes on
        any device. The packed and FP4 formats stay on the CPU kernel."""
        return self.args["module"].format == CompressionFormat.FLOAT_QUANTIZED.value

    def stored_spans(self, r0: int, r1: int) -> dict:
        return module_spans(self.args["module"], r0, r1)

    def dense_from(self, parts: dict[str, torch.Tensor], r0: int, r1: int) -> torch.Tensor:
        m = self.args["module"]
        return get_format(m.format).dequantize(parts, WeightArgs.from_dict(m.weights))


class CompressedTensorsFormat(SourceFormat):
    """``quant_method: "compressed-tensors"``."""

    no_lossless: ClassVar[str] = "already a compressed-tensors checkpoint"

    def read(self, ckpt, qcfg, where, groups):
        if (qcfg.get("sparsity_config") or {}).get("format"):
            raise UnsupportedError(f"sparse format {qcfg['sparsity_config']['format']!r} cannot be read", file=where)
        out, dropped = [], {}
        for m in modules_of(ckpt).values():
            if m.quantized:
                out.append(_module(m, dropped))
        if qcfg.get("kv_cache_scheme"):
            for parts in groups.values():
                drop_kv_scales(parts, dropped)
        return out, dropped


def _module(m, dropped: dict[str, str]) -> CompressedTensorsModule:
    """The source module of one quantized compressed-tensors module (its activation scales put in ``dropped``)."""
    anchor = m.parts.get("weight_packed") or m.parts.get("weight")
    if m.group is None:
        raise BadInputError("quantized tensors that no config group targets", **at(anchor))
    if get_format(m.format) is None:
        raise UnsupportedError(f"format {m.format!r} cannot be dequantized", **at(anchor))
    if m.format == CompressionFormat.MARLIN_24.value:
        raise UnsupportedError(f"{m.format} is a kernel layout spanning whole modules: decompress it first, then quantize", **at(anchor))
    if "weight_g_idx" in m.parts:
        raise UnsupportedError("act-order weights (weight_g_idx, compressed-tensors <= 0.18 actorder 'group') cannot be dequantized", **at(anchor))
    if len(anchor.shape) != 2:
        raise UnsupportedError(f"{len(anchor.shape)}-D quantized weight; only 2-D Linear weights are read", **at(anchor))
    args = WeightArgs.from_dict(m.weights)
    try:
        shape = tuple(dense_shape(m))
    except (KeyError, ValueError) as e:
        raise BadInputError(f"cannot tell the dense shape: {e}", **at(anchor)) from e
    scale = m.parts.get("weight_scale")
    if scale is None:
        raise BadInputError(f"{m.name}.weight_scale is missing (scales missing)", **at(anchor))
    # the dtype decompress gives: the scale's (int and FP8 formats), bf16 for E4M3/E8M0-scaled microscale
    # formats (NVFP4, MXFP4, MXFP8), fp16 for another integer scale (docs/compressed-tensors-format.md §10)
    dtype = scale.dtype if scale.dtype in FLOAT_DTYPES else "BF16" if m.format in _FP4 or scale.dtype in ("U8", "F8_E4M3") else "F16"
    align = math.lcm(128, args.block_structure[0]) if args.strategy == "block" and args.block_structure else 128
    # the tensors the dense weight is computed from; the module's others (its bias) pass through as they are
    parts = {p: i for p, i in m.parts.items() if p == "weight" or p in QUANT_PARTS}
    for p, i in m.parts.items():
        if p in ACT_PARTS:
            dropped[i.name] = "activation scale of the source's quantization"
    label = f"compressed-tensors {m.format} ({_describe(args)})"
    return CompressedTensorsModule(m.name, label, parts, shape, dtype, align, {"module": m})


def _describe(a: WeightArgs) -> str:
    unit = {"block": "block " + "x".join(map(str, a.block_structure or ())), "channel": "channel", "tensor": "tensor"}.get(a.strategy, f"group {a.group_size}")
    return f"{a.type}{a.num_bits} {unit}{'' if a.symmetric else ' asym'}"


#: the registered object (:mod:`ctconvert.sources`)
COMPRESSED_TENSORS = CompressedTensorsFormat("compressed-tensors", "compressed-tensors")
