"""The modules of a compressed-tensors checkpoint: which group, format and args each has.

Resolution follows compressed-tensors (``utils/match.py``,
compressed-tensors-format.md §7.5): a module listed in ``ignore`` is dense;
otherwise, among every group's targets, exact names win over ``re:`` patterns,
which win over the class name ``Linear``; ties go to the first group.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .checkpoint.reader import Checkpoint
from .checkpoint.safetensors_io import TensorInfo, read_rows, read_tensor
from .formats.dequant import dequantize_weight, logical_shape
from .plan import _FUSED_OF, is_linear_weight, matches

QUANT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape", "weight_g_idx")
ACT_PARTS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point")


@dataclass
class Module:
    name: str
    parts: dict[str, TensorInfo] = field(default_factory=dict)  # local name -> tensor
    group: str | None = None
    format: str | None = None
    weights: dict | None = None

    @property
    def quantized(self) -> bool:
        return "weight_packed" in self.parts or {"weight", "weight_scale"} <= self.parts.keys()


def resolve_group(module: str, qcfg: dict, is_linear: bool) -> str | None:
    """The config group that applies to ``module`` (None when ignored or untargeted)."""
    if matches(module, qcfg.get("ignore") or [], is_linear=is_linear):
        return None
    best = None
    for gname, g in (qcfg.get("config_groups") or {}).items():
        for t in g.get("targets") or []:
            if t == module:
                kind = 0
            elif t.startswith("re:") and re.match(t[3:], module):
                kind = 1
            elif t == "Linear" and is_linear:
                kind = 2
            else:
                continue
            if best is None or kind < best[0]:
                best = (kind, gname)
    return best[1] if best else None


def natural_key(name: str) -> list:
    """Sort key that orders ``layers.9`` before ``layers.10`` (numbers compare as numbers)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def modules_of(ckpt: Checkpoint) -> dict[str, Module]:
    """Group tensors by module and attach each quantized module's group, format and weight args."""
    qcfg = ckpt.quantization_config or {}
    groups = qcfg.get("config_groups") or {}
    mods: dict[str, Module] = defaultdict(lambda: Module(""))
    for name, info in ckpt.tensors.items():
        mod, _, part = name.rpartition(".")
        m = mods[mod]
        m.name = mod
        m.parts[part] = info
    for m in mods.values():
        w = m.parts.get("weight")
        linear = m.quantized or (w is not None and is_linear_weight(m.name + ".weight", w))
        if not qcfg or not linear:
            continue
        g = resolve_group(m.name, qcfg, True)
        if g is not None:
            m.group = g
            m.format = groups[g].get("format") or qcfg.get("format")
            m.weights = groups[g].get("weights") or {}
    return dict(mods)


def dense_shape(m: Module) -> tuple[int, int]:
    """``[N, K]`` of a quantized module: ``weight_shape`` when stored, else from the tensor shapes
    (a packed weight without a known format is taken as FP4 when uint8, else int4)."""
    ws = m.parts.get("weight_shape")
    shape = [int(x) for x in read_tensor(ws).tolist()] if ws is not None else None
    fmt = m.format
    if fmt is None and "weight_packed" in m.parts:
        fmt = "nvfp4-pack-quantized" if m.parts["weight_packed"].dtype == "U8" else "pack-quantized"
    return logical_shape({p: i.shape for p, i in m.parts.items()}, m.weights or {"num_bits": 4}, fmt, shape)


def module_rows(m: Module, r0: int, r1: int) -> dict[str, torch.Tensor]:
    """The compressed tensors of module ``m`` that cover dense rows ``[r0, r1)``."""
    w = m.weights or {}
    strategy = w.get("strategy")
    bits = int(w.get("num_bits") or 8)
    out: dict[str, torch.Tensor] = {}
    for part, info in m.parts.items():
        if part in ("weight", "weight_packed"):
            out[part] = read_rows(info, r0, r1)
        elif part in ("weight_scale", "weight_zero_point"):
            if info.numel <= 1 or strategy == "tensor" or len(info.shape) < 2:
                out[part] = read_tensor(info)
            elif strategy == "block":
                bh = (w.get("block_structure") or [128, 128])[0]
                out[part] = read_rows(info, r0 // bh, min(info.shape[0], math.ceil(r1 / bh)))
            elif part == "weight_zero_point" and info.dtype == "I32":  # packed along dim 0
                out[part] = read_rows(info, r0 * bits // 32, min(info.shape[0], math.ceil(r1 * bits / 32)))
            else:
                out[part] = read_rows(info, r0, r1)
        elif part == "weight_global_scale":
            out[part] = read_tensor(info)
    return out


def dense_row_chunks(m: Module, chunk_elems: int):
    """Yield ``(r0, r1, dense rows)`` of a quantized module, dequantized as compressed-tensors does,
    in chunks of about ``chunk_elems`` elements (multiples of 128 rows, so blocks and packed
    zero points stay whole). Raises what :func:`dequantize_weight` raises."""
    n, k = dense_shape(m)
    step = max(128, (chunk_elems // max(1, k)) // 128 * 128)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        parts = module_rows(m, r0, r1)
        if "weight_shape" in m.parts:
            parts["weight_shape"] = torch.tensor([r1 - r0, k])
        yield r0, r1, dequantize_weight(parts, m.weights, m.format)


def fused_global_scales(mods: dict[str, Module]) -> dict[str, dict[str, float]]:
    """NVFP4 ``weight_global_scale`` of every fused-set member, by set (parent module name)."""
    sets: dict[str, dict[str, float]] = {}
    for m in mods.values():
        parent, _, leaf = m.name.rpartition(".")
        if "weight_global_scale" in m.parts and leaf in _FUSED_OF:
            sets.setdefault(f"{parent}.{{{','.join(_FUSED_OF[leaf])}}}", {})[leaf] = float(
                read_tensor(m.parts["weight_global_scale"]).float().reshape(-1)[0])
    return sets
