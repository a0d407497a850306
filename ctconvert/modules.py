"""The modules of a compressed-tensors checkpoint: which group, format and args each has.

Resolution follows compressed-tensors (``utils/match.py``,
compressed-tensors-format.md §7.5): a module listed in ``ignore`` is dense;
otherwise, among every group's targets, exact names win over ``re:`` patterns,
which win over the class name ``Linear``; ties go to the first group.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from .checkpoint.reader import Checkpoint
from .checkpoint.safetensors_io import TensorInfo
from .plan import is_linear_weight, matches

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
        return "weight_packed" in self.parts or ("weight_scale" in self.parts and ("weight" in self.parts or "weight_packed" in self.parts))


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
