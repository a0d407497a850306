"""marlin-24 (Sparse-Marlin W4A16 2:4, vLLM <= 0.15): ``weight_packed``, ``meta`` and ``scale_packed``.

docs/kernel-layouts.md §9. The checkpoint holds the kernel layout (vLLM 0.14.1
``compressed_tensors/schemes/compressed_tensors_w4a16_24.py`` only re-wraps the parameters); the writer
is compressed-tensors 0.14's ``compressors/sparse_quantized_compressors/marlin_24.py``
(``Marlin24Compressor``), and vLLM's test twin ``quantization/utils/marlin_utils_test_24.py``
(``marlin_24_quantize``). Steps for an ``(N, K)`` 2:4 weight of signed int4 values ``q``:

1. The SM80 selection of :mod:`.sparse24` on ``(N, K)``: values ``(N, K/2)`` and int16 metadata
   ``(N, K/16)``, scattered with the marlin-24 row remap
   ``r//64*64 + (r%2)*2 + (r%8)//4 + ((r%4)//2)*32 + ((r%64)//8)*4`` (then the same 2x2 swap and
   interleave), then reinterpreted as ``(K/32, 2N)`` without moving data.
2. The values, transposed to ``(K/2, N)`` and offset by +8 (``uint4b8``), cut into 16x16 tiles
   (tile-major), permuted by the 1024-entry marlin-24 permutation and packed 8 per int32, low first:
   ``(K/32, 2N)``.
3. Scales ``(G, N)`` (the transposed ``weight_scale``, fp16): grouped (``group_size < K``, vLLM's rule)
   -> per 64 columns the gather ``i*8 + [0,4,1,5,2,6,3,7]``; channelwise -> unchanged. compressed-tensors
   0.14 compares ``group_size`` with K/2 instead, which differs only for K = 2·group_size (one layer
   shape, K = 256 with group 128): ctconvert follows vLLM, whose kernel reads the scales.

Shape rules (vLLM's ``gptq_marlin_24`` kernel: thread tiles of 128 in N and K): N % 128 == 0,
K % 128 == 0, group 128 or channelwise. Every function has its exact inverse.
"""

from __future__ import annotations

import torch

from .common import check_tensor
from .sparse24 import sm80_compress, sm80_decompress

__all__ = [
    "MARLIN24_GROUP",
    "marlin24_meta_remap",
    "marlin24_pack",
    "marlin24_permute_scales",
    "marlin24_shape_problem",
    "marlin24_unpack",
    "marlin24_unpermute_scales",
    "marlin24_weight_perm",
]

MARLIN24_GROUP = 128
_TILE = 16
_SCALE_PERM = [i * 8 + j for i in range(8) for j in (0, 4, 1, 5, 2, 6, 3, 7)]


def marlin24_shape_problem(n: int, k: int, group_size: int | None) -> str | None:
    """Why the marlin-24 kernel cannot take an ``(N, K)`` layer, or None."""
    if group_size not in (None, -1, MARLIN24_GROUP):
        return f"marlin-24 takes group size 128 or channelwise scales, not group {group_size}"
    if k % 128:
        return f"K={k} is not a multiple of 128 (the marlin-24 kernel's K tile)"
    if n % 128:
        return f"N={n} is not a multiple of 128 (the marlin-24 kernel's N tile)"
    return None


def marlin24_meta_remap(rows: torch.Tensor) -> torch.Tensor:
    """The marlin-24 metadata row remap (module docstring, step 1)."""
    return rows // 64 * 64 + (rows % 2) * 2 + (rows % 8) // 4 + ((rows % 4) // 2) * 32 + ((rows % 64) // 8) * 4


def marlin24_weight_perm(device=None) -> torch.Tensor:
    """int64 ``[1024]``: the marlin-24 permutation of one ``16 x 64`` chunk of tiled values (4-bit).

    Entry ``((i*4 + j)*2 + block)*4 + t`` (i < 32, j < 4, block < 2, t < 4) is
    ``16*row + 256*(i//8) + 8*((i//4)%2) + 4*block + j`` with ``row = 2*(i%4) + [0, 1, 8, 9][t]``; then
    each run of 8 is interleaved ``[0,2,4,6,1,3,5,7]`` (kernel-layouts §9 step 3)."""
    i = torch.arange(32).reshape(32, 1, 1, 1)
    j = torch.arange(4).reshape(1, 4, 1, 1)
    block = torch.arange(2).reshape(1, 1, 2, 1)
    row = 2 * (i % 4) + torch.tensor([0, 1, 8, 9]).reshape(1, 1, 1, 4)
    perm = (16 * row + 256 * (i // 8) + 8 * ((i // 4) % 2) + 4 * block + j).reshape(-1, 8)
    return perm[:, torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])].reshape(-1).to(device)


def _tile(v: torch.Tensor) -> torch.Tensor:
    """``(R, C)`` -> ``(R/16, 16C)``: 16x16 tiles, tile-major."""
    r, c = v.shape
    return v.reshape(r // _TILE, _TILE, c // _TILE, _TILE).permute(0, 2, 1, 3).reshape(r // _TILE, c * _TILE)


def _untile(t: torch.Tensor, r: int, c: int) -> torch.Tensor:
    return t.reshape(r // _TILE, c // _TILE, _TILE, _TILE).permute(0, 2, 1, 3).reshape(r, c)


def marlin24_pack(q: torch.Tensor, scale: torch.Tensor, group_size: int | None) -> dict[str, torch.Tensor]:
    """marlin-24 tensors of one layer: ``q`` int8 ``(N, K)`` signed int4 values in ``[-8, 7]``, 2:4 along K;
    ``scale`` fp16 ``(N, G)`` (G = K/128, or 1 channelwise). Returns ``weight_packed`` int32 ``(K/32, 2N)``,
    ``meta`` int16 ``(K/32, 2N)``, ``scale_packed`` fp16 ``(G, N)``. Raises ``ValueError`` (shapes, values,
    not 2:4) or ``LayoutTypeError``."""
    check_tensor(q, "q", torch.int8, ndim=2)
    n, k = q.shape
    if (problem := marlin24_shape_problem(n, k, group_size)) is not None:
        raise ValueError(problem)
    if bool(((q < -8) | (q > 7)).any()):
        raise ValueError("marlin-24 takes signed 4-bit values in [-8, 7]")
    sel = sm80_compress(q.to(torch.float16), remap=marlin24_meta_remap)  # fp16 values -> int16 metadata, as the writer does
    vals = (sel["values"].t().to(torch.int64) + 8).contiguous()  # (K/2, N), uint4b8
    tiled = _tile(vals)
    perm = marlin24_weight_perm(q.device)
    tiled = tiled.reshape(-1, perm.numel())[:, perm].reshape(tiled.shape)
    words = (tiled.reshape(tiled.shape[0], -1, 8) << (4 * torch.arange(8, device=q.device))).sum(-1)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return {
        "weight_packed": packed.contiguous(),
        "meta": sel["meta"].reshape(k // 32, 2 * n),
        "scale_packed": marlin24_permute_scales(scale, k, group_size),
    }


def marlin24_unpack(weight_packed: torch.Tensor, meta: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of the weight part of :func:`marlin24_pack`: int8 ``q`` ``(N, K)``."""
    check_tensor(weight_packed, "weight_packed", torch.int32, shape=(k // 32, 2 * n))
    check_tensor(meta, "meta", torch.int16, shape=(k // 32, 2 * n))
    w = weight_packed.to(torch.int64) & 0xFFFFFFFF
    tiled = ((w.unsqueeze(-1) >> (4 * torch.arange(8, device=w.device))) & 0xF).reshape(k // 2 // _TILE, n * _TILE)
    perm = marlin24_weight_perm(w.device)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=w.device)
    tiled = tiled.reshape(-1, perm.numel())[:, inv].reshape(tiled.shape)
    vals = (_untile(tiled, k // 2, n) - 8).t().to(torch.float16).contiguous()  # (N, K/2)
    return sm80_decompress(vals, meta.reshape(n, k // 16), remap=marlin24_meta_remap).to(torch.int8)


def _grouped(k: int, group_size: int | None) -> bool:
    return group_size not in (None, -1) and group_size < k


def marlin24_permute_scales(scale: torch.Tensor, k: int, group_size: int | None) -> torch.Tensor:
    """``scale_packed`` ``(G, N)`` from ``scale`` ``(N, G)`` (module docstring, step 3)."""
    s = scale.t().contiguous()
    if not _grouped(k, group_size):
        return s
    g, n = s.shape
    return s.reshape(-1, 64)[:, torch.tensor(_SCALE_PERM, device=s.device)].reshape(g, n).contiguous()


def marlin24_unpermute_scales(scale_packed: torch.Tensor, k: int, group_size: int | None) -> torch.Tensor:
    """Inverse of :func:`marlin24_permute_scales`: ``(N, G)``."""
    s = scale_packed
    if _grouped(k, group_size):
        g, n = s.shape
        inv = torch.empty(64, dtype=torch.int64)
        inv[torch.tensor(_SCALE_PERM)] = torch.arange(64)
        s = s.reshape(-1, 64)[:, inv.to(s.device)].reshape(g, n)
    return s.t().contiguous()
