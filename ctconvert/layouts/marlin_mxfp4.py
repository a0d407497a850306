"""vLLM's Marlin layout for MXFP4 weights (W4A16), and its inverse.

docs/kernel-layouts.md §5.3: vLLM 0.33.0 runs MXFP4 weights through the same
``prepare_fp4_layer_for_marlin`` as NVFP4 (``is_nvfp4 = False``: no
``weight_global_scale``), ``vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py``:

1. weight: uint8 ``(N, K/2)`` (even k in the low nibble) viewed as int32 ``(N, K/8)``,
   transposed to the GPTQ 4-bit layout, zero-padded and repacked (4 bits, §3.1, §3.4), as for NVFP4;
2. scales: the E8M0 bytes ``(N, K/32)`` are viewed as ``float8_e8m0fnu``, cast to the
   activation dtype, transposed, zero-padded and permuted (``marlin_permute_scales``,
   group 32, §4), then ``mxfp4_marlin_process_scales``: the middle pair of every 4
   consecutive values swapped (``[0,2,1,3]``, for 16-bit activations) and the values
   cast back to ``float8_e8m0fnu``.

Every step is index math except the cast E8M0 -> act dtype -> E8M0, which is applied
here elementwise to the permuted bytes (the permutation only moves values, and a zero
padding byte maps to byte 0 both ways, so the bytes are the same as vLLM's order of
steps). FP8 activations (``input_dtype = float8_e4m3fn``: no reorder, bytes + 6) are
not built: ctconvert's Marlin layouts take 16-bit activations (:func:`.common.act_dtype`).

What cannot be inverted: with ``float16`` activations the cast loses every scale outside
fp16's range: bytes 1..102 (below 2^-24) become 0 and bytes 143..254 (above 2^15) become
inf and then the NaN byte 0xFF; :func:`marlin_mxfp4_lost_scales` says which. With
``bfloat16`` activations every byte 0..255 survives, so the inverse is exact.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .common import act_dtype as act_dtype_of
from .common import check_tensor
from .marlin import gptq_to_pack_quantized, marlin_repack, marlin_unrepack, pack_quantized_to_gptq
from .marlin_nvfp4 import REORDER4, check_fp4
from .marlin_scales import marlin_permute_scales, marlin_unpermute_scales
from .versions import DEFAULT_LAYOUT_VERSION

__all__ = [
    "MXFP4_GROUP_SIZE",
    "e8m0_through",
    "mxfp4_marlin_process_scales",
    "mxfp4_marlin_unprocess_scales",
    "marlin_mxfp4_repack",
    "marlin_mxfp4_unrepack",
    "marlin_mxfp4_lost_scales",
]

MXFP4_GROUP_SIZE = 32


def _reorder4(x: torch.Tensor) -> torch.Tensor:
    """Swap the middle pair of every 4 consecutive values, ``[0,2,1,3]`` (its own inverse)."""
    return x.reshape(-1, 4)[:, list(REORDER4)].reshape(x.shape)


def e8m0_through(byte: torch.Tensor, act_dtype) -> torch.Tensor:
    """E8M0 bytes after vLLM's round trip ``float8_e8m0fnu -> act_dtype -> float8_e8m0fnu`` (§5.3), as uint8.

    Exact for every byte with bfloat16; with float16, bytes whose value 2^(b-127) is not an fp16
    value change (module docstring)."""
    dt = act_dtype_of(act_dtype)
    return byte.view(torch.float8_e8m0fnu).to(dt).to(torch.float8_e8m0fnu).view(torch.uint8)


def mxfp4_marlin_process_scales(permuted_scales: torch.Tensor, act_dtype) -> torch.Tensor:
    """``mxfp4_marlin_process_scales`` for 16-bit activations, with the cast of §5.3 step 2.

    Args:
        permuted_scales: uint8 (or ``float8_e8m0fnu``) E8M0 bytes ``(padded_K/32, padded_N)``
            from ``marlin_permute_scales(group 32)``; padded_N % 4 == 0.
        act_dtype: float16 or bfloat16.

    Returns:
        ``float8_e8m0fnu`` ``(padded_K/32, padded_N)``: reordered ``[0,2,1,3]`` per 4, after the cast.
    """
    check_tensor(permuted_scales, "permuted_scales", (torch.uint8, torch.float8_e8m0fnu), ndim=2)
    if permuted_scales.shape[1] % 4:
        raise ValueError(f"padded_N must be a multiple of 4, got {permuted_scales.shape[1]}")
    b = _reorder4(permuted_scales.view(torch.uint8))
    return e8m0_through(b, act_dtype).view(torch.float8_e8m0fnu)


def mxfp4_marlin_unprocess_scales(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`mxfp4_marlin_process_scales` (exact where the cast was): uint8 permuted bytes."""
    check_tensor(codes, "codes", (torch.uint8, torch.float8_e8m0fnu), ndim=2)
    return _reorder4(codes.view(torch.uint8))


def marlin_mxfp4_repack(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, act_dtype, layout_version: str = DEFAULT_LAYOUT_VERSION
) -> dict[str, torch.Tensor]:
    """compressed-tensors MXFP4 layer -> vLLM's MXFP4 Marlin (W4A16) tensors (§5.3).

    Args:
        weight_packed: ``(N, K/2)`` uint8, two E2M1 codes per byte, even k in the low nibble.
        weight_scale: ``(N, K/32)`` uint8 E8M0 bytes (scale = 2^(byte - 127)).
        act_dtype: float16 or bfloat16.
        layout_version: vLLM release (tile padding from 0.25, §3.4).

    Returns:
        ``marlin_q_w`` int32 ``(padded_K/16, 2*padded_N)`` and ``marlin_scales``
        ``float8_e8m0fnu`` ``(padded_K/32, padded_N)`` (the kernel's ``weight`` and ``weight_scale``).

    Raises:
        TypeError/ValueError: wrong dtypes or shapes, K not a multiple of 32, bad act_dtype or version.
    """
    act_dtype_of(act_dtype)
    n, k = check_fp4(weight_packed, weight_scale, "MXFP4", MXFP4_GROUP_SIZE, (torch.uint8, torch.float8_e8m0fnu), "hold E8M0 bytes (uint8)")
    q_w = pack_quantized_to_gptq(weight_packed.contiguous().view(torch.int32), 4, k, copy=False)  # (K/8, N), a view
    marlin_q_w = marlin_repack(q_w, k, n, 4, None, layout_version, group_size=MXFP4_GROUP_SIZE)
    permuted = marlin_permute_scales(weight_scale.view(torch.uint8).t(), k, n, MXFP4_GROUP_SIZE, layout_version)
    return {"marlin_q_w": marlin_q_w, "marlin_scales": mxfp4_marlin_process_scales(permuted, act_dtype)}


def marlin_mxfp4_unrepack(
    kernel: Mapping[str, torch.Tensor], size_n: int, size_k: int, layout_version: str = DEFAULT_LAYOUT_VERSION
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`marlin_mxfp4_repack`: ``weight_packed`` uint8 ``(N, K/2)`` (bit-exact) and
    ``weight_scale`` uint8 ``(N, K/32)`` (bit-exact unless :func:`marlin_mxfp4_lost_scales` flags an entry).

    Args:
        kernel: ``marlin_q_w`` and ``marlin_scales`` (the repack's output).
        size_n, size_k: the unpadded N and K.

    Raises:
        KeyError: a kernel tensor is missing. ValueError/TypeError: shapes, dtypes or non-zero padding.
    """
    if size_k % MXFP4_GROUP_SIZE:
        raise ValueError(f"size_k must be a multiple of 32, got {size_k}")
    q_w = marlin_unrepack(kernel["marlin_q_w"], size_k, size_n, 4, None, layout_version, group_size=MXFP4_GROUP_SIZE)
    weight_packed = gptq_to_pack_quantized(q_w, 4, size_k).view(torch.uint8)  # (N, K/2)
    perm = mxfp4_marlin_unprocess_scales(kernel["marlin_scales"])
    s = marlin_unpermute_scales(perm, size_k, size_n, MXFP4_GROUP_SIZE, layout_version)
    return {"weight_packed": weight_packed, "weight_scale": s.t().contiguous()}


def marlin_mxfp4_lost_scales(weight_scale: torch.Tensor, act_dtype) -> torch.Tensor:
    """Bool ``(N, K/32)`` mask: True where the Marlin scales cannot give the checkpoint byte back (§5.3 cast)."""
    b = weight_scale.view(torch.uint8)
    return e8m0_through(b, act_dtype) != b
