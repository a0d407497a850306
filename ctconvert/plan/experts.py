"""The plan's fused 3-D experts phase: which fused expert tensors are split into per-expert Linear weights.

Fused tensors are found by :func:`ctconvert.checkpoint.families.split_fused_experts` (the family table); a
fused tensor is written one 2-D weight per expert when any of its module's parts is quantized, else copied
whole as stored, with the reasons and ``ignore`` entries vLLM needs. Phases 2a and 2b of
:func:`ctconvert.plan.planner.make_plan`.
"""

from __future__ import annotations

import re

from ..checkpoint.families import FusedExperts, split_fused_experts
from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import TensorInfo
from ..errors import UnsupportedError
from .decisions import Decisions, TensorDecision

__all__ = ["fused_experts", "settle_experts"]


def fused_experts(ckpt: Checkpoint, keep_unclassified: bool, d: Decisions) -> dict[str, FusedExperts]:
    """The fused 3-D expert tensors and their per-expert parts. A family whose layout is not known is
    refused (:func:`split_fused_experts`); with ``keep_unclassified`` its fused tensors stay whole and
    phase 2c keeps them dense and reports them."""
    try:
        return split_fused_experts(ckpt.tensors, ckpt.config)
    except UnsupportedError as e:
        if not keep_unclassified:
            raise
        d.notes.append(f"fused experts not split: {e.message}")
        return {}


def settle_experts(d: Decisions, fused: dict[str, FusedExperts], stored: dict[str, TensorInfo]) -> dict[str, FusedExperts]:
    """Which fused tensors are written per expert: every tensor (weights and biases) of an ``experts`` module
    with a quantized part, so that no loader sees that module half fused (its dense parts are listed one by
    one). The others are copied whole, as stored: their parts' decisions are folded into the stored tensor's
    row (kept dense, the ``experts`` module listed in ``ignore`` when its parts were)."""
    quantized = {fe.parent for fe in fused.values() if not fe.bias and any(d.rows[p.name].action == "quantize" for p in fe.parts)}
    split = {n: fe for n, fe in fused.items() if fe.parent in quantized}
    for n, fe in fused.items():
        row = d.rows[n] = TensorDecision(n, stored[n].file.name, stored[n].dtype, stored[n].shape, "split")
        if n in split:
            row.reason = _split_reason(fe, stored[n])
            continue
        parts = [d.rows.pop(p.name) for p in fe.parts]
        listed = [p.name[: -len(".weight")] for p in fe.parts if p.name[: -len(".weight")] in d.ignored]
        if listed:
            d.ignored[:] = [m for m in d.ignored if m not in set(listed)]
            d.ignored += [fe.parent, _expert_probe_pattern(fe)]
        dense = next((r for r in parts if r.action == "ignore"), None)
        row.action = "ignore" if dense is not None and not fe.bias else "copy"
        why = dense.reason if dense is not None else "its weights are kept dense" if fe.bias else "not targeted"
        row.reason = f"fused experts kept dense and copied as stored: {why}"
        names = {p.name for p in fe.parts}
        kept = [x for x in d.notes if x.split(":")[0] not in names]
        if len(kept) < len(d.notes):  # --skip-incompatible notes named the parts, which are not written
            problem = next(x for x in d.notes if x.split(":")[0] in names).split(": ", 1)[1].removesuffix("; kept dense and listed in ignore")
            d.notes[:] = [*kept, f"{n}: {problem}; kept dense and listed in ignore"]
    return split


def _expert_probe_pattern(fe: FusedExperts) -> str:
    """The ``ignore`` pattern vLLM needs for dense fused experts: it picks a fused-MoE layer's method from the
    per-expert names ``<experts>.0.<gate|up|down>`` (vLLM 0.33 compressed_tensors_moe.py
    ``CompressedTensorsMoEMethod.get_moe_method``), which the ``experts`` module's own name does not match."""
    return rf"re:{re.escape(fe.parent)}\.\d+\.({'|'.join(fe.layout.names)})$"


def _split_reason(fe: FusedExperts, info: TensorInfo) -> str:
    how = f"gate/up {'interleaved' if fe.layout.interleaved else 'halves'}" if fe.member == "gate_up_proj" else "one per expert"
    how = f"transposed, {how}" if fe.transposed else how
    leaves = ",".join(sorted({p.name.split(".")[-2] for p in fe.parts}))
    return f"fused experts ({fe.model_type}: {how}) written as {fe.parent}.{{0..{info.shape[0] - 1}}}.{{{leaves}}}.{'bias' if fe.bias else 'weight'}"
