"""vLLM's Marlin layout for FP8 weights (W8A16), and its inverse.

docs/kernel-layouts.md §5.1 (``prepare_fp8_layer_for_marlin``, vLLM 0.33.0
``vllm/model_executor/layers/quantization/utils/marlin_utils_fp8.py``). The
weight repack and the scale permutation are the generic Marlin ones of
:mod:`.marlin` (§3, §4); this module adds the FP8 byte packing and the
exponent-bias folding of the scales.

Everything is index math or exact IEEE arithmetic on whole tensors (powers of
two, casts that are exact on the values involved, bit views): no Python loop
over elements, no host synchronisation, results on the input's device.
``act_dtype`` is the activation dtype (``torch.float16`` / ``torch.bfloat16``
or ``"float16"`` / ``"bfloat16"``); ``layout_version`` a vLLM release string as
in :mod:`.marlin`.

What cannot be inverted (the inverse is exact for everything else, and
:func:`marlin_fp8_lost_scales` says which checkpoint entries are affected): the
cast of the scales to ``act_dtype`` (§5.1 step 2) rounds fp32 (or the other
16-bit type) scales; the x2^8 fold overflows fp16 scales above 255.875 to inf
(§5.1 step 4; x2^120 overflows bf16 scales >= 2^8). Per-tensor scales of fused
shards are recovered from the first row of each shard (needs ``logical_widths``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .common import LayoutTypeError, check_tensor, int_view
from .common import act_dtype as act_dtype_of
from .marlin import gptq_to_pack_quantized, marlin_permute_scales, marlin_repack, marlin_unpermute_scales, marlin_unrepack, pack_quantized_to_gptq
from .versions import DEFAULT_LAYOUT_VERSION

__all__ = [
    "fp8_exponent_bias",
    "fp8_fold_exponent_bias",
    "fp8_unfold_exponent_bias",
    "fp8_expand_scales",
    "fp8_collapse_scales",
    "marlin_fp8_permuted_scales",
    "marlin_fp8_repack",
    "marlin_fp8_unrepack",
    "marlin_fp8_lost_scales",
]

# =========================================================================== FP8 (§5.1)


def fp8_exponent_bias(act_dtype) -> int:
    """b = 2^(e-1) - 2^(4-1) with e the exponent width of ``act_dtype``: 8 (fp16), 120 (bf16) (§5.1 step 4)."""
    e = 5 if act_dtype_of(act_dtype) == torch.float16 else 8
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
    if scales.device.type == "meta":  # planning: torch's meta kernel for this mul imports torch._dynamo on first use (seconds)
        return torch.empty(scales.shape, dtype=scales.dtype, device=scales.device)
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
            f"weight_scale must be (N, 1) per channel or (S,) per tensor/shard, got {tuple(weight_scale.shape)} (block-wise FP8 scales are not supported)"
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


def fp8_expand_scales(weight_scale: torch.Tensor, size_n: int, act_dtype, logical_widths: Sequence[int] | None = None) -> torch.Tensor:
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
    dt = act_dtype_of(act_dtype)
    if not isinstance(weight_scale, torch.Tensor) or not weight_scale.is_floating_point():
        raise LayoutTypeError(f"weight_scale must be a float tensor, got {getattr(weight_scale, 'dtype', weight_scale)}")
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
    layout_version: str = DEFAULT_LAYOUT_VERSION,
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
    layout_version: str = DEFAULT_LAYOUT_VERSION,
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
    check_tensor(weight_fp8, "weight_fp8", ndim=2)
    if weight_fp8.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise LayoutTypeError(f"weight_fp8 must be float8_e4m3fn (or uint8 bytes), got {weight_fp8.dtype}")
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
    layout_version: str = DEFAULT_LAYOUT_VERSION,
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
    act_dtype_of(ms.dtype)
    s = marlin_unpermute_scales(fp8_unfold_exponent_bias(ms), size_k, size_n, -1, layout_version)
    return {"weight": weight, "weight_scale": fp8_collapse_scales(s, strategy, logical_widths, scale_dtype)}


def marlin_fp8_lost_scales(weight_scale: torch.Tensor, size_n: int, act_dtype, logical_widths: Sequence[int] | None = None) -> torch.Tensor:
    """Bool mask, shaped like ``weight_scale``: True where the FP8 Marlin round trip
    (cast to act_dtype, fold, unfold, cast back to ``weight_scale.dtype``) does not
    give the checkpoint value back bit for bit (§5.1 steps 2 and 4)."""
    strategy, widths = _fp8_widths(weight_scale, size_n, logical_widths)
    s = fp8_unfold_exponent_bias(fp8_fold_exponent_bias(fp8_expand_scales(weight_scale, size_n, act_dtype, widths)))
    back = fp8_collapse_scales(s, strategy, widths, weight_scale.dtype).reshape(weight_scale.shape)
    return int_view(back) != int_view(weight_scale.contiguous())
