"""The kernel layouts: which module each kernel takes, its repack into vLLM's layout, and the exact inverse.

One :class:`Kernel` object per kernel layout (the table of targets and the kernels each offers is
``ctconvert.plan.kernel_targets``, which may import both ``formats/`` and ``layouts/``). ``repack`` takes one
module's compressed-tensors tensors (local names: ``weight_packed``,
``weight_scale``, ...) and returns the tensors the kernel's layer holds after
vLLM's ``process_weights_after_loading`` (same parameter names, kernel layout)
plus a JSON-able record of everything ``unrepack`` needs. A kernel decides what
it takes from the weight ``QuantizationArgs`` (a dict, as in the checkpoint's
config) and the names of the module's tensors, not from format names:

* ``marlin-int`` (:data:`MARLIN_INT`): packed int4/int8 (``weight_packed`` int32 words), symmetric or
  asymmetric, grouped or channelwise, act-order (``weight_g_idx``, layout <= 0.29);
  docs/kernel-layouts.md §2-§4.
* ``marlin-fp8`` (:data:`MARLIN_FP8`): FP8 weight-only Marlin, channel or tensor scales (§5.1).
* ``marlin-nvfp4`` (:data:`MARLIN_NVFP4`): NVFP4 weights on Marlin, W4A16 (§5.2).
* ``marlin-mxfp4`` (:data:`MARLIN_MXFP4`): MXFP4 weights on Marlin, W4A16 (§5.3).
* ``cutlass-nvfp4`` (:data:`CUTLASS_NVFP4`): NVFP4 W4A4 on CUTLASS: swizzled block scales, padded weight,
  ``alpha`` (§6).
* ``cutlass-2of4`` and ``cutlass-2of4-sm80``: one class, :class:`Sparse24Kernel`, over its layout parameters
  (:data:`.sparse24.SM90`: vLLM <= 0.18's ``CompressedTensors24`` for the SM90 CUTLASS 2:4 kernels, §8.1;
  :data:`.sparse24.SM80`: PyTorch's SM80 semi-structured layout, §8.2) and the sparse-24-bitmask functions,
  which its builder hands in.

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

from . import cutlass, marlin, marlin_fp8, marlin_mxfp4, marlin_nvfp4, sparse24
from .versions import DEFAULT_LAYOUT_VERSION, LAYOUT_VERSIONS

__all__ = [
    "CUTLASS_NVFP4",
    "DEFAULT_LAYOUT_VERSION",
    "LAYOUT_VERSIONS",
    "MARLIN_FP8",
    "MARLIN_INT",
    "MARLIN_MXFP4",
    "MARLIN_NVFP4",
    "Kernel",
    "Sparse24Kernel",
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


# ------------------------------------------------------------------ 2:4: cutlass-2of4 (§8.1), cutlass-2of4-sm80 (§8.2)


class Sparse24Kernel(Kernel):
    """A CUTLASS 2:4 kernel: a ``sparse-24-bitmask`` module (``compressed``, ``bitmask``, ``shape``; dense, FP8 or
    int8 values) in one :class:`~.sparse24.Sparse24Layout` (``layout``: :data:`.sparse24.SM90` or
    :data:`.sparse24.SM80`): ``weight`` values and ``meta``, ``weight_scale`` as float32; ``input_scale`` and
    ``bias`` as they are. The layout keeps neither which zero positions the bitmask marks nor the sign of a stored
    zero: ``bitmask_source`` and ``negative_zeros_source`` (packed like the bitmask) keep them for the exact inverse.

    ``bitmask``: the sparse-24-bitmask functions (``dense``, ``values``, ``pack``, ``unpack``;
    ``ctconvert.formats.sparse24.BITMASK``), given by the caller that builds the kernel: ``layouts/`` does not
    import ``formats/``."""

    def __init__(self, name: str, layout: sparse24.Sparse24Layout, bitmask):
        super().__init__(name, self._accepts, self._repack, self._unrepack, _SPARSE24_TAKES)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "bitmask", bitmask)

    @staticmethod
    def _accepts(weights: dict, parts: set) -> bool:
        bits, _ = _bits_type(weights)
        return {"compressed", "bitmask"} <= parts and bits in (0, 8)

    def _kernel_tensors(self, c: torch.Tensor, bm: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
        if c.device.type == "meta":  # planning: only the shapes
            return {p: torch.empty(shape, dtype=dt, device="meta") for p, (dt, shape) in self.layout.planned(n, k, c.dtype).items()}
        try:
            dense = self.bitmask.dense(c, bm, (n, k))
        except ValueError as e:
            raise ValueError(f"compressed {tuple(c.shape)} and bitmask do not describe a 2:4 weight ({n}, {k})") from e
        comp = self.layout.compress(dense)
        return {"weight": comp["values"], "meta": comp["meta"]}

    def _repack(self, t: dict[str, torch.Tensor], weights: dict, v: str, act_dtype: torch.dtype) -> tuple[dict, dict]:
        c, bm = t["compressed"], t["bitmask"]
        n, k = c.shape[0], 2 * c.shape[1]
        if k % 8:
            raise ValueError(f"K={k} is not a multiple of 8 (vLLM's cutlass_sparse_compress)")
        if c.dtype not in self.layout.dtypes:
            raise ValueError(f"{c.dtype} weights are not taken by the {self.layout.arch} 2:4 layout")
        if c.device.type == "meta":
            negzero = torch.empty((n, -(-(k // 2) // 8)), dtype=torch.uint8, device="meta")
        else:
            negzero = self.bitmask.pack(sparse24.negative_zeros(c))
        out = {**self._kernel_tensors(c, bm, n, k), "bitmask_source": bm, "negative_zeros_source": negzero}
        if "weight_scale" in t:
            out["weight_scale"] = t["weight_scale"].to(torch.float32)
        out.update({p: t[p] for p in ("input_scale", "bias") if p in t})
        scale_dtype = str(t["weight_scale"].dtype) if "weight_scale" in t else None
        return out, {"kernel": self.name, "size_n": n, "size_k": k, "layout_version": v, "scale_dtype": scale_dtype}

    def _unrepack(self, t: dict[str, torch.Tensor], rec: dict) -> dict:
        n, k = rec["size_n"], rec["size_k"]
        dense = self.layout.decompress(t["weight"], t["meta"], n, k)
        values = self.bitmask.values(dense, t["bitmask_source"])
        out = {
            "compressed": sparse24.restore_negative_zeros(values, self.bitmask.unpack(t["negative_zeros_source"], values.shape[1])),
            "bitmask": t["bitmask_source"],
            "shape": torch.tensor([[n], [k]], dtype=torch.int64, device=dense.device),
        }
        if "weight_scale" in t:
            out["weight_scale"] = t["weight_scale"].to(getattr(torch, rec["scale_dtype"].replace("torch.", "")))
        out.update({p: t[p] for p in ("input_scale", "bias") if p in t})
        return out


_SPARSE24_TAKES = ("compressed", "bitmask", "shape", "weight_scale", "input_scale", "bias")


# ------------------------------------------------------------------ the kernels that need nothing from outside layouts/

MARLIN_INT = Kernel(
    "marlin-int",
    _takes_marlin_int,
    _marlin_int,
    _unmarlin_int,
    ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "bias"),
)
MARLIN_FP8 = Kernel("marlin-fp8", _takes_marlin_fp8, _marlin_fp8, _unmarlin_fp8, ("weight", "weight_scale", "bias"))
MARLIN_NVFP4 = Kernel("marlin-nvfp4", _takes_nvfp4, _marlin_nvfp4, _unmarlin_nvfp4, ("weight_packed", "weight_scale", "weight_global_scale", "bias"))
MARLIN_MXFP4 = Kernel("marlin-mxfp4", _takes_marlin_mxfp4, _marlin_mxfp4, _unmarlin_mxfp4, ("weight_packed", "weight_scale", "bias"))
CUTLASS_NVFP4 = Kernel(
    "cutlass-nvfp4",
    _takes_cutlass_nvfp4,
    _cutlass_nvfp4,
    _uncutlass_nvfp4,
    ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "bias"),
)


def split_parts(kernel: Kernel, tensors: dict) -> tuple[dict, dict]:
    """``(taken, copied)``: the module's tensors ``kernel`` rebuilds (its :attr:`Kernel.takes`), and the others,
    which :func:`repack_module` copies unchanged (an ``input_global_scale`` or ``input_scale`` on Marlin, which
    runs the activations unquantized)."""
    takes = kernel.takes
    return {p: t for p, t in tensors.items() if p in takes}, {p: t for p, t in tensors.items() if p not in takes}


def with_copied(kernel: Kernel, outs: dict, rec: dict, copied: dict) -> None:
    """Add the ``copied`` tensors (:func:`split_parts`) to a kernel's ``outs``, unchanged under their own names,
    and list them in ``rec["copied"]`` (so that :func:`unrepack_module` gives them back), in place. Raises
    ``ValueError`` when one has the name of a kernel tensor."""
    if clash := sorted(copied.keys() & outs.keys()):
        raise ValueError(f"{kernel.name} writes {', '.join(clash)} itself; the module's own tensor of that name cannot be kept")
    outs.update(copied)
    if copied:
        rec["copied"] = sorted(copied)


def repack_module(
    kernel: Kernel, tensors: dict[str, torch.Tensor], weights: dict, layout_version: str, act_dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict]:
    """Kernel-layout tensors and the inverse's record for one module.

    ``tensors``: every tensor of the module (local names), on any device (``meta`` to plan). The kernel
    rebuilds those it takes; each other one is copied unchanged under its own name and listed in the
    record's ``copied`` (:func:`with_copied`): nothing of the module is left out. Raises ``ValueError``
    on shapes the kernel rejects."""
    taken, copied = split_parts(kernel, tensors)
    outs, rec = kernel.repack(taken, weights, layout_version, act_dtype)
    with_copied(kernel, outs, rec, copied)
    return outs, rec


def unrepack_module(kernel: Kernel, tensors: dict[str, torch.Tensor], rec: dict) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one module, bit for bit, from its kernel layout and record (the
    record's ``copied`` tensors as they are). Raises ``KeyError`` for a missing tensor."""
    copied = rec.get("copied") or []
    out = kernel.unrepack({p: t for p, t in tensors.items() if p not in copied}, rec)
    out.update({p: tensors[p] for p in copied})
    return out
