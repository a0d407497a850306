"""The pre-pass of one tensor over row chunks and its ranges in the quantize pass: :class:`TensorSearch`."""

from __future__ import annotations

import torch

from ..base import WeightArgs
from .groups import grouped, range_absmax
from .search import MSEObserver

__all__ = ["CUDA_BATCH_ELEMS", "TensorSearch"]

#: the pre-pass searches CUDA chunks in batches of at least this many elements (128 MB of bf16): one search of a
#: few large tensors instead of many of 4M-element chunks, each of which waits on the GPU a few times to settle
#: its unsure groups (``gpu_search``): 8B NVFP4A16 ``nvfp4_expanded_mse`` on an H200, 1696 searches of ~4.4 ms
#: overhead beside 0.8 ms of kernel each (scripts/bench_observers.py --e2e)
CUDA_BATCH_ELEMS = 64 * 2**20


class TensorSearch:
    """The pre-pass of one tensor, chunk by chunk, and its ranges in the quantize pass (module docstring).

    ``add(row0, chunk)`` searches a row chunk in full (every grid step), keeps its groups' steps (int16,
    or with global patience the int64 ``hits`` and the unshrunk range) and folds in its ``improved`` steps;
    :attr:`absmax` is then the tensor's searched absmax for the NVFP4 global scale (:func:`range_absmax`),
    and ``ranges(row0, chunk)`` the chunk's ranges from its kept steps (no second search), equal to one
    search of the whole tensor. Memory: 2 bytes per group (12 with global patience) until :meth:`ranges`
    takes them, and on a GPU the chunks held for one batched search (:data:`CUDA_BATCH_ELEMS` elements at most,
    plus the last chunk).
    Example::

        ts = TensorSearch(OBSERVERS["nvfp4_expanded_mse"], args)
        for r0, chunk in chunks:                    # pass 1, all members of a fused set
            ts.add(r0, chunk)
        gs = nvfp4_global_scale(max(t.absmax for t in fused_set), dtype)
        for r0, chunk in chunks:                    # pass 2
            out = fmt.quantize(chunk, args, gs, ranges=ts.ranges(r0, chunk))
    """

    def __init__(self, observer: MSEObserver, args: WeightArgs, impl: str = "auto", batch_elems: int | None = None):
        self.observer, self.args, self.impl = observer, args, impl
        self.batch_elems = batch_elems
        self.tracker = observer.stop_tracker() if observer.needs_stop_pass else None
        self._absmax = torch.zeros((), dtype=torch.float32)
        self._kept: dict[int, tuple] = {}
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._pending_elems = 0

    def _batch_limit(self, chunk: torch.Tensor) -> int:
        """Elements of pending chunks searched together: ``batch_elems`` when given, else :data:`CUDA_BATCH_ELEMS`
        for a CUDA chunk and 0 (each chunk at once) for another; 0 too for the tensor strategy, whose one group
        is the whole tensor (its rows are not independent groups)."""
        if self.args.strategy not in ("group", "tensor_group", "channel"):
            return 0
        if self.batch_elems is not None:
            return self.batch_elems
        return CUDA_BATCH_ELEMS if chunk.device.type == "cuda" else 0

    def add(self, row0: int, chunk: torch.Tensor, last: bool = False) -> None:
        """Search rows ``[row0, row0 + len(chunk))`` (every grid step) and keep what the quantize pass needs.

        A chunk may be held (a copy, on its device) and searched later with the next ones, as one tensor of
        their rows: each group's search depends on its own elements only and ``improved`` is the OR over
        groups, so the kept steps, hits, ranges and absmax are those of a search per chunk. The held chunks
        are searched once they reach the batch size (:meth:`_batch_limit`), with ``last`` (the tensor's last
        chunk: so that a search error is raised while the caller still knows the tensor), and before any
        result is read. Raises ``ValueError`` as the observer's search does (NaN/inf, a shape it does not take)."""
        limit = self._batch_limit(chunk)
        if limit <= 0:
            self._search([row0], chunk)
            return
        self._pending.append((row0, chunk.clone(memory_format=torch.contiguous_format)))
        self._pending_elems += chunk.numel()
        if last or self._pending_elems >= limit:
            self._flush()

    def _flush(self) -> None:
        """Search the held chunks together (:meth:`add`)."""
        if not self._pending:
            return
        pending, self._pending, self._pending_elems = self._pending, [], 0
        w = pending[0][1] if len(pending) == 1 else torch.cat([c for _, c in pending])
        self._search([r for r, _ in pending], w, [c.shape[0] for _, c in pending])

    def _search(self, rows0: list[int], w: torch.Tensor, sizes: list[int] | None = None) -> None:
        """One search of ``w``: the rows of the chunks added at ``rows0`` (``sizes`` rows each; None: one chunk)."""
        found = self.observer.search(w, self.args, steps=self.observer.total_steps, impl=self.impl)
        sizes = sizes or [w.shape[0]]
        if self.tracker is None:
            if found.min.numel():
                self._absmax = torch.maximum(self._absmax, range_absmax(found.min, found.max).cpu())
            for r0, step in zip(rows0, torch.split(found.step, sizes)):
                self._kept[r0] = (step,)
            return
        self.tracker.add(found.improved)
        x = grouped(w, self.args)
        parts = (torch.split(t, sizes) for t in (found.hits, torch.amin(x, dim=-1) * self.observer.expand, torch.amax(x, dim=-1) * self.observer.expand))
        for r0, kept in zip(rows0, zip(*parts)):
            self._kept[r0] = kept

    @property
    def steps(self) -> int:
        """The grid steps the whole tensor's search runs (known once every chunk is added)."""
        self._flush()
        return self.observer.total_steps if self.tracker is None else self.tracker.steps

    @property
    def absmax(self) -> torch.Tensor:
        """fp32 0-d: the tensor's searched ranges' absmax (:func:`range_absmax`), once every chunk is added."""
        self._flush()
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
        self._flush()
        kept = self._kept.pop(row0)
        if self.tracker is None:
            return self.observer.ranges_from_steps(chunk, self.args, kept[0].to(chunk.device))
        hits, mn0, mx0 = kept
        return self.observer.ranges_at(mn0, mx0, self.observer.steps_at(hits, self.steps))
