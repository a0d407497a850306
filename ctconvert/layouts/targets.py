"""Per-module repack for a target kernel, and its exact inverse.

``repack_module(kernel, tensors, weights, fmt, layout_version, act_dtype)``
takes one module's compressed-tensors tensors (local names: ``weight_packed``,
``weight_scale``, ...) and returns the tensors the kernel's layer holds after
vLLM's ``process_weights_after_loading`` (same parameter names, kernel
layout) plus a JSON-able record of everything the inverse needs
(``unrepack_module``). Kernels:

* ``marlin-int``: pack-quantized int4/int8, symmetric or asymmetric, grouped or
  channelwise, act-order (``weight_g_idx``, layout <= 0.29); kernel-layouts.md §2-§4.
* ``marlin-fp8``: FP8 weight-only Marlin (§5.1).
* ``marlin-nvfp4``: NVFP4 weights on Marlin, W4A16 (§5.2).
* ``cutlass-nvfp4``: NVFP4 W4A4 on CUTLASS: swizzled block scales, padded weight, ``alpha`` (§6).
"""

from __future__ import annotations

import torch

from . import marlin as M

LAYOUT_VERSIONS = ("0.33", "0.32", "0.31", "0.30", "0.29", "0.25", "0.21")
DEFAULT_LAYOUT_VERSION = "0.33"


def choose_kernel(target: str, fmt: str | None, weights: dict, parts: set[str]) -> str | None:
    """The kernel a module goes to under ``target`` (None: the target does not take it)."""
    bits = int(weights.get("num_bits") or 0)
    typ = weights.get("type")
    if target == "marlin":
        if fmt == "pack-quantized" and typ == "int" and bits in (4, 8):
            return "marlin-int"
        if fmt in ("float-quantized", "naive-quantized") and typ == "float" and bits == 8 and weights.get("strategy") in ("channel", "tensor"):
            return "marlin-fp8"
        if fmt == "nvfp4-pack-quantized":
            return "marlin-nvfp4"
        return None
    if target == "cutlass-nvfp4":
        if fmt == "nvfp4-pack-quantized" and "input_global_scale" in parts:
            return "cutlass-nvfp4"
        return None
    return None


def _group(weights: dict, k: int) -> int:
    s = weights.get("strategy")
    g = weights.get("group_size")
    return int(g) if s == "group" and g and int(g) != k else -1


def _marlin_int(t: dict[str, torch.Tensor], weights: dict, v: str) -> tuple[dict, dict]:
    if "weight_shape" not in t:
        raise ValueError("pack-quantized module without weight_shape")
    n, k = (int(x) for x in t["weight_shape"].tolist()) if t["weight_shape"].device.type != "meta" else _shape_from(t, weights)
    bits = int(weights["num_bits"])
    g = _group(weights, k)
    q_w = M.pack_quantized_to_gptq(t["weight_packed"], bits, k, copy=False)
    perm = sorted_g = None
    if "weight_g_idx" in t:
        sorted_g, perm = M.marlin_sort_g_idx(t["weight_g_idx"])
    out = {"weight_packed": M.marlin_repack(q_w, k, n, bits, perm, v, group_size=g),
           "weight_scale": M.marlin_permute_scales(t["weight_scale"].t(), k, n, g, v)}
    if "weight_zero_point" in t:
        out["weight_zero_point"] = M.marlin_zero_points(t["weight_zero_point"], k, n, bits, v, group_size=g)
    if "bias" in t:
        out["bias"] = M.marlin_permute_bias(t["bias"], k, n, g, v)
    if perm is not None:
        out["weight_g_idx"] = sorted_g
        out["g_idx_sort_indices"] = perm
    pn, pk = (n, k) if perm is not None else M.marlin_padded_nk(n, k, g, v)
    rec = {"kernel": "marlin-int", "size_n": n, "size_k": k, "num_bits": bits, "group_size": g, "padded_n": pn, "padded_k": pk,
           "act_order": perm is not None, "layout_version": v, "weight_g_idx_dtype": str(t["weight_g_idx"].dtype) if perm is not None else None}
    return out, rec


def _shape_from(t: dict[str, torch.Tensor], weights: dict) -> tuple[int, int]:
    """[N, K] of a pack-quantized module from tensor shapes alone (meta planning)."""
    n = t["weight_packed"].shape[0]
    bits = int(weights["num_bits"])
    s = t["weight_scale"]
    g = weights.get("group_size")
    if weights.get("strategy") == "group" and g:
        return n, s.shape[1] * int(g)
    return n, t["weight_packed"].shape[1] * 32 // bits


def _unmarlin_int(t: dict[str, torch.Tensor], rec: dict) -> dict:
    n, k, bits, g, v = rec["size_n"], rec["size_k"], rec["num_bits"], rec["group_size"], rec["layout_version"]
    perm = t.get("g_idx_sort_indices")
    q_w = M.marlin_unrepack(t["weight_packed"], k, n, bits, perm, v, group_size=g)
    out = {"weight_packed": M.gptq_to_pack_quantized(q_w, bits, k),
           "weight_scale": M.marlin_unpermute_scales(t["weight_scale"], k, n, g, v).t().contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64, device=q_w.device)}
    if "weight_zero_point" in t:
        out["weight_zero_point"] = M.marlin_unzero_points(t["weight_zero_point"], k, n, bits, v, group_size=g)
    if "bias" in t:
        out["bias"] = M.marlin_unpermute_bias(t["bias"], k, n, g, v)
    if perm is not None:
        g_idx = torch.empty_like(t["weight_g_idx"])
        g_idx[perm.long()] = t["weight_g_idx"]
        out["weight_g_idx"] = g_idx
    return out


def repack_module(kernel: str, tensors: dict[str, torch.Tensor], weights: dict, fmt: str, layout_version: str,
                  act_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """Kernel-layout tensors and the inverse's record for one module. Raises ``ValueError`` on shapes the kernel rejects."""
    if kernel == "marlin-int":
        return _marlin_int(tensors, weights, layout_version)
    if kernel in ("marlin-fp8", "marlin-nvfp4", "cutlass-nvfp4"):
        from . import fp_targets

        return fp_targets.repack(kernel, tensors, weights, layout_version, act_dtype)
    raise ValueError(f"unknown kernel {kernel!r}")


def unrepack_module(tensors: dict[str, torch.Tensor], rec: dict) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one module, bit for bit, from its kernel layout and record."""
    kernel = rec["kernel"]
    if kernel == "marlin-int":
        return _unmarlin_int(tensors, rec)
    if kernel in ("marlin-fp8", "marlin-nvfp4", "cutlass-nvfp4"):
        from . import fp_targets

        return fp_targets.unrepack(tensors, rec)
    raise ValueError(f"unknown kernel {kernel!r}")
