"""vLLM's Marlin layouts for integer weight-only (WNA16) checkpoints, and their inverses.

Everything here is index math on whole tensors (reshape / permute / ``index_select``
with small index vectors, bytes viewed as int32): no loop runs over elements, no
value is converted, and every function runs unchanged on CUDA tensors (the small
index vectors are moved to the input's device). Every forward transform has an
exact inverse that gives back the input bit for bit.

Sections (§) refer to ``docs/kernel-layouts.md``. Conventions (§0.2): ``K`` = in-features, ``N`` =
out-features, both per tensor-parallel partition; ``pf = 32 // num_bits``; the
GPTQ layout is int32 ``(K/pf, N)`` whose word ``(i, n)`` holds ``W[i*pf + j, n]``
in bits ``[j*bits, (j+1)*bits)``; all int32 words are little-endian.

Layout versions (§0.1, §3.3, §3.4, §12). ``layout_version`` is a vLLM release
string, ``"MAJOR.MINOR"`` or ``"MAJOR.MINOR.PATCH"`` (e.g. ``"0.33"``, ``"0.29.0"``):

* >= 0.25: tile padding (``marlin_padded_nk``, §3.4);
* <  0.25 (e.g. ``"0.21"``): no padding; vLLM rejected shapes with
  ``N % 64 != 0`` or ``K % 128 != 0`` (§3.4, last line), and so do these functions;
* <= 0.29: act-order (``perm`` / ``g_idx``, §3.3) exists; such layers are never
  padded and must have the strict shape above (§3.3, §3.4);
* >= 0.30: act-order is gone (§0.1, PR #54809); passing ``perm`` raises.

Rules are those of vLLM 0.33.0 for every version >= 0.30.

This module holds the weight layouts (GPTQ conversion, tile repack, act-order);
the scales, bias and zero points are in :mod:`.marlin_scales` and the shape
rules in :mod:`.marlin_base` (both re-exported here).

Not implemented: the 8-bit-activation layout (``is_a_8bit``, §3.2), AWQ inputs
(§3.6) and MoE stacks; no reference vectors cover them here.

Errors: every function raises ``ValueError`` for a bad argument (bits not in
{4, 8}, wrong dtype, shape or rank, an invalid ``perm``, a version that does not
allow the request, non-zero padding when ``check_padding`` is on).
"""

from __future__ import annotations

import functools

import torch

from .common import check_tensor, parse_version
from .marlin_base import (
    STRICT_K,
    STRICT_N,
    TILE_K,
    TILE_N,
    check_bits,
    check_group,
    check_positive,
    gather_last,
    inverse,
    marlin_padded_nk,
    pack_words,
    pad2,
    rowmajor,
    scale_dims,
    unpack_words,
    unpad2,
)
from .marlin_scales import (
    marlin_permute_bias,
    marlin_permute_scales,
    marlin_unpermute_bias,
    marlin_unpermute_scales,
    marlin_unzero_points,
    marlin_zero_points,
    scale_perm_for,
    scale_perms,
)
from .versions import DEFAULT_LAYOUT_VERSION

__all__ = [
    "pack_quantized_to_gptq",
    "gptq_to_pack_quantized",
    "marlin_padded_nk",
    "marlin_repack",
    "marlin_unrepack",
    "marlin_sort_g_idx",
    "marlin_permute_scales",
    "marlin_unpermute_scales",
    "marlin_permute_bias",
    "marlin_unpermute_bias",
    "marlin_zero_points",
    "marlin_unzero_points",
    "scale_dims",
    "scale_perm_for",
    "scale_perms",
]

_LAST_ACT_ORDER = (0, 29)  # §0.1, §3.3


def _gptq_unpack(q_w: torch.Tensor, num_bits: int) -> torch.Tensor:
    """GPTQ int32 ``(K/pf, N)`` -> uint8 ``(K, N)`` (§0.2)."""
    rows, n = q_w.shape
    return unpack_words(q_w, num_bits).permute(0, 2, 1).reshape(rows * (32 // num_bits), n)


def _gptq_pack(w: torch.Tensor, num_bits: int) -> torch.Tensor:
    """uint8 ``(K, N)`` -> GPTQ int32 ``(K/pf, N)``, inverse of :func:`_gptq_unpack`."""
    k, n = w.shape
    pf = 32 // num_bits
    return pack_words(w.reshape(k // pf, pf, n).permute(0, 2, 1), num_bits)


@functools.cache
def _tile_src_index(num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each value of a Marlin tile comes from (§3.1), and the inverse map.

    Returns ``(src, inv)``, int64 ``(1024,)`` on the CPU. ``src[w*pf + j]`` is the
    tile-local index ``16-row r * 64 + column c`` of value j (bits ``j*bits``) of
    tile word w; ``inv`` is its inverse permutation.
    """
    th = torch.arange(32).view(32, 1)
    warp = torch.arange(4).view(1, 4)
    r0 = 2 * (th % 4)  # (32, 1)
    c0 = 16 * warp + th // 4  # (32, 4)
    base = r0 * TILE_N + c0  # tile index of a0 for lane (th, warp)
    if num_bits == 4:
        # word 4*th + warp; nibbles a0, a2, b0, b2, a1, a3, b1, b3 (§3.1)
        dr = torch.tensor([0, 8, 0, 8, 1, 9, 1, 9])
        dc = torch.tensor([0, 0, 8, 8, 0, 0, 8, 8])
        src = base.view(32, 4, 1) + (dr * TILE_N + dc).view(1, 1, 8)
    else:
        # words 8*th + 2*warp + h; bytes a0, a2, a1, a3 (h=0) / b0, b2, b1, b3 (h=1) (§3.1)
        dr = torch.tensor([0, 8, 1, 9])
        dc = torch.tensor([0, 8])
        src = base.view(32, 4, 1, 1) + (dc.view(1, 1, 2, 1) + dr.view(1, 1, 1, 4) * TILE_N)
    src = src.reshape(-1)
    inv = torch.empty_like(src)
    inv[src] = torch.arange(src.numel())
    return src, inv


def _check_perm(perm: torch.Tensor, size_k: int, device: torch.device) -> torch.Tensor:
    if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int32, torch.int64) or perm.dim() != 1:
        raise ValueError("perm must be a 1-D int32/int64 tensor (g_idx_sort_indices, §3.3)")
    if perm.numel() != size_k:
        raise ValueError(f"perm must have size_k = {size_k} entries, got {perm.numel()}")
    p = perm.to(device=device, dtype=torch.int64)
    if not torch.equal(torch.sort(p).values, torch.arange(size_k, device=device)):
        raise ValueError("perm is not a permutation of range(size_k) (§3.3)")
    return p


def _resolve_act_order(perm, size_k, size_n, layout_version, device):
    """Validate ``perm`` against the version and shape rules; return int64 perm or None (§3.3)."""
    if perm is None or (isinstance(perm, torch.Tensor) and perm.numel() == 0):
        return None  # vLLM passes an empty perm for "no act-order"
    if parse_version(layout_version) > _LAST_ACT_ORDER:
        raise ValueError(f"act-order (perm) was removed in vLLM 0.30 (§0.1, §3.3); layout_version {layout_version!r} has none")
    if size_n % STRICT_N or size_k % STRICT_K:
        raise ValueError(f"act-order layers are never tile-padded: vLLM <= 0.29 needs N % 64 == 0 and K % 128 == 0 (§3.3, §3.4), got N={size_n}, K={size_k}")
    return _check_perm(perm, size_k, device)


def _k_pack_factor(num_bits: int, size_k: int) -> int:
    """``pf = 32 // num_bits`` of a GPTQ weight of K ``size_k``; ValueError unless K is a positive multiple of pf (§2)."""
    pf = check_bits(num_bits)
    check_positive("size_k", size_k)
    if size_k % pf:
        raise ValueError(f"size_k {size_k} must be a multiple of the pack factor {pf} (§2)")
    return pf


def pack_quantized_to_gptq(weight_packed: torch.Tensor, num_bits: int, size_k: int, *, copy: bool = True) -> torch.Tensor:
    """compressed-tensors ``weight_packed`` -> GPTQ layout (kernel-layouts §2).

    Both layouts pack along K, low bits first, so this is a plain transpose: no
    bits move (§2 "What vLLM does", ``permute_param_layout_``).

    Args:
        weight_packed: int32 ``(N, size_k*num_bits/32)``, the checkpoint tensor
            (value = signed q + 2^(bits-1), §2).
        num_bits: 4 or 8.
        size_k: K; must be a multiple of ``pf = 32 // num_bits`` (vLLM's
            ``marlin_pad_qweight`` derives pf from ``K / rows``).

        copy: False returns the transposed view (no copy): :func:`marlin_repack`
            reads it in place.

    Returns:
        int32 ``(size_k*num_bits//32, N)``, contiguous (a view with ``copy=False``), same device.

    Raises:
        ValueError: bits not in {4, 8}; size_k not positive or not a multiple of
            pf; weight_packed not int32 2-D of that width.
    """
    pf = _k_pack_factor(num_bits, size_k)
    if not isinstance(weight_packed, torch.Tensor) or weight_packed.dim() != 2:
        raise ValueError("weight_packed must be a 2-D tensor (N, K*bits/32) (§2)")
    check_tensor(weight_packed, "weight_packed", torch.int32, (weight_packed.shape[0], size_k // pf))
    return rowmajor(weight_packed.t()) if copy else weight_packed.t()


def gptq_to_pack_quantized(q_w: torch.Tensor, num_bits: int, size_k: int) -> torch.Tensor:
    """GPTQ layout -> compressed-tensors ``weight_packed``; exact inverse of
    :func:`pack_quantized_to_gptq` (kernel-layouts §2).

    Args:
        q_w: int32 ``(size_k*num_bits//32, N)``.
        num_bits: 4 or 8.
        size_k: K, a multiple of ``32 // num_bits``.

    Returns:
        int32 ``(N, size_k*num_bits//32)``, contiguous.

    Raises:
        ValueError: as :func:`pack_quantized_to_gptq`.
    """
    pf = _k_pack_factor(num_bits, size_k)
    if not isinstance(q_w, torch.Tensor) or q_w.dim() != 2:
        raise ValueError("q_w must be a 2-D tensor (K*bits/32, N) (§0.2)")
    check_tensor(q_w, "q_w", torch.int32, (size_k // pf, q_w.shape[1]))
    return rowmajor(q_w.t())


def _repack_dims(size_k, size_n, num_bits, group_size, layout_version, act_order):
    pf = check_bits(num_bits)
    check_positive("size_k", size_k)
    check_positive("size_n", size_n)
    if size_k % pf:
        raise ValueError(f"size_k {size_k} must be a multiple of the pack factor {pf} (§2)")
    if act_order:
        check_group(group_size, size_k)
        return pf, size_n, size_k  # strict shape was checked: never padded (§3.3)
    padded_n, padded_k = marlin_padded_nk(size_n, size_k, group_size, layout_version)
    return pf, padded_n, padded_k


def marlin_repack(
    q_w: torch.Tensor,
    size_k: int,
    size_n: int,
    num_bits: int,
    perm: torch.Tensor | None = None,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
    *,
    group_size: int,
) -> torch.Tensor:
    """``gptq_marlin_repack`` with vLLM's tile padding (kernel-layouts §3.1, §3.3, §3.4).

    Steps: zero-pad the GPTQ weight to ``(padded_k/pf, padded_n)`` (§3.4; from
    vLLM 0.25), reorder the rows by ``perm`` if given (act-order, vLLM <= 0.29:
    ``repack(W, perm) == repack(W[perm, :])``, §3.3), cut into 16x64 tiles emitted
    k-tile-major, and place the values of each tile by the ``mma.m16n8k16`` lane
    math with the interleave ``[0,2,4,6,1,3,5,7]`` (4-bit) / ``[0,2,1,3]`` (8-bit)
    (§3.1). Standard (16-bit activation) layout only, not ``is_a_8bit`` (§3.2).

    Args:
        q_w: int32 GPTQ layout ``(size_k/pf, size_n)`` (§0.2), e.g. from
            :func:`pack_quantized_to_gptq`. Any device.
        size_k: K, unpadded; a multiple of ``pf = 32 // num_bits``.
        size_n: N, unpadded.
        num_bits: 4 (uint4b8 / uint4) or 8 (uint8b128 / uint8).
        perm: act-order ``g_idx_sort_indices``, int32/int64 ``(size_k,)`` (§3.3),
            or None / an empty tensor. Needs ``layout_version <= 0.29`` and
            ``N % 64 == 0``, ``K % 128 == 0`` (no padding with act-order).
        layout_version: vLLM release (module docstring).
        group_size: -1 or the quantization group; only the padding depends on it
            (K is rounded to a multiple of ``lcm(128 or 64, group)``, §3.4).

    Returns:
        int32 ``(padded_k/16, padded_n*16/pf)`` = ``(Kp/16, 2*Np)`` for 4-bit,
        ``(Kp/16, 4*Np)`` for 8-bit; contiguous, on q_w's device.

    Raises:
        ValueError: bad bits/sizes/group/version, q_w not int32 ``(K/pf, N)``,
            an invalid perm, or perm with a version or shape that forbids it.
    """
    act = _resolve_act_order(perm, size_k, size_n, layout_version, getattr(q_w, "device", None))
    pf, padded_n, padded_k = _repack_dims(size_k, size_n, num_bits, group_size, layout_version, act is not None)
    check_tensor(q_w, "q_w", torch.int32, (size_k // pf, size_n))

    if act is None:  # Triton (CUDA) or C (CPU): read q_w in place (padding reads as zero), write the tiles once
        if q_w.is_cuda:
            from . import gpu as impl  # imports Triton: only for CUDA tensors
        else:
            from . import cpu as impl
        if impl.available(q_w):
            return impl.marlin_tiles(q_w.t().unsqueeze(0), num_bits, size_n, size_k, padded_n, padded_k)[0]

    w = _gptq_unpack(q_w, num_bits)  # uint8 (K, N)
    if act is not None:
        w = w.index_select(0, act)  # tile row r of k-tile kt reads source row perm[16*kt + r] (§3.3)
    w = pad2(w, padded_k, padded_n)  # §3.4 step 3

    kt, nt = padded_k // TILE_K, padded_n // TILE_N
    tiles = w.reshape(kt, TILE_K, nt, TILE_N).permute(0, 2, 1, 3)  # (kt, nt, 16, 64), k-tile-major
    src, _ = _tile_src_index(num_bits)
    vals = gather_last(tiles, src).reshape(kt, nt, (TILE_K * TILE_N) // pf, pf)
    return pack_words(vals, num_bits).reshape(kt, nt * (TILE_K * TILE_N) // pf)


def marlin_unrepack(
    marlin_q_w: torch.Tensor,
    size_k: int,
    size_n: int,
    num_bits: int,
    perm: torch.Tensor | None = None,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
    *,
    group_size: int,
    check_padding: bool = True,
) -> torch.Tensor:
    """Exact inverse of :func:`marlin_repack` (kernel-layouts §3.1, §3.3, §3.4).

    Undoes the tile placement, drops the padding and undoes the act-order row
    order, giving back the GPTQ layout bit for bit.

    Args:
        marlin_q_w: int32 ``(padded_k/16, padded_n*16/pf)``.
        size_k, size_n, num_bits, perm, layout_version, group_size: exactly as
            given to :func:`marlin_repack`.
        check_padding: if True (default), raise when the padded rows/columns do
            not hold stored value 0 (vLLM zero-pads, §3.4).

    Returns:
        int32 GPTQ layout ``(size_k/pf, size_n)``, contiguous.

    Raises:
        ValueError: as :func:`marlin_repack`, a wrong input shape/dtype, or
            non-zero padding with ``check_padding``.
    """
    act = _resolve_act_order(perm, size_k, size_n, layout_version, getattr(marlin_q_w, "device", None))
    pf, padded_n, padded_k = _repack_dims(size_k, size_n, num_bits, group_size, layout_version, act is not None)
    kt, nt = padded_k // TILE_K, padded_n // TILE_N
    words_per_tile = (TILE_K * TILE_N) // pf
    check_tensor(marlin_q_w, "marlin_q_w", torch.int32, (kt, nt * words_per_tile))

    vals = unpack_words(marlin_q_w.reshape(kt, nt, words_per_tile), num_bits)  # (kt, nt, T, pf)
    _, inv = _tile_src_index(num_bits)
    tiles = gather_last(vals, inv).reshape(kt, nt, TILE_K, TILE_N)
    w = tiles.permute(0, 2, 1, 3).reshape(padded_k, padded_n)
    w = unpad2(w, size_k, size_n, check_padding, "marlin_q_w")
    if act is not None:
        w = w.index_select(0, inverse(act))
    return _gptq_pack(w, num_bits)


def marlin_sort_g_idx(g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Act-order sort, as vLLM <= 0.29's ``marlin_sort_g_idx`` (kernel-layouts §3.3, §4).

    ``sort_indices = torch.argsort(g_idx)`` (the default, not stable, sort) as
    int32, and ``sorted_g_idx = g_idx[sort_indices]``. Tie order (rows of one
    group) depends on the device the sort runs on: vLLM sorts on the GPU at load
    time, so to verify against a vLLM dump use its ``g_idx_sort_indices`` (§3.3).
    On the CPU (torch 2.13) this reproduces the reference vectors' indices.

    Args:
        g_idx: integer ``(K,)``, e.g. the checkpoint's ``weight_g_idx`` int32.

    Returns:
        ``(sorted_g_idx, sort_indices)``: ``(K,)`` in g_idx's dtype, and int32
        ``(K,)``; on g_idx's device.

    Raises:
        ValueError: g_idx not a 1-D integer tensor.
    """
    if not isinstance(g_idx, torch.Tensor) or g_idx.dim() != 1 or g_idx.is_floating_point() or g_idx.is_complex():
        raise ValueError("g_idx must be a 1-D integer tensor (§3.3)")
    sort_indices = torch.argsort(g_idx).to(torch.int32)
    return g_idx.index_select(0, sort_indices.long()), sort_indices
