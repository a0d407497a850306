"""``ctconvert quantize``: a dense checkpoint -> a compressed-tensors (or kernel-native) checkpoint.

Reads top to bottom, as a list of stages (:mod:`ctconvert.stages`): open the checkpoint (headers
only) -> plan every tensor -> (calibrate) -> what the executor is told -> (with a ``--target``, the
kernel layout) -> write: the output folder (hidden, resumable), the executor streaming the work
units into it, the config and provenance, renamed into place. A dry run reports what each stage
would do instead of running it.
"""

from __future__ import annotations

from pathlib import Path

from ..pipeline.options import QuantizeOptions
from ..plan.result import ConversionResult
from ..stages.calibrate import CalibrateStage
from ..stages.job import QuantizeJob, Stage, run_stages
from ..stages.plan import PlanErrorStage, PlanStage
from ..stages.quantize import QuantizeStage
from ..stages.source import SourceStage
from ..stages.target import TargetStage
from ..stages.write import WriteStage, partial_hint

__all__ = ["QuantizeResult", "partial_hint", "quantize"]


#: what a conversion did: the one result type of every conversion (:mod:`ctconvert.plan.result`)
QuantizeResult = ConversionResult


def quantize(src, out: str | Path | None, scheme: str, options: QuantizeOptions | None = None, *, progress=None) -> ConversionResult:
    """Convert ``src`` (a folder, or an opened :class:`~ctconvert.sources.Source`) to ``out``; see
    :func:`ctconvert.api.quantize` for the options and errors.

    ``options``: a :class:`~ctconvert.pipeline.options.QuantizeOptions` (None: every default); with a
    ``target``, the kernel-native tensors are written in the same pass (``quantize --target``,
    :class:`ctconvert.stages.target.TargetStage`). ``progress``: ``(total_bytes) -> context manager with .update(n)``."""
    o = options if options is not None else QuantizeOptions()
    return run_stages(_stages(scheme, o), QuantizeJob(src, out, o, progress))


def _stages(scheme: str, o: QuantizeOptions) -> list[Stage]:
    """The stages of this run, built from the options (checked in the order the command always checked them)."""
    target = TargetStage(o) if o.target is not None else None
    write = WriteStage(o)
    quantize = QuantizeStage(o)
    plan = PlanStage(scheme, o)
    return [SourceStage(), plan, CalibrateStage(o), quantize, *([target] if target else []), PlanErrorStage(), write]
