"""The calibrated tensors of a run (:attr:`ExecOptions.calibrated <ctconvert.pipeline.executor.ExecOptions.calibrated>`,
module -> {part: tensor}) as the executor writes them: at once when they are known, else later.

With calibration beside the write stage the mapping is a :class:`~ctconvert.calibration.feed.CalibratedFeed`, whose
``ready(module)`` says whether a module's layer has been calibrated yet. A module that is not ready is not waited
for: its tensors (``input_global_scale``, ``input_scale``, ``k_scale``...) are written when they come
(:meth:`CalibratedWrites.flush`), at the offsets the shard plan gave them, which do not depend on when they are
written, so the bytes are those of a run calibrated first. With a kernel layout (``repack``) the module's tensors go
through the layout with its weights, so they are waited for there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["CalibratedWrites"]


class CalibratedWrites:
    """``calibrated``: module -> {part: tensor} (a plain mapping, or a feed with ``ready``); ``defer``: whether a
    module not ready yet may be written later (False: always wait, as a kernel layout needs)."""

    def __init__(self, calibrated: Mapping, defer: bool):
        self.calibrated = calibrated
        self._ready = getattr(calibrated, "ready", None) if defer else None
        self.pending: list[tuple[str, dict[str, str] | None]] = []  # (module, part -> output name | None: module.part)

    def __bool__(self) -> bool:
        return bool(self.calibrated)

    def __contains__(self, module: str) -> bool:
        return module in self.calibrated

    def now(self, module: str, names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        """``module``'s calibrated tensors, or ``{}`` when they are not known yet and will be written by :meth:`flush`
        (``names``: part -> output name of the parts to write then; None: every part, as ``module.part``)."""
        if self._ready is not None and not self._ready(module):
            self.pending.append((module, names))
            return {}
        return self.calibrated.get(module, {})

    def flush(self, write: Callable[[str, torch.Tensor], None], wait: bool) -> None:
        """``write(output name, CPU tensor)`` the pending tensors whose layer is calibrated (``wait``: all of them,
        waiting for each); raises what a failed calibration raised."""
        left = []
        for module, names in self.pending:
            if not wait and not self._ready(module):
                left.append((module, names))
                continue
            for part, t in self.calibrated.get(module, {}).items():
                if names is None or part in names:
                    write(names[part] if names is not None else f"{module}.{part}", t.cpu())
        self.pending = left
