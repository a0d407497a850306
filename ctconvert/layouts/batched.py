"""Repack a batch of same-shaped modules at once (same bytes as :func:`.kernels.repack_module` per module).

A model repeats a few Linear shapes many times (q/k/v/o, gate/up/down per
layer), so the repack runs per *shape*, not per module: the tensors of B
modules stacked on a leading dim go through one Triton launch for the weight
tiles (:func:`.gpu.marlin_tiles`) and one for the scales
(:func:`.gpu.permute_scales`), plus a few whole-batch torch ops. Per-module
launches made the repack bound by launch overhead (13 GB/s on an H200 for
112 modules of a 1B model); batched, it runs at memory speed.

Fast paths (CUDA with Triton; zero points and biases go module by module: they are tiny):
``marlin-int`` without act-order, ``marlin-fp8`` with channel
scales, ``marlin-nvfp4``. Everything else (the CPU, ``cutlass-nvfp4``,
act-order, per-tensor FP8 scales) runs :func:`.kernels.repack_module` per
module and stacks the results, so the contract is the same everywhere.

The record (:func:`.kernels.repack_module`'s second value) is computed once
per batch on meta tensors; value-dependent fields (the NVFP4 ``scale_factor``)
are filled in per module. Sections (§) refer to docs/kernel-layouts.md.
"""

from __future__ import annotations

import torch

from . import kernels, marlin, marlin_fp8, marlin_nvfp4


def _meta(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for p, t in tensors.items():
        if p == "weight_shape":
            out[p] = t[0].cpu()  # values are needed for N, K; checked equal across the batch
        else:
            out[p] = torch.empty(t.shape[1:], dtype=t.dtype, device="meta")
    return out


_PLANS: dict[tuple, tuple] = {}


def _plan(kernel, tensors, weights, v, act_dtype):
    """Output shapes/dtypes and record of one module of the batch (meta tensors; cached per shape)."""
    meta = _meta(tensors)
    key = (
        kernel.name,
        v,
        act_dtype,
        repr(sorted(weights.items())),
        tuple(sorted((p, t.dtype, tuple(t.shape), tuple(t.tolist()) if p == "weight_shape" else None) for p, t in meta.items())),
    )
    if key not in _PLANS:
        _PLANS[key] = kernels.repack_module(kernel, meta, weights, v, act_dtype)
    outs, rec = _PLANS[key]
    return outs, dict(rec)


def _per_module(kernel, tensors, weights, v, act_dtype):
    b = next(iter(tensors.values())).shape[0]
    res = [kernels.repack_module(kernel, {p: t[i] for p, t in tensors.items()}, weights, v, act_dtype) for i in range(b)]
    outs = {p: torch.stack([r[0][p] for r in res]) for p in res[0][0]}
    return outs, [r[1] for r in res]


def _on_gpu(tensors: dict[str, torch.Tensor]) -> bool:
    w = tensors.get("weight_packed", tensors.get("weight"))
    if w is None or not w.is_cuda:
        return False
    from . import gpu  # imports Triton: only for CUDA tensors

    return gpu.available(w)


def _fp8_channel_scales(t: dict[str, torch.Tensor]) -> bool:
    w, s = t["weight"], t["weight_scale"]
    return s.dim() == 3 and s.shape[1] == w.shape[1] and s.shape[2] == 1 and w.shape[1] != 1


def repack_batch(
    kernel: kernels.Kernel, tensors: dict[str, torch.Tensor], weights: dict, layout_version: str, act_dtype: torch.dtype, planned: tuple | None = None
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Kernel-layout tensors for B modules of one shape, stacked, and one record per module.

    Args:
        kernel: the :class:`.kernels.Kernel` (``ctconvert.plan.kernel_targets`` chooses it).
        tensors: local part name -> ``(B, *shape)`` tensor: the modules' compressed-tensors
            tensors, stacked (same shapes, dtypes and ``weight_shape`` values).
        weights, layout_version, act_dtype: as :func:`.kernels.repack_module`.
        planned: ``({part: (dtype, shape)}, record)`` of one module, as a caller planned it already with
            :func:`.kernels.repack_module` (``quantize --target`` plans every module shape before converting);
            else it is planned here, on meta tensors.

    Returns:
        ``(outs, records)``: part name -> ``(B, *kernel_shape)`` and B records,
        each equal to what :func:`.kernels.repack_module` gives for that module.

    Raises:
        ValueError: shapes the kernel rejects, or modules whose ``weight_shape`` differ.
    """
    if "weight_shape" in tensors and not bool((tensors["weight_shape"] == tensors["weight_shape"][:1]).all()):
        raise ValueError("a batch must hold modules of one shape")
    fast = _FAST.get(kernel.name)
    if fast is None or not _on_gpu(tensors) or not fast[0](tensors):
        return _per_module(kernel, tensors, weights, layout_version, act_dtype)
    if planned is not None:
        spec, rec = planned[0], dict(planned[1])
    else:
        meta_outs, rec = _plan(kernel, tensors, weights, layout_version, act_dtype)
        spec = {p: (t.dtype, tuple(t.shape)) for p, t in meta_outs.items()}
    b = next(iter(tensors.values())).shape[0]
    taken, copied = kernels.split_parts(kernel, tensors)
    outs, per_module = fast[1](taken, rec, act_dtype, layout_version)
    kernels.with_copied(kernel, outs, {}, copied)  # (the record lists them already: planned by repack_module)
    recs = [dict(rec, **(per_module[i] if per_module else {})) for i in range(b)]
    if outs.keys() != spec.keys():  # the planned (per-module) names, shapes and dtypes hold
        raise AssertionError(f"batched {kernel.name}: {sorted(outs)} != {sorted(spec)}")
    for p, (dtype, shape) in spec.items():
        if tuple(outs[p].shape[1:]) != tuple(shape) or outs[p].dtype != dtype:
            raise AssertionError(f"batched {kernel.name} {p}: {tuple(outs[p].shape[1:])} {outs[p].dtype} != {tuple(shape)} {dtype}")
    return outs, recs


def _marlin_int(t: dict[str, torch.Tensor], rec: dict, act_dtype: torch.dtype, v: str):
    from . import gpu

    n, k, bits, g = rec["size_n"], rec["size_k"], rec["num_bits"], rec["group_size"]
    pn, pk = rec["padded_n"], rec["padded_k"]
    out = {"weight_packed": gpu.marlin_tiles(t["weight_packed"], bits, n, k, pn, pk)}
    ng, _, _, pg = marlin.scale_dims(k, n, g, v)
    s = t["weight_scale"]  # (B, N, G)
    if s.shape[1:] != (n, ng):
        raise ValueError(f"weight_scale must be (N, G) = ({n}, {ng}), got {tuple(s.shape[1:])}")
    out["weight_scale"] = gpu.permute_scales(s, pg, pn, marlin.scale_perm_for(g, pk))
    if "weight_zero_point" in t:
        out["weight_zero_point"] = torch.stack([marlin.marlin_zero_points(z, k, n, bits, v, group_size=g) for z in t["weight_zero_point"]])
    if "bias" in t:
        out["bias"] = torch.stack([marlin.marlin_permute_bias(x, k, n, g, v) for x in t["bias"]])
    return out, None


def _marlin_fp8(t: dict[str, torch.Tensor], rec: dict, act_dtype: torch.dtype, v: str):
    from . import gpu

    n, k = rec["size_n"], rec["size_k"]
    pn, pk = marlin.marlin_padded_nk(n, k, -1, v)
    w = t["weight"]
    words = w.view(torch.uint8).view(torch.int32)  # (B, N, K/4): byte j of a word = k element 4i+j (§5.1)
    s = t["weight_scale"].to(torch.float32).to(act_dtype)  # fp8_expand_scales, channel (§5.1 step 2)
    permuted = gpu.permute_scales(s, 1, pn, marlin.scale_perms()[1])
    out = {
        "weight": gpu.marlin_tiles(words, 8, n, k, pn, pk),
        "weight_scale": marlin_fp8.fp8_fold_exponent_bias(permuted),
        "weight_scale_source": t["weight_scale"],
    }
    if "bias" in t:  # prepare_fp8_layer_for_marlin (kernels._marlin_fp8)
        out["bias"] = torch.stack([marlin.marlin_permute_bias(x, k, n, -1, v) for x in t["bias"]])
    return out, None


def _marlin_nvfp4(t: dict[str, torch.Tensor], rec: dict, act_dtype: torch.dtype, v: str):
    from . import gpu

    n, k = rec["size_n"], rec["size_k"]
    g = marlin_nvfp4.NVFP4_GROUP_SIZE
    pn, pk = marlin.marlin_padded_nk(n, k, g, v)
    ws = t["weight_scale"].view(torch.uint8)  # (B, N, K/16) e4m3 bytes
    b = ws.shape[0]
    # sf from the largest positive finite scale of each module
    sf = marlin_nvfp4.nvfp4_scale_factor_from_max(gpu.e4m3_top(ws), act_dtype, v)
    perm = marlin.scale_perms()[0]
    idx = perm[(torch.arange(64) // 4) * 4 + torch.tensor(marlin_nvfp4.REORDER4).repeat(16)]  # scale_perm, then [0,2,1,3] per 4
    codes = gpu.permute_scales(ws, pk // g, pn, idx, sf)
    words = t["weight_packed"].view(torch.int32)  # (B, N, K/8), nibble j of a word = k element 8i+j
    gs = t["weight_global_scale"].reshape(b, -1)
    _, marlin_gs = marlin_nvfp4.nvfp4_marlin_global_scale(gs, act_dtype, sf, dim=1)
    out = {
        "weight_packed": gpu.marlin_tiles(words, 4, n, k, pn, pk),
        "weight_scale": codes.view(torch.float8_e4m3fn),
        "weight_global_scale": marlin_gs,
        "weight_scale_source": t["weight_scale"],
        "weight_global_scale_source": t["weight_global_scale"],
    }
    if "bias" in t:  # prepare_fp4_layer_for_marlin (kernels._marlin_nvfp4)
        out["bias"] = torch.stack([marlin.marlin_permute_bias(x, k, n, g, v) for x in t["bias"]])
    return out, [{"scale_factor": float(x)} for x in sf.tolist()]


#: the CUDA fast paths: kernel -> (whether a batch qualifies, run(stacked tensors, record, act_dtype, version)
#: -> (stacked outputs, per-module record fields or None)); other kernels and batches go module by module
def _half_scales(t: dict[str, torch.Tensor]) -> bool:
    """16-bit scales: the batched kernels write scales of the activation's width; fp32 scales (a checkpoint
    quantized from fp32 weights) take the per-module path (an H200 run: batched marlin-int scales of an fp32
    model came out half as wide as the per-module layout)."""
    return t["weight_scale"].dtype in (torch.float16, torch.bfloat16)


_FAST = {
    "marlin-int": (lambda t: "weight_g_idx" not in t and _half_scales(t), _marlin_int),
    "marlin-fp8": (_fp8_channel_scales, _marlin_fp8),
    "marlin-nvfp4": (lambda t: True, _marlin_nvfp4),
}
