"""NVFP4 tensors for vLLM's CUTLASS / FlashInfer W4A4 kernels (docs/kernel-layouts.md §6).

Everything here is pure index math or exact IEEE arithmetic on whole tensors:
no Python loops over elements, no host synchronisation (unless a ``check_*``
flag asks for one), and every result lives on the device of its input, so the
functions run unchanged on CUDA tensors. Each transform has an exact inverse.

Reference (vLLM 0.33.0, docs/kernel-layouts.md §12):
``swizzle_blockscale`` and ``pad_nvfp4_weight_for_cutlass`` in
``vllm/model_executor/layers/quantization/utils/nvfp4_utils.py``, and the
scalars of ``CompressedTensorsW4A4Fp4.process_weights_after_loading``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .common import LayoutTypeError, round_up

__all__ = [
    "SWIZZLE_ATOM_ROWS",
    "SWIZZLE_ATOM_COLS",
    "swizzle_blockscale",
    "unswizzle_blockscale",
    "pad_nvfp4_weight",
    "unpad_nvfp4_weight",
    "nvfp4_cutlass_scalars",
    "nvfp4_cutlass_unscalars",
    "nvfp4_cutlass_layer",
    "nvfp4_cutlass_unlayer",
    "reciprocal_preimage",
]

#: A swizzle atom is 128 rows x 4 scale columns = 512 bytes (§6.1).
SWIZZLE_ATOM_ROWS = 128
SWIZZLE_ATOM_COLS = 4


def _check_one_byte(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise LayoutTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.element_size() != 1 or t.is_complex() or t.dtype == torch.bool:
        raise LayoutTypeError(f"{name} must be float8_e4m3fn or uint8 (1-byte elements), got {t.dtype}")


# ---------------------------------------------------------------------------
# §6.1 block-scale swizzle
# ---------------------------------------------------------------------------


def swizzle_blockscale(scale: torch.Tensor) -> torch.Tensor:
    """Zero-pad and swizzle NVFP4 block scales into 128x4 atoms (§6.1).

    Args:
        scale: ``(M, Kb)`` or ``(B, M, Kb)`` block scales, ``M`` = out-features,
            ``Kb`` = K/16. dtype ``float8_e4m3fn`` or ``uint8`` (any 1-byte dtype;
            the bytes are moved, never converted).

    Returns:
        A new contiguous tensor of the same dtype and device, shape
        ``(Mp, Kp)`` or ``(B, Mp, Kp)`` with ``Mp = roundup(M, 128)`` and
        ``Kp = roundup(Kb, 4)``. Source ``(m, k)`` lands at the flat byte offset
        ``((mt*(Kp/4) + kt)*32 + m32)*16 + m4*4 + k4`` of its matrix, where
        ``m = 128*mt + 32*m4 + m32`` and ``k = 4*kt + k4``. Padding bytes are 0.

    Raises:
        TypeError: not a tensor, or elements are not 1 byte wide.
        ValueError: ``scale`` is not 2-D or 3-D.
    """
    _check_one_byte(scale, "scale")
    if scale.ndim not in (2, 3):
        raise ValueError(f"scale must be 2-D (M, K/16) or 3-D (B, M, K/16), got shape {tuple(scale.shape)}")
    src = scale.view(torch.uint8)
    if src.ndim == 2:
        src = src.unsqueeze(0)
    b, m, kb = src.shape
    mp, kp = round_up(m, SWIZZLE_ATOM_ROWS), round_up(kb, SWIZZLE_ATOM_COLS)
    buf = torch.zeros((b, mp, kp), dtype=torch.uint8, device=scale.device)
    buf[:, :m, :kb] = src
    # (b, mt, m4, m32, kt, k4) -> (b, mt, kt, m32, m4, k4)
    out = buf.view(b, mp // 128, 4, 32, kp // 4, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    out = out.view(b, mp, kp).view(scale.dtype)
    return out[0] if scale.ndim == 2 else out


def unswizzle_blockscale(swizzled: torch.Tensor, M: int, K_blocks: int, *, check_padding: bool = False) -> torch.Tensor:
    """Exact inverse of :func:`swizzle_blockscale`: un-swizzle and drop the padding.

    Args:
        swizzled: ``(Mp, Kp)`` or ``(B, Mp, Kp)``, 1-byte dtype, with
            ``Mp = roundup(M, 128)`` and ``Kp = roundup(K_blocks, 4)``.
        M: the unpadded row count (out-features).
        K_blocks: the unpadded number of scale columns (K/16).
        check_padding: also verify that every padding byte is 0 (this reads
            a value back to the host, i.e. synchronises a CUDA stream).

    Returns:
        A new contiguous ``(M, K_blocks)`` or ``(B, M, K_blocks)`` tensor, same
        dtype and device.

    Raises:
        TypeError: elements are not 1 byte wide.
        ValueError: wrong rank, ``M``/``K_blocks`` negative, the shape is not the
            padded shape of ``(M, K_blocks)``, or (with ``check_padding``) a
            padding byte is non-zero.
    """
    _check_one_byte(swizzled, "swizzled")
    if swizzled.ndim not in (2, 3):
        raise ValueError(f"swizzled must be 2-D or 3-D, got shape {tuple(swizzled.shape)}")
    if M < 0 or K_blocks < 0:
        raise ValueError(f"M and K_blocks must be >= 0, got {M}, {K_blocks}")
    mp, kp = round_up(M, SWIZZLE_ATOM_ROWS), round_up(K_blocks, SWIZZLE_ATOM_COLS)
    if tuple(swizzled.shape[-2:]) != (mp, kp):
        raise ValueError(f"swizzled has shape {tuple(swizzled.shape)}, expected (..., {mp}, {kp}) for M={M}, K_blocks={K_blocks}")
    src = swizzled.view(torch.uint8)
    if src.ndim == 2:
        src = src.unsqueeze(0)
    b = src.shape[0]
    # (b, mt, kt, m32, m4, k4) -> (b, mt, m4, m32, kt, k4): the same axis swap.
    full = src.reshape(b, mp // 128, kp // 4, 32, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(b, mp, kp)
    if check_padding and (bool(full[:, M:, :].any()) or bool(full[:, :, K_blocks:].any())):
        raise ValueError("swizzled block scales have non-zero bytes in the padding")
    out = full[:, :M, :K_blocks].contiguous().view(swizzled.dtype)
    return out[0] if swizzled.ndim == 2 else out


# ---------------------------------------------------------------------------
# §6.2 weight padding
# ---------------------------------------------------------------------------


def _check_alignment(alignment: int) -> None:
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment % 2:
        raise ValueError(f"alignment must be a positive even int, got {alignment!r}")


def pad_nvfp4_weight(weight_packed: torch.Tensor, alignment: int = 32) -> tuple[torch.Tensor, int]:
    """Zero-pad a packed NVFP4 weight for the CUTLASS / FlashInfer kernels (§6.2).

    Args:
        weight_packed: ``(N, K/2)`` uint8, two E2M1 codes per byte (any 1-byte
            dtype is accepted and kept).
        alignment: 32 for CUTLASS / FlashInfer-CUTLASS, 64 for the FlashInfer
            CuTe-DSL W4A16 kernel. Rows (N) and K (in fp4 elements) are padded
            to multiples of it.

    Returns:
        ``(weight_padded, weights_padding_bytes)``: a contiguous
        ``(roundup(N, a), roundup(K, a)/2)`` tensor (it may share storage with
        the input when nothing needs padding) and the K padding in **bytes**
        (a Python int; row padding is not counted, as in vLLM).

    Raises:
        TypeError: not 1-byte elements. ValueError: not 2-D, or bad alignment.
    """
    _check_one_byte(weight_packed, "weight_packed")
    _check_alignment(alignment)
    if weight_packed.ndim != 2:
        raise ValueError(f"weight_packed must be 2-D (N, K/2), got shape {tuple(weight_packed.shape)}")
    n, kbytes = weight_packed.shape
    np_ = round_up(n, alignment)
    pad_bytes = (round_up(2 * kbytes, alignment) - 2 * kbytes) // 2
    if np_ == n and pad_bytes == 0:
        return weight_packed.contiguous(), 0
    out = torch.zeros((np_, kbytes + pad_bytes), dtype=torch.uint8, device=weight_packed.device)
    out[:n, :kbytes] = weight_packed.view(torch.uint8)
    return out.view(weight_packed.dtype), pad_bytes


def unpad_nvfp4_weight(weight_padded: torch.Tensor, N: int, K: int, *, check_padding: bool = False) -> torch.Tensor:
    """Exact inverse of :func:`pad_nvfp4_weight`: keep the first ``N`` rows and ``K/2`` bytes.

    Args:
        weight_padded: ``(Np, Kp/2)`` 1-byte tensor with ``Np >= N``, ``Kp >= K``.
        N: out-features; K: in-features (even).
        check_padding: verify that the dropped bytes are 0 (synchronises).

    Returns:
        A new contiguous ``(N, K/2)`` tensor, same dtype and device.

    Raises:
        TypeError, ValueError: bad dtype, rank, odd K, a shape smaller than
        ``(N, K/2)``, or (with ``check_padding``) non-zero padding.
    """
    _check_one_byte(weight_padded, "weight_padded")
    if weight_padded.ndim != 2:
        raise ValueError(f"weight_padded must be 2-D, got shape {tuple(weight_padded.shape)}")
    if N < 0 or K < 0 or K % 2:
        raise ValueError(f"N must be >= 0 and K even and >= 0, got N={N}, K={K}")
    if weight_padded.shape[0] < N or weight_padded.shape[1] < K // 2:
        raise ValueError(f"weight_padded {tuple(weight_padded.shape)} is smaller than (N, K/2) = ({N}, {K // 2})")
    if check_padding:
        u = weight_padded.view(torch.uint8)
        if bool(u[N:, :].any()) or bool(u[:, K // 2 :].any()):
            raise ValueError("padded NVFP4 weight has non-zero bytes in the padding")
    return weight_padded[:N, : K // 2].contiguous()


# ---------------------------------------------------------------------------
# §6.2 scalars
# ---------------------------------------------------------------------------


def _check_float_tensor(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.element_size() < 2:
        raise LayoutTypeError(f"{name} must be a float tensor (fp16/bf16/fp32), got {getattr(t, 'dtype', type(t))}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty")


def reciprocal_preimage(y: torch.Tensor) -> torch.Tensor:
    """A float32 ``x`` with ``1.0 / x == y`` bit for bit, for fp32 ``y = 1.0 / x0``.

    fp32 reciprocal is not injective (for mantissas above sqrt(2) two inputs can
    round to one output), so the divisor ``x0`` itself may be unrecoverable;
    this returns the candidate nearest ``1/y`` among ``1/y`` +- 2 ulp that maps
    back onto ``y`` (``x0`` is always one of those), else ``1/y``. Elementwise,
    vectorised, no host sync. Shape and device of ``y``; dtype float32.
    """
    y = y.to(torch.float32)
    x0 = 1.0 / y
    bits = x0.view(torch.int32).unsqueeze(-1)
    offs = torch.tensor([0, -1, 1, -2, 2], dtype=torch.int32, device=y.device)
    cand = (bits + offs).view(torch.float32)
    ok = (1.0 / cand).view(torch.int32) == y.view(torch.int32).unsqueeze(-1)
    ok = ok & torch.isfinite(cand) & (cand.view(torch.int32) ^ bits >= 0)  # same sign
    # first candidate (in order 0, -1, +1, -2, +2) that maps back; 0 if none does
    idx = torch.where(ok.any(-1), ok.to(torch.uint8).argmax(-1), torch.zeros_like(ok[..., 0], dtype=torch.long))
    return cand.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def nvfp4_cutlass_scalars(weight_global_scale: torch.Tensor, input_global_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The fp32 scalars vLLM's compressed-tensors NVFP4 W4A4 scheme builds (§6.2).

    Args:
        weight_global_scale: ``(S,)`` (or any shape) checkpoint **divisors**,
            one per fused shard; float.
        input_global_scale: ``(S,)`` activation divisors; float.

    Returns:
        dict of 0-dim float32 tensors on the input's device:
        ``weight_global_scale = 1/max(wgs)``, ``input_global_scale = 1/max(igs)``,
        ``input_global_scale_inv = max(igs)``,
        ``alpha = input_global_scale * weight_global_scale`` (all fp32 ops).

    Raises:
        TypeError: not float tensors. ValueError: empty.
    """
    _check_float_tensor(weight_global_scale, "weight_global_scale")
    _check_float_tensor(input_global_scale, "input_global_scale")
    wdiv = weight_global_scale.max().to(torch.float32)
    idiv = input_global_scale.max().to(torch.float32)
    wgs = 1.0 / wdiv
    igs = 1.0 / idiv
    return {
        "weight_global_scale": wgs,
        "input_global_scale": igs,
        "input_global_scale_inv": idiv,
        "alpha": igs * wgs,
    }


def nvfp4_cutlass_unscalars(scalars: Mapping[str, torch.Tensor], weight_global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Inverse of :func:`nvfp4_cutlass_scalars`: checkpoint divisors, shape ``(1,)`` fp32.

    ``input_global_scale`` = ``input_global_scale_inv`` (bit-exact: it *is* the
    max divisor). The weight divisor is only known through ``1/max(wgs)``, and
    fp32 reciprocal is not injective, so pass the checkpoint's
    ``weight_global_scale`` to get it back exactly (it is returned as given);
    otherwise :func:`reciprocal_preimage` gives a divisor that reproduces every
    kernel scalar bit for bit. Per-shard values below the max are not
    recoverable from the kernel tensors (vLLM keeps only the max).

    Raises:
        KeyError: a scalar is missing. TypeError/ValueError: bad divisor tensor.
    """
    idiv = scalars["input_global_scale_inv"].to(torch.float32).reshape(1)
    if weight_global_scale is not None:
        _check_float_tensor(weight_global_scale, "weight_global_scale")
        wdiv = weight_global_scale
    else:
        wdiv = reciprocal_preimage(scalars["weight_global_scale"]).reshape(1)
    return {"weight_global_scale": wdiv, "input_global_scale": idiv}


# ---------------------------------------------------------------------------
# a whole layer
# ---------------------------------------------------------------------------


def nvfp4_cutlass_layer(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    input_global_scale: torch.Tensor,
    alignment: int = 32,
) -> dict[str, torch.Tensor]:
    """All kernel tensors of a compressed-tensors NVFP4 W4A4 layer on the CUTLASS path (§6).

    Args:
        weight_packed: ``(N, K/2)`` uint8. weight_scale: ``(N, K/16)``
            float8_e4m3fn (or uint8). weight_global_scale / input_global_scale:
            ``(S,)`` float divisors. alignment: weight padding (§6.2).

    Returns:
        dict: ``weight`` (padded, uint8), ``weight_scale`` (swizzled,
        ``(roundup(N,128), roundup(K/16,4))``), the 0-dim fp32 scalars of
        :func:`nvfp4_cutlass_scalars`, and ``weights_padding_bytes`` (0-dim int64).

    Raises:
        TypeError/ValueError: from the parts, or ``weight_scale`` is not ``(N, K/16)``.
    """
    _check_one_byte(weight_packed, "weight_packed")
    _check_one_byte(weight_scale, "weight_scale")
    if weight_packed.ndim != 2 or weight_scale.ndim != 2:
        raise ValueError("weight_packed and weight_scale must be 2-D")
    n, kb2 = weight_packed.shape
    if (2 * kb2) % 16 or tuple(weight_scale.shape) != (n, 2 * kb2 // 16):
        raise ValueError(
            f"weight_scale {tuple(weight_scale.shape)} does not match weight_packed {tuple(weight_packed.shape)}: expected (N, K/16) with K % 16 == 0"
        )
    weight, pad_bytes = pad_nvfp4_weight(weight_packed, alignment)
    out = {"weight": weight, "weight_scale": swizzle_blockscale(weight_scale)}
    out.update(nvfp4_cutlass_scalars(weight_global_scale, input_global_scale))
    out["weights_padding_bytes"] = torch.tensor(pad_bytes, dtype=torch.int64, device=weight_packed.device)
    return out


def nvfp4_cutlass_unlayer(
    kernel: Mapping[str, torch.Tensor],
    N: int,
    K: int,
    weight_global_scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`nvfp4_cutlass_layer`: the compressed-tensors tensors.

    Returns ``weight_packed`` ``(N, K/2)``, ``weight_scale`` ``(N, K/16)``, and
    the divisors of :func:`nvfp4_cutlass_unscalars` (see there for what is exact).

    Raises:
        KeyError: a kernel tensor is missing. ValueError: shapes do not fit N, K.
    """
    if K % 16:
        raise ValueError(f"K must be a multiple of 16, got {K}")
    out = {
        "weight_packed": unpad_nvfp4_weight(kernel["weight"], N, K),
        "weight_scale": unswizzle_blockscale(kernel["weight_scale"], N, K // 16),
    }
    out.update(nvfp4_cutlass_unscalars(kernel, weight_global_scale))
    return out
