"""The pre-pass of one tensor over row chunks and its ranges in the quantize pass: :class:`TensorSearch`."""

from __future__ import annotations

import torch

from ..base import WeightArgs
from .groups import grouped, range_absmax
from .search import MSEObserver

__all__ = ["TensorSearch"]


class TensorSearch:
    """The pre-pass of one tensor, chunk by chunk, and its ranges in the quantize pass (module docstring).

    ``add(row0, chunk)`` searches a row chunk in full (every grid step), keeps its groups' steps (int16,
    or with global patience the int64 ``hits`` and the unshrunk range) and folds in its ``improved`` steps;
    :attr:`absmax` is then the tensor's searched absmax for the NVFP4 global scale (:func:`range_absmax`),
    and ``ranges(row0, chunk)`` the chunk's ranges from its kept steps (no second search), equal to one
    search of the whole tensor. Memory: 2 bytes per group (12 with global patience) until :meth:`ranges`
    takes them.
    Example::

        ts = TensorSearch(OBSERVERS["nvfp4_expanded_mse"], args)
        for r0, chunk in chunks:                    # pass 1, all members of a fused set
            ts.add(r0, chunk)
        gs = nvfp4_global_scale(max(t.absmax for t in fused_set), dtype)
        for r0, chunk in chunks:                    # pass 2
            out = fmt.quantize(chunk, args, gs, ranges=ts.ranges(r0, chunk))
    """

    def __init__(self, observer: MSEObserver, args: WeightArgs, impl: str = "auto"):
        self.observer, self.args, self.impl = observer, args, impl
        self.tracker = observer.stop_tracker() if observer.needs_stop_pass else None
        self._absmax = torch.zeros((), dtype=torch.float32)
        self._kept: dict[int, tuple] = {}

    def add(self, row0: int, chunk: torch.Tensor) -> None:
        """Search rows ``[row0, row0 + len(chunk))`` (every grid step) and keep what the quantize pass needs."""
        found = self.observer.search(chunk, self.args, steps=self.observer.total_steps, impl=self.impl)
        if self.tracker is None:
            if found.min.numel():
                self._absmax = torch.maximum(self._absmax, range_absmax(found.min, found.max).cpu())
            self._kept[row0] = (found.step,)
            return
        self.tracker.add(found.improved)
        x = grouped(chunk, self.args)
        self._kept[row0] = (found.hits, torch.amin(x, dim=-1) * self.observer.expand, torch.amax(x, dim=-1) * self.observer.expand)

    @property
    def steps(self) -> int:
        """The grid steps the whole tensor's search runs (known once every chunk is added)."""
        return self.observer.total_steps if self.tracker is None else self.tracker.steps

    @property
    def absmax(self) -> torch.Tensor:
        """fp32 0-d: the tensor's searched ranges' absmax (:func:`range_absmax`), once every chunk is added."""
        if self.tracker is None:
            return self._absmax
        out = torch.zeros((), dtype=torch.float32)
        for hits, mn0, mx0 in self._kept.values():
            if mn0.numel():
                mn, mx = self.observer.ranges_at(mn0, mx0, self.observer.steps_at(hits, self.steps))
                out = torch.maximum(out, range_absmax(mn, mx).cpu())
        return out

    def ranges(self, row0: int, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges of the chunk added at ``row0`` (the same rows), D ``[rows, G]``, as one search of the whole
        tensor finds them; every chunk must have been added first. Raises ``KeyError`` for a chunk never added."""
        kept = self._kept.pop(row0)
        if self.tracker is None:
            return self.observer.ranges_from_steps(chunk, self.args, kept[0].to(chunk.device))
        hits, mn0, mx0 = kept
        return self.observer.ranges_at(mn0, mx0, self.observer.steps_at(hits, self.steps))
