"""The ``--target`` stage: the kernel-native layout written in the same pass (``quantize --target``).

It wraps :class:`~ctconvert.stages.layout.LayoutStage`: the plan is rewritten so that each quantized
module outputs its kernel tensors, and the executor sends every finished module through it (on the
device). Its rules: no ``--resume`` or ``--refresh`` (there is no intermediate checkpoint to reuse);
the result's format names the layout.
"""

from __future__ import annotations

from ..errors import UsageError, plural
from ..pipeline.options import QuantizeOptions
from ..plan.kernel_targets import CT_FORMAT_TARGETS
from .job import QuantizeJob, Stage
from .layout import LayoutStage

__all__ = ["TargetStage"]


class TargetStage(Stage):
    """The options ``target``, ``layout_version``, ``act_dtype`` (checked here: :class:`LayoutStage` raises
    :class:`UsageError` for an unknown one) and ``resume`` (refused, as ``--refresh`` of an earlier output is)."""

    def __init__(self, o: QuantizeOptions):
        self.layout = LayoutStage(o.target, o.layout_version, o.act_dtype)
        self.resume = o.resume

    def prepare(self, job: QuantizeJob) -> None:
        job.layout = self.layout

    def report(self, job: QuantizeJob) -> None:
        self.layout.mark_carried(job.plan)  # the rows of the tensors --target sends through their module's kernel say so

    def run(self, job: QuantizeJob) -> None:
        layout = self.layout
        if self.resume or job.refresh:
            raise UsageError("--target cannot be combined with --resume or --refresh")
        job.fingerprint["target"] = [layout.target, layout.layout_version, layout.act_dtype]
        job.plan = layout.plan(job.plan, job.ckpt, job.qconfig)
        job.exec.repack = layout

    def finish(self, job: QuantizeJob) -> None:
        """The result's format names the kernel-native layout, and its notes how many modules it holds."""
        result, target = job.result, self.layout.target
        result.format = target if target in CT_FORMAT_TARGETS else f"kernel-native ({target}, from {result.format})"  # marlin-24: a compressed-tensors format
        if not result.dry_run and target in CT_FORMAT_TARGETS:
            result.notes.append(f"packed {plural(len(self.layout.records), 'module')} as {target}")
        elif not result.dry_run:
            result.notes.append(f"repacked {plural(len(self.layout.records), 'module')} for {target} (vLLM layout {self.layout.layout_version})")
