"""2:4 structured sparsity: magnitude pruning along K, the ``sparse-24-bitmask`` format and the ``marlin-24`` format.

The bitmask (pack, unpack, values at its positions) lives here only: the 2:4 kernel layouts
(``ctconvert.layouts.kernels``, ``Sparse24Kernel``) receive these functions as data
(:data:`BITMASK`), since ``layouts/`` imports nothing of ``formats/``.

Format facts (docs/compressed-tensors-format.md §4.8, §5.6; compressed-tensors 0.14.0.1,
``compressors/sparse_compressors/sparse_24_bitmask.py``, ``sparse24_bitmask_compress`` and
``get_24_bytemasks``; ``utils/helpers.py``, ``pack_bitmasks``):

* Every group of 4 consecutive elements along K keeps exactly 2 positions: the two largest
  magnitudes, ``torch.topk(|x|, 2)`` on the CPU. Ties (equal magnitudes; ``-0.0`` and ``+0.0``
  are equal) are broken the way that ``topk`` breaks them, which depends only on the weak order
  of the 4 magnitudes: :data:`TIE_TABLE` holds the kept pair for each of the 75 weak orders
  (recorded from compressed-tensors 0.14.0.1 with torch 2.13.0 by
  ``scripts/make_sparse24_reference.py``; ``tests/data/sparse24_ct014.safetensors``).
* The magnitudes compared: ``|x|`` for float weights; for FP8 the raw bytes viewed as int8
  (``0x80``, i.e. ``-0.0``, wraps to -128 and is the smallest); for int8 ``|q|`` computed without
  wrap-around. compressed-tensors takes ``abs`` of the int8 tensor, so a stored -128 counts as
  -128 and would be dropped in favour of a zero: ctconvert keeps it (the only deviation; it
  changes nothing for groups without -128).
* ``compressed`` ``[N, K/2]`` holds the kept values in k order, in the weight's dtype (after
  quantization); ``bitmask`` U8 ``[N, ceil(K/8)]`` has bit ``c % 8`` (LSB first) of byte
  ``c // 8`` set for each kept column ``c`` (NumPy ``packbits(bitorder="little")``); ``shape``
  I64 ``[2, 1]`` holds ``[[N], [K]]``.

Pruning a dense weight (``quantize --sparsity 2:4``) uses the same rule on ``|w|``, so pruning
then compressing equals compressed-tensors' compressor applied to the unpruned weight, and a
weight that is already 2:4 (at most 2 non-zeros in every group) is returned unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import CompressionFormat, WeightFormat
from .common import smallest_subnormal
from .integer import quantize_int

__all__ = [
    "BITMASK",
    "BitmaskCodec",
    "Marlin24",
    "SPARSE_PREFIX",
    "TIE_TABLE",
    "Sparse24Bitmask",
    "bitmask_values",
    "compress24",
    "decompress24",
    "is_24",
    "magnitude_key",
    "marlin24_quantize",
    "mask24",
    "pack_bitmask",
    "prune24",
    "sparse24_format",
    "unpack_bitmask",
]

#: weak order of 4 magnitudes -> kept positions (bit i = position i kept). The key is the rank vector
#: ``r_i = #{j : m_j < m_i}`` written as 4 digits; the values are what compressed-tensors 0.14.0.1's
#: ``get_24_bytemasks`` (``torch.topk`` on the CPU, torch 2.13.0) keeps.
TIE_TABLE: dict[str, int] = {
    "0000": 12, "0003": 12, "0022": 12, "0023": 12, "0030": 12, "0032": 12, "0111": 12, "0113": 12, "0122": 12,
    "0123": 12, "0131": 12, "0132": 12, "0202": 10, "0203": 10, "0212": 10, "0213": 10, "0220": 6, "0221": 6,
    "0230": 6, "0231": 6, "0300": 10, "0302": 10, "0311": 10, "0312": 10, "0320": 6, "0321": 6, "1011": 12,
    "1013": 12, "1022": 12, "1023": 12, "1031": 12, "1032": 12, "1101": 10, "1103": 10, "1110": 6, "1130": 6,
    "1202": 10, "1203": 10, "1220": 6, "1230": 6, "1301": 10, "1302": 10, "1310": 6, "1320": 6, "2002": 9,
    "2003": 9, "2012": 9, "2013": 9, "2020": 5, "2021": 5, "2030": 5, "2031": 5, "2102": 9, "2103": 9,
    "2120": 5, "2130": 5, "2200": 3, "2201": 3, "2210": 3, "2300": 3, "2301": 3, "2310": 3, "3000": 5,
    "3002": 9, "3011": 5, "3012": 9, "3020": 5, "3021": 5, "3101": 3, "3102": 9, "3110": 3, "3120": 5,
    "3200": 3, "3201": 3, "3210": 3,
}  # fmt: skip

#: the format name of a module stored as sparse-24-bitmask; ``"+<inner format>"`` follows for quantized values
SPARSE_PREFIX = CompressionFormat.SPARSE_24_BITMASK.value

_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def _lut(device: torch.device) -> torch.Tensor:
    """``[256, 4]`` bool: rank code ``sum r_i 4^i`` -> kept positions (rows of impossible codes are unused)."""
    if device not in _LUT_CACHE:
        lut = torch.zeros(256, 4, dtype=torch.bool)
        for ranks, bits in TIE_TABLE.items():
            code = sum(int(r) << (2 * i) for i, r in enumerate(ranks))
            lut[code] = torch.tensor([bool(bits >> i & 1) for i in range(4)])
        _LUT_CACHE[device] = lut.to(device)
    return _LUT_CACHE[device]


def _check_k(x: torch.Tensor) -> None:
    if x.ndim != 2 or x.shape[1] % 4:
        raise ValueError(f"2:4 sparsity needs a 2-D weight with K a multiple of 4, got shape {tuple(x.shape)}")


def magnitude_key(x: torch.Tensor) -> torch.Tensor:
    """The magnitudes the 2:4 rule compares (module docstring): fp32 ``|x|`` for float weights, int16 for
    FP8 (int8 view of the bytes, ``abs`` wrapping at -128) and int8 (``|q|``). Raises ``ValueError`` for
    NaN/inf or another dtype."""
    if x.dtype == torch.float8_e4m3fn:
        b = x.view(torch.int8).to(torch.int16)
        return torch.where(b == -128, b, b.abs())
    if x.dtype == torch.int8:
        return x.to(torch.int16).abs()
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise ValueError("weight holds NaN/inf; 2:4 pruning needs finite values")
        return x.abs()  # exact in the weight's own dtype
    raise ValueError(f"2:4 sparsity does not take dtype {x.dtype}")


def mask24(x: torch.Tensor) -> torch.Tensor:
    """bool ``[R, K]``: the 2 positions each group of 4 along K keeps (module docstring). ``x``: ``[R, K]``,
    K a multiple of 4, float, FP8 or int8. Raises ``ValueError``."""
    _check_k(x)
    key = magnitude_key(x).reshape(x.shape[0], -1, 4)
    m = [key[..., i] for i in range(4)]
    code = torch.zeros(key.shape[:2], dtype=torch.uint8, device=x.device)  # sum r_i 4^i, r_i = #{j: key_j < key_i}
    for i in range(4):
        for j in range(i + 1, 4):
            code += (m[j] < m[i]).to(torch.uint8) << (2 * i)
            code += (m[i] < m[j]).to(torch.uint8) << (2 * j)
    return _lut(x.device)[code.long()].reshape(x.shape)


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    """Non-zero test of the 2:4 structure: ``-0.0`` is zero (FP8: byte & 0x7F != 0)."""
    if x.dtype == torch.float8_e4m3fn:
        return (x.view(torch.uint8) & 0x7F) != 0
    return x != 0


def is_24(x: torch.Tensor) -> bool:
    """Whether every group of 4 along K of ``x`` ``[R, K]`` has at most 2 non-zeros (``-0.0`` counts as zero)."""
    _check_k(x)
    return bool((_nonzero(x).reshape(x.shape[0], -1, 4).sum(-1) <= 2).all())


def prune24(w: torch.Tensor) -> torch.Tensor:
    """Magnitude 2:4 pruning along K: ``w`` ``[R, K]`` (bf16/fp16/fp32, K % 4 == 0) with the two smallest
    ``|w|`` of every group of 4 set to ``+0.0`` (ties: :data:`TIE_TABLE`). A weight that is already 2:4 comes
    back unchanged (same bytes). Raises ``ValueError`` for NaN/inf or a bad shape."""
    if not w.is_floating_point() or w.dtype == torch.float8_e4m3fn:
        raise ValueError(f"2:4 pruning takes bf16/fp16/fp32 weights, got {w.dtype}")
    return torch.where(mask24(w), w, torch.zeros((), dtype=w.dtype, device=w.device))


def pack_bitmask(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[R, K]`` -> uint8 ``[R, ceil(K/8)]``, column ``c`` at bit ``c % 8`` of byte ``c // 8`` (§4.8)."""
    r, k = mask.shape
    pad = -k % 8
    m = torch.nn.functional.pad(mask, (0, pad)) if pad else mask
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=mask.device)
    return (m.reshape(r, -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_bitmask(bits: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitmask`: uint8 ``[R, ceil(K/8)]`` -> bool ``[R, K]``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :k]


def compress24(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``sparse-24-bitmask`` of ``x`` ``[R, K]`` (float, FP8 or int8; K % 4 == 0): ``compressed`` ``[R, K/2]``
    (same dtype) and ``bitmask`` uint8 ``[R, ceil(K/8)]``. Groups with more than 2 non-zeros lose their
    smallest (as compressed-tensors does); callers prune first. Raises ``ValueError``."""
    mask = mask24(x)
    r, k = x.shape
    raw = x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x
    vals = raw[mask].reshape(r, k // 2)
    return {"compressed": vals.view(x.dtype) if vals.dtype != x.dtype else vals, "bitmask": pack_bitmask(mask)}


def decompress24(compressed: torch.Tensor, bitmask: torch.Tensor, shape) -> torch.Tensor:
    """Dense ``[N, K]`` (``compressed``'s dtype, zeros elsewhere) from ``compressed`` ``[N, K/2]`` and
    ``bitmask`` (as compressed-tensors' ``sparse24_bitmask_decompress``). ``shape``: ``(N, K)``, or the
    stored ``[[N], [K]]`` tensor. Raises ``ValueError`` when the mask does not hold 2 bits per group."""
    n, k = (int(v) for v in (shape.reshape(-1).tolist() if isinstance(shape, torch.Tensor) else shape))
    mask = unpack_bitmask(bitmask, k)
    if tuple(compressed.shape) != (n, k // 2) or int(mask.sum()) != n * (k // 2):
        raise ValueError(f"compressed {tuple(compressed.shape)} / bitmask do not describe a 2:4 weight of shape ({n}, {k})")
    raw = compressed.view(torch.uint8) if compressed.dtype == torch.float8_e4m3fn else compressed
    out = torch.zeros((n, k), dtype=raw.dtype, device=compressed.device)
    out[mask] = raw.reshape(-1)
    return out.view(compressed.dtype) if out.dtype != compressed.dtype else out


def bitmask_values(dense: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`decompress24` given the bitmask: ``compressed`` ``[N, K/2]`` of ``dense`` ``[N, K]`` (its
    values at the columns ``bitmask`` marks, in k order; same dtype). Raises ``RuntimeError`` when the mask does not
    mark K/2 columns per row."""
    n, k = dense.shape
    raw = dense.view(torch.uint8) if dense.dtype == torch.float8_e4m3fn else dense
    vals = raw[unpack_bitmask(bitmask, k)].reshape(n, k // 2)
    return vals.view(dense.dtype) if vals.dtype != dense.dtype else vals


@dataclass(frozen=True)
class BitmaskCodec:
    """The sparse-24-bitmask functions a 2:4 kernel layout needs, handed to it as data: ``dense(compressed,
    bitmask, (N, K))`` (:func:`decompress24`), ``values(dense, bitmask)`` (:func:`bitmask_values`), ``pack(mask)``
    (:func:`pack_bitmask`) and ``unpack(bits, k)`` (:func:`unpack_bitmask`)."""

    dense: Callable[..., torch.Tensor]
    values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    pack: Callable[[torch.Tensor], torch.Tensor]
    unpack: Callable[[torch.Tensor, int], torch.Tensor]


#: the one bitmask of sparse-24-bitmask (docs/compressed-tensors-format.md §4.8)
BITMASK = BitmaskCodec(decompress24, bitmask_values, pack_bitmask, unpack_bitmask)


def marlin24_quantize(w: torch.Tensor, group_size: int | None) -> dict[str, torch.Tensor]:
    """The marlin-24 writer's quantization of a dense ``w`` ``(N, K)`` (compressed-tensors 0.14,
    ``Marlin24Compressor.compress``): prune (:func:`prune24`), symmetric int4 scales from the pruned weight in
    its dtype (docs/compressed-tensors-format.md §6.3, as the observer computes them), then the weight and the
    scale cast to fp16 and ``q = clamp(round(fp16(w / s)), -8, 7)``. Returns ``weight`` int8 ``(N, K)`` and
    ``weight_scale`` fp16 ``(N, G)`` (G = K/group_size, or 1 for ``group_size=None``)."""
    pruned = prune24(w)
    scale = quantize_int(pruned, 4, group_size)["weight_scale"].to(torch.float16)
    n, k = w.shape
    g = k if group_size is None else group_size
    x = pruned.to(torch.float16).to(torch.float32).reshape(n, k // g, g) / scale.to(torch.float32).unsqueeze(-1)
    x = x.to(torch.float16).to(torch.float32) + 0.0
    q = torch.round(x.clamp_(-8, 7)).to(torch.int8).reshape(n, k)
    return {"weight": q, "weight_scale": scale}


class Marlin24(WeightFormat):
    """``marlin-24`` (compressed-tensors <= 0.14, vLLM <= 0.15's ``CompressedTensorsW4A16Sparse24``): symmetric int4
    2:4 weights stored in the Sparse-Marlin kernel layout (docs/kernel-layouts.md §9).

    Two steps, because the layout spans every row of the weight: per row chunk, :meth:`quantize` gives the values
    (int8 ``weight`` ``(N, K)``, signed int4, 2:4; fp16 ``weight_scale`` ``(N, G)``: :func:`marlin24_quantize`,
    described by :meth:`outputs`); per whole module they are packed into the stored tensors of
    :meth:`packed_outputs` (``weight_packed``, ``meta``, ``scale_packed``) by the layout math of
    ``ctconvert.layouts.marlin24`` (``marlin24_pack``, inverse ``marlin24_unpack``), which ``--target marlin-24``
    joins to this format (``ctconvert.plan.kernel_targets``)."""

    name = CompressionFormat.MARLIN_24
    required = ("weight_packed", "meta", "scale_packed")

    def outputs(self, shape, dtype, args):
        n, k = shape
        g = 1 if args.group_size is None else k // args.group_size
        return {"weight": (torch.int8, (n, k)), "weight_scale": (torch.float16, (n, g))}

    def packed_outputs(self, shape: tuple[int, int], args) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The stored tensors of an ``(N, K)`` weight: ``weight_packed`` int32 and ``meta`` int16 ``(K/32, 2N)``,
        ``scale_packed`` fp16 ``(G, N)`` (compressed-tensors 0.14, ``Marlin24Compressor.compression_param_info``)."""
        n, k = shape
        g = self.outputs(shape, torch.float16, args)["weight_scale"][1][1]
        return {"weight_packed": (torch.int32, (k // 32, 2 * n)), "meta": (torch.int16, (k // 32, 2 * n)), "scale_packed": (torch.float16, (g, n))}

    def k_multiple(self, args):
        return 128

    def n_multiple(self, args):
        return 128

    def quantize(self, w, args, global_scale=None, impl="auto"):
        if args.num_bits != 4 or args.type != "int" or not args.symmetric:
            raise ValueError("marlin-24 takes symmetric int4 weights")
        return marlin24_quantize(w, args.group_size)

    def dense_shape(self, shapes, args, weight_shape=None):
        k32, n2 = shapes["weight_packed"]
        return n2 // 2, 32 * k32

    def zero_row_floor(self, args, dtype, global_scale=None):
        return 15 * smallest_subnormal(torch.float16), 0.0  # symmetric int4, fp16 scales (as :class:`.integer.PackQuantized`)


class Sparse24Bitmask(WeightFormat):
    """``sparse-24-bitmask`` over an inner quantization format (or none: dense 2:4 values).

    Quantizing a row chunk prunes it (:func:`prune24`), quantizes the pruned rows with the inner format
    (scales see the pruned weight, as after llm-compressor's pruning), then compresses the quantized
    ``weight`` (:func:`compress24`): ``compressed``, ``bitmask`` beside the inner format's other tensors
    (``weight_scale`` ...), and the whole-tensor ``shape``. The inner format must store an unpacked
    ``weight`` (FP8 ``float-quantized``, int8 ``int-quantized``); compressed-tensors 0.14 has no other
    combination (§4.8).
    """

    name = CompressionFormat.SPARSE_24_BITMASK
    required = ("compressed", "bitmask", "shape")

    def __init__(self, inner: WeightFormat | None = None):
        if inner is not None and "weight" not in inner.required:
            raise ValueError(f"sparse-24-bitmask cannot hold {inner.name} weights (it needs an unpacked weight)")
        self.inner = inner

    def outputs(self, shape, dtype, args):
        n, k = shape
        inner = self.inner.outputs(shape, dtype, args) if self.inner else {"weight": (dtype, (n, k))}
        wdt, _ = inner.pop("weight")
        return {"compressed": (wdt, (n, k // 2)), "bitmask": (torch.uint8, (n, math.ceil(k / 8))), "shape": (torch.int64, (2, 1)), **inner}

    def dense_shape(self, shapes, args, weight_shape=None):
        n, half = shapes["compressed"]
        return n, 2 * half

    def row_align(self, args):
        return self.inner.row_align(args) if self.inner else 1

    def k_multiple(self, args):
        """vLLM's CompressedTensors24 reads ``bitmask`` as ``[N, K/8]`` and CUTLASS needs K % 8 (§4.8, kernel-layouts §8.1)."""
        return math.lcm(8, self.inner.k_multiple(args) if self.inner else 1)

    def n_multiple(self, args):
        return self.inner.n_multiple(args) if self.inner else 1

    def scale_flags_nonfinite(self, args):
        return False  # pruning can drop a NaN before any scale sees it: the executor scans the input

    def zero_row_floor(self, args, dtype, global_scale=None):
        return self.inner.zero_row_floor(args, dtype, global_scale) if self.inner else (0.0, 0.0)  # dense 2:4 values: exact

    def quantize(self, w, args, global_scale=None, impl="auto"):
        pruned = prune24(w)
        if self.inner is not None:
            # compressed-tensors 0.14 compressed 2:4 modules whose observers had registered a (zero) weight zero
            # point, and adding it turns a -0.0 weight into +0.0 before the cast (byte 0x00, not the 0x80 of the
            # model-free path; tests/data/sparse24_ct014.safetensors): a quantized 2:4 value has no -0 from a -0
            # weight, so the bitmask's tie order over the FP8 bytes is that of compressed-tensors 0.14. (A negative weight whose
            # quotient underflows fp32 gave +0 there and gives -0 here: no real weight's row spans 2^149.)
            pruned = pruned + 0.0
        out = dict(self.inner.quantize(pruned, args, global_scale, impl)) if self.inner else {"weight": pruned}
        out.update(compress24(out.pop("weight")))
        return out

    def whole_tensor_outputs(self, shape, global_scale):
        inner = self.inner.whole_tensor_outputs(shape, global_scale) if self.inner else {}
        return {"shape": torch.tensor(list(shape), dtype=torch.int64).reshape(2, 1), **inner}

    def dequantize(self, tensors, args, *, dtype=None, impl="auto", out=None):
        n, half = tensors["compressed"].shape
        dense = decompress24(tensors["compressed"], tensors["bitmask"], (n, 2 * half))
        if self.inner is None:
            dense = dense if dtype is None else dense.to(dtype)
            return dense if out is None else out.copy_(dense)
        rest = {p: t for p, t in tensors.items() if p not in ("compressed", "bitmask", "shape")}
        return self.inner.dequantize({"weight": dense, **rest}, args, dtype=dtype, impl=impl, out=out)

    def dequant_spec(self, tensors, args):
        """The inner format's spec over the decompressed codes (zeros at the pruned positions: FP8 and int8 byte 0 is
        the value 0); None for dense 2:4 values (compared exactly) or a mask that does not hold 2 of every 4."""
        if self.inner is None:
            return None
        n, half = tensors["compressed"].shape
        dense = decompress24(tensors["compressed"], tensors["bitmask"], (n, 2 * half))
        rest = {p: t for p, t in tensors.items() if p not in ("compressed", "bitmask", "shape")}
        return self.inner.dequant_spec({"weight": dense, **rest}, args)

    def __repr__(self) -> str:
        return f"<format sparse-24-bitmask over {self.inner.name.value if self.inner else 'dense'}>"


def sparse24_format(inner: WeightFormat | None) -> Sparse24Bitmask:
    """The ``sparse-24-bitmask`` format over ``inner`` (None: dense values). Raises ``ValueError``."""
    return Sparse24Bitmask(inner)
