"""Quantization schemes by compressed-tensors preset name, and what each writes.

A :class:`Scheme` ties a preset (``FP8_DYNAMIC``, ``W4A16`` ...; the names and
their QuantizationArgs are compressed-tensors' own presets,
``compressed_tensors.quantization.quant_scheme``) to:

* the compressed-tensors ``format`` its tensors are written in
  (compressed-tensors-format.md §3.3),
* the output tensors per quantized Linear, with dtypes and shapes (§4),
* the function of :mod:`ctconvert.formats` that computes them, on a row chunk,
* the shape rules it imposes (K divisible by the group size; row alignment of
  chunks so that block scales and dim-0 packed zero points stay whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from .checkpoint.safetensors_io import TORCH_TO_ST
from .errors import UnsupportedError, UsageError
from .formats import fp4, fp8, integer, native


@dataclass(frozen=True)
class Scheme:
    """One weight quantization recipe.

    ``kind``: ``fp8_channel`` | ``fp8_block`` | ``int`` | ``nvfp4`` | ``mxfp4``.
    ``group_size``: columns per scale (``None`` = one per row). ``row_align``:
    row chunks must start at multiples of this. ``global_scale``: needs one
    absmax over the fused set before any chunk is quantized.
    """

    name: str
    preset: str
    format: str
    kind: str
    num_bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    block: tuple[int, int] | None = None

    @property
    def global_scale(self) -> bool:
        return self.kind == "nvfp4"

    @property
    def scale_flags_nonfinite(self) -> bool:
        """Whether ``weight_scale`` is non-finite exactly when its group holds a NaN/inf: the scale is
        max|x| / constant (max over the abs bit patterns in the C kernels, NaN-propagating ``amax`` in
        torch), so a finite group gives a finite scale and NaN/inf give NaN/inf. Then the separate
        NaN/inf scan of the input can be skipped."""
        return self.kind in ("fp8_channel", "fp8_block") or (self.kind == "int" and self.symmetric)

    @property
    def row_align(self) -> int:
        if self.kind == "fp8_block":
            return self.block[0]
        if self.kind == "int" and not self.symmetric:
            return 32  # zero points are packed along dim 0, 32 rows -> B words
        return 1

    @property
    def k_multiple(self) -> int:
        """K must be a multiple of this (1 = any)."""
        if self.kind in ("nvfp4", "mxfp4", "int") and self.group_size:
            return self.group_size
        if self.kind == "fp8_block":
            return self.block[1]
        return 1

    def outputs(self, module: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, str, tuple[int, ...]]]:
        """Output tensors ``(name, safetensors dtype, shape)`` replacing ``module.weight``."""
        n, k = shape
        d = TORCH_TO_ST[dtype]
        m = module + "."
        if self.kind == "fp8_channel":
            return [(m + "weight", "F8_E4M3", (n, k)), (m + "weight_scale", d, (n, 1))]
        if self.kind == "fp8_block":
            bh, bw = self.block
            return [(m + "weight", "F8_E4M3", (n, k)), (m + "weight_scale", d, (math.ceil(n / bh), math.ceil(k / bw)))]
        if self.kind == "int":
            g = 1 if self.group_size is None else k // self.group_size
            if self.format == "int-quantized":
                out = [(m + "weight", "I8", (n, k)), (m + "weight_scale", d, (n, g))]
                if not self.symmetric:
                    out.append((m + "weight_zero_point", "I8", (n, g)))
                return out
            out = [
                (m + "weight_packed", "I32", (n, math.ceil(k * self.num_bits / 32))),
                (m + "weight_scale", d, (n, g)),
                (m + "weight_shape", "I64", (2,)),
            ]
            if not self.symmetric:
                out.append((m + "weight_zero_point", "I32", (math.ceil(n * self.num_bits / 32), g)))
            return out
        if self.kind == "nvfp4":
            return [
                (m + "weight_packed", "U8", (n, k // 2)),
                (m + "weight_scale", "F8_E4M3", (n, k // 16)),
                (m + "weight_global_scale", "F32", (1,)),
            ]
        if self.kind == "mxfp4":
            return [(m + "weight_packed", "U8", (n, k // 2)), (m + "weight_scale", "U8", (n, k // 32))]
        raise AssertionError(self.kind)

    def quantize_rows(self, w: torch.Tensor, global_scale: torch.Tensor | None = None, impl: str = "auto") -> dict[str, torch.Tensor]:
        """Quantize a row chunk ``w`` ``[r, K]``; keys are local names (``weight_packed`` ...).

        Row-wise outputs cover the same rows; ``fp8_block`` scales cover
        ``ceil(r / bh)`` block rows; asymmetric packed zero points cover
        ``ceil(r * B / 32)`` words. ``weight_shape`` and ``weight_global_scale``
        are not produced here (they belong to the whole tensor).

        ``impl``: ``auto`` (the fused C kernels for CPU tensors, the Triton
        kernels for CUDA tensors, when available; else the torch reference),
        ``torch``, ``native`` or ``triton``. Every implementation gives the
        same bytes.
        """
        if impl == "native" or (impl == "auto" and w.device.type == "cpu" and native.available()):
            return self._quantize_fused(native, w, global_scale)
        if impl in ("auto", "triton") and w.device.type == "cuda":
            from .formats import gpu  # imports Triton: only when a CUDA tensor needs it

            if not gpu.available():
                return self._quantize_torch(w, global_scale)
            try:
                return self._quantize_fused(gpu, w, global_scale)
            except NotImplementedError:
                pass
        return self._quantize_torch(w, global_scale)

    def _quantize_fused(self, kernels, w: torch.Tensor, global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Through a fused-kernel module, :mod:`.formats.native` (CPU) or :mod:`.formats.gpu` (CUDA):
        both expose the same functions."""
        if self.kind == "fp8_channel":
            return kernels.fp8_channel(w)
        if self.kind == "fp8_block":
            return kernels.fp8_block(w, self.block)
        if self.kind == "int":
            pack = self.format == "pack-quantized"
            out = kernels.int_quant(w, self.num_bits, self.group_size, self.symmetric, pack)
            if pack and not self.symmetric:
                out["weight_zero_point"] = integer.pack_int32_dim0(out["weight_zero_point"], self.num_bits)
            return out
        if self.kind == "nvfp4":
            return kernels.nvfp4(w, global_scale)
        if self.kind == "mxfp4":
            return kernels.mxfp4(w)
        raise AssertionError(self.kind)

    def _quantize_torch(self, w: torch.Tensor, global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if self.kind == "fp8_channel":
            return fp8.quantize_fp8_channel(w)
        if self.kind == "fp8_block":
            return fp8.quantize_fp8_block(w, self.block)
        if self.kind == "int":
            r = integer.quantize_int(w, self.num_bits, self.group_size, self.symmetric)
            if self.format == "int-quantized":
                return r
            out = {"weight_packed": integer.pack_int32(r["weight"], self.num_bits), "weight_scale": r["weight_scale"]}
            if not self.symmetric:
                out["weight_zero_point"] = integer.pack_int32_dim0(r["weight_zero_point"], self.num_bits)
            return out
        if self.kind == "nvfp4":
            return fp4.quantize_nvfp4(w, global_scale)
        if self.kind == "mxfp4":
            return fp4.quantize_mxfp4(w)
        raise AssertionError(self.kind)

    def config_group(self, targets: list[str]) -> dict:
        """The ``config_groups`` entry: compressed-tensors' preset, serialized as its 0.20 ``model_dump``.

        The QuantizationArgs of each preset are compressed-tensors'
        (``quant_scheme.PRESET_SCHEMES``); ``tests/test_config.py`` checks this
        table against the library, key for key. Kept as data so that a
        conversion does not pay compressed-tensors' multi-second import.
        """
        weights, inputs = _PRESET_ARGS[self.preset]
        return {
            "targets": list(targets),
            "weights": dict(weights),
            "input_activations": dict(inputs) if inputs else None,
            "output_activations": None,
            "format": self.format,
        }


def _args(num_bits, type_, strategy, group_size=None, symmetric=True, dynamic=False, **extra):
    d = {"num_bits": num_bits, "type": type_, "symmetric": symmetric, "group_size": group_size, "strategy": strategy}
    if "block_structure" in extra:
        d["block_structure"] = extra.pop("block_structure")
    d["dynamic"] = dynamic
    d.update(extra)
    return d


_FP8_TOKEN = _args(8, "float", "token", dynamic=True)
_PRESET_ARGS: dict[str, tuple[dict, dict | None]] = {
    "FP8_DYNAMIC": (_args(8, "float", "channel"), _FP8_TOKEN),
    "FP8_BLOCK": (_args(8, "float", "block", block_structure=[128, 128]), _args(8, "float", "group", 128, dynamic=True)),
    "W8A8": (_args(8, "int", "channel"), _args(8, "int", "token", dynamic=True)),
    "W4A16": (_args(4, "int", "group", 128), None),
    "W4A16_ASYM": (_args(4, "int", "group", 128, symmetric=False), None),
    "W8A16": (_args(8, "int", "group", 128), None),
    "NVFP4A16": (_args(4, "float", "tensor_group", 16, scale_dtype="torch.float8_e4m3fn"), None),
    "MXFP4A16": (_args(4, "float", "group", 32, scale_dtype="torch.uint8"), None),
}


_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("FP8_DYNAMIC", "FP8_DYNAMIC", "float-quantized", "fp8_channel"),
        Scheme("FP8_BLOCK", "FP8_BLOCK", "float-quantized", "fp8_block", block=(128, 128)),
        Scheme("W8A8", "W8A8", "int-quantized", "int", num_bits=8, group_size=None),
        Scheme("W4A16", "W4A16", "pack-quantized", "int", num_bits=4, group_size=128),
        Scheme("W4A16_ASYM", "W4A16_ASYM", "pack-quantized", "int", num_bits=4, group_size=128, symmetric=False),
        Scheme("W8A16", "W8A16", "pack-quantized", "int", num_bits=8, group_size=128),
        Scheme("NVFP4A16", "NVFP4A16", "nvfp4-pack-quantized", "nvfp4", num_bits=4, group_size=16),
        Scheme("MXFP4A16", "MXFP4A16", "mxfp4-pack-quantized", "mxfp4", num_bits=4, group_size=32),
    )
}
_ALIASES = {"INT8": "W8A8"}

#: quantized lm_head choices (``--lm-head``): NVFP4A16, or FP8 per-row weights
#: with dynamic per-token activations (the FP8_DYNAMIC preset aimed at the head).
LM_HEAD_SCHEMES = {"none": None, "nvfp4a16": "NVFP4A16", "fp8": "FP8_DYNAMIC"}


def scheme_names() -> list[str]:
    """Every accepted scheme name (upper case), aliases included."""
    return sorted([*_SCHEMES, *_ALIASES])


def get_scheme(name: str) -> Scheme:
    """Look a scheme up by preset name, case-insensitively.

    Raises :class:`UnsupportedError` for NVFP4 (W4A4: needs calibrated
    activation scales) and :class:`UsageError` for an unknown name.
    """
    key = name.strip().upper()
    key = _ALIASES.get(key, key)
    if key in _SCHEMES:
        return _SCHEMES[key]
    if key in ("NVFP4", "W4A4_NVFP4"):
        raise UnsupportedError(
            "scheme NVFP4 (W4A4) needs calibrated activation global scales (input_global_scale), "
            "which data-free conversion cannot produce; use --scheme NVFP4A16 (weight-only NVFP4) instead"
        )
    raise UsageError(f"unknown scheme {name!r}; choose one of: {', '.join(scheme_names())}")

