"""The kernels table: which module each kernel takes, its repack into vLLM's layout, and the exact inverse.

:data:`KERNELS` holds one :class:`Kernel` per kernel layout. ``repack`` takes one
module's compressed-tensors tensors (local names: ``weight_packed``,
``weight_scale``, ...) and returns the tensors the kernel's layer holds after
vLLM's ``process_weights_after_loading`` (same parameter names, kernel layout)
plus a JSON-able record of everything ``unrepack`` needs. A kernel decides what
it takes from the weight ``QuantizationArgs`` (a dict, as in the checkpoint's
config) and the names of the module's tensors, not from format names:

* ``marlin-int``: packed int4/int8 (``weight_packed`` int32 words), symmetric or
  asymmetric, grouped or channelwise, act-order (``weight_g_idx``, layout <= 0.29);
  docs/kernel-layouts.md §2-§4.
* ``marlin-fp8``: FP8 weight-only Marlin, channel or tensor scales (§5.1).
* ``marlin-nvfp4``: NVFP4 weights on Marlin, W4A16 (§5.2).
* ``marlin-mxfp4``: MXFP4 weights on Marlin, W4A16 (§5.3).
* ``cutlass-nvfp4``: NVFP4 W4A4 on CUTLASS: swizzled block scales, padded weight, ``alpha`` (§6).
* ``cutlass-2of4`` (target ``cutlass-2of4``): a ``sparse-24-bitmask`` module (dense 2:4 values, FP8 or
  int8) as vLLM <= 0.18's ``CompressedTensors24`` holds it for the SM90 CUTLASS 2:4 kernels: ``weight``
  (``cutlass_sparse_compress`` values), ``meta``, ``weight_scale`` as float32 (§8.1). The layout forgets
  which zero positions the bitmask marks and the sign of a stored zero: ``bitmask_source`` and
  ``negative_zeros_source`` keep them for the exact inverse.
* ``cutlass-2of4-sm80`` (target ``cutlass-2of4-sm80``): the same module in PyTorch's SM80 semi-structured
  layout (``torch.sparse.to_sparse_semi_structured``, CUTLASS backend): ``weight`` values and ``meta`` (§8.2).
* ``marlin-24`` (target ``marlin-24``, ``quantize`` only): int4 2:4 values and fp16 scales
  (:class:`ctconvert.formats.sparse24.Marlin24Values`) packed as ``weight_packed``/``meta``/``scale_packed``
  (§9). Its output is the compressed-tensors ``marlin-24`` format itself (what vLLM <= 0.15 loads), so
  :data:`CT_FORMAT_TARGETS` lists it: its checkpoint keeps compressed-tensors' config, not the kernel-native tag.

Where vLLM's processing loses information (scales cast or folded into the
activation dtype, fused shards' global-scale divisors reduced to one
reciprocal; see :mod:`.marlin_fp8`, :mod:`.marlin_nvfp4`, :mod:`.cutlass`),
the source tensor is kept beside the kernel tensors as ``<name>_source`` so
that the inverse is exact; a kernel never reads those.

Every tensor of a module is accounted for: a kernel rebuilds the tensors it
takes (:attr:`Kernel.takes`; a Linear's ``bias`` as vLLM holds it after
loading: ``marlin_permute_bias`` on every Marlin kernel, as
``prepare_fp8_layer_for_marlin`` / ``prepare_fp4_layer_for_marlin`` in vLLM
0.33's ``marlin_utils_fp8.py`` / ``marlin_utils_fp4.py`` do; unchanged on
CUTLASS NVFP4), and :func:`repack_module` copies every other one unchanged
under its own name and lists it in the record's ``copied`` (e.g. the
``input_global_scale`` of an NVFP4 W4A4 module or the static ``input_scale`` of
an FP8 one on Marlin, whose activations stay 16-bit), which the inverse gives
back as it is. Nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cutlass, marlin, marlin24, marlin_fp8, marlin_mxfp4, marlin_nvfp4, sparse24
from .versions import DEFAULT_LAYOUT_VERSION, LAYOUT_VERSIONS

__all__ = [
    "CT_FORMAT_TARGETS",
    "DEFAULT_LAYOUT_VERSION",
    "KERNELS",
    "LAYOUT_VERSIONS",
    "TARGETS",
    "VLLM_RELEASES",
    "Kernel",
    "choose_kernel",
    "repack_module",
    "split_parts",
    "unrepack_module",
    "with_copied",
]


@dataclass(frozen=True)
class Kernel:
    """One kernel layout. ``accepts(weights, parts)``; ``repack(tensors, weights, layout_version, act_dtype)
    -> (tensors, record)``; ``unrepack(tensors, record) -> tensors``. ``takes``: the module's tensors
    (local names) that ``repack`` reads and rebuilds; :func:`repack_module` copies every other tensor of
    the module unchanged (:func:`split_parts`)."""

    name: str
    target: str  # the --target that builds it
    accepts: Callable[[dict, set], bool]
    repack: Callable[[dict, dict, str, torch.dtype], tuple[dict, dict]]
    unrepack: Callable[[dict, dict], dict]
    takes: tuple[str, ...] = ()


def _bits_type(weights: dict) -> tuple[int, str | None]:
    return int(weights.get("num_bits") or 0), weights.get("type")


# ------------------------------------------------------------------ marlin-int (§2-§4)


def _takes_marlin_int(weights: dict, parts: set) -> bool:
    bits, typ = _bits_type(weights)
    return "weight_packed" in parts and typ == "int" and bits in (4, 8)


def _group(weights: dict, k: int) -> int:
    s = weights.get("strategy")
    g = weights.get("group_size")
    return int(g) if s == "group" and g and int(g) != k else -1


def _marlin_int(t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
    if "weight_shape" not in t or t["weight_shape"].device.type == "meta":
        raise ValueError("pack-quantized module without weight_shape values")  # (also when planning on meta tensors)
    n, k = (int(x) for x in t["weight_shape"].tolist())
    bits = int(weights["num_bits"])
    g = _group(weights, k)
    q_w = marlin.pack_quantized_to_gptq(t["weight_packed"], bits, k, copy=False)
    perm = sorted_g = None
    if "weight_g_idx" in t:
        sorted_g, perm = marlin.marlin_sort_g_idx(t["weight_g_idx"])
    out = {
        "weight_packed": marlin.marlin_repack(q_w, k, n, bits, perm, v, group_size=g),
        "weight_scale": marlin.marlin_permute_scales(t["weight_scale"].t(), k, n, g, v),
    }
    if "weight_zero_point" in t:
        out["weight_zero_point"] = marlin.marlin_zero_points(t["weight_zero_point"], k, n, bits, v, group_size=g)
    if "bias" in t:
        out["bias"] = marlin.marlin_permute_bias(t["bias"], k, n, g, v)
    if perm is not None:
        out["weight_g_idx"] = sorted_g
        out["g_idx_sort_indices"] = perm
    pn, pk = (n, k) if perm is not None else marlin.marlin_padded_nk(n, k, g, v)
    rec = {
        "kernel": "marlin-int",
        "size_n": n,
        "size_k": k,
        "num_bits": bits,
        "group_size": g,
        "padded_n": pn,
        "padded_k": pk,
        "act_order": perm is not None,
        "layout_version": v,
        "weight_g_idx_dtype": str(t["weight_g_idx"].dtype) if perm is not None else None,
    }
    return out, rec


def _unmarlin_int(t: dict[str, torch.Tensor], rec: dict) -> dict:
    n, k, bits, g, v = rec["size_n"], rec["size_k"], rec["num_bits"], rec["group_size"], rec["layout_version"]
    perm = t.get("g_idx_sort_indices")
    q_w = marlin.marlin_unrepack(t["weight_packed"], k, n, bits, perm, v, group_size=g)
    out = {
        "weight_packed": marlin.gptq_to_pack_quantized(q_w, bits, k),
        "weight_scale": marlin.marlin_unpermute_scales(t["weight_scale"], k, n, g, v).t().contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64, device=q_w.device),
    }
    if "weight_zero_point" in t:
        out["weight_zero_point"] = marlin.marlin_unzero_points(t["weight_zero_point"], k, n, bits, v, group_size=g)
    if "bias" in t:
        out["bias"] = marlin.marlin_unpermute_bias(t["bias"], k, n, g, v)
    if perm is not None:
        g_idx = torch.empty_like(t["weight_g_idx"])
        g_idx[perm.long()] = t["weight_g_idx"]
        out["weight_g_idx"] = g_idx
    return out


# ------------------------------------------------------------------ marlin-fp8 (§5.1)


def _takes_marlin_fp8(weights: dict, parts: set) -> bool:
    bits, typ = _bits_type(weights)
    return "weight" in parts and typ == "float" and bits == 8 and weights.get("strategy") in ("channel", "tensor")


def _marlin_fp8(t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
    w = t["weight"]
    n, k = w.shape
    k_out = marlin_fp8.marlin_fp8_repack(w, t["weight_scale"], act_dtype, v)
    out = {"weight": k_out["marlin_q_w"], "weight_scale": k_out["marlin_scales"], "weight_scale_source": t["weight_scale"]}
    rec = {
        "kernel": "marlin-fp8",
        "size_n": n,
        "size_k": k,
        "strategy": weights.get("strategy") or "channel",
        "layout_version": v,
        "scale_dtype": str(t["weight_scale"].dtype),
    }
    if "bias" in t:  # prepare_fp8_layer_for_marlin: marlin_permute_bias (padded as the weight: group -1)
        out["bias"] = marlin.marlin_permute_bias(t["bias"], k, n, -1, v)
        rec["bias_permuted"] = True  # (a record without it: written before ctconvert permuted FP8 biases)
    return out, rec


def _unmarlin_fp8(t: dict[str, torch.Tensor], rec: dict) -> dict:
    back = marlin_fp8.marlin_fp8_unrepack(
        {"marlin_q_w": t["weight"], "marlin_scales": t["weight_scale"]},
        rec["size_n"],
        rec["size_k"],
        rec["layout_version"],
        strategy=rec["strategy"],
        scale_dtype=getattr(torch, rec["scale_dtype"].replace("torch.", "")),
    )
    out = {"weight": back["weight"], "weight_scale": t["weight_scale_source"]}
    if "bias" in t:
        b = t["bias"]
        out["bias"] = marlin.marlin_unpermute_bias(b, rec["size_k"], rec["size_n"], -1, rec["layout_version"]) if rec.get("bias_permuted") else b
    return out


# ------------------------------------------------------------------ NVFP4: marlin-nvfp4 (§5.2), cutlass-nvfp4 (§6)


def _takes_nvfp4(weights: dict, parts: set) -> bool:
    bits, typ = _bits_type(weights)
    return {"weight_packed", "weight_global_scale"} <= parts and typ == "float" and bits == 4


def _takes_cutlass_nvfp4(weights: dict, parts: set) -> bool:
    return _takes_nvfp4(weights, parts) and "input_global_scale" in parts


def _marlin_nvfp4(t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
    wp = t["weight_packed"]
    n, k = wp.shape[0], wp.shape[1] * 2
    k_out = marlin_nvfp4.marlin_nvfp4_repack(wp, t["weight_scale"], t["weight_global_scale"], act_dtype, v)
    out = {
        "weight_packed": k_out["marlin_q_w"],
        "weight_scale": k_out["marlin_scales"],
        "weight_global_scale": k_out["marlin_global_scale"],
        "weight_scale_source": t["weight_scale"],
        "weight_global_scale_source": t["weight_global_scale"],
    }
    if "bias" in t:  # prepare_fp4_layer_for_marlin: marlin_permute_bias (padded as the weight: group 16)
        out["bias"] = marlin.marlin_permute_bias(t["bias"], k, n, marlin_nvfp4.NVFP4_GROUP_SIZE, v)
    sf = k_out["scale_factor"]
    rec = {
        "kernel": "marlin-nvfp4",
        "size_n": n,
        "size_k": k,
        "layout_version": v,
        "act_dtype": str(act_dtype).replace("torch.", ""),
        "scale_factor": float(sf) if sf.device.type != "meta" else None,
    }
    return out, rec


def _unmarlin_nvfp4(t: dict[str, torch.Tensor], rec: dict) -> dict:
    act = torch.float16 if rec.get("act_dtype") == "float16" else torch.bfloat16
    back = marlin_nvfp4.marlin_nvfp4_unrepack(
        {
            "marlin_q_w": t["weight_packed"],
            "marlin_scales": t["weight_scale"],
            "marlin_global_scale": t["weight_global_scale"],
            "scale_factor": torch.tensor(rec["scale_factor"] or 1.0),
        },
        rec["size_n"],
        rec["size_k"],
        act,
        rec["layout_version"],
        weight_global_scale=t["weight_global_scale_source"],
    )
    out = {"weight_packed": back["weight_packed"], "weight_scale": t["weight_scale_source"], "weight_global_scale": t["weight_global_scale_source"]}
    if "bias" in t:
        out["bias"] = marlin.marlin_unpermute_bias(t["bias"], rec["size_k"], rec["size_n"], marlin_nvfp4.NVFP4_GROUP_SIZE, rec["layout_version"])
    return out


def _cutlass_nvfp4(t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
    wp = t["weight_packed"]
    n, k = wp.shape[0], wp.shape[1] * 2
    k_out = cutlass.nvfp4_cutlass_layer(wp, t["weight_scale"], t["weight_global_scale"], t["input_global_scale"])
    out = {
        "weight_packed": k_out["weight"],
        "weight_scale": k_out["weight_scale"],
        "alpha": k_out["alpha"],
        "input_global_scale_inv": k_out["input_global_scale_inv"],
        "weight_global_scale_source": t["weight_global_scale"],
        "input_global_scale_source": t["input_global_scale"],
    }
    if "bias" in t:  # the CUTLASS NVFP4 linear adds the bias as it is (no load-time change)
        out["bias"] = t["bias"]
    rec = {
        "kernel": "cutlass-nvfp4",
        "size_n": n,
        "size_k": k,
        "layout_version": v,
        "weights_padding_bytes": int(k_out["weights_padding_bytes"]) if wp.device.type != "meta" else None,
    }
    return out, rec


def _uncutlass_nvfp4(t: dict[str, torch.Tensor], rec: dict) -> dict:
    back = cutlass.nvfp4_cutlass_unlayer(
        {"weight": t["weight_packed"], "weight_scale": t["weight_scale"], "alpha": t["alpha"], "input_global_scale_inv": t["input_global_scale_inv"]},
        rec["size_n"],
        rec["size_k"],
        weight_global_scale=t["weight_global_scale_source"],
    )
    out = {
        "weight_packed": back["weight_packed"],
        "weight_scale": back["weight_scale"],
        "weight_global_scale": t["weight_global_scale_source"],
        "input_global_scale": t["input_global_scale_source"],
    }
    if "bias" in t:
        out["bias"] = t["bias"]
    return out


# ------------------------------------------------------------------ marlin-mxfp4 (§5.3)


def _takes_marlin_mxfp4(weights: dict, parts: set) -> bool:
    bits, typ = _bits_type(weights)
    return "weight_packed" in parts and "weight_global_scale" not in parts and typ == "float" and bits == 4 and weights.get("group_size") == 32


def _marlin_mxfp4(t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
    wp = t["weight_packed"]
    n, k = wp.shape[0], wp.shape[1] * 2
    k_out = marlin_mxfp4.marlin_mxfp4_repack(wp, t["weight_scale"], act_dtype, v)
    out = {"weight_packed": k_out["marlin_q_w"], "weight_scale": k_out["marlin_scales"]}
    if act_dtype == torch.float16:  # the cast to fp16 loses scales outside its range (marlin_mxfp4 docstring)
        out["weight_scale_source"] = t["weight_scale"]
    if "bias" in t:  # prepare_fp4_layer_for_marlin: marlin_permute_bias (padded as the weight: group 32)
        out["bias"] = marlin.marlin_permute_bias(t["bias"], k, n, marlin_mxfp4.MXFP4_GROUP_SIZE, v)
    rec = {"kernel": "marlin-mxfp4", "size_n": n, "size_k": k, "layout_version": v, "act_dtype": str(act_dtype).replace("torch.", "")}
    return out, rec


def _unmarlin_mxfp4(t: dict[str, torch.Tensor], rec: dict) -> dict:
    back = marlin_mxfp4.marlin_mxfp4_unrepack(
        {"marlin_q_w": t["weight_packed"], "marlin_scales": t["weight_scale"]}, rec["size_n"], rec["size_k"], rec["layout_version"]
    )
    out = {"weight_packed": back["weight_packed"], "weight_scale": t.get("weight_scale_source", back["weight_scale"])}
    if "bias" in t:
        out["bias"] = marlin.marlin_unpermute_bias(t["bias"], rec["size_k"], rec["size_n"], marlin_mxfp4.MXFP4_GROUP_SIZE, rec["layout_version"])
    return out


# ------------------------------------------------------------------ 2:4: cutlass-2of4 (§8.1), cutlass-2of4-sm80 (§8.2), marlin-24 (§9)


def _takes_sparse24(weights: dict, parts: set) -> bool:
    bits, _ = _bits_type(weights)
    return {"compressed", "bitmask"} <= parts and bits in (0, 8)


def _sparse24(layout: str):
    def repack(t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
        c, bm = t["compressed"], t["bitmask"]
        n, k = c.shape[0], 2 * c.shape[1]
        if k % 8:
            raise ValueError(f"K={k} is not a multiple of 8 (vLLM's cutlass_sparse_compress)")
        dtypes = sparse24.SM90_DTYPES if layout == "sm90" else sparse24.SM80_DTYPES
        if c.dtype not in dtypes:
            raise ValueError(f"{c.dtype} weights are not taken by the {layout.upper()} 2:4 layout")
        if c.device.type == "meta":  # planning: only the shapes
            dense = torch.empty((n, k), dtype=c.dtype, device="meta")
            if layout == "sm90":
                vk, me, ke = sparse24.sm90_sizes(n, k, c.dtype)
                kt = {"weight": torch.empty((n, vk), dtype=c.dtype, device="meta"), "meta": torch.empty((me, ke), dtype=torch.uint8, device="meta")}
            else:
                sparse24.sm80_check_shape(n, k, c.dtype)
                md, per = (torch.int32, 32) if c.dtype == torch.int8 else (torch.int16, 16)
                kt = {"weight": torch.empty((n, k // 2), dtype=c.dtype, device="meta"), "meta": torch.empty((n, k // per), dtype=md, device="meta")}
        else:
            dense = sparse24.bitmask_dense(c, bm, n, k)
            comp = sparse24.sm90_compress(dense) if layout == "sm90" else sparse24.sm80_compress(dense)
            kt = {"weight": comp["values"], "meta": comp["meta"]}
        # the kernel layout keeps neither which zeros the bitmask marks nor the sign of a stored zero: both kept
        out = {
            **kt,
            "bitmask_source": bm,
            "negative_zeros_source": sparse24.negative_zeros(c)
            if c.device.type != "meta"
            else torch.empty((n, -(-(k // 2) // 8)), dtype=torch.uint8, device="meta"),
        }
        if "weight_scale" in t:
            out["weight_scale"] = t["weight_scale"].to(torch.float32)
        for p in ("input_scale", "bias"):
            if p in t:
                out[p] = t[p]
        rec = {
            "kernel": "cutlass-2of4" if layout == "sm90" else "cutlass-2of4-sm80",
            "size_n": n,
            "size_k": k,
            "layout_version": v,
            "scale_dtype": str(t["weight_scale"].dtype) if "weight_scale" in t else None,
        }
        return out, rec

    def unrepack(t: dict[str, torch.Tensor], rec: dict) -> dict:
        n, k = rec["size_n"], rec["size_k"]
        if layout == "sm90":
            dense = sparse24.sm90_decompress(t["weight"], t["meta"], n, k)
        else:
            dense = sparse24.sm80_decompress(t["weight"], t["meta"])
        out = {
            "compressed": sparse24.restore_negative_zeros(sparse24.bitmask_values(dense, t["bitmask_source"]), t["negative_zeros_source"]),
            "bitmask": t["bitmask_source"],
            "shape": torch.tensor([[n], [k]], dtype=torch.int64, device=dense.device),
        }
        if "weight_scale" in t:
            out["weight_scale"] = t["weight_scale"].to(getattr(torch, rec["scale_dtype"].replace("torch.", "")))
        for p in ("input_scale", "bias"):
            if p in t:
                out[p] = t[p]
        return out

    return repack, unrepack


def _takes_marlin24(weights: dict, parts: set) -> bool:
    bits, typ = _bits_type(weights)
    return {"weight", "weight_scale"} <= parts and typ == "int" and bits == 4


def _marlin24(t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
    q, s = t["weight"], t["weight_scale"]
    n, k = q.shape
    g = weights.get("group_size") if weights.get("strategy") == "group" else None
    if (problem := marlin24.marlin24_shape_problem(n, k, g)) is not None:
        raise ValueError(problem)
    if q.device.type == "meta":
        out = {
            "weight_packed": torch.empty((k // 32, 2 * n), dtype=torch.int32, device="meta"),
            "meta": torch.empty((k // 32, 2 * n), dtype=torch.int16, device="meta"),
            "scale_packed": torch.empty((s.shape[1], n), dtype=torch.float16, device="meta"),
        }
    else:
        out = marlin24.marlin24_pack(q, s, g)
    return out, {"kernel": "marlin-24", "size_n": n, "size_k": k, "group_size": g or -1, "layout_version": v}


def _unmarlin24(t: dict[str, torch.Tensor], rec: dict) -> dict:
    n, k, g = rec["size_n"], rec["size_k"], rec["group_size"]
    return {
        "weight": marlin24.marlin24_unpack(t["weight_packed"], t["meta"], n, k),
        "weight_scale": marlin24.marlin24_unpermute_scales(t["scale_packed"], k, None if g == -1 else g),
    }


# ------------------------------------------------------------------ the table

_SPARSE24_TAKES = ("compressed", "bitmask", "shape", "weight_scale", "input_scale", "bias")


#: every kernel layout, in the order a target tries them
KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel(
            "marlin-int",
            "marlin",
            _takes_marlin_int,
            _marlin_int,
            _unmarlin_int,
            ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "bias"),
        ),
        Kernel("marlin-fp8", "marlin", _takes_marlin_fp8, _marlin_fp8, _unmarlin_fp8, ("weight", "weight_scale", "bias")),
        Kernel("marlin-nvfp4", "marlin", _takes_nvfp4, _marlin_nvfp4, _unmarlin_nvfp4, ("weight_packed", "weight_scale", "weight_global_scale", "bias")),
        Kernel("marlin-mxfp4", "marlin", _takes_marlin_mxfp4, _marlin_mxfp4, _unmarlin_mxfp4, ("weight_packed", "weight_scale", "bias")),
        Kernel(
            "cutlass-nvfp4",
            "cutlass-nvfp4",
            _takes_cutlass_nvfp4,
            _cutlass_nvfp4,
            _uncutlass_nvfp4,
            ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "bias"),
        ),
        Kernel("cutlass-2of4", "cutlass-2of4", _takes_sparse24, *_sparse24("sm90"), _SPARSE24_TAKES),
        Kernel("cutlass-2of4-sm80", "cutlass-2of4-sm80", _takes_sparse24, *_sparse24("sm80"), _SPARSE24_TAKES),
        Kernel("marlin-24", "marlin-24", _takes_marlin24, _marlin24, _unmarlin24, ("weight", "weight_scale")),
    )
}
#: the kernel-layout targets (``--target``) and what each takes, for messages
TARGETS = {
    "marlin": "pack-quantized int4/int8 (W4A16, W4A16_ASYM, W8A16), FP8 per channel or tensor (FP8_DYNAMIC), NVFP4 (NVFP4A16) and MXFP4 (MXFP4A16)",
    "cutlass-nvfp4": "NVFP4 W4A4 (with input_global_scale)",
    "cutlass-2of4": "sparse-24-bitmask (dense, FP8, int8) for the SM90 CUTLASS 2:4 kernels",
    "cutlass-2of4-sm80": "sparse-24-bitmask (fp16/bf16, int8) in PyTorch's SM80 semi-structured layout",
    "marlin-24": "W4A16 with --sparsity 2:4 (quantize only)",
}
#: targets whose output is a compressed-tensors format (its own config), not the kernel-native tag
CT_FORMAT_TARGETS = ("marlin-24",)
#: which vLLM releases load each 2:4 output (docs/kernel-layouts.md §0.1, §8, §9; docs/field-notes.md F1)
VLLM_RELEASES = {
    "sparse-24-bitmask": "vLLM <= 0.18 (CompressedTensors24, SM90 GPUs; removed by vLLM PR #36799); compressed-tensors <= 0.14 reads it",
    "marlin-24": "vLLM <= 0.15 (CompressedTensorsW4A16Sparse24, SM80+ GPUs, fp16 activations); compressed-tensors <= 0.14 reads it",
    "cutlass-2of4": "kernel-native, no loader reads it as is: the tensors vLLM <= 0.18 builds at load time for the SM90 CUTLASS 2:4 kernels "
    "(cutlass_scaled_sparse_mm)",
    "cutlass-2of4-sm80": "kernel-native, no loader reads it as is: PyTorch's SM80 semi-structured layout (values and meta of "
    "torch.sparse.SparseSemiStructuredTensorCUTLASS)",
}


def choose_kernel(target: str, weights: dict, parts: set[str]) -> str | None:
    """The kernel a module goes to under ``target`` (None: the target does not take it).

    ``weights``: the module's weight QuantizationArgs (a dict); ``parts``: the names of its tensors."""
    return next((k.name for k in KERNELS.values() if k.target == target and k.accepts(weights, set(parts))), None)


def split_parts(kernel: str, tensors: dict) -> tuple[dict, dict]:
    """``(taken, copied)``: the module's tensors ``kernel`` rebuilds (its :attr:`Kernel.takes`), and the others,
    which :func:`repack_module` copies unchanged (an ``input_global_scale`` or ``input_scale`` on Marlin, which
    runs the activations unquantized). Raises ``ValueError`` for an unknown kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}")
    takes = KERNELS[kernel].takes
    return {p: t for p, t in tensors.items() if p in takes}, {p: t for p, t in tensors.items() if p not in takes}


def with_copied(kernel: str, outs: dict, rec: dict, copied: dict) -> None:
    """Add the ``copied`` tensors (:func:`split_parts`) to a kernel's ``outs``, unchanged under their own names,
    and list them in ``rec["copied"]`` (so that :func:`unrepack_module` gives them back), in place. Raises
    ``ValueError`` when one has the name of a kernel tensor."""
    if clash := sorted(copied.keys() & outs.keys()):
        raise ValueError(f"{kernel} writes {', '.join(clash)} itself; the module's own tensor of that name cannot be kept")
    outs.update(copied)
    if copied:
        rec["copied"] = sorted(copied)


def repack_module(
    kernel: str, tensors: dict[str, torch.Tensor], weights: dict, layout_version: str, act_dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict]:
    """Kernel-layout tensors and the inverse's record for one module.

    ``tensors``: every tensor of the module (local names), on any device (``meta`` to plan). The kernel
    rebuilds those it takes; each other one is copied unchanged under its own name and listed in the
    record's ``copied`` (:func:`with_copied`): nothing of the module is left out. Raises ``ValueError``
    on shapes the kernel rejects or an unknown kernel."""
    taken, copied = split_parts(kernel, tensors)
    outs, rec = KERNELS[kernel].repack(taken, weights, layout_version, act_dtype)
    with_copied(kernel, outs, rec, copied)
    return outs, rec


def unrepack_module(tensors: dict[str, torch.Tensor], rec: dict) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one module, bit for bit, from its kernel layout and record (the
    record's ``copied`` tensors as they are). Raises ``ValueError`` for an unknown kernel, ``KeyError`` for a
    missing tensor."""
    kernel = rec["kernel"]
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}")
    copied = rec.get("copied") or []
    out = KERNELS[kernel].unrepack({p: t for p, t in tensors.items() if p not in copied}, rec)
    out.update({p: tensors[p] for p in copied})
    return out
