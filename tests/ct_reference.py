"""The reference: compressed-tensors' own CPU path, driven the way llm-compressor drives it.

Observation (min/max per quantization unit, llm-compressor's memoryless
min-max observer) is done here with plain torch reductions in the weight's
dtype; the scales, zero points, global scales, quantization and packing all
come from compressed-tensors itself (``calculate_qparams``,
``generate_gparam`` and the format's compressor).
"""

from __future__ import annotations

import os

os.environ.setdefault("CT_ENFORCE_EAGER", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

PRESET_FORMAT = {
    "FP8_DYNAMIC": "float-quantized",
    "FP8": "float-quantized",
    "FP8_BLOCK": "float-quantized",
    "W8A8": "int-quantized",
    "INT8": "int-quantized",
    "W4A16": "pack-quantized",
    "W4A16_ASYM": "pack-quantized",
    "W8A16": "pack-quantized",
    "NVFP4A16": "nvfp4-pack-quantized",
    "NVFP4": "nvfp4-pack-quantized",
    "MXFP4A16": "mxfp4-pack-quantized",
    "MXFP4": "mxfp4-pack-quantized",
    "MXFP8A16": "mxfp8-quantized",
    "MXFP8": "mxfp8-quantized",
}


def observe(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min/max per unit, in w's dtype, shaped like the scale."""
    s = args.strategy.value if hasattr(args.strategy, "value") else args.strategy
    n, k = w.shape
    if s == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if s in ("group", "tensor_group"):
        g = w.reshape(n, k // args.group_size, args.group_size)
        return g.amin(-1), g.amax(-1)
    if s == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if s == "block":
        bh, bw = args.block_structure
        wp = F.pad(w, (0, -k % bw, 0, -n % bh))
        b = wp.reshape(wp.shape[0] // bh, bh, wp.shape[1] // bw, bw)
        return b.amin(dim=(1, 3)), b.amax(dim=(1, 3))
    raise ValueError(s)


def ct_compress(w: torch.Tensor, scheme: str | QuantizationScheme, fused_with: list[torch.Tensor] | None = None) -> dict:
    """compressed-tensors' compressed state dict for one weight.

    ``fused_with``: every member of the weight's fused set (including ``w``)
    for the shared NVFP4 global scale (llm-compressor's fused observers).
    """
    if isinstance(scheme, str):
        fmt = PRESET_FORMAT[scheme.upper()]
        scheme = preset_name_to_scheme(scheme.upper(), ["Linear"])
    else:
        fmt = scheme.format
    args = scheme.weights
    mn, mx = observe(w, args)
    gs = None
    if args.strategy == "tensor_group":
        members = fused_with or [w]
        tmin = torch.stack([m.amin() for m in members]).amin().reshape(1)
        tmax = torch.stack([m.amax() for m in members]).amax().reshape(1)
        gs = generate_gparam(tmin, tmax)
    scale, zp = calculate_qparams(mn, mx, args, global_scale=gs)
    sd = {"weight": w, "weight_scale": scale}
    if not args.symmetric:  # symmetric weights have no zero point (llm-compressor's initialize_quantized_linear:
        sd["weight_zero_point"] = zp  # force_zero_point=False), so quantize() keeps an FP8 -0.0 as 0x80
    if gs is not None:
        sd["weight_global_scale"] = gs
    comp = BaseCompressor.get_value_from_registry(fmt)
    out = comp.compress(sd, scheme)
    return {k: v for k, v in out.items()}
