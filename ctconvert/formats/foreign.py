"""Weight formats of other tools, read back exactly as their own reference decompressors do.

These are the formats ctconvert takes as input besides compressed-tensors (see
:mod:`ctconvert.sources`); each function works on a row range of one
module and is written from the published layout:

- Hugging Face / DeepSeek FP8 block (``quant_method: "fp8"``): E4M3 ``weight [N, K]``,
  fp32 ``weight_scale_inv [ceil(N/bh), ceil(K/bw)]``; dense = ``fp32(w) * fp32(s)`` cast to
  bf16, as compressed-tensors 0.20 ``entrypoints/convert/converters/fp8block_dequantizer.py``
  (``FP8BlockDequantizer._create_dequantized_weight``) computes it.
- AutoAWQ GEMM (``quant_method: "awq"``, ``version: "gemm"``): int32 ``qweight [K, N/8]`` and
  ``qzeros [K/G, N/8]`` packed along N, eight 4-bit values per word in the order
  ``[0, 2, 4, 6, 1, 3, 5, 7]`` (value of column ``8c + AWQ_ORDER[i]`` in nibble ``i``), fp16
  ``scales [K/G, N]``; dense = ``(q - z) * s`` in fp16 (casper-hansen/AutoAWQ
  ``awq/modules/linear/gemm.py``, ``WQLinear_GEMM.from_linear``; the unpacking of
  compressed-tensors 0.20 ``converters/autoawq.py``, ``AutoAWQConverter.reverse_awq_order``).
- GPTQ (``quant_method: "gptq"``): int32 ``qweight [K*B/32, N]`` packed along K and
  ``qzeros [G, N*B/32]`` packed along N, value ``i`` of a word in bits ``[i*B, (i+1)*B)``;
  fp16 ``scales [G, N]``; int32 ``g_idx [K]`` (the group of each input column). Format
  ``gptq`` (v1) stores each zero point minus one: the zero is ``(stored + 1) mod 2^B``;
  ``gptq_v2`` stores it as it is. dense = ``s[g_idx[k]] * (q - z[g_idx[k]])`` in fp16
  (AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py``, ``QuantLinear.forward``'s
  torch path; GPTQModel ``gptqmodel/nn_modules/qlinear/__init__.py``, ``dequantize_weight``).
- ModelOpt NVFP4 (``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``): uint8 ``weight
  [N, K/2]`` (E2M1 codes, even column in the low nibble), E4M3 ``weight_scale [N, K/16]``,
  fp32 ``weight_scale_2`` (one value); dense = ``e2m1 * (fp32(scale) * scale_2)`` in fp32 cast to
  the model dtype (NVIDIA/Model-Optimizer ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``,
  ``NVFP4QTensor.dequantize``, non-fast path).

Every product here is exact before its final rounding (a small integer times an fp16, an
E4M3 code times an fp32), so these reproduce the references bit for bit.
"""

from __future__ import annotations

import torch

from .fp4 import unpack_e2m1

__all__ = [
    "AWQ_ORDER",
    "awq_unpack",
    "dequant_grouped_int",
    "fp8_block_dequantize",
    "gptq_unpack_cols",
    "gptq_unpack_rows",
    "modelopt_nvfp4_dequantize",
    "nvfp4_global_scale_for",
]

#: AutoAWQ GEMM: nibble ``i`` of a word holds logical column ``8c + AWQ_ORDER[i]``
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def fp8_block_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """bf16 ``[r, K]`` from E4M3 rows ``w [r, K]`` (``r`` rows starting at a block boundary) and their
    block scales ``scale_inv [ceil(r/bh), ceil(K/bw)]``: ``fp32(w) * fp32(scale)`` rounded once to bf16."""
    bh, bw = block
    r, k = w.shape
    if r % bh == 0 and k % bw == 0:  # whole blocks: broadcast the scales instead of expanding them
        x = w.to(torch.float32).view(r // bh, bh, k // bw, bw)
        x.mul_(scale_inv.to(torch.float32)[: r // bh].view(r // bh, 1, k // bw, 1))
        return x.view(r, k).to(torch.bfloat16)
    s = scale_inv.to(torch.float32).repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:r, :k]
    return (w.to(torch.float32) * s).to(torch.bfloat16)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM int32 words ``[R, W]`` (packed along their columns) -> 4-bit values ``[R, 8W]`` int16
    in logical column order (:data:`AWQ_ORDER`)."""
    r, w = words.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [R, W, 8]: nibble i
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles
    return out.reshape(r, w * 8).to(torch.int16)


def gptq_unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ int32 words ``[K*B/32, C]`` packed along dim 0 -> values ``[K, C]`` int16 (value ``i`` of word
    row ``j`` is row ``j*32/B + i``). ``bits`` must divide 32."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    v = (words.to(torch.int32).unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)  # [J, per, C]
    return v.reshape(words.shape[0] * per, words.shape[1]).to(torch.int16)


def gptq_unpack_cols(words: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ int32 words ``[G, C*B/32]`` packed along dim 1 -> values ``[G, C]`` int16."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    v = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [G, W, per]
    return v.reshape(words.shape[0], words.shape[1] * per).to(torch.int16)


def dequant_grouped_int(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """``[r, K]`` in the scales' dtype: ``scales[:, g] * (q - zeros[:, g])`` with ``g = g_idx[k]``.

    ``q [r, K]`` and ``zeros [r, G]`` are unsigned integers, ``scales [r, G]`` fp16 (or bf16/fp32),
    ``g_idx [K]`` int. The difference is a small integer and the product is exact in fp32, so one
    rounding to the scales' dtype gives what the fp16 arithmetic of AutoAWQ and GPTQ gives."""
    g = g_idx.long()
    diff = q.to(torch.float32) - zeros.to(torch.float32)[:, g]
    return (diff * scales.to(torch.float32)[:, g]).to(scales.dtype)


def modelopt_nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[r, K]`` of ``dtype`` from ModelOpt NVFP4 rows: ``e2m1 * (fp32(scale) * scale_2)`` in fp32, cast once."""
    vals = unpack_e2m1(packed).to(torch.float32)
    r, k = vals.shape
    per_block = scale.to(torch.float32) * scale_2.to(torch.float32).reshape(-1)[0]
    return (vals.view(r, k // 16, 16) * per_block.unsqueeze(-1)).reshape(r, k).to(dtype)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def nvfp4_global_scale_for(scale_2: float) -> tuple[torch.Tensor, bool] | None:
    """A compressed-tensors ``weight_global_scale`` ``g`` (fp32 ``[1]``) equivalent to ModelOpt's
    ``weight_scale_2`` ``w``, and whether ``fl32(1 / g) == w`` as well (what vLLM's NVFP4 kernels
    use); None when there is none.

    The two formats are reciprocal (compressed-tensors 0.20 ``converters/modelopt_nvfp4.py``:
    ``weight_global_scale = 1 / weight_scale_2``), but compressed-tensors dequantizes with
    ``e2m1 * (scale / g)`` and ModelOpt with ``e2m1 * (scale * w)``, so ``1 / w`` alone can
    differ in the last bit. ``g`` is taken among the fp32 neighbours of ``1 / w`` such that
    ``bf16(e2m1 * (s / g)) == bf16(e2m1 * (s * w))`` for **every** E4M3 code ``s`` and E2M1 value:
    then every dequantized value is equal, whatever the tensor holds."""
    w = torch.tensor([scale_2], dtype=torch.float32)
    if not bool(torch.isfinite(w).all()) or float(w) <= 0:
        return None
    s = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    s = s[torch.isfinite(s)]
    want = (_E2M1[:, None] * (s * w)[None]).to(torch.bfloat16)
    base = (1.0 / w).view(torch.int32)
    fallback = None
    for d in (0, -1, 1, -2, 2, -3, 3, -4, 4):
        g = (base + d).view(torch.float32)
        if torch.equal((_E2M1[:, None] * (s / g)[None]).to(torch.bfloat16), want):
            if torch.equal(1.0 / g, w):
                return g, True
            fallback = fallback if fallback is not None else g
    return (fallback, False) if fallback is not None else None
