"""Global patience: the grid steps a whole tensor's search runs, from its row chunks' searches."""

from __future__ import annotations

import torch

__all__ = ["StopTracker"]


class StopTracker:
    """The number of grid steps llm-compressor's search of a whole tensor runs, from its chunks' searches.

    A group's improvement at step ``i`` depends only on its own errors at steps ``<= i``, so the whole
    tensor improves at step ``i`` exactly when some chunk's full search (``search(chunk, args,
    steps=total)``) did; the loop stops after ``patience`` consecutive steps without one. :meth:`add` each
    chunk's ``Search.improved``; :attr:`steps` is then the count to pass as ``search(..., steps=...)``;
    :attr:`final` says that no further chunk can change it (every later chunk may be skipped).
    """

    def __init__(self, total: int, patience: int):
        self.total, self.patience = total, patience
        self.any = torch.zeros(total, dtype=torch.bool)

    def add(self, improved: torch.Tensor) -> None:
        """OR in one chunk's ``Search.improved`` (a full search: ``total`` steps)."""
        if improved.numel() != self.total:
            raise ValueError(f"a stop pass needs searches of all {self.total} steps, got {improved.numel()}")
        self.any |= improved.cpu()

    @property
    def steps(self) -> int:
        stale = 0
        for i, hit in enumerate(self.any.tolist()):
            stale = 0 if hit else stale + 1
            if stale >= self.patience:
                return i + 1
        return self.total

    @property
    def final(self) -> bool:
        return self.steps == self.total
