"""vLLM's Marlin layouts for floating-point weights: FP8 (W8A16) and NVFP4 (W4A16).

kernel-layouts.md §5.1 (FP8, ``prepare_fp8_layer_for_marlin``) and §5.2 (NVFP4,
``prepare_fp4_layer_for_marlin``), vLLM 0.33.0 rules. The weight repack and the
scale permutation are the generic Marlin ones of :mod:`.marlin` (§3, §4); this
module adds the float-specific steps: FP8 byte packing and the exponent-bias
folding of the scales, the NVFP4 S0E5M3 scale codes, the scale-factor rule and
the global scale.

Everything is index math or exact IEEE arithmetic on whole tensors (powers of two,
casts that are exact on the values involved, bit views): no Python loop over
elements, no host synchronisation, results on the input's device, so the functions
run unchanged on CUDA tensors. ``act_dtype`` is the model / activation dtype
(``torch.float16`` or ``torch.bfloat16``, or the strings ``"float16"`` /
``"bfloat16"``). ``layout_version`` is a vLLM release string as in :mod:`.marlin`.

What cannot be inverted (the ``*_unrepack`` functions are exact for everything
else, and :func:`marlin_fp8_lost_scales` / :func:`marlin_nvfp4_lost_scales` say
which checkpoint entries are affected):

* FP8 scales: the cast to ``act_dtype`` (§5.1 step 2) rounds fp32 (or the other
  16-bit type) scales; the x2^8 fold overflows fp16 scales above 255.875 to inf
  (§5.1 step 4; x2^120 overflows bf16 scales >= 2^8). Per-tensor scales of fused
  shards are recovered from the first row of each shard (needs ``logical_widths``).
* NVFP4 scales: entries with ``scale * sf * 128 < 2`` are set to 0 (§5.2 step
  3.4), e.g. every e4m3 subnormal scale (< 2^-6) for float16 activations;
  negative, -0.0 and NaN scales are not representable either.
* Global scales (NVFP4 divisors): vLLM keeps ``1/max(divisors)`` only; the other
  shards' values are gone, and fp32 reciprocal is not injective, so the divisor
  itself comes back exactly only when passed in (``weight_global_scale=``);
  otherwise a divisor that reproduces every kernel tensor bit for bit is returned.
  ``scale_factor`` (sf) must be kept next to the kernel tensors: it is not
  recoverable from them, and the inverse needs it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from .cutlass import reciprocal_preimage
from .marlin import (
    gptq_to_pack_quantized,
    marlin_permute_scales,
    marlin_repack,
    marlin_unpermute_scales,
    marlin_unrepack,
    pack_quantized_to_gptq,
)

__all__ = [
    "NVFP4_GROUP_SIZE",
    "fp8_exponent_bias",
    "fp8_fold_exponent_bias",
    "fp8_unfold_exponent_bias",
    "fp8_expand_scales",
    "fp8_collapse_scales",
    "marlin_fp8_permuted_scales",
    "marlin_fp8_repack",
    "marlin_fp8_unrepack",
    "marlin_fp8_lost_scales",
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
_REORDER4 = (0, 2, 1, 3)  # §5.2 step 3.1; its own inverse


# --------------------------------------------------------------------------- helpers


def _act_dtype(act_dtype) -> torch.dtype:
    names = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16}
    dt = names.get(act_dtype.removeprefix("torch.")) if isinstance(act_dtype, str) else act_dtype
    if dt not in (torch.float16, torch.bfloat16):
        raise ValueError(f"act_dtype must be float16 or bfloat16 (16-bit activations, §5.1/§5.2), got {act_dtype!r}")
    return dt


def _version(layout_version: str) -> tuple[int, int]:
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:[.+-].*)?", str(layout_version).strip())
    if m is None:
        raise ValueError(f"layout_version must be a vLLM release like '0.33' or '0.29.0', got {layout_version!r}")
    return int(m.group(1)), int(m.group(2))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _check_2d(t, name: str, dtype: torch.dtype | None, shape: tuple[int, int] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.ndim != 2 or (shape is not None and tuple(t.shape) != tuple(shape)):
        want = shape if shape is not None else "2-D"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _reorder4(x: torch.Tensor) -> torch.Tensor:
    """Swap the middle pair of every 4 consecutive values, ``[0,2,1,3]`` (§5.2 step 3.1)."""
    return x.reshape(-1, 4)[:, list(_REORDER4)].reshape(x.shape)


# =========================================================================== FP8 (§5.1)


def fp8_exponent_bias(act_dtype) -> int:
    """b = 2^(e-1) - 2^(4-1) with e the exponent width of ``act_dtype``: 8 (fp16), 120 (bf16) (§5.1 step 4)."""
    e = 5 if _act_dtype(act_dtype) == torch.float16 else 8
    return 2 ** (e - 1) - 2 ** (4 - 1)


def fp8_fold_exponent_bias(scales: torch.Tensor) -> torch.Tensor:
    """``fp8_fused_exponent_bias_into_scales``: ``scales * 2^b`` in the scales' dtype (§5.1 step 4).

    Args:
        scales: fp16 or bf16, any shape (the permuted ``(1, padded_N)`` scales).

    Returns:
        Same shape and dtype. Exact, except that fp16 values above 255.875 (bf16:
        >= 2^8) overflow to inf, as in vLLM.

    Raises:
        ValueError: scales not fp16/bf16.
    """
    b = fp8_exponent_bias(scales.dtype)
    return scales * torch.full((), 2.0**b, dtype=scales.dtype, device=scales.device)


def fp8_unfold_exponent_bias(marlin_scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp8_fold_exponent_bias`: ``* 2^-b``; exact for finite values (inf stays inf)."""
    b = fp8_exponent_bias(marlin_scales.dtype)
    return (marlin_scales.float() * 2.0**-b).to(marlin_scales.dtype)


def _fp8_widths(weight_scale: torch.Tensor, size_n: int, logical_widths: Sequence[int] | None):
    """(strategy, widths) of a FP8 checkpoint scale (§5.1 step 2)."""
    if weight_scale.ndim == 2 and tuple(weight_scale.shape) == (size_n, 1) and size_n != 1:
        return "channel", None
    if weight_scale.ndim > 1 and weight_scale.numel() != 1:
        raise ValueError(
            f"weight_scale must be (N, 1) per channel or (S,) per tensor/shard, got {tuple(weight_scale.shape)} "
            "(block-wise FP8 scales are not supported)"
        )
    s = weight_scale.numel()
    if logical_widths is None:
        if s == 0 or size_n % s:
            raise ValueError(f"{s} per-tensor scales do not divide N={size_n}; pass logical_widths")
        widths = [size_n // s] * s
    else:
        widths = [int(w) for w in logical_widths]
        if len(widths) != s or sum(widths) != size_n or min(widths, default=0) <= 0:
            raise ValueError(f"logical_widths {widths} must have {s} positive entries summing to N={size_n}")
    return "tensor", widths


def fp8_expand_scales(
    weight_scale: torch.Tensor, size_n: int, act_dtype, logical_widths: Sequence[int] | None = None
) -> torch.Tensor:
    """Checkpoint FP8 scales -> one ``act_dtype`` scale per output row (§5.1 step 2, §7.1).

    vLLM loads the scale as fp32, expands a per-tensor scale over the rows of its
    fused shard (``convert_to_channelwise``), then casts to ``act_dtype`` (the only
    rounding step).

    Args:
        weight_scale: ``(N, 1)`` (strategy channel), or ``(S,)`` / ``()`` / ``(1, 1)``
            (strategy tensor, one per fused shard); fp32, fp16 or bf16.
        size_n: N.
        act_dtype: float16 or bfloat16.
        logical_widths: rows of each shard (sum N); default: S equal shards.

    Returns:
        ``(N,)`` in ``act_dtype``.

    Raises:
        TypeError: not a float tensor. ValueError: shape/widths inconsistent, bad act_dtype.
    """
    dt = _act_dtype(act_dtype)
    if not isinstance(weight_scale, torch.Tensor) or not weight_scale.is_floating_point():
        raise TypeError(f"weight_scale must be a float tensor, got {getattr(weight_scale, 'dtype', weight_scale)}")
    strategy, widths = _fp8_widths(weight_scale, size_n, logical_widths)
    s = weight_scale.to(torch.float32).reshape(-1)
    if strategy == "tensor":
        reps = torch.tensor(widths, dtype=torch.long, device=s.device)
        s = s.repeat_interleave(reps, output_size=size_n)
    return s.to(dt)


def fp8_collapse_scales(
    scales_n: torch.Tensor,
    strategy: str = "channel",
    logical_widths: Sequence[int] | None = None,
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Inverse of :func:`fp8_expand_scales` (up to its rounding, see the module docstring).

    Args:
        scales_n: ``(N,)`` per-row scales.
        strategy: ``"channel"`` -> ``(N, 1)``; ``"tensor"`` -> ``(S,)``, the first
            row of each shard of ``logical_widths`` (default: one shard).
        scale_dtype: dtype of the result (default: that of ``scales_n``).

    Raises:
        ValueError: unknown strategy or widths that do not sum to N.
    """
    n = scales_n.numel()
    s = scales_n.reshape(n)
    if strategy == "channel":
        out = s.reshape(n, 1)
    elif strategy == "tensor":
        widths = [n] if logical_widths is None else [int(w) for w in logical_widths]
        if sum(widths) != n or min(widths, default=0) <= 0:
            raise ValueError(f"logical_widths {widths} must be positive and sum to N={n}")
        starts = [sum(widths[:i]) for i in range(len(widths))]
        out = s.index_select(0, torch.tensor(starts, dtype=torch.long, device=s.device))
    else:
        raise ValueError(f"strategy must be 'channel' or 'tensor', got {strategy!r}")
    out = out.contiguous()
    return out if scale_dtype is None else out.to(scale_dtype)


def marlin_fp8_permuted_scales(
    weight_scale: torch.Tensor,
    size_k: int,
    size_n: int,
    act_dtype,
    logical_widths: Sequence[int] | None = None,
    layout_version: str = "0.33",
) -> torch.Tensor:
    """FP8 Marlin scales before the exponent-bias fold (§5.1 steps 2-3).

    :func:`fp8_expand_scales`, shaped ``(1, N)``, zero-padded to ``padded_N`` and
    permuted with ``group_size=-1`` (``scale_perm_single``, §4).

    Returns:
        ``(1, padded_N)`` in ``act_dtype``.
    """
    s = fp8_expand_scales(weight_scale, size_n, act_dtype, logical_widths).reshape(1, size_n)
    return marlin_permute_scales(s, size_k, size_n, -1, layout_version)


def marlin_fp8_repack(
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    act_dtype,
    layout_version: str = "0.33",
    logical_widths: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """compressed-tensors W8A16-FP8 layer -> vLLM's FP8 Marlin tensors (§5.1).

    Weight: the e4m3 bytes of each row viewed as int32 ``(N, K/4)`` (byte j of a
    word = k element 4i+j), transposed to the 8-bit GPTQ layout ``(K/4, N)``,
    zero-padded (§3.4, group -1) and repacked (``gptq_marlin_repack``, 8 bits, §3.1).
    Scales: :func:`marlin_fp8_permuted_scales`, then :func:`fp8_fold_exponent_bias`.

    Args:
        weight_fp8: ``(N, K)`` float8_e4m3fn (or its uint8 bytes); K % 4 == 0.
        weight_scale: ``(N, 1)`` per channel or ``(S,)`` per tensor / fused shard,
            fp32/fp16/bf16.
        act_dtype: float16 or bfloat16 (FP8 activations skip the fold; not handled).
        layout_version: vLLM release (padding from 0.25).
        logical_widths: rows of each fused shard, for ``(S,)`` scales.

    Returns:
        ``{"marlin_q_w": int32 (padded_K/16, 4*padded_N),
        "marlin_scales": act_dtype (1, padded_N)}`` (vLLM's ``weight`` and
        ``weight_scale`` after loading).

    Raises:
        TypeError: wrong dtypes. ValueError: bad shapes (K % 4, scales vs N),
        act_dtype, version, or a shape the version's Marlin rejects.
    """
    _check_2d(weight_fp8, "weight_fp8", None)
    if weight_fp8.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"weight_fp8 must be float8_e4m3fn (or uint8 bytes), got {weight_fp8.dtype}")
    n, k = weight_fp8.shape
    if k % 4 or n == 0 or k == 0:
        raise ValueError(f"FP8 Marlin needs K % 4 == 0 and non-empty shapes (pack_fp8_to_int32), got (N, K) = ({n}, {k})")
    words = weight_fp8.contiguous().view(torch.uint8).view(torch.int32)  # (N, K/4), little-endian
    q_w = pack_quantized_to_gptq(words, 8, k, copy=False)  # (K/4, N), a view
    marlin_q_w = marlin_repack(q_w, k, n, 8, None, layout_version, group_size=-1)
    permuted = marlin_fp8_permuted_scales(weight_scale, k, n, act_dtype, logical_widths, layout_version)
    return {"marlin_q_w": marlin_q_w, "marlin_scales": fp8_fold_exponent_bias(permuted)}


def marlin_fp8_unrepack(
    kernel: Mapping[str, torch.Tensor],
    size_n: int,
    size_k: int,
    layout_version: str = "0.33",
    strategy: str = "channel",
    logical_widths: Sequence[int] | None = None,
    scale_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`marlin_fp8_repack`: back to the compressed-tensors tensors.

    Args:
        kernel: ``marlin_q_w`` and ``marlin_scales`` as returned by the repack
            (the activation dtype is that of ``marlin_scales``).
        size_n, size_k: the unpadded N and K.
        strategy, logical_widths: how the checkpoint stored the scale
            (``"channel"`` -> ``(N, 1)``, ``"tensor"`` -> ``(S,)``).
        scale_dtype: dtype of the returned scale (default: the activation dtype).

    Returns:
        ``{"weight": float8_e4m3fn (N, K), "weight_scale": (N, 1) or (S,)}``. The
        weight is bit-exact; the scale is the act_dtype-rounded value (exact
        unless :func:`marlin_fp8_lost_scales` flags it).

    Raises:
        KeyError: a kernel tensor is missing. ValueError/TypeError: shapes,
        dtypes or non-zero padding do not fit.
    """
    if size_k % 4:
        raise ValueError(f"size_k must be a multiple of 4, got {size_k}")
    q_w = marlin_unrepack(kernel["marlin_q_w"], size_k, size_n, 8, None, layout_version, group_size=-1)
    weight = gptq_to_pack_quantized(q_w, 8, size_k).view(torch.uint8).view(torch.float8_e4m3fn)
    ms = kernel["marlin_scales"]
    _act_dtype(ms.dtype)
    s = marlin_unpermute_scales(fp8_unfold_exponent_bias(ms), size_k, size_n, -1, layout_version)
    return {"weight": weight, "weight_scale": fp8_collapse_scales(s, strategy, logical_widths, scale_dtype)}


def marlin_fp8_lost_scales(
    weight_scale: torch.Tensor, size_n: int, act_dtype, logical_widths: Sequence[int] | None = None
) -> torch.Tensor:
    """Bool mask, shaped like ``weight_scale``: True where the FP8 Marlin round trip
    (cast to act_dtype, fold, unfold, cast back to ``weight_scale.dtype``) does not
    give the checkpoint value back bit for bit (§5.1 steps 2 and 4)."""
    strategy, widths = _fp8_widths(weight_scale, size_n, logical_widths)
    s = fp8_unfold_exponent_bias(fp8_fold_exponent_bias(fp8_expand_scales(weight_scale, size_n, act_dtype, widths)))
    back = fp8_collapse_scales(s, strategy, widths, weight_scale.dtype).reshape(weight_scale.shape)
    return _bits(back) != _bits(weight_scale.contiguous())


# =========================================================================== NVFP4 (§5.2)


def _exponent_bias_nvfp4(act_dtype) -> int:
    """b = 2^(e-1) - 2^(2-1): 14 for fp16, 126 for bf16 (§5.2 step 4)."""
    e = 5 if _act_dtype(act_dtype) == torch.float16 else 8
    return 2 ** (e - 1) - 2 ** (2 - 1)


def nvfp4_scale_factor(scales: torch.Tensor, act_dtype, layout_version: str = "0.33") -> torch.Tensor:
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
    x = scales.float()
    return nvfp4_scale_factor_from_max(torch.where(x > 0, x, torch.zeros_like(x)).amax(), act_dtype, layout_version)


def nvfp4_scale_factor_from_max(top: torch.Tensor, act_dtype, layout_version: str = "0.33") -> torch.Tensor:
    """:func:`nvfp4_scale_factor` from each module's largest positive scale (0 when there is none).

    Args:
        top: any shape, e4m3 values (float8_e4m3fn or any float dtype), >= 0.

    Returns:
        float32, top's shape: one sf per entry (§5.2 step 3.2).
    """
    dt = _act_dtype(act_dtype)
    one = torch.ones(top.shape, dtype=torch.float32, device=top.device)
    if dt == torch.float16 or _version(layout_version) < _SF_SINCE:
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


def nvfp4_marlin_process_scales(
    permuted_scales: torch.Tensor, act_dtype, layout_version: str = "0.33"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4_marlin_process_scales`` with the factor rule (§5.2 step 3).

    Args:
        permuted_scales: ``(padded_K/16, padded_N)`` in ``act_dtype``, from
            ``marlin_permute_scales(group 16)``; padded_N % 4 == 0.

    Returns:
        ``(codes, sf)``: float8_e4m3fn ``(padded_K/16, padded_N)`` S0E5M3 codes
        (reordered ``[0,2,1,3]`` per 4), and sf as a 0-dim float32 tensor.
    """
    _check_2d(permuted_scales, "permuted_scales", None)
    if permuted_scales.shape[1] % 4:
        raise ValueError(f"padded_N must be a multiple of 4, got {permuted_scales.shape[1]}")
    h = _reorder4(permuted_scales.to(torch.float16))
    sf = nvfp4_scale_factor(h, act_dtype, layout_version)
    return nvfp4_encode_s0e5m3(h, sf), sf


def nvfp4_marlin_unprocess_scales(codes: torch.Tensor, scale_factor: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nvfp4_marlin_process_scales`: float8_e4m3fn permuted scales.

    Decodes (:func:`nvfp4_decode_s0e5m3`) and undoes the ``[0,2,1,3]`` reorder.
    Flushed entries come back as 0 (module docstring).
    """
    _check_2d(codes, "codes", None)
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
        raise TypeError("weight_global_scale must be a float tensor of divisors")
    if weight_global_scale.numel() == 0:
        raise ValueError("weight_global_scale is empty")
    b = _exponent_bias_nvfp4(act_dtype)
    top = weight_global_scale.max() if dim is None else weight_global_scale.amax(dim=dim)
    ct = 1.0 / top.to(torch.float32)
    return ct, (ct * 2.0 ** (b - 7)) / scale_factor


def nvfp4_marlin_unglobal_scale(
    marlin_global_scale: torch.Tensor, act_dtype, scale_factor: torch.Tensor
) -> torch.Tensor:
    """Inverse of the second half of :func:`nvfp4_marlin_global_scale`: ``ct`` (0-dim fp32).

    Exact unless the forward overflowed to inf."""
    b = _exponent_bias_nvfp4(act_dtype)
    return (marlin_global_scale.to(torch.float32) * scale_factor) / 2.0 ** (b - 7)


def _check_nvfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int]:
    _check_2d(weight_packed, "weight_packed", torch.uint8)
    n, k = weight_packed.shape[0], 2 * weight_packed.shape[1]
    if n == 0 or k == 0 or k % NVFP4_GROUP_SIZE:
        raise ValueError(f"NVFP4 needs non-empty shapes and K % 16 == 0, got (N, K) = ({n}, {k})")
    if weight_scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    _check_2d(weight_scale, "weight_scale", None, (n, k // NVFP4_GROUP_SIZE))
    return n, k


def marlin_nvfp4_repack(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    act_dtype,
    layout_version: str = "0.33",
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
    dt = _act_dtype(act_dtype)
    n, k = _check_nvfp4(weight_packed, weight_scale)
    q_w = pack_quantized_to_gptq(weight_packed.contiguous().view(torch.int32), 4, k, copy=False)  # (K/8, N), a view
    marlin_q_w = marlin_repack(q_w, k, n, 4, None, layout_version, group_size=NVFP4_GROUP_SIZE)
    s = weight_scale.view(torch.float8_e4m3fn).t().to(dt)  # (K/16, N), exact
    permuted = marlin_permute_scales(s, k, n, NVFP4_GROUP_SIZE, layout_version)
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
    layout_version: str = "0.33",
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
    dt = _act_dtype(act_dtype)
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


def marlin_nvfp4_lost_scales(
    weight_scale: torch.Tensor, act_dtype, layout_version: str = "0.33"
) -> torch.Tensor:
    """Bool ``(N, K/16)`` mask: True where the Marlin S0E5M3 codes cannot give the
    checkpoint block scale back bit for bit (flushed below 2/(128*sf), negative,
    -0.0 or NaN; §5.2 step 3). The round trip is exact iff the mask is all False."""
    s = weight_scale.view(torch.float8_e4m3fn)
    sf = nvfp4_scale_factor(s, act_dtype, layout_version)
    back = nvfp4_decode_s0e5m3(nvfp4_encode_s0e5m3(s, sf), sf)
    return _bits(back) != _bits(s.contiguous())
