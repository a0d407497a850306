"""vLLM's Marlin layout for NVFP4 weights (W4A16), and its inverse.

docs/kernel-layouts.md §5.2 (``prepare_fp4_layer_for_marlin``, vLLM 0.33.0
``vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py``). The
weight repack and the scale permutation are the generic Marlin ones of
:mod:`.marlin` (§3, §4); this module adds the S0E5M3 scale codes, the
scale-factor rule and the global scale.

Everything is index math or exact IEEE arithmetic on whole tensors; results
stay on the input's device. ``act_dtype`` and ``layout_version`` as in
:mod:`.marlin_fp8`.

What cannot be inverted (the inverse is exact for everything else, and
:func:`marlin_nvfp4_lost_scales` says which entries are affected):

* scales with ``scale * sf * 128 < 2`` are set to 0 (§5.2 step 3.4), e.g. every
  e4m3 subnormal scale (< 2^-6) for float16 activations; negative, -0.0 and NaN
  scales are not representable either;
* global scales (NVFP4 divisors): vLLM keeps ``1/max(divisors)`` only; the other
  shards' values are gone, and fp32 reciprocal is not injective, so the divisor
  itself comes back exactly only when passed in (``weight_global_scale=``);
  otherwise a divisor that reproduces every kernel tensor bit for bit is returned;
* ``scale_factor`` (sf) must be kept next to the kernel tensors: it is not
  recoverable from them, and the inverse needs it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .common import LayoutTypeError, check_tensor, int_view, parse_version
from .common import act_dtype as act_dtype_of
from .cutlass import reciprocal_preimage
from .marlin import gptq_to_pack_quantized, marlin_repack, marlin_unrepack, pack_quantized_to_gptq
from .marlin_scales import marlin_permute_scales, marlin_unpermute_scales
from .versions import DEFAULT_LAYOUT_VERSION

__all__ = [
    "NVFP4_GROUP_SIZE",
    "REORDER4",
    "nvfp4_scale_factor",
    "nvfp4_scale_factor_from_max",
    "nvfp4_encode_s0e5m3",
    "nvfp4_decode_s0e5m3",
    "nvfp4_marlin_process_scales",
    "nvfp4_marlin_unprocess_scales",
    "nvfp4_marlin_global_scale",
    "nvfp4_marlin_unglobal_scale",
    "marlin_nvfp4_repack",
    "marlin_nvfp4_unrepack",
    "marlin_nvfp4_lost_scales",
]

NVFP4_GROUP_SIZE = 16
_FP8_MAX_SCALED = 448.0 * 128.0  # e4m3 max * 2^7 (§5.2 step 3.2)
_SF_SINCE = (0, 21)  # the NVFP4 scale-factor rule (§5.2 step 3.2, §12)
#: §5.2 step 3.1: the middle pair of every 4 consecutive scales swapped; its own inverse
REORDER4 = (0, 2, 1, 3)


def _reorder4(x: torch.Tensor) -> torch.Tensor:
    """Swap the middle pair of every 4 consecutive values, ``[0,2,1,3]`` (§5.2 step 3.1)."""
    if x.device.type == "meta":
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x.reshape(-1, 4).index_select(1, torch.tensor(REORDER4, device=x.device)).reshape(x.shape)


# =========================================================================== NVFP4 (§5.2)


def _exponent_bias_nvfp4(act_dtype) -> int:
    """b = 2^(e-1) - 2^(2-1): 14 for fp16, 126 for bf16 (§5.2 step 4)."""
    e = 5 if act_dtype_of(act_dtype) == torch.float16 else 8
    return 2 ** (e - 1) - 2 ** (2 - 1)


def nvfp4_scale_factor(scales: torch.Tensor, act_dtype, layout_version: str = DEFAULT_LAYOUT_VERSION) -> torch.Tensor:
    """The power-of-two factor sf of the scale-factor rule (§5.2 step 3.2; vLLM >= 0.21).

    With ``m = max(scales * 128)`` over the entries > 0: ``sf = 2^floor(log2(448*128 / m))``
    if ``m < 448*128``, else 1; always 1 for float16 activations, for vLLM < 0.21,
    and when no entry is > 0. floor(log2) is taken exactly from the fp32 exponent
    (``frexp``), which equals vLLM's ``log2().floor()`` on every e4m3 value.

    Args:
        scales: block scales, any shape, float8_e4m3fn (or its uint8 bytes) /
            fp16 / bf16 / fp32 holding e4m3 values; zero padding does not matter.

    Returns:
        0-dim float32 tensor on the scales' device.
    """
    if scales.dtype == torch.uint8:  # raw e4m3 bytes
        scales = scales.view(torch.float8_e4m3fn)
    if scales.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=scales.device)
    if scales.device.type == "meta":  # planning: a value, not known there (torch's meta kernels would import torch._dynamo)
        return torch.empty((), dtype=torch.float32, device="meta")
    if scales.dtype == torch.float8_e4m3fn:
        # On the bytes: a positive e4m3 value's byte (sign bit clear) orders like the value; 0x7F is NaN
        # (not > 0) and bytes >= 0x80 are negative, so the largest byte below 0x7F is the largest positive value.
        b = scales.view(torch.uint8)
        top = torch.where(b < 0x7F, b, torch.zeros_like(b)).amax()
        return nvfp4_scale_factor_from_max(top.view(torch.float8_e4m3fn).float(), act_dtype, layout_version)
    x = scales.float()
    return nvfp4_scale_factor_from_max(torch.where(x > 0, x, torch.zeros_like(x)).amax(), act_dtype, layout_version)


def nvfp4_scale_factor_from_max(top: torch.Tensor, act_dtype, layout_version: str = DEFAULT_LAYOUT_VERSION) -> torch.Tensor:
    """:func:`nvfp4_scale_factor` from each module's largest positive scale (0 when there is none).

    Args:
        top: any shape, e4m3 values (float8_e4m3fn or any float dtype), >= 0.

    Returns:
        float32, top's shape: one sf per entry (§5.2 step 3.2).
    """
    dt = act_dtype_of(act_dtype)
    one = torch.ones(top.shape, dtype=torch.float32, device=top.device)
    if dt == torch.float16 or parse_version(layout_version) < _SF_SINCE:
        return one
    m = top.float() * 128.0
    _, e = torch.frexp(torch.full_like(m, _FP8_MAX_SCALED) / m)  # ratio = mant * 2^e, mant in [0.5, 1)
    sf = torch.ldexp(one, (e - 1).to(torch.float32))
    return torch.where((m > 0) & (m < _FP8_MAX_SCALED), sf, one)


def nvfp4_encode_s0e5m3(scales: torch.Tensor, scale_factor: torch.Tensor) -> torch.Tensor:
    """Elementwise S0E5M3 encoding (§5.2 steps 3.3-3.5), without the reorder.

    ``h = fp16(fp16(s) * sf) * 128`` (fp16), ``h := 0 where h < 2``; the code is the
    high byte of ``bits(h) << 1``, i.e. ``(bits(h) >> 7) & 0xFF`` (5 exponent and
    3 mantissa bits of fp16, bias 15). Exact on e4m3 values.

    Args:
        scales: e4m3 values in any float dtype, any shape.
        scale_factor: 0-dim (or broadcastable) float32 power of two.

    Returns:
        Same shape, dtype float8_e4m3fn holding the codes (compare as uint8).
    """
    if scales.device.type == "meta":  # planning (see nvfp4_scale_factor)
        return torch.empty(scales.shape, dtype=torch.float8_e4m3fn, device="meta")
    return _encode_s0e5m3(scales, scale_factor)


def _encode_s0e5m3(scales: torch.Tensor, scale_factor: torch.Tensor) -> torch.Tensor:
    h = (scales.to(torch.float16).float() * scale_factor).to(torch.float16)
    h = h * torch.full((), 128.0, dtype=torch.float16, device=h.device)
    h = torch.where(h < 2, torch.zeros_like(h), h)
    code = (h.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def nvfp4_decode_s0e5m3(codes: torch.Tensor, scale_factor: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nvfp4_encode_s0e5m3`: codes -> float8_e4m3fn block scales.

    ``fp16(bits = code << 7) / 128 / sf``, cast to e4m3; exact for every code the
    encoder produces from an e4m3 value that was not flushed to 0.

    Args:
        codes: float8_e4m3fn (or uint8) codes, any shape.
        scale_factor: 0-dim float32, the sf used to encode.
    """
    c = codes.view(torch.uint8).to(torch.int32) << 7
    h = c.to(torch.int16).view(torch.float16)
    return (h.float() / 128.0 / scale_factor).to(torch.float8_e4m3fn)


def nvfp4_marlin_process_scales(permuted_scales: torch.Tensor, act_dtype, layout_version: str = DEFAULT_LAYOUT_VERSION) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4_marlin_process_scales`` with the factor rule (§5.2 step 3).

    Args:
        permuted_scales: ``(padded_K/16, padded_N)`` in ``act_dtype`` (or float8_e4m3fn: the same
            values before vLLM's exact cast), from ``marlin_permute_scales(group 16)``; padded_N % 4 == 0.

    Returns:
        ``(codes, sf)``: float8_e4m3fn ``(padded_K/16, padded_N)`` S0E5M3 codes
        (reordered ``[0,2,1,3]`` per 4), and sf as a 0-dim float32 tensor.
    """
    check_tensor(permuted_scales, "permuted_scales", ndim=2)
    if permuted_scales.shape[1] % 4:
        raise ValueError(f"padded_N must be a multiple of 4, got {permuted_scales.shape[1]}")
    if permuted_scales.dtype == torch.float8_e4m3fn:
        # The scales before vLLM's cast to act_dtype: each code is a function of the byte alone (for one sf),
        # so the 256 e4m3 values are cast and encoded as vLLM's path does, and every scale is looked up;
        # the same codes as the whole-tensor float passes, NaN bytes included.
        b = _reorder4(permuted_scales.view(torch.uint8))
        sf = nvfp4_scale_factor(b.view(torch.float8_e4m3fn), act_dtype, layout_version)
        if b.device.type == "meta":
            return torch.empty(b.shape, dtype=torch.float8_e4m3fn, device="meta"), sf
        every = torch.arange(256, dtype=torch.int32, device=b.device).to(torch.uint8).view(torch.float8_e4m3fn)
        table = nvfp4_encode_s0e5m3(every.to(act_dtype_of(act_dtype)).to(torch.float16), sf).view(torch.uint8)
        return table[b.to(torch.int32)].view(torch.float8_e4m3fn), sf
    h = _reorder4(permuted_scales.to(torch.float16))
    sf = nvfp4_scale_factor(h, act_dtype, layout_version)
    return nvfp4_encode_s0e5m3(h, sf), sf


def nvfp4_marlin_unprocess_scales(codes: torch.Tensor, scale_factor: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nvfp4_marlin_process_scales`: float8_e4m3fn permuted scales.

    Decodes (:func:`nvfp4_decode_s0e5m3`) and undoes the ``[0,2,1,3]`` reorder.
    Flushed entries come back as 0 (module docstring).
    """
    check_tensor(codes, "codes", ndim=2)
    dec = nvfp4_decode_s0e5m3(codes, scale_factor).view(torch.uint8)
    return _reorder4(dec).view(torch.float8_e4m3fn)


def nvfp4_marlin_global_scale(
    weight_global_scale: torch.Tensor, act_dtype, scale_factor: torch.Tensor, dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global scale of the NVFP4 Marlin path (§5.2 intro and step 4).

    ``ct = 1 / max(divisors)`` (fp32, what the compressed-tensors scheme gives the
    kernel), then ``marlin = ct * 2^(b-7) / sf`` with b = 14 (fp16) or 126 (bf16).

    Args:
        weight_global_scale: ``(S,)`` checkpoint divisors, one per fused shard.
        scale_factor: 0-dim float32 sf (or one per module, with ``dim``).
        dim: reduce over this dim only (a batch of modules, one row each).

    Returns:
        ``(ct, marlin)``, 0-dim float32 tensors (one per row with ``dim``).

    Raises:
        TypeError/ValueError: not a non-empty float tensor; bad act_dtype.
    """
    if not isinstance(weight_global_scale, torch.Tensor) or not weight_global_scale.is_floating_point():
        raise LayoutTypeError("weight_global_scale must be a float tensor of divisors")
    if weight_global_scale.numel() == 0:
        raise ValueError("weight_global_scale is empty")
    b = _exponent_bias_nvfp4(act_dtype)
    top = weight_global_scale.max() if dim is None else weight_global_scale.amax(dim=dim)
    if top.device.type == "meta":  # planning (see nvfp4_scale_factor): values unknown there
        ct = torch.empty(top.shape, dtype=torch.float32, device="meta")
        return ct, torch.empty(torch.broadcast_shapes(top.shape, scale_factor.shape), dtype=torch.float32, device="meta")
    ct = 1.0 / top.to(torch.float32)
    return ct, (ct * 2.0 ** (b - 7)) / scale_factor


def nvfp4_marlin_unglobal_scale(marlin_global_scale: torch.Tensor, act_dtype, scale_factor: torch.Tensor) -> torch.Tensor:
    """Inverse of the second half of :func:`nvfp4_marlin_global_scale`: ``ct`` (0-dim fp32).

    Exact unless the forward overflowed to inf."""
    b = _exponent_bias_nvfp4(act_dtype)
    return (marlin_global_scale.to(torch.float32) * scale_factor) / 2.0 ** (b - 7)


def check_fp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor, fmt: str, group: int, scale_dtypes: tuple, scale_rule: str) -> tuple[int, int]:
    """``(N, K)`` of an FP4 module (NVFP4 or MXFP4): ``weight_packed`` uint8 ``(N, K/2)``, two E2M1 codes a byte, and
    ``weight_scale`` ``(N, K/group)`` of one of ``scale_dtypes``.

    Raises ``ValueError`` (``fmt`` and ``group`` name the rule) for empty shapes or K not a multiple of the group,
    ``LayoutTypeError`` (``weight_scale must {scale_rule}``) for another scale dtype."""
    check_tensor(weight_packed, "weight_packed", torch.uint8, ndim=2)
    n, k = weight_packed.shape[0], 2 * weight_packed.shape[1]
    if n == 0 or k == 0 or k % group:
        raise ValueError(f"{fmt} needs non-empty shapes and K % {group} == 0, got (N, K) = ({n}, {k})")
    if weight_scale.dtype not in scale_dtypes:
        raise LayoutTypeError(f"weight_scale must {scale_rule}, got {weight_scale.dtype}")
    check_tensor(weight_scale, "weight_scale", shape=(n, k // group), ndim=2)
    return n, k


def marlin_nvfp4_repack(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    act_dtype,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
) -> dict[str, torch.Tensor]:
    """compressed-tensors NVFP4 layer -> vLLM's NVFP4 Marlin (W4A16) tensors (§5.2).

    Weight: uint8 ``(N, K/2)`` viewed as int32 ``(N, K/8)``, transposed to the GPTQ
    4-bit layout, zero-padded (group 16, §3.4) and repacked (4 bits, §3.1).
    Scales: ``weight_scale.T`` -> act_dtype (exact) -> pad + ``marlin_permute_scales``
    (group 16, §4) -> :func:`nvfp4_marlin_process_scales`.
    Global scale: :func:`nvfp4_marlin_global_scale`.

    Args:
        weight_packed: ``(N, K/2)`` uint8, two E2M1 codes per byte, even k low nibble.
        weight_scale: ``(N, K/16)`` float8_e4m3fn (or its uint8 bytes).
        weight_global_scale: ``(S,)`` float32 divisors (one per fused shard).
        act_dtype: float16 or bfloat16.
        layout_version: vLLM release (padding from 0.25; sf rule from 0.21).

    Returns:
        dict of: ``marlin_q_w`` int32 ``(padded_K/16, 2*padded_N)``,
        ``marlin_scales`` float8_e4m3fn ``(padded_K/16, padded_N)`` (S0E5M3 codes),
        ``marlin_global_scale`` 0-dim fp32 (these three are the kernel's
        ``weight``, ``weight_scale``, ``weight_global_scale``), ``scale_factor``
        0-dim fp32 (needed by the inverse) and ``weight_global_scale_ct`` 0-dim
        fp32 (``1/max(divisors)``).

    Raises:
        TypeError/ValueError: wrong dtypes or shapes, bad act_dtype or version.
    """
    dt = act_dtype_of(act_dtype)
    n, k = check_fp4(weight_packed, weight_scale, "NVFP4", NVFP4_GROUP_SIZE, (torch.float8_e4m3fn, torch.uint8), "be float8_e4m3fn")
    q_w = pack_quantized_to_gptq(weight_packed.contiguous().view(torch.int32), 4, k, copy=False)  # (K/8, N), a view
    marlin_q_w = marlin_repack(q_w, k, n, 4, None, layout_version, group_size=NVFP4_GROUP_SIZE)
    # (K/16, N): permuted as e4m3 bytes (a permutation and zero padding: the values vLLM moves after its
    # exact cast to act_dtype), then encoded from e4m3, without two whole-tensor casts
    s = weight_scale.view(torch.uint8).t()
    permuted = marlin_permute_scales(s, k, n, NVFP4_GROUP_SIZE, layout_version).view(torch.float8_e4m3fn)
    codes, sf = nvfp4_marlin_process_scales(permuted, dt, layout_version)
    ct, gs = nvfp4_marlin_global_scale(weight_global_scale, dt, sf)
    return {
        "marlin_q_w": marlin_q_w,
        "marlin_scales": codes,
        "marlin_global_scale": gs,
        "scale_factor": sf,
        "weight_global_scale_ct": ct,
    }


def marlin_nvfp4_unrepack(
    kernel: Mapping[str, torch.Tensor],
    size_n: int,
    size_k: int,
    act_dtype,
    layout_version: str = DEFAULT_LAYOUT_VERSION,
    weight_global_scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`marlin_nvfp4_repack`: back to the compressed-tensors tensors.

    Args:
        kernel: ``marlin_q_w``, ``marlin_scales``, ``marlin_global_scale`` and
            ``scale_factor`` (the repack's output; sf must have been kept).
        size_n, size_k: the unpadded N and K.
        act_dtype, layout_version: as given to the repack.
        weight_global_scale: the checkpoint divisors, if kept; returned as given.

    Returns:
        ``weight_packed`` uint8 ``(N, K/2)`` (bit-exact), ``weight_scale``
        float8_e4m3fn ``(N, K/16)`` (exact except flushed entries, which are 0;
        see :func:`marlin_nvfp4_lost_scales`), ``weight_global_scale`` float32
        ``(1,)`` divisor (or the one passed in) whose ``1/x`` is ``ct`` bit for bit.

    Raises:
        KeyError: a kernel tensor is missing. ValueError/TypeError: shapes,
        dtypes or non-zero padding do not fit.
    """
    dt = act_dtype_of(act_dtype)
    if size_k % NVFP4_GROUP_SIZE:
        raise ValueError(f"size_k must be a multiple of 16, got {size_k}")
    q_w = marlin_unrepack(kernel["marlin_q_w"], size_k, size_n, 4, None, layout_version, group_size=NVFP4_GROUP_SIZE)
    weight_packed = gptq_to_pack_quantized(q_w, 4, size_k).view(torch.uint8)  # (N, K/2)
    sf = kernel["scale_factor"].to(torch.float32)
    perm_fp8 = nvfp4_marlin_unprocess_scales(kernel["marlin_scales"], sf)
    s = marlin_unpermute_scales(perm_fp8.view(torch.uint8), size_k, size_n, NVFP4_GROUP_SIZE, layout_version)
    weight_scale = s.t().contiguous().view(torch.float8_e4m3fn)
    if weight_global_scale is None:
        ct = nvfp4_marlin_unglobal_scale(kernel["marlin_global_scale"], dt, sf)
        weight_global_scale = reciprocal_preimage(ct).reshape(1)
    return {"weight_packed": weight_packed, "weight_scale": weight_scale, "weight_global_scale": weight_global_scale}


def marlin_nvfp4_lost_scales(weight_scale: torch.Tensor, act_dtype, layout_version: str = DEFAULT_LAYOUT_VERSION) -> torch.Tensor:
    """Bool ``(N, K/16)`` mask: True where the Marlin S0E5M3 codes cannot give the
    checkpoint block scale back bit for bit (flushed below 2/(128*sf), negative,
    -0.0 or NaN; §5.2 step 3). The round trip is exact iff the mask is all False."""
    s = weight_scale.view(torch.float8_e4m3fn)
    sf = nvfp4_scale_factor(s, act_dtype, layout_version)
    back = nvfp4_decode_s0e5m3(nvfp4_encode_s0e5m3(s, sf), sf)
    return int_view(back) != int_view(s.contiguous())
