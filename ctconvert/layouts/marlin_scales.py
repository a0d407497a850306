"""vLLM's Marlin layouts of a WNA16 module's scales, bias and zero points, and their exact inverses (§4).

Sections (§) refer to ``docs/kernel-layouts.md``; shapes and padding follow :mod:`.marlin_base`
(versions: the :mod:`.marlin` docstring). Values are moved, never converted; every function runs
unchanged on CUDA tensors and raises ``ValueError`` for a bad argument.
"""

from __future__ import annotations

import functools

import torch

from .common import check_tensor
from .marlin_base import check_bits, gather_last, inverse, pack_words, pad2, scale_dims, unpack_words, unpad2
from .versions import DEFAULT_LAYOUT_VERSION

__all__ = [
    "marlin_permute_bias",
    "marlin_permute_scales",
    "marlin_unpermute_bias",
    "marlin_unpermute_scales",
    "marlin_unzero_points",
    "marlin_zero_points",
    "scale_perm_for",
    "scale_perms",
]


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


def scale_perm_for(group_size: int, padded_k: int) -> torch.Tensor:
    """The scale permutation vLLM applies: ``scale_perm`` for groups smaller than the padded K, else ``scale_perm_single`` (§4)."""
    grouped, single = scale_perms()
    # vLLM: grouped iff group_size != -1 and group_size < size_k, with the *padded* K (§4)
    return grouped if group_size != -1 and group_size < padded_k else single


def _permute_rows(x: torch.Tensor, rows: int, cols: int, perm: torch.Tensor) -> torch.Tensor:
    """Zero-pad 2-D ``x`` to ``(rows, cols)`` (§3.4 step 3), then gather each run of ``len(perm)`` values with ``perm`` (§4)."""
    return gather_last(pad2(x, rows, cols), perm).reshape(rows, cols)


def _unpermute_rows(x: torch.Tensor, rows: int, cols: int, perm: torch.Tensor, check: bool, what: str) -> torch.Tensor:
    """Exact inverse of :func:`_permute_rows`: 2-D ``x`` (the padded shape) back to ``(rows, cols)``; ``check``: padding must be zero."""
    return unpad2(gather_last(x, inverse(perm)).reshape(x.shape), rows, cols, check, what)


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
    return _permute_rows(s, padded_g, padded_n, scale_perm_for(group_size, padded_k))


def marlin_unpermute_scales(
    marlin_s: torch.Tensor, size_k: int, size_n: int, group_size: int, layout_version: str = DEFAULT_LAYOUT_VERSION, *, check_padding: bool = True
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
    return _unpermute_rows(marlin_s, g, size_n, scale_perm_for(group_size, padded_k), check_padding, "marlin_s")


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
    return _permute_rows(b.reshape(1, size_n), 1, padded_n, scale_perms()[1]).reshape(padded_n)


def marlin_unpermute_bias(
    marlin_b: torch.Tensor, size_k: int, size_n: int, group_size: int, layout_version: str = DEFAULT_LAYOUT_VERSION, *, check_padding: bool = True
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
    return _unpermute_rows(marlin_b.reshape(1, padded_n), 1, size_n, scale_perms()[1], check_padding, "marlin_b").reshape(size_n)


def _zp_dims(size_k, size_n, num_bits, group_size, layout_version):
    pf = check_bits(num_bits)
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
    z = unpack_words(zp, num_bits).permute(1, 0, 2).reshape(g, size_n)  # unpack_cols(zp.T): (G, N)
    z = pad2(z, padded_g, padded_n)
    z = gather_last(z, _zp_perm(num_bits)).reshape(padded_g, padded_n // pf, pf)
    return pack_words(z, num_bits)


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
    z = unpack_words(marlin_zp, num_bits).reshape(padded_g, padded_n)
    z = gather_last(z, inverse(_zp_perm(num_bits))).reshape(padded_g, padded_n)
    z = unpad2(z, g, size_n, check_padding, "marlin_zp")
    return pack_words(z.reshape(g, size_n // pf, pf).permute(1, 0, 2), num_bits)
