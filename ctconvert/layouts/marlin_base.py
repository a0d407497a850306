"""What Marlin's integer weight and scale layouts share: the shape rules and the index helpers.

Shape rules (``docs/kernel-layouts.md`` §2, §3.4): the bits (4 or 8, pack factor ``32 // bits``), the group
(-1 for channelwise, else dividing K), the groups of a checkpoint and after padding, vLLM's tile padding
(:func:`marlin_padded_nk`) and the scales' dims (:func:`scale_dims`). Index helpers: int32 words of 4/8-bit
values, little-endian (§0.2), gathers along the last axis, zero padding and its check. Every function raises
``ValueError`` for a bad argument; none converts a value. The layouts themselves are in :mod:`.marlin` (weights)
and :mod:`.marlin_scales` (scales, bias, zero points).
"""

from __future__ import annotations

import math
import sys

import torch

from .common import int_view, parse_version, round_up
from .versions import DEFAULT_LAYOUT_VERSION

__all__ = ["marlin_padded_nk", "scale_dims"]

if sys.byteorder != "little":  # pragma: no cover - every torch target is little-endian
    raise ImportError("ctconvert.layouts.marlin views bytes as int32 words: needs a little-endian host (§0.2)")

_SUPPORTED_BITS = (4, 8)
TILE_K = 16  # tile_k_size (§3)
TILE_N = 64  # tile_n_size (§3)
STRICT_N = 64  # GPTQ_MARLIN_MIN_THREAD_N: shape rule without padding (§3.4)
STRICT_K = 128  # GPTQ_MARLIN_MIN_THREAD_K
_PADDING_SINCE = (0, 25)  # §0.1, §3.4


def check_bits(num_bits: int) -> int:
    if num_bits not in _SUPPORTED_BITS:
        raise ValueError(f"Marlin integer layouts support num_bits 4 and 8 (§3), got {num_bits!r}")
    return 32 // num_bits


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_group(group_size: int, size_k: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"group_size must be -1 (channelwise) or a positive int, got {group_size!r}")
    if 0 < group_size < size_k and size_k % group_size:
        raise ValueError(f"group_size {group_size} does not divide size_k {size_k}: vLLM's Marlin rejects a group that straddles the partition (§3.4)")


def num_groups(size_k: int, group_size: int) -> int:
    """G of the checkpoint (§2): 1 for channelwise or a group covering K, else K / group."""
    return 1 if group_size == -1 or group_size >= size_k else size_k // group_size


def padded_groups(padded_k: int, group_size: int) -> int:
    """G after padding (vLLM's ``marlin_pad_scales``: ``padded_k // group``; §3.4 step 3)."""
    return 1 if group_size == -1 else max(1, padded_k // group_size)


def unpack_words(words: torch.Tensor, num_bits: int) -> torch.Tensor:
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


def pack_words(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """uint8 ``(..., pf)`` -> int32 ``(...)``, the exact inverse of :func:`unpack_words`."""
    out_shape = values.shape[:-1]
    if values.device.type == "meta":  # planning (see unpack_words)
        return torch.empty(out_shape, dtype=torch.int32, device="meta")
    if num_bits == 4:
        v = values.reshape(*out_shape, 4, 2)
        values = v[..., 0] | (v[..., 1] << 4)
    # through 1-D, so the result has plain row-major strides even with size-1 dims
    return values.contiguous().reshape(-1).view(torch.int32).reshape(out_shape)


def inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def gather_last(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[..., idx]`` per chunk of ``len(idx)`` along a flattened view."""
    return x.reshape(-1, idx.numel()).index_select(1, idx.to(x.device))


def rowmajor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with plain row-major strides (``.contiguous()`` keeps odd strides on size-1 dims)."""
    stride, expected = 1, []
    for size in reversed(t.shape):
        expected.append(stride)
        stride *= size
    if t.stride() == tuple(reversed(expected)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def pad2(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor at the bottom and on the right (§3.4 step 3); bit-exact copy."""
    if tuple(x.shape) == (rows, cols):
        return rowmajor(x)
    out = x.new_zeros((rows, cols))
    out[: x.shape[0], : x.shape[1]] = x
    return out


def unpad2(x: torch.Tensor, rows: int, cols: int, check: bool, what: str) -> torch.Tensor:
    if check and tuple(x.shape) != (rows, cols):
        bits = int_view(x)
        if bool(bits[rows:].any()) or bool(bits[:, cols:].any()):
            raise ValueError(f"{what}: the padding region (§3.4) holds non-zero bits; not a tensor built by vLLM")
    return rowmajor(x[:rows, :cols])


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
    check_positive("size_n", size_n)
    check_positive("size_k", size_k)
    check_group(group_size, size_k)
    if parse_version(layout_version) < _PADDING_SINCE:
        if size_n % STRICT_N or size_k % STRICT_K:
            raise ValueError(f"vLLM {layout_version} has no Marlin tile padding and needs N % 64 == 0 and K % 128 == 0 (§3.4), got N={size_n}, K={size_k}")
        return size_n, size_k

    g = group_size if group_size > 0 else 1
    candidates = (
        (round_up(size_n, 64), round_up(size_k, math.lcm(128, g))),
        (round_up(size_n, 128), round_up(size_k, math.lcm(64, g))),
    )
    return min(candidates, key=lambda nk: (nk[0] * nk[1], nk[0] + nk[1]))


def scale_dims(size_k: int, size_n: int, group_size: int, layout_version: str) -> tuple[int, int, int, int]:
    """``(G, padded_n, padded_k, padded_G)`` of a module's scales (§2, §3.4 step 3). Raises ``ValueError``."""
    check_positive("size_k", size_k)
    check_positive("size_n", size_n)
    padded_n, padded_k = marlin_padded_nk(size_n, size_k, group_size, layout_version)
    return num_groups(size_k, group_size), padded_n, padded_k, padded_groups(padded_k, group_size)
