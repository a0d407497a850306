"""What every weight format shares: its name, its quantization arguments, and the object interface.

A format is one object (:class:`WeightFormat`), the way compressed-tensors
registers one compressor class per ``CompressionFormat``
(``compressed_tensors/compressors/base.py``, ``BaseCompressor.register``,
release 0.20): the tensors it writes (names, dtypes, shapes), its quantizers
(the torch reference, the fused C kernels of :mod:`.native`, the Triton kernels
of :mod:`.gpu`), its dequantizer, the tensors a reader requires, the outputs
that belong to the whole tensor, and its shape rules. The objects live beside
their bit helpers (:mod:`.fp8`, :mod:`.integer`, :mod:`.fp4`) and are
registered in :data:`ctconvert.formats.FORMATS`.

Granularity has one vocabulary, as in compressed-tensors' ``QuantizationStrategy``
(``compressed_tensors/quantization/quant_args.py``): ``tensor``, ``channel``,
``group``, ``tensor_group`` (a group scale plus a global scale) and ``block``;
:func:`expand_scale` broadcasts a scale of any of them to the weight's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch (and the C kernels, which load it) is imported where it is used: the names and WeightArgs stay torch-free
    import torch

__all__ = [
    "CompressionFormat",
    "DequantSpec",
    "WeightArgs",
    "WeightFormat",
    "byte_values",
    "dequantize_unpacked",
    "expand_scale",
    "factor_layout",
    "part_rows",
    "unpacked_spec",
]


class CompressionFormat(str, Enum):
    """compressed-tensors format names (``compressed_tensors/config/base.py``, ``CompressionFormat``, 0.20)."""

    FLOAT_QUANTIZED = "float-quantized"
    INT_QUANTIZED = "int-quantized"
    NAIVE_QUANTIZED = "naive-quantized"
    PACK_QUANTIZED = "pack-quantized"
    NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
    MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
    MXFP8_QUANTIZED = "mxfp8-quantized"
    SPARSE_24_BITMASK = "sparse-24-bitmask"  # legacy (compressed-tensors <= 0.14): formats/sparse24.py
    MARLIN_24 = "marlin-24"  # legacy (compressed-tensors <= 0.14, vLLM <= 0.15)
    DENSE = "dense"
    MIXED_PRECISION = "mixed-precision"

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class WeightArgs:
    """The weight ``QuantizationArgs`` the bytes depend on (compressed-tensors ``quant_args.py``, 0.20).

    ``type``: ``"int"`` | ``"float"``; ``strategy``: see the module docstring;
    ``group_size``: columns per scale (``None`` for tensor/channel/block);
    ``block_structure``: ``(rows, cols)`` of a block scale.
    """

    type: str = "int"
    num_bits: int = 8
    strategy: str = "channel"
    group_size: int | None = None
    symmetric: bool = True
    block_structure: tuple[int, int] | None = None

    @classmethod
    def from_dict(cls, d: dict | None, *, num_bits: int = 8) -> WeightArgs:
        """From a ``config_groups[*].weights`` dict; ``num_bits`` is the default when it is missing.

        A missing ``strategy`` is ``group`` when a ``group_size`` is given, else ``channel``; a
        ``block_structure`` may be a list or a ``"128x128"`` string, and defaults to 128x128 for
        strategy ``block``."""
        d = d or {}
        g = d.get("group_size")
        strategy = d.get("strategy") or ("group" if g else "channel")
        block = d.get("block_structure")
        if isinstance(block, str):
            block = [int(x) for x in block.lower().split("x")]
        if block is None and strategy == "block":
            block = [128, 128]
        return cls(
            type=d.get("type") or "int",
            num_bits=int(d.get("num_bits") or num_bits),
            strategy=strategy,
            group_size=int(g) if g else None,
            symmetric=bool(d.get("symmetric", True)),
            block_structure=tuple(int(x) for x in block) if block else None,
        )


def expand_scale(scale: torch.Tensor, n: int, k: int, args: WeightArgs) -> torch.Tensor:
    """Broadcast a scale (or zero point) of ``args.strategy`` to ``[n, k]``, in fp32.

    ``tensor`` (or one element): everywhere; ``channel``: ``[n, 1]`` along rows;
    ``group``/``tensor_group``: ``[n, G]`` repeated ``group_size`` times; ``block``: ``[ceil(n/bh), ceil(k/bw)]`` repeated in
    both dims, cut to ``[n, k]``. Raises ``ValueError`` for an unknown strategy.
    """
    import torch

    s = scale.to(torch.float32)
    strategy = args.strategy
    if strategy == "tensor" or s.numel() == 1:
        return s.reshape(1, 1).expand(n, k)
    if strategy == "channel":
        return s.reshape(n, 1).expand(n, k)
    if strategy in ("group", "tensor_group"):
        return s.repeat_interleave(args.group_size, dim=1)[:, :k]
    if strategy == "block":
        bh, bw = args.block_structure
        return s.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]
    raise ValueError(f"unknown strategy {strategy!r}")


def factor_layout(t: torch.Tensor, n: int, k: int, args: WeightArgs, grouped_view: bool = False) -> tuple[torch.Tensor, tuple[int, int, int]] | None:
    """Where :func:`expand_scale` takes each element of a ``[n, k]`` scale (or zero point) from, for the fused kernel.

    Returns ``(t as contiguous fp32, (stride, rdiv, g))``: element ``(r // rdiv) * stride + c // g`` of the flat
    tensor is what ``expand_scale(t, n, k, args)[r, c]`` holds; None where :func:`expand_scale` would fail or
    broadcast in a way this cannot say (the torch reference then runs and does what it does). ``grouped_view``:
    the rule of :func:`dequantize_unpacked`'s per-group path instead (``t.reshape(n, k // g, 1)`` when
    ``k % g == 0`` and ``t`` has more than one element).
    """
    import torch

    if t.is_complex() or n <= 0 or k <= 0:
        return None
    s = t.to(torch.float32).contiguous()
    strategy, g = args.strategy, args.group_size
    if grouped_view and strategy in ("group", "tensor_group") and g and k % g == 0 and s.numel() > 1:
        return (s, (k // g, 1, g)) if s.numel() == n * (k // g) else None
    if strategy == "tensor" or s.numel() == 1:
        return (s.reshape(-1), (0, 1, k)) if s.numel() == 1 else None
    if strategy == "channel":
        return (s.reshape(-1), (1, 1, k)) if s.numel() == n else None
    if strategy in ("group", "tensor_group"):
        ok = g and s.dim() == 2 and s.shape[0] == n and s.shape[1] * g >= k
        return (s, (s.shape[1], 1, g)) if ok else None
    if strategy == "block" and args.block_structure:
        bh, bw = args.block_structure
        ok = bh > 0 and bw > 0 and s.dim() == 2 and s.shape[0] * bh >= n and s.shape[1] * bw >= k
        return (s, (s.shape[1], bh, bw)) if ok else None
    return None


def byte_values(dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``[256]``: the value of each byte as an element of the one-byte ``dtype`` (int8, uint8, E4M3), by torch's
    own conversion (``.to(torch.float32)``), so a table lookup equals the conversion bit for bit."""
    import torch

    return torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype).to(torch.float32)


@dataclass
class DequantSpec:
    """One dequantization as the fused CPU kernel computes it (:func:`ctconvert.formats.native.dequant.dequant`):
    ``D((lut[code] - zero_point) * factor)`` over ``[n, k]``.

    ``codes``: uint8 ``[n, row bytes]``, one code per byte or (``nibbles``) two, element ``2j`` low; ``lut``:
    fp32 code -> value; ``factor``/``zero_point``: fp32, placed by ``layout`` (:func:`factor_layout`); ``mid``:
    D, the dtype compressed-tensors' decompress returns."""

    codes: torch.Tensor
    nibbles: bool
    k: int
    lut: torch.Tensor
    factor: torch.Tensor
    zero_point: torch.Tensor | None
    layout: tuple[int, int, int]
    mid: torch.dtype


def unpacked_spec(tensors: dict[str, torch.Tensor], args: WeightArgs, codes: torch.Tensor | None = None, nibbles: bool = False, lut=None, k=None):
    """The :class:`DequantSpec` of :func:`dequantize_unpacked` (``(q - zp) * scale`` in the scale's dtype), or None
    where the kernel does not take it. ``codes``/``nibbles``/``lut``/``k``: the codes of a packed weight in place of an
    unpacked one-byte ``weight`` (int8, E4M3)."""
    import torch

    from .common import KERNEL_DTYPES

    scale = tensors["weight_scale"]
    d = scale.dtype if scale.dtype.is_floating_point else torch.float16
    if d not in KERNEL_DTYPES:
        return None
    if codes is None:
        w = tensors["weight"]
        if w.dim() != 2 or w.element_size() != 1 or w.dtype.is_complex or w.dtype == torch.bool:
            return None
        n, k = w.shape
        codes, lut = w.contiguous().view(torch.uint8), byte_values(w.dtype)
    n = codes.shape[0]
    fl = factor_layout(scale, n, k, args, grouped_view=True)
    if fl is None:
        return None
    zp = tensors.get("weight_zero_point")
    if zp is not None:
        zl = factor_layout(zp, n, k, args, grouped_view=True)
        if zl is None or zl[1] != fl[1]:
            return None
        zp = zl[0]
    return DequantSpec(codes, nibbles, k, lut, fl[0], zp, fl[1], d)


def part_rows(part: str, shape: tuple[int, ...], dtype: str, r0: int, r1: int, args: WeightArgs):
    """Which rows of a module's stored tensor ``part`` cover its dense rows ``[r0, r1)``.

    Returns ``(a, b)`` (a row range of the stored tensor), ``None`` (the whole tensor: per-tensor
    scales, global scales) or ``False`` (not a weight tensor: ``weight_shape``, activation scales).
    ``dtype`` is the safetensors dtype: a zero point stored as I32 is packed along dim 0
    (docs/compressed-tensors-format.md §4.3).
    """
    if part in ("weight", "weight_packed", "compressed", "bitmask"):
        return r0, r1
    if part in ("weight_scale", "weight_zero_point"):
        numel = math.prod(shape)
        if numel <= 1 or args.strategy == "tensor" or len(shape) < 2:
            return None
        if args.strategy == "block":
            bh = args.block_structure[0]
            return r0 // bh, min(shape[0], math.ceil(r1 / bh))
        if part == "weight_zero_point" and dtype == "I32":
            bits = args.num_bits
            return r0 * bits // 32, min(shape[0], math.ceil(r1 * bits / 32))
        return r0, r1
    if part == "weight_global_scale":
        return None
    return False


def dequantize_unpacked(tensors: dict[str, torch.Tensor], args: WeightArgs) -> torch.Tensor:
    """``(q - zp) * scale`` of an unpacked ``weight`` (FP8 or int8), in the scale's dtype (fp16 for an
    integer scale), as compressed-tensors' ``_dequantize`` computes it (docs/compressed-tensors-format.md §10)."""
    import torch

    scale = tensors["weight_scale"]
    d = scale.dtype if scale.dtype.is_floating_point else torch.float16
    w = tensors["weight"]
    q = w.to(torch.float32, copy=True)  # owned: the group path below works in place
    n, k = w.shape
    zp = tensors.get("weight_zero_point")
    g = args.group_size
    if args.strategy in ("group", "tensor_group") and g and k % g == 0 and scale.numel() > 1:
        # per group by broadcasting over a [n, G, g] view (the values of expand_scale, without building it)
        q3 = q.view(n, k // g, g)
        if zp is not None:
            q3.sub_(zp.to(torch.float32).reshape(n, k // g, 1))
        return q3.mul_(scale.to(torch.float32).reshape(n, k // g, 1)).view(n, k).to(d)
    if args.strategy == "block" and zp is None and args.block_structure and scale.dim() == 2:
        bh, bw = args.block_structure
        if n % bh == 0 and k % bw == 0 and tuple(scale.shape) == (n // bh, k // bw):
            # whole blocks: the scale broadcast over a [n/bh, bh, k/bw, bw] view, the values of expand_scale without
            # building it (two repeat_interleave passes and an [n, k] fp32 tensor per chunk on the computing thread)
            q4 = q.view(n // bh, bh, k // bw, bw)
            return q4.mul_(scale.to(torch.float32).reshape(n // bh, 1, k // bw, 1)).view(n, k).to(d)
    if zp is not None:
        q = q - expand_scale(zp, n, k, args)
    return (q * expand_scale(scale, n, k, args)).to(d)


class WeightFormat:
    """One compressed-tensors weight format. Subclasses set the class attributes and the hooks.

    ``name``: the :class:`CompressionFormat`; ``required``: tensors a reader needs (local names);
    ``needs_global_scale``: one absmax over the fused set before any chunk is quantized;
    ``writes``: whether ctconvert quantizes into it (``naive-quantized`` is read only); ``takes_ranges``:
    whether :meth:`quantize` takes an observer's ``ranges`` (:mod:`.observers`); ``reads_back``: whether its
    quantizer reads a device value back to the host on a GPU (an overflow check that raises at once), so that its
    launches cannot be captured as a CUDA graph (:mod:`ctconvert.pipeline.graphs`).
    """

    name: CompressionFormat
    required: tuple[str, ...] = ()
    needs_global_scale = False
    writes = True
    takes_ranges = False
    reads_back = False

    # -- shapes ------------------------------------------------------------------
    def outputs(self, shape: tuple[int, int], dtype: torch.dtype, args: WeightArgs) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Tensors replacing ``module.weight`` ``[N, K]`` of ``dtype``: local name -> (dtype, shape)."""
        raise NotImplementedError(f"{self.name} is not written by ctconvert")

    def dense_shape(self, shapes: dict[str, tuple[int, ...]], args: WeightArgs, weight_shape=None) -> tuple[int, int]:
        """The dense ``[N, K]`` from the stored tensors' shapes (``weight_shape``'s values when given)."""
        if weight_shape is not None:
            return tuple(int(x) for x in weight_shape)
        return tuple(shapes["weight"])

    def row_align(self, args: WeightArgs) -> int:
        """Row chunks must start at multiples of this."""
        return 1

    def k_multiple(self, args: WeightArgs) -> int:
        """K must be a multiple of this (1 = any)."""
        return args.group_size or 1

    def n_multiple(self, args: WeightArgs) -> int:
        """N must be a multiple of this for loaders (1 = any)."""
        return 1

    def zero_scale(self, args: WeightArgs, dtype: torch.dtype) -> float | None:
        """The ``weight_scale`` value (as a number; E8M0 scales: the stored byte) of a group whose computed
        scale is zero in the weight's ``dtype``: compressed-tensors substitutes this value, and only such
        groups can quantize to all zeros from non-zero values (every other group's largest value maps to
        a non-zero level). None: not known for this format."""
        return None

    def zero_row_floor(self, args: WeightArgs, dtype: torch.dtype, global_scale: float | None = None) -> tuple[float, float]:
        """How small a row of ``dtype`` values must be to quantize to all zeros in a correct output: ``(absolute,
        relative)``, the row's absmax is below ``absolute`` (its scales underflow: the zero-scale substitute of
        :meth:`zero_scale` then maps every value to 0) or below ``relative`` times the absmax of the values its
        scale is computed from (a per-tensor or block scale, where a row far below the others rounds to 0). Each
        bound is the format's exact one times 2, so rounding cannot put a genuinely tiny row above it; a row
        above both must quantize to something (its largest value maps to a non-zero level). ``global_scale``: the
        module's NVFP4 ``weight_global_scale``. ``(0, 0)``: not known for this format (no row may be lost)."""
        return 0.0, 0.0

    def scale_flags_nonfinite(self, args: WeightArgs) -> bool:
        """Whether ``weight_scale`` is non-finite exactly when its group holds a NaN/inf (the scale is
        ``max|x| / constant``: NaN-propagating in torch, over abs bit patterns in C), so that a separate
        NaN/inf scan of the input may be skipped."""
        return False

    # -- quantizing ----------------------------------------------------------------
    def quantize(
        self,
        w: torch.Tensor,
        args: WeightArgs,
        global_scale: torch.Tensor | None = None,
        impl: str = "auto",
        ranges: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Quantize a row chunk ``w`` ``[r, K]``; keys are local names (``weight_packed`` ...).

        ``impl``: ``auto`` (the C kernels for CPU tensors, the Triton kernels for CUDA tensors, when
        available; else the torch reference), ``torch``, ``native`` or ``triton``: the same bytes.
        ``ranges``: per-group ``(min, max)`` of an observer (:mod:`.observers`, D ``[r, G]``) that the scales
        are computed from in place of the chunk's own min/max (the torch reference then runs; for NVFP4
        ``global_scale`` must come from the fused set's searched ranges). Whole-tensor outputs
        (:meth:`whole_tensor_outputs`) are not produced here. Raises ``ValueError`` for values the format
        cannot hold, for ranges a format does not take, and for a K that is not a multiple of the group
        size (the planner keeps such a weight dense first; the kernels would read past a row's end).
        """
        from . import native

        if args.group_size and w.dim() == 2 and w.shape[1] % args.group_size:
            raise ValueError(f"K={w.shape[1]} is not a multiple of the group size {args.group_size} ({self.name})")

        if ranges is not None:
            return self._reference_ranges(w, args, global_scale, ranges)
        if impl == "native" or (impl == "auto" and w.device.type == "cpu" and native.available()):
            return self._fused(native, w, args, global_scale)
        if impl in ("auto", "triton") and w.device.type == "cuda":
            from . import gpu  # imports Triton: only when a CUDA tensor needs it

            if gpu.available():
                try:
                    return self._fused(gpu, w, args, global_scale)
                except NotImplementedError:
                    pass
        return self._reference(w, args, global_scale)

    def whole_tensor_outputs(self, shape: tuple[int, int], global_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Outputs that belong to the whole tensor, known once its last chunk is done."""
        return {}

    def _reference(self, w, args, global_scale):
        raise NotImplementedError(f"{self.name} is not written by ctconvert")

    def _reference_ranges(self, w, args, global_scale, ranges):
        """The torch reference with scales from an observer's ``ranges`` (see :meth:`quantize`)."""
        raise ValueError(f"{self.name} does not take an observer's ranges")

    def _fused(self, kernels, w, args, global_scale):
        """Through :mod:`.native` (CPU) or :mod:`.gpu` (CUDA): both expose the same functions."""
        raise NotImplementedError(f"{self.name} is not written by ctconvert")

    # -- reading -------------------------------------------------------------------
    def dequantize(
        self, tensors: dict[str, torch.Tensor], args: WeightArgs, *, dtype: torch.dtype | None = None, impl: str = "auto", out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Dense ``[N, K]`` from the compressed tensors (local names), as compressed-tensors' ``decompress``
        computes it (in the scale's dtype for int and FP8 formats, bf16 for FP4 and MX), then cast to ``dtype``
        when given (torch's ``.to``: round to nearest even).

        ``impl``: ``auto`` (the fused C kernel of :mod:`.native.dequant` for CPU tensors when it is built and
        takes the layout, else the torch reference), ``torch`` or ``native`` (raises ``ValueError`` for a layout
        the kernel does not take): the same bytes. A chunk whose products hold a NaN is computed by the torch
        reference (whose NaN bit patterns the kernel does not reproduce). ``out``: a contiguous CPU tensor of
        the result's shape and dtype (``dtype`` must be given) that receives the result, which is returned (a
        reused buffer: no fresh allocation). Raises ``KeyError`` for a missing tensor and what the torch
        reference raises for inconsistent shapes.
        """
        from .common import KERNEL_DTYPES
        from .native import dequant as native_dequant

        if impl != "torch" and dtype in (None, *KERNEL_DTYPES) and (impl == "native" or native_dequant.available()):
            spec = None
            if all(t.device.type == "cpu" for t in tensors.values()):
                try:
                    spec = self.dequant_spec(tensors, args)
                except (RuntimeError, ValueError, IndexError, TypeError):  # inconsistent tensors: the reference says how
                    spec = None
            if spec is None and impl == "native":
                raise ValueError(f"{self.name} tensors of this layout are not taken by the native dequantization kernel")
            if spec is not None:
                got = native_dequant.dequant(
                    spec.codes, spec.nibbles, spec.k, spec.lut, spec.factor, spec.zero_point, spec.layout, spec.mid, dtype or spec.mid, out=out
                )
                if got is not None:
                    return got
        ref = self._dequantize_reference(tensors, args)
        ref = ref if dtype is None else ref.to(dtype)
        if out is None:
            return ref
        if out.shape != ref.shape or out.dtype != ref.dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, the result {tuple(ref.shape)} {ref.dtype}")
        return out.copy_(ref)

    def _dequantize_reference(self, tensors: dict[str, torch.Tensor], args: WeightArgs) -> torch.Tensor:
        """The torch reference of :meth:`dequantize` (without the cast)."""
        raise NotImplementedError(f"{self.name} cannot be dequantized")

    def dequant_spec(self, tensors: dict[str, torch.Tensor], args: WeightArgs) -> DequantSpec | None:
        """The fused kernel's view of :meth:`_dequantize_reference`, or None where it has none."""
        return None

    def __repr__(self) -> str:
        return f"<format {self.name.value}>"
