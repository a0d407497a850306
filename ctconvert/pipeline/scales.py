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

With a weight observer other than ``minmax`` (``--observer``, :mod:`ctconvert.formats.observers`) the
same pass is the observer's pre-pass where a chunk alone does not decide its ranges: each chunk is
searched once (:class:`~ctconvert.formats.observers.TensorSearch`: its groups' grid steps kept, the
global patience of ``memoryless_mse`` folded in), NVFP4's set scale comes from the absmax of the
*searched* ranges of every member (llm-compressor's ``Observer.get_global_scale``), and the quantize
pass takes each chunk's ranges from what was kept (:meth:`UnitScales.ranges`). A unit whose chunks
decide their own ranges (a group format with ``nvfp4_expanded_mse``, which never stops early) has no
pre-pass: its chunks are searched as they are quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats.fp4 import nvfp4_global_scale
from ..formats.fp8 import fp8_scale
from ..formats.observers import TensorSearch, WeightObserver

__all__ = ["UnitScales", "fp8_tensor_scale", "needs_absmax_pass", "observer_of", "per_tensor_scale", "search_impl"]


def per_tensor_scale(scheme) -> bool:
    """Whether ``scheme`` (a :class:`~ctconvert.plan.schemes.Scheme`) quantizes each weight with one scale
    known before its chunks: float weights of ``strategy: tensor`` (the ``FP8`` preset)."""
    return scheme.weights.strategy == "tensor" and scheme.weights.type == "float"


def observer_of(opts, unit):
    """The weight observer of work ``unit`` under executor options ``opts`` (:class:`~ctconvert.pipeline.executor.ExecOptions`):
    its config group's (a recipe's, ``group_observers``), else the run's (``observer``; None: min/max), for the unit's
    modules (``WeightObserver.for_unit``: the imatrix observers' calibration data of each member)."""
    obs = opts.group_observers.get(unit.group, opts.observer)
    return None if obs is None else obs.for_unit(unit.modules)


def needs_absmax_pass(scheme, observer: WeightObserver | None = None) -> bool:
    """Whether a unit of ``scheme`` is read for its absmax (and ``observer``'s pre-pass) before any chunk is
    quantized. ``observer``: an observer other than min/max (None: min/max)."""
    return bool(scheme.global_scale or per_tensor_scale(scheme) or (observer is not None and observer.needs_stop_pass))


def search_impl(impl: str) -> str:
    """The observer search implementation for the executor's quantizer ``impl``: ``torch`` and ``native`` as
    told, else ``auto`` (the C kernel where built; a CUDA chunk on the GPU where it can: the same ranges)."""
    return impl if impl in ("torch", "native") else "auto"


def fp8_tensor_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 preset's ``weight_scale`` ``[1]`` of dtype ``dtype`` from a tensor's fp32 absmax (0-d; ``[n]``: the
    ``[n]`` scales of ``n`` tensors, elementwise): ``fp8_scale(amax, dtype)`` (already a value of ``dtype``, so the
    cast is exact; an all-zero tensor, ``-0.0`` included, gets ``eps(dtype)``)."""
    return fp8_scale(amax, dtype).reshape(-1).to(dtype)


@dataclass
class UnitScales:
    """What one unit's absmax pass gathers (:meth:`observe`, per chunk) and gives (:meth:`finish`).

    ``amax``: fp32 0-d absmax of the whole set (also the executor's NaN/inf flag on a GPU);
    ``global_scale``: NVFP4's fp32 ``[1]`` set scale; ``weight_scale``: member index -> the FP8
    preset's ``[1]`` per-tensor scale. Both None/empty for a scheme without an absmax pass.
    ``observer``: the run's observer other than min/max (None: min/max); ``searches``: member -> its
    pre-pass (:meth:`search`)."""

    observer: WeightObserver | None = None
    amax: torch.Tensor | None = None
    member_amax: dict[int, torch.Tensor] = field(default_factory=dict)
    global_scale: torch.Tensor | None = None
    global_amax: torch.Tensor | None = None  # NVFP4: the absmax the set scale came from (zero-row notes name it)
    weight_scale: dict[int, torch.Tensor] = field(default_factory=dict)
    searches: dict[int, TensorSearch] = field(default_factory=dict)

    def observe(self, member: int, a: torch.Tensor) -> None:
        """One chunk of member ``member``: its fp32 0-d absmax ``a``."""
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        prev = self.member_amax.get(member)
        self.member_amax[member] = a if prev is None else torch.maximum(prev, a)

    def search(self, member: int, row0: int, w: torch.Tensor, scheme, impl: str = "auto", last: bool = False) -> None:
        """The observer's pre-pass over one chunk ``w`` ``[r, K]`` (rows from ``row0``) of member ``member``
        (nothing without an observer); ``last``: the member's last chunk (chunks held for a batched search are
        searched then: :meth:`TensorSearch.add`). Raises ``ValueError`` as the observer does (NaN/inf, a scheme
        it does not take)."""
        if self.observer is None:
            return
        ts = self.searches.get(member)
        if ts is None:
            ts = self.searches[member] = TensorSearch(self.observer.member(member), scheme.weights, search_impl(impl))
        ts.add(row0, w, last)  # on w's device: a CUDA chunk is searched on the GPU (the CPU path's ranges, gpu_search.py)

    def ranges(self, member: int, row0: int, w: torch.Tensor, scheme, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor] | None:
        """The observer's ``(min, max)`` ranges of one chunk, D ``[r, G]`` on ``w``'s device, for
        ``Scheme.quantize_rows(..., ranges=...)``: from the pre-pass when the unit had one, else searched now
        (on w's device, the CPU path's ranges on every device); None without an observer."""
        if self.observer is None:
            return None
        ts = self.searches.get(member)
        found = ts.ranges(row0, w) if ts is not None else self.observer.member(member).ranges(w, scheme.weights, impl=search_impl(impl))
        return found[0].to(w.device), found[1].to(w.device)

    def finish(self, scheme, set_dtype: torch.dtype, dtypes: list[torch.dtype]) -> None:
        """The pass is over: the scales of ``scheme``'s format. ``set_dtype``: the dtype NVFP4's set scale
        is rounded in (the last member read's); ``dtypes``: each member's weight dtype. With an observer,
        NVFP4's set scale is from its members' searched ranges."""
        if scheme.global_scale:
            amax = self.amax
            if self.observer is not None:
                amax = torch.stack([ts.absmax for ts in self.searches.values()]).max()
                amax = amax if self.amax is None else amax.to(self.amax.device)
            self.global_scale = nvfp4_global_scale(amax, set_dtype)
            self.global_amax = amax
        if per_tensor_scale(scheme):
            self.weight_scale = {m: fp8_tensor_scale(a, dtypes[m]) for m, a in self.member_amax.items()}
