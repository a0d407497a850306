"""The executor's absmax pass: the weight scales that only a whole tensor, or a whole fused set, gives.

Two schemes need a scale before any row chunk is quantized, so the executor
reads such a unit once for its absmax (holding the chunks on the device when
the set fits in ``hold_bytes``, else reading them again), then quantizes:

* NVFP4 (``tensor_group`` weights): one ``weight_global_scale`` fp32 ``[1]`` for the
  whole fused set, from the set's absmax (:func:`ctconvert.formats.fp4.nvfp4_global_scale`;
  docs/compressed-tensors-format.md §9.1), written beside every member;
* the ``FP8`` preset (float weights, ``strategy: tensor``): one ``weight_scale`` ``[1]`` per
  tensor, in the weight's dtype: ``fp8_scale(absmax)`` (:func:`ctconvert.formats.fp8.fp8_scale`:
  ``D(absmax / 448)``, zero -> ``eps(D)``), the scale compressed-tensors' static FP8 preset
  writes (docs/compressed-tensors-format.md §4.2).

The absmax of a chunk is exact (a maximum of stored values), so the maximum over
the chunks equals the whole tensor's absmax, whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats.fp4 import nvfp4_global_scale
from ..formats.fp8 import fp8_scale

__all__ = ["UnitScales", "fp8_tensor_scale", "needs_absmax_pass", "per_tensor_scale"]


def per_tensor_scale(scheme) -> bool:
    """Whether ``scheme`` (a :class:`~ctconvert.plan.schemes.Scheme`) quantizes each weight with one scale
    known before its chunks: float weights of ``strategy: tensor`` (the ``FP8`` preset)."""
    return scheme.weights.strategy == "tensor" and scheme.weights.type == "float"


def needs_absmax_pass(scheme) -> bool:
    """Whether a unit of ``scheme`` is read for its absmax before any chunk is quantized."""
    return scheme.global_scale or per_tensor_scale(scheme)


def fp8_tensor_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 preset's ``weight_scale`` ``[1]`` of dtype ``dtype`` from a tensor's fp32 absmax (0-d):
    ``fp8_scale(amax, dtype)`` (already a value of ``dtype``, so the cast is exact; an all-zero
    tensor, ``-0.0`` included, gets ``eps(dtype)``)."""
    return fp8_scale(amax, dtype).reshape(1).to(dtype)


@dataclass
class UnitScales:
    """What one unit's absmax pass gathers (:meth:`observe`, per chunk) and gives (:meth:`finish`).

    ``amax``: fp32 0-d absmax of the whole set (also the executor's NaN/inf flag on a GPU);
    ``global_scale``: NVFP4's fp32 ``[1]`` set scale; ``weight_scale``: member index -> the FP8
    preset's ``[1]`` per-tensor scale. Both None/empty for a scheme without an absmax pass."""

    amax: torch.Tensor | None = None
    member_amax: dict[int, torch.Tensor] = field(default_factory=dict)
    global_scale: torch.Tensor | None = None
    weight_scale: dict[int, torch.Tensor] = field(default_factory=dict)

    def observe(self, member: int, a: torch.Tensor) -> None:
        """One chunk of member ``member``: its fp32 0-d absmax ``a``."""
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        prev = self.member_amax.get(member)
        self.member_amax[member] = a if prev is None else torch.maximum(prev, a)

    def finish(self, scheme, set_dtype: torch.dtype, dtypes: list[torch.dtype]) -> None:
        """The pass is over: the scales of ``scheme``'s format. ``set_dtype``: the dtype NVFP4's set scale
        is rounded in (the last member read's); ``dtypes``: each member's weight dtype."""
        if scheme.global_scale:
            self.global_scale = nvfp4_global_scale(self.amax, set_dtype)
        if per_tensor_scale(scheme):
            self.weight_scale = {m: fp8_tensor_scale(a, dtypes[m]) for m, a in self.member_amax.items()}
