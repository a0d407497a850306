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

Not implemented: the 8-bit-activation layout (``is_a_8bit``, §3.2), AWQ inputs
(§3.6) and MoE stacks; no reference vectors cover them here.

Errors: every function raises ``ValueError`` for a bad argument (bits not in
{4, 8}, wrong dtype, shape or rank, an invalid ``perm``, a version that does not
allow the request, non-zero padding when ``check_padding`` is on).
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from .common import check_tensor, int_view, parse_version, round_up
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

if sys.byteorder != "little":  # pragma: no cover - every torch target is little-endian
    raise ImportError("ctconvert.layouts.marlin views bytes as int32 words: needs a little-endian host (§0.2)")

_SUPPORTED_BITS = (4, 8)
_TILE_K = 16  # tile_k_size (§3)
_TILE_N = 64  # tile_n_size (§3)
_STRICT_N = 64  # GPTQ_MARLIN_MIN_THREAD_N: shape rule without padding (§3.4)
_STRICT_K = 128  # GPTQ_MARLIN_MIN_THREAD_K
_PADDING_SINCE = (0, 25)  # §0.1, §3.4
_LAST_ACT_ORDER = (0, 29)  # §0.1, §3.3


# --------------------------------------------------------------------------- helpers


def _check_bits(num_bits: int) -> int:
    if num_bits not in _SUPPORTED_BITS:
        raise ValueError(f"Marlin integer layouts support num_bits 4 and 8 (§3), got {num_bits!r}")
    return 32 // num_bits


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_group(group_size: int, size_k: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"group_size must be -1 (channelwise) or a positive int, got {group_size!r}")
    if 0 < group_size < size_k and size_k % group_size:
        raise ValueError(f"group_size {group_size} does not divide size_k {size_k}: vLLM's Marlin rejects a group that straddles the partition (§3.4)")


def _num_groups(size_k: int, group_size: int) -> int:
    """G of the checkpoint (§2): 1 for channelwise or a group covering K, else K / group."""
    return 1 if group_size == -1 or group_size >= size_k else size_k // group_size


def _padded_groups(padded_k: int, group_size: int) -> int:
    """G after padding (vLLM's ``marlin_pad_scales``: ``padded_k // group``; §3.4 step 3)."""
    return 1 if group_size == -1 else max(1, padded_k // group_size)


def _unpack_words(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int32 ``(...)`` -> uint8 ``(..., pf)``: value j of each word = bits ``[j*bits, (j+1)*bits)`` (§0.2)."""
    if words.device.type == "meta":  # planning: torch's meta kernels for & and >> import torch._dynamo on first use (seconds)
        return torch.empty((*words.shape, 32 // num_bits), dtype=torch.uint8, device="meta")
    # through 1-D: a "contiguous" tensor may still carry an odd stride on a size-1 dim
    b = words.contiguous().reshape(-1).view(torch.uint8).reshape(*words.shape, 4)  # little-endian bytes
    if num_bits == 8:
        return b
    # written into one buffer rather than torch.stack'ed: planning runs this on meta tensors, where stack's Python
    # reference imports torch._dynamo (1-2 s at start-up)
    out = torch.empty((*b.shape, 2), dtype=torch.uint8, device=b.device)
    out[..., 0] = b & 0xF
    out[..., 1] = b >> 4
    return out.reshape(*words.shape, 8)


def _pack_words(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """uint8 ``(..., pf)`` -> int32 ``(...)``, the exact inverse of :func:`_unpack_words`."""
    out_shape = values.shape[:-1]
    if values.device.type == "meta":  # planning (see _unpack_words)
        return torch.empty(out_shape, dtype=torch.int32, device="meta")
    if num_bits == 4:
        v = values.reshape(*out_shape, 4, 2)
        values = v[..., 0] | (v[..., 1] << 4)
    # through 1-D, so the result has plain row-major strides even with size-1 dims
    return values.contiguous().reshape(-1).view(torch.int32).reshape(out_shape)


def _gptq_unpack(q_w: torch.Tensor, num_bits: int) -> torch.Tensor:
    """GPTQ int32 ``(K/pf, N)`` -> uint8 ``(K, N)`` (§0.2)."""
    rows, n = q_w.shape
    return _unpack_words(q_w, num_bits).permute(0, 2, 1).reshape(rows * (32 // num_bits), n)


def _gptq_pack(w: torch.Tensor, num_bits: int) -> torch.Tensor:
    """uint8 ``(K, N)`` -> GPTQ int32 ``(K/pf, N)``, inverse of :func:`_gptq_unpack`."""
    k, n = w.shape
    pf = 32 // num_bits
    return _pack_words(w.reshape(k // pf, pf, n).permute(0, 2, 1), num_bits)


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
    base = r0 * _TILE_N + c0  # tile index of a0 for lane (th, warp)
    if num_bits == 4:
        # word 4*th + warp; nibbles a0, a2, b0, b2, a1, a3, b1, b3 (§3.1)
        dr = torch.tensor([0, 8, 0, 8, 1, 9, 1, 9])
        dc = torch.tensor([0, 0, 8, 8, 0, 0, 8, 8])
        src = base.view(32, 4, 1) + (dr * _TILE_N + dc).view(1, 1, 8)
    else:
        # words 8*th + 2*warp + h; bytes a0, a2, a1, a3 (h=0) / b0, b2, b1, b3 (h=1) (§3.1)
        dr = torch.tensor([0, 8, 1, 9])
        dc = torch.tensor([0, 8])
        src = base.view(32, 4, 1, 1) + (dc.view(1, 1, 2, 1) + dr.view(1, 1, 1, 4) * _TILE_N)
    src = src.reshape(-1)
    inv = torch.empty_like(src)
    inv[src] = torch.arange(src.numel())
    return src, inv


@functools.cache
def scale_perms() -> tuple[torch.Tensor, torch.Tensor]:
    """``scale_perm`` (64: ``i + 8j``, an 8x8 transpose) and ``scale_perm_single``
    (32: ``2i + {0,1,8,9,16,17,24,25}``), int64 on the CPU (§4 ``get_scale_perms``)."""
    grouped = (torch.arange(8).view(8, 1) + 8 * torch.arange(8).view(1, 8)).reshape(-1)
    single = (2 * torch.arange(4).view(4, 1) + torch.tensor([0, 1, 8, 9, 16, 17, 24, 25]).view(1, 8)).reshape(-1)
    return grouped, single


@functools.cache
def _zp_perm(num_bits: int) -> torch.Tensor:
    """One 64-entry gather for zero points: ``scale_perm``, then the per-8 (4-bit,
    ``[0,2,4,6,1,3,5,7]``) or per-4 (8-bit, ``[0,2,1,3]``) interleave (§4)."""
    grouped, _ = scale_perms()
    il = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7] if num_bits == 4 else [0, 2, 1, 3])
    n = il.numel()
    pos = (torch.arange(64) // n) * n + il.repeat(64 // n)
    return grouped[pos]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _gather_last(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[..., idx]`` per chunk of ``len(idx)`` along a flattened view."""
    return x.reshape(-1, idx.numel()).index_select(1, idx.to(x.device))


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with plain row-major strides (``.contiguous()`` keeps odd strides on size-1 dims)."""
    stride, expected = 1, []
    for size in reversed(t.shape):
        expected.append(stride)
        stride *= size
    if t.stride() == tuple(reversed(expected)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _pad2(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the bottom and on the right (§3.4 step 3); bit-exact copy."""
    if tuple(x.shape) == (rows, cols):
        return _rowmajor(x)
    out = x.new_zeros((rows, cols))
    out[: x.shape[0], : x.shape[1]] = x
    return out


def _unpad2(x: torch.Tensor, rows: int, cols: int, check: bool, what: str) -> torch.Tensor:
    if check and tuple(x.shape) != (rows, cols):
        bits = int_view(x)
        if bool(bits[rows:].any()) or bool(bits[:, cols:].any()):
            raise ValueError(f"{what}: the padding region (§3.4) holds non-zero bits; not a tensor built by vLLM")
    return _rowmajor(x[:rows, :cols])


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
    if size_n % _STRICT_N or size_k % _STRICT_K:
        raise ValueError(f"act-order layers are never tile-padded: vLLM <= 0.29 needs N % 64 == 0 and K % 128 == 0 (§3.3, §3.4), got N={size_n}, K={size_k}")
    return _check_perm(perm, size_k, device)


# --------------------------------------------------------------------------- §2


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
    pf = _check_bits(num_bits)
    _check_positive("size_k", size_k)
    if size_k % pf:
        raise ValueError(f"size_k {size_k} must be a multiple of the pack factor {pf} (§2)")
    if not isinstance(weight_packed, torch.Tensor) or weight_packed.dim() != 2:
        raise ValueError("weight_packed must be a 2-D tensor (N, K*bits/32) (§2)")
    check_tensor(weight_packed, "weight_packed", torch.int32, (weight_packed.shape[0], size_k // pf))
    return _rowmajor(weight_packed.t()) if copy else weight_packed.t()


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
    pf = _check_bits(num_bits)
    _check_positive("size_k", size_k)
    if size_k % pf:
        raise ValueError(f"size_k {size_k} must be a multiple of the pack factor {pf} (§2)")
    if not isinstance(q_w, torch.Tensor) or q_w.dim() != 2:
        raise ValueError("q_w must be a 2-D tensor (K*bits/32, N) (§0.2)")
    check_tensor(q_w, "q_w", torch.int32, (size_k // pf, q_w.shape[1]))
    return _rowmajor(q_w.t())


# --------------------------------------------------------------------------- §3.4


def marlin_padded_nk(size_n: int, size_k: int, group_size: int, layout_version: str = DEFAULT_LAYOUT_VERSION) -> tuple[int, int]:
    """The ``(padded_n, padded_k)`` vLLM repacks with (kernel-layouts §3.4).

    From vLLM 0.25 (``marlin_padded_nk``; g = group_size, or 1 for channelwise):
    candidates ``(roundup(N, 64), roundup(K, lcm(128, g)))`` and
    ``(roundup(N, 128), roundup(K, lcm(64, g)))``; the smaller ``Np*Kp`` wins,
    then the smaller ``Np+Kp``, then the first. Before 0.25 there is no padding
    and vLLM rejected ``N % 64 != 0`` or ``K % 128 != 0``: the shape is
    returned unchanged or ValueError is raised.

    Args:
        size_n: N (out-features, per partition), > 0.
        size_k: K (in-features, per partition), > 0.
        group_size: -1 (channelwise) or > 0; if ``group_size < K`` it must
            divide K (vLLM's ``check_marlin_supports_layer``).
        layout_version: vLLM release, e.g. ``"0.33"`` (module docstring).

    Returns:
        ``(padded_n, padded_k)`` Python ints.

    Raises:
        ValueError: non-positive sizes, bad group_size, bad version string, or a
            shape that a version without padding rejects.
    """
    _check_positive("size_n", size_n)
    _check_positive("size_k", size_k)
    _check_group(group_size, size_k)
    if parse_version(layout_version) < _PADDING_SINCE:
        if size_n % _STRICT_N or size_k % _STRICT_K:
            raise ValueError(f"vLLM {layout_version} has no Marlin tile padding and needs N % 64 == 0 and K % 128 == 0 (§3.4), got N={size_n}, K={size_k}")
        return size_n, size_k

    g = group_size if group_size > 0 else 1
    candidates = (
        (round_up(size_n, 64), round_up(size_k, math.lcm(128, g))),
        (round_up(size_n, 128), round_up(size_k, math.lcm(64, g))),
    )
    return min(candidates, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def _repack_dims(size_k, size_n, num_bits, group_size, layout_version, act_order):
    pf = _check_bits(num_bits)
    _check_positive("size_k", size_k)
    _check_positive("size_n", size_n)
    if size_k % pf:
        raise ValueError(f"size_k {size_k} must be a multiple of the pack factor {pf} (§2)")
    if act_order:
        _check_group(group_size, size_k)
        return pf, size_n, size_k  # strict shape was checked: never padded (§3.3)
    padded_n, padded_k = marlin_padded_nk(size_n, size_k, group_size, layout_version)
    return pf, padded_n, padded_k


# --------------------------------------------------------------------------- §3.1 / §3.3


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
    w = _pad2(w, padded_k, padded_n)  # §3.4 step 3

    kt, nt = padded_k // _TILE_K, padded_n // _TILE_N
    tiles = w.reshape(kt, _TILE_K, nt, _TILE_N).permute(0, 2, 1, 3)  # (kt, nt, 16, 64), k-tile-major
    src, _ = _tile_src_index(num_bits)
    vals = _gather_last(tiles, src).reshape(kt, nt, (_TILE_K * _TILE_N) // pf, pf)
    return _pack_words(vals, num_bits).reshape(kt, nt * (_TILE_K * _TILE_N) // pf)


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
    kt, nt = padded_k // _TILE_K, padded_n // _TILE_N
    words_per_tile = (_TILE_K * _TILE_N) // pf
    check_tensor(marlin_q_w, "marlin_q_w", torch.int32, (kt, nt * words_per_tile))

    vals = _unpack_words(marlin_q_w.reshape(kt, nt, words_per_tile), num_bits)  # (kt, nt, T, pf)
    _, inv = _tile_src_index(num_bits)
    tiles = _gather_last(vals, inv).reshape(kt, nt, _TILE_K, _TILE_N)
    w = tiles.permute(0, 2, 1, 3).reshape(padded_k, padded_n)
    w = _unpad2(w, size_k, size_n, check_padding, "marlin_q_w")
    if act is not None:
        w = w.index_select(0, _inverse(act))
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


# --------------------------------------------------------------------------- §4 scales and bias


def scale_dims(size_k: int, size_n: int, group_size: int, layout_version: str) -> tuple[int, int, int, int]:
    """``(G, padded_n, padded_k, padded_G)`` of a module's scales (§2, §3.4 step 3). Raises ``ValueError``."""
    _check_positive("size_k", size_k)
    _check_positive("size_n", size_n)
    padded_n, padded_k = marlin_padded_nk(size_n, size_k, group_size, layout_version)
    return _num_groups(size_k, group_size), padded_n, padded_k, _padded_groups(padded_k, group_size)


def scale_perm_for(group_size: int, padded_k: int) -> torch.Tensor:
    """The scale permutation vLLM applies: ``scale_perm`` for groups smaller than the padded K, else ``scale_perm_single`` (§4)."""
    grouped, single = scale_perms()
    # vLLM: grouped iff group_size != -1 and group_size < size_k, with the *padded* K (§4)
    return grouped if group_size != -1 and group_size < padded_k else single


def marlin_permute_scales(s: torch.Tensor, size_k: int, size_n: int, group_size: int, layout_version: str = DEFAULT_LAYOUT_VERSION) -> torch.Tensor:
    """``marlin_pad_scales`` + ``marlin_permute_scales`` (kernel-layouts §3.4, §4).

    Zero-pads ``s`` to ``(padded_G, padded_n)`` with ``padded_G = padded_k / group``
    (1 for channelwise), then gathers each run of 64 values with ``scale_perm``
    (an 8x8 transpose) when ``group_size != -1 and group_size < padded_k``, else
    each run of 32 with ``scale_perm_single`` (§4). Note the padded K: K = group
    = 64 pads to 128, two groups, ``grouped``. Values are moved, never converted.

    Args:
        s: scales ``(G, size_n)`` = the checkpoint's ``weight_scale.T`` (§2),
            G = K/group_size (1 for channelwise or ``group_size >= K``); any dtype
            (fp16/bf16 in practice), kept.
        size_k, size_n: unpadded K and N.
        group_size: -1 or the group.
        layout_version: vLLM release (padding from 0.25, §3.4).

    Returns:
        ``(padded_G, padded_n)``, s's dtype, contiguous.

    Raises:
        ValueError: bad sizes/group/version, s not 2-D ``(G, size_n)``.
    """
    g, padded_n, padded_k, padded_g = scale_dims(size_k, size_n, group_size, layout_version)
    check_tensor(s, "s", None, (g, size_n))
    s = _pad2(s, padded_g, padded_n)
    return _gather_last(s, scale_perm_for(group_size, padded_k)).reshape(padded_g, padded_n)


def marlin_unpermute_scales(
    marlin_s: torch.Tensor,
    size_k: int,
    size_n: int,
    group_size: int,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
    *,
    check_padding: bool = True,
) -> torch.Tensor:
    """Exact inverse of :func:`marlin_permute_scales` (kernel-layouts §4, §3.4).

    Args:
        marlin_s: ``(padded_G, padded_n)``, any dtype.
        size_k, size_n, group_size, layout_version: as given to the forward.
        check_padding: raise if the padded region holds non-zero bits.

    Returns:
        ``(G, size_n)`` in marlin_s's dtype (transpose for the checkpoint's
        ``(N, G)``), contiguous.

    Raises:
        ValueError: bad arguments, a wrong shape, or non-zero padding.
    """
    g, padded_n, padded_k, padded_g = scale_dims(size_k, size_n, group_size, layout_version)
    check_tensor(marlin_s, "marlin_s", None, (padded_g, padded_n))
    inv = _inverse(scale_perm_for(group_size, padded_k))
    s = _gather_last(marlin_s, inv).reshape(padded_g, padded_n)
    return _unpad2(s, g, size_n, check_padding, "marlin_s")


def marlin_permute_bias(b: torch.Tensor, size_k: int, size_n: int, group_size: int, layout_version: str = DEFAULT_LAYOUT_VERSION) -> torch.Tensor:
    """``marlin_pad_dim`` + ``marlin_permute_bias`` (kernel-layouts §3.4, §4).

    Zero-pads the bias to ``padded_n`` (which depends on K and the group, so
    they are arguments) and gathers each run of 32 with ``scale_perm_single``.

    Args:
        b: ``(size_n,)`` bias, any dtype (kept).
        size_k, size_n, group_size, layout_version: the layer's, as for the weight.

    Returns:
        ``(padded_n,)`` in b's dtype, contiguous.

    Raises:
        ValueError: bad arguments or b not ``(size_n,)``.
    """
    _, padded_n, _, _ = scale_dims(size_k, size_n, group_size, layout_version)
    check_tensor(b, "b", None, (size_n,))
    b = _pad2(b.reshape(1, size_n), 1, padded_n)
    return _gather_last(b, scale_perms()[1]).reshape(padded_n)


def marlin_unpermute_bias(
    marlin_b: torch.Tensor,
    size_k: int,
    size_n: int,
    group_size: int,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
    *,
    check_padding: bool = True,
) -> torch.Tensor:
    """Exact inverse of :func:`marlin_permute_bias` (kernel-layouts §4, §3.4).

    Args:
        marlin_b: ``(padded_n,)``.
        size_k, size_n, group_size, layout_version: as given to the forward.
        check_padding: raise if the padded entries hold non-zero bits.

    Returns:
        ``(size_n,)`` in marlin_b's dtype, contiguous.

    Raises:
        ValueError: bad arguments, a wrong shape, or non-zero padding.
    """
    _, padded_n, _, _ = scale_dims(size_k, size_n, group_size, layout_version)
    check_tensor(marlin_b, "marlin_b", None, (padded_n,))
    b = _gather_last(marlin_b, _inverse(scale_perms()[1])).reshape(1, padded_n)
    return _unpad2(b, 1, size_n, check_padding, "marlin_b").reshape(size_n)


# --------------------------------------------------------------------------- §4 zero points


def _zp_dims(size_k, size_n, num_bits, group_size, layout_version):
    pf = _check_bits(num_bits)
    g, padded_n, padded_k, padded_g = scale_dims(size_k, size_n, group_size, layout_version)
    if size_n % pf:
        raise ValueError(f"size_n {size_n} must be a multiple of the pack factor {pf} (vLLM's unpack_cols, §4)")
    return pf, g, padded_n, padded_g


def marlin_zero_points(
    zp: torch.Tensor,
    size_k: int,
    size_n: int,
    num_bits: int,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
    *,
    group_size: int,
) -> torch.Tensor:
    """compressed-tensors ``weight_zero_point`` -> Marlin zero points (kernel-layouts §2, §4, §3.4).

    vLLM's path: ``unpack_cols(zp.T)`` to unsigned ``(G, N)`` (the +2^(bits-1)
    offset is kept, §2), zero-pad to ``(padded_G, padded_n)`` (§3.4 step 3), gather
    each run of 64 with ``scale_perm`` (never the single one), interleave per 8
    (4-bit, ``[0,2,4,6,1,3,5,7]``) or per 4 (8-bit, ``[0,2,1,3]``), then
    ``pack_cols``: pf consecutive columns per int32, low bits first (§4).
    vLLM 0.33's dense Marlin kernel takes zero points only with 4-bit weights;
    8-bit is the ``num_bits=8`` branch of ``marlin_zero_points``.

    Args:
        zp: int32 ``(size_n*num_bits/32, G)``, packed along N (dim 0), low bits
            first (§2); G as for the scales.
        size_k, size_n: unpadded K and N; size_n a multiple of ``32 // num_bits``.
        num_bits: 4 or 8.
        layout_version: vLLM release.
        group_size: -1 or the group (sets G and the padding).

    Returns:
        int32 ``(padded_G, padded_n*num_bits/32)``, contiguous.

    Raises:
        ValueError: bad bits/sizes/group/version, zp not int32 of that shape.
    """
    pf, g, padded_n, padded_g = _zp_dims(size_k, size_n, num_bits, group_size, layout_version)
    check_tensor(zp, "zp", torch.int32, (size_n // pf, g))
    z = _unpack_words(zp, num_bits).permute(1, 0, 2).reshape(g, size_n)  # unpack_cols(zp.T): (G, N)
    z = _pad2(z, padded_g, padded_n)
    z = _gather_last(z, _zp_perm(num_bits)).reshape(padded_g, padded_n // pf, pf)
    return _pack_words(z, num_bits)


def marlin_unzero_points(
    marlin_zp: torch.Tensor,
    size_k: int,
    size_n: int,
    num_bits: int,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
    *,
    group_size: int,
    check_padding: bool = True,
) -> torch.Tensor:
    """Exact inverse of :func:`marlin_zero_points`: back to compressed-tensors
    ``weight_zero_point`` (kernel-layouts §4, §2).

    Args:
        marlin_zp: int32 ``(padded_G, padded_n*num_bits/32)``.
        size_k, size_n, num_bits, layout_version, group_size: as for the forward.
        check_padding: raise if the padded region holds non-zero values.

    Returns:
        int32 ``(size_n*num_bits/32, G)``, contiguous.

    Raises:
        ValueError: bad arguments, a wrong shape/dtype, or non-zero padding.
    """
    pf, g, padded_n, padded_g = _zp_dims(size_k, size_n, num_bits, group_size, layout_version)
    check_tensor(marlin_zp, "marlin_zp", torch.int32, (padded_g, padded_n // pf))
    z = _unpack_words(marlin_zp, num_bits).reshape(padded_g, padded_n)
    z = _gather_last(z, _inverse(_zp_perm(num_bits))).reshape(padded_g, padded_n)
    z = _unpad2(z, g, size_n, check_padding, "marlin_zp")
    return _pack_words(z.reshape(g, size_n // pf, pf).permute(1, 0, 2), num_bits)
