"""Shared helpers for the quantization formats (docs/compressed-tensors-format.md §6.1)."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # E4M3FN largest finite value (format spec §5.3)
FP4_MAX = 6.0  # E2M1 largest value (§5.2)
#: dtype codes of the fused kernels (``quant.c`` and the Triton kernels of :mod:`.gpu`)
KERNEL_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def dtype_eps(dtype: torch.dtype) -> float:
    """The value compressed-tensors puts in place of a zero scale of ``dtype`` (§6.1).

    bf16 -> 2^-7, fp16 -> 2^-10, fp32 -> 2^-23 (``torch.finfo(dtype).eps``),
    float8_e4m3fn -> 0.125, integer dtypes -> 1.
    """
    if dtype == torch.float8_e4m3fn:
        return 0.125
    if dtype.is_floating_point:
        return torch.finfo(dtype).eps
    return 1.0


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive value of a floating ``dtype``: fp32 2^-149, bf16 2^-133, fp16 2^-24 (a scale below half
    of it rounds to zero in that dtype)."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps


def rd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round an fp32 tensor to ``dtype`` (RNE) and back to fp32.

    Models one arithmetic step done "in D" by torch on the CPU, which computes
    bf16/fp16 ops in fp32 and rounds the result.
    """
    if dtype == torch.float32:
        return x
    return x.to(dtype).to(torch.float32)


def sdiv(a: torch.Tensor, b: float) -> torch.Tensor:
    """``a / b`` for fp32 ``a`` and a constant ``b``, correctly rounded on every device.

    (On CUDA, PyTorch turns division by a Python scalar into a multiplication
    by its reciprocal, which rounds differently; a device tensor divisor keeps
    IEEE division.)
    """
    return a / torch.tensor(b, dtype=torch.float32, device=a.device)


def group_absmax(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group ``max(|min(x, 0)|, max(x, 0))`` along the last dim, in fp32.

    ``w``: ``[N, K]`` with ``K % group_size == 0``. Returns ``[N, K // group_size]``.
    Exact in any input dtype (min/max/abs do not round).
    """
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size)
    mn, mx = torch.aminmax(g, dim=-1)
    return torch.maximum(mx.clamp_min(0), mn.clamp_max(0).neg()).to(torch.float32)


def group_minmax(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(min(x, 0), max(x, 0))`` along the last dim, in fp32."""
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size)
    mn, mx = torch.aminmax(g, dim=-1)
    return mn.clamp_max(0).to(torch.float32), mx.clamp_min(0).to(torch.float32)


def tensor_absmax(w: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the whole tensor (``w`` any shape, a float dtype), fp32 0-d on ``w``'s device: the value of
    ``max(|min(x, 0)|, max(x, 0))`` (compressed-tensors' ``max_val_pos``), exact in any dtype, NaN where ``w`` holds a
    NaN, ``+0.0`` for zeros (``-0.0`` then is no scale's concern: NVFP4's global scale clamps to ``tiny``, FP8's maps
    a zero scale to ``eps``). One reduction and one cast (an infinity-norm), not six kernels: a MoE checkpoint's
    ~9,000 expert tensors paid ~1.3 s of launches for them on an H200."""
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=w.device)
    return torch.linalg.vector_norm(w, float("inf")).to(torch.float32)


def ranges_absmax(mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """``max(|min(mn, 0)|, max(mx, 0))`` of per-group ranges (an observer's ``(min, max)``), in fp32: the
    ``max_val_pos`` compressed-tensors' ``calculate_qparams`` takes a symmetric scale from."""
    return torch.maximum(mx.clamp_min(0), mn.clamp_max(0).neg()).to(torch.float32)
