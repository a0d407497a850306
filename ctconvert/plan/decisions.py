"""What the planner decides per tensor: the plan table's rows, and the record its phases share.

:class:`TensorDecision` is one row of the plan table (``quantize --dry-run``, ``--json``); :class:`Decisions`
is what the per-tensor phase of :func:`ctconvert.plan.planner.make_plan` found and the later phases read
and amend (rows, the modules to quantize, the ``ignore`` list, notes, which patterns were used).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Decisions", "TensorDecision"]


@dataclass
class TensorDecision:
    """Row of the plan table: one input tensor and what happens to it."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    action: str  # quantize | ignore | copy | split (a fused 3-D expert tensor written as per-expert tensors)
    scheme: str | None = None
    fused_set: str | None = None
    reason: str | None = None
    source: str | None = None  # the source format a quantized input's tensor is dequantized from (requantize)
    slice_of: str | None = None  # a per-expert part: the stored fused tensor it is a slice of
    cast: str | None = None  # a copied tensor written in another dtype: "fp32->bf16" (--dense-dtype)
    group: str | None = None  # the config group of a quantized tensor (a recipe's plan; None with one --scheme)


@dataclass
class Decisions:
    """What the per-tensor phase found (the later phases read it)."""

    rows: dict[str, TensorDecision] = field(default_factory=dict)
    to_quantize: dict[str, str] = field(default_factory=dict)  # tensor name -> module
    group_of: dict[str, str] = field(default_factory=dict)  # tensor name to quantize -> its config group
    ignored: list[str] = field(default_factory=list)  # modules listed in ignore
    notes: list[str] = field(default_factory=list)
    head_name: str | None = None
    used_targets: set[str] = field(default_factory=set)
    used_ignore: set[str] = field(default_factory=set)
    defaults: dict[str, int] = field(default_factory=dict)  # default rule -> modules it kept dense
    flags: tuple[str, str] = ("--targets", "--ignore")  # how the reasons name targets and ignore (a recipe's own words with --recipe)
