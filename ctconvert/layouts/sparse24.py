"""2:4 sparse kernel layouts: CUTLASS 3.x SM90 (vLLM <= 0.18 ``cutlass_sparse_compress``) and PyTorch's SM80 format.

Both take a dense ``(M, K)`` weight with at most two non-zeros in every group of 4 along K and
return the kept values and the 2-bit index metadata in the order the kernel reads them; both have
exact inverses (:func:`sm90_decompress`, :func:`sm80_decompress`). Pure index math, any device.

* SM90 (docs/kernel-layouts.md §8.1; ``tests/data/testvectors/cutlass_sm90_2of4.safetensors``, made
  with CUTLASS v4.2.1's compressor configured as vLLM 0.18's ``csrc/sparse/cutlass/sparse_scaled_mm_c3x.cuh``
  ``cutlass_sparse_compress``): values ``(M, roundup(K, A)/2)`` (A = 16 for 16-bit, 32 for 8-bit types),
  metadata uint8 ``(roundup(M, 64), roundup(K, 128)/8)`` in 64x16-byte atoms, M-atoms first.
* SM80 (§8.2; PyTorch 2.13 ``torch/sparse/_semi_structured_conversions.py``,
  ``sparse_semi_structured_from_dense_cutlass`` and ``_calculate_meta_reordering_scatter_offsets``):
  values ``(M, K/2)``, metadata int16 ``(M, K/16)`` (fp16/bf16) or int32 ``(M, K/32)`` (int8), scattered
  by a row remap, a 2x2 swap and ColumnMajorInterleaved<2>. The marlin-24 metadata
  (:mod:`.marlin24`) is this format with another row remap: :func:`sm80_meta_offsets` takes the remap.

The zero test ignores the sign bit of float types (``-0.0`` is zero); for int8 only 0 is zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .common import check_tensor, round_up

__all__ = [
    "SM80",
    "SM80_DTYPES",
    "SM90",
    "SM90_DTYPES",
    "Sparse24Layout",
    "negative_zeros",
    "restore_negative_zeros",
    "sm80_compress",
    "sm80_decompress",
    "sm80_meta_offsets",
    "sm80_row_remap",
    "sm90_compress",
    "sm90_decompress",
    "sm90_meta_offsets",
    "sm90_sizes",
    "sm80_check_shape",
]

SM90_DTYPES = (torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
SM80_DTYPES = (torch.float16, torch.bfloat16, torch.int8)

# nonzero pattern of a group (bit i = element i non-zero) -> (idx0, idx1) of the two stored elements.
# Two non-zeros: their positions. Fewer (the degenerate groups of §8.1 / §8.2 differ between the kernels):
_SM90_DEGENERATE = {0b0000: (0, 0), 0b0001: (0, 3), 0b0010: (1, 3), 0b0100: (2, 3), 0b1000: (0, 3)}
_SM80_DEGENERATE = {0b0000: (2, 3), 0b0001: (0, 2), 0b0010: (1, 2), 0b0100: (2, 3), 0b1000: (2, 3)}


def _index_table(degenerate: dict[int, tuple[int, int]], device) -> torch.Tensor:
    """int64 ``[16, 2]``: pattern -> (idx0, idx1); -1 marks patterns with more than two non-zeros."""
    t = torch.full((16, 2), -1, dtype=torch.int64)
    for pat in range(16):
        pos = [i for i in range(4) if pat >> i & 1]
        if len(pos) == 2:
            t[pat] = torch.tensor(pos)
        elif len(pos) < 2:
            t[pat] = torch.tensor(degenerate[pat])
    return t.to(device)


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.int8:
        return x != 0
    bits = x.view({1: torch.uint8, 2: torch.int16}[x.element_size()])
    return (bits & (0x7F if x.element_size() == 1 else 0x7FFF)) != 0


def _select(dense: torch.Tensor, degenerate: dict, zero_degenerate_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (M, K/2), idx (M, K/4, 2))`` of a 2:4 weight; ``ValueError`` for a group with > 2 non-zeros."""
    m, k = dense.shape
    nz = _nonzero(dense).reshape(m, k // 4, 4)
    pat = (nz.to(torch.int64) << torch.arange(4, device=dense.device)).sum(-1)
    idx = _index_table(degenerate, dense.device)[pat]
    if bool((idx < 0).any()):
        r, g = (idx[..., 0] < 0).nonzero()[0].tolist()
        raise ValueError(f"row {r}, columns {4 * g}..{4 * g + 3} hold more than 2 non-zeros: not 2:4 sparse")
    raw = dense.view(torch.uint8) if dense.dtype == torch.float8_e4m3fn else dense
    vals = raw.reshape(m, k // 4, 4).gather(-1, idx)
    if zero_degenerate_values:  # SM90 stores +0 where a group has fewer than two non-zeros
        keep = nz.gather(-1, idx)
        vals = torch.where(keep, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
    vals = vals.reshape(m, k // 2)
    return (vals.view(dense.dtype) if vals.dtype != dense.dtype else vals), idx


def _place(values: torch.Tensor, idx: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Dense ``(m, k)`` from values ``(m, >=k/2)`` and indices ``(m, k/4, 2)`` (zeros elsewhere)."""
    raw = values.view(torch.uint8) if values.dtype == torch.float8_e4m3fn else values
    raw = raw[:, : k // 2].reshape(m, k // 4, 2)
    out = torch.zeros((m, k // 4, 4), dtype=raw.dtype, device=values.device)
    out.scatter_(-1, idx[..., 1:], raw[..., 1:])
    out.scatter_(-1, idx[..., :1], raw[..., :1])  # a degenerate (0, 0) pair: the first value wins (both are 0)
    out = out.reshape(m, k)
    return out.view(values.dtype) if out.dtype != values.dtype else out


# ------------------------------------------------------------------ SM90 (§8.1)


def sm90_sizes(m: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(values columns, meta rows, meta columns)`` of an ``(m, k)`` weight in the SM90 layout."""
    align = 32 if dtype in (torch.int8, torch.float8_e4m3fn) else 16
    return round_up(k, align) // 2, round_up(m, 64), round_up(k, 128) // 8


def sm90_meta_offsets(me: int, ke: int, sixteen_bit: bool, device=None) -> torch.Tensor:
    """int64 ``(me, ke)``: the byte offset of logical metadata byte ``(m, b)`` in the SM90 buffer (§8.1)."""
    m = torch.arange(me, device=device).reshape(-1, 1)
    b = torch.arange(ke, device=device).reshape(1, -1)
    atom = ((b // 16) * (me // 64) + m // 64) * 1024
    r, c = m % 64, b % 16
    if not sixteen_bit:
        return atom + 16 * r + c
    r0, r1, r2 = r % 8, (r // 8) % 2, r // 16
    c0, c1, c2 = c % 2, (c // 2) % 2, c // 4
    return atom + c0 + 2 * r1 + 4 * c2 + 16 * r0 + 128 * c1 + 256 * r2


def sm90_compress(dense: torch.Tensor) -> dict[str, torch.Tensor]:
    """``cutlass_sparse_compress`` of a 2:4 ``dense`` ``(M, K)`` (fp16/bf16/int8/fp8, K % 4 == 0 here; vLLM
    itself needs K % 8): ``values`` ``(M, roundup(K, A)/2)`` same dtype, ``meta`` uint8
    ``(roundup(M, 64), roundup(K, 128)/8)``. Raises ``ValueError`` (not 2:4, shape) or ``LayoutTypeError``."""
    check_tensor(dense, "dense", SM90_DTYPES, ndim=2)
    m, k = dense.shape
    if k % 4:
        raise ValueError(f"K={k} is not a multiple of 4")
    vk, me, ke = sm90_sizes(m, k, dense.dtype)
    vals, idx = _select(dense, _SM90_DEGENERATE, zero_degenerate_values=True)
    values = torch.zeros((m, vk), dtype=dense.dtype, device=dense.device)
    values[:, : k // 2] = vals
    code = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.uint8)  # (m, k/4)
    logical = torch.zeros((me, ke * 2), dtype=torch.uint8, device=dense.device)
    logical[:m, : k // 4] = code
    logical = logical[:, 0::2] | (logical[:, 1::2] << 4)  # (me, ke): group 2b low nibble, 2b+1 high
    meta = torch.zeros(me * ke, dtype=torch.uint8, device=dense.device)
    meta[sm90_meta_offsets(me, ke, dense.element_size() == 2, dense.device).reshape(-1)] = logical.reshape(-1)
    return {"values": values, "meta": meta.reshape(me, ke)}


def sm90_decompress(values: torch.Tensor, meta: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Inverse of :func:`sm90_compress`: the dense ``(m, k)`` weight (degenerate groups' zeros as +0.0)."""
    check_tensor(values, "values", SM90_DTYPES, ndim=2)
    vk, me, ke = sm90_sizes(m, k, values.dtype)
    check_tensor(values, "values", shape=(m, vk))
    check_tensor(meta, "meta", torch.uint8, shape=(me, ke))
    logical = meta.reshape(-1)[sm90_meta_offsets(me, ke, values.element_size() == 2, meta.device)]
    codes = torch.stack((logical & 0xF, logical >> 4), -1).reshape(me, 2 * ke)[:m, : k // 4].to(torch.int64)
    idx = torch.stack((codes & 3, codes >> 2), -1)
    return _place(values, idx, m, k)


# ------------------------------------------------------------------ SM80 (§8.2) and its row remaps


def sm80_row_remap(rows: torch.Tensor, meta_dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's remap: ``r//g*g + (r%8)*w + (r%g)//8`` (g = 32, w = 4 for int16; g = 16, w = 2 for int32)."""
    g, w = (32, 4) if meta_dtype == torch.int16 else (16, 2)
    return rows // g * g + (rows % 8) * w + (rows % g) // 8


def sm80_meta_offsets(m: int, ncols: int, remap, device=None) -> torch.Tensor:
    """int64 ``(m, ncols)``: the element offset of logical meta element ``(r, c)`` (remap, 2x2 swap,
    ColumnMajorInterleaved<2>: ``(c//2)*2m + 2r + c%2``). ``remap``: rows -> remapped rows."""
    r = remap(torch.arange(m, device=device).reshape(-1, 1)).expand(m, ncols)
    c = torch.arange(ncols, device=device).reshape(1, -1).expand(m, ncols)
    shift = ((r % 2 == 0) & (c % 2 == 1)).to(torch.int64) - ((r % 2 == 1) & (c % 2 == 0)).to(torch.int64)
    r, c = r + shift, c - shift
    return (c // 2) * 2 * m + 2 * r + c % 2


def _sm80_meta_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int32 if dtype == torch.int8 else torch.int16


def sm80_pack_codes(idx: torch.Tensor, meta_dtype: torch.dtype) -> torch.Tensor:
    """Group codes ``idx0 | idx1 << 2`` of ``idx`` ``(M, K/4, 2)`` packed 4 (int16) or 8 (int32) per element, low first."""
    m, groups, _ = idx.shape
    per = 4 if meta_dtype == torch.int16 else 8
    code = (idx[..., 0] | (idx[..., 1] << 2)).reshape(m, groups // per, per)
    word = (code << (4 * torch.arange(per, device=idx.device))).sum(-1)  # int64, < 2^32
    if meta_dtype == torch.int16:
        return torch.where(word >= 2**15, word - 2**16, word).to(torch.int16)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def sm80_unpack_codes(meta: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`sm80_pack_codes`: int64 ``(M, groups, 2)`` indices."""
    m = meta.shape[0]
    per = 4 if meta.dtype == torch.int16 else 8
    word = meta.to(torch.int64) & ((1 << (4 * per)) - 1)
    code = (word.unsqueeze(-1) >> (4 * torch.arange(per, device=meta.device))) & 0xF
    code = code.reshape(m, groups)
    return torch.stack((code & 3, code >> 2), -1)


def sm80_check_shape(m: int, k: int, dtype: torch.dtype) -> None:
    """``ValueError`` unless PyTorch's SM80 converter takes an ``(m, k)`` weight of ``dtype`` (see :func:`sm80_compress`)."""
    md = _sm80_meta_dtype(dtype)
    per = 4 if md == torch.int16 else 8
    if m % (32 if md == torch.int16 else 16):
        raise ValueError(f"M={m} is not a multiple of {32 if md == torch.int16 else 16} (SM80 2:4 format)")
    if k % (4 * per * 2):
        raise ValueError(f"K={k} is not a multiple of {4 * per * 2} (SM80 2:4 format)")


def sm80_compress(dense: torch.Tensor, remap=None) -> dict[str, torch.Tensor]:
    """PyTorch's SM80 2:4 format of ``dense`` ``(M, K)`` (fp16/bf16/int8): ``values`` ``(M, K/2)``, ``meta``
    int16 ``(M, K/16)`` or int32 ``(M, K/32)``. ``remap``: the metadata row remap (default PyTorch's;
    marlin-24 passes its own). Shape rules (PyTorch's converter): M % 32 (16-bit) or M % 16 (int8), K % 32
    (16-bit) or K % 64 (int8): an even number of meta columns. Raises ``ValueError``/``LayoutTypeError``."""
    check_tensor(dense, "dense", SM80_DTYPES, ndim=2)
    m, k = dense.shape
    md = _sm80_meta_dtype(dense.dtype)
    sm80_check_shape(m if remap is None else 32, k, dense.dtype)
    if remap is None:
        remap = lambda r: sm80_row_remap(r, md)  # noqa: E731
    vals, idx = _select(dense, _SM80_DEGENERATE, zero_degenerate_values=False)
    logical = sm80_pack_codes(idx, md)
    meta = torch.empty(logical.numel(), dtype=md, device=dense.device)
    meta[sm80_meta_offsets(m, logical.shape[1], remap, dense.device).reshape(-1)] = logical.reshape(-1)
    return {"values": vals.contiguous(), "meta": meta.reshape(logical.shape)}


def sm80_decompress(values: torch.Tensor, meta: torch.Tensor, remap=None) -> torch.Tensor:
    """Inverse of :func:`sm80_compress`: the dense ``(M, K)`` weight (the values at the stored indices)."""
    check_tensor(values, "values", SM80_DTYPES, ndim=2)
    m, half = values.shape
    k = 2 * half
    md = _sm80_meta_dtype(values.dtype)
    check_tensor(meta, "meta", md, shape=(m, k // (16 if md == torch.int16 else 32)))
    if remap is None:
        remap = lambda r: sm80_row_remap(r, md)  # noqa: E731
    logical = meta.reshape(-1)[sm80_meta_offsets(m, meta.shape[1], remap, meta.device)]
    return _place(values, sm80_unpack_codes(logical, k // 4), m, k)


# ------------------------------------------------------------------ the two CUTLASS 2:4 layouts as parameters of one kernel


def negative_zeros(values: torch.Tensor) -> torch.Tensor:
    """bool, ``values``' shape: where ``values`` holds a ``-0.0`` (the kernels store zeros as +0.0; a caller keeps
    these positions for the exact inverse). int8: none."""
    if values.dtype == torch.int8:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    bits = values.view({1: torch.uint8, 2: torch.int16}[values.element_size()]).to(torch.int32) & 0xFFFF
    return bits == (0x80 if values.element_size() == 1 else 0x8000)


def restore_negative_zeros(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`negative_zeros`: ``values`` with ``-0.0`` where ``mask`` (bool, same shape) is set."""
    if values.dtype == torch.int8:
        return values
    return torch.where(mask, torch.full((), -0.0, dtype=values.dtype, device=values.device), values)


def _sm90_planned(m: int, k: int, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, int]]]:
    vk, me, ke = sm90_sizes(m, k, dtype)
    return {"weight": (dtype, (m, vk)), "meta": (torch.uint8, (me, ke))}


def _sm80_planned(m: int, k: int, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, int]]]:
    sm80_check_shape(m, k, dtype)
    md = _sm80_meta_dtype(dtype)
    return {"weight": (dtype, (m, k // 2)), "meta": (md, (m, k // (32 if md == torch.int32 else 16)))}


@dataclass(frozen=True)
class Sparse24Layout:
    """One CUTLASS 2:4 layout, the parameters of the 2:4 kernel (``ctconvert.layouts.kernels.Sparse24Kernel``):
    ``arch`` (``SM90`` | ``SM80``, for messages), the value ``dtypes`` it takes, ``compress(dense) -> {values, meta}``,
    ``decompress(values, meta, m, k) -> dense`` and ``planned(m, k, dtype) -> {"weight"|"meta": (dtype, shape)}``
    (the shapes without any data; ``ValueError`` for a shape the layout rejects)."""

    arch: str
    dtypes: tuple[torch.dtype, ...]
    compress: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    decompress: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
    planned: Callable[[int, int, torch.dtype], dict[str, tuple[torch.dtype, tuple[int, int]]]]


#: vLLM <= 0.18's ``cutlass_sparse_compress`` (§8.1)
SM90 = Sparse24Layout("SM90", SM90_DTYPES, sm90_compress, sm90_decompress, _sm90_planned)
#: PyTorch's SM80 semi-structured layout (§8.2)
SM80 = Sparse24Layout("SM80", SM80_DTYPES, sm80_compress, lambda values, meta, m, k: sm80_decompress(values, meta), _sm80_planned)
