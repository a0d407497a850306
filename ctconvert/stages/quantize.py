"""The quantize stage: what the streaming executor is told (:class:`~ctconvert.pipeline.executor.ExecOptions`).

The executor itself runs inside the output folder the write stage opens; this stage resolves the
devices, plans how the quantized modules split over tensor/expert-parallel ranks (a dry run,
``--tp``/``--ep``: :mod:`ctconvert.plan.parallel`), says what ``--sparsity`` warns about, builds
the ``quantization_config`` (compressed-tensors' serialization,
:func:`ctconvert.checkpoint.config.build_quantization_config`; 2:4: compressed-tensors 0.14's,
:func:`ctconvert.plan.sparsity.sparse_config`; the ``kv_cache_scheme`` of ``--kv-cache``) and hands
the executor the calibrated tensors (``job.calibration``).
"""

from __future__ import annotations

from ..checkpoint.config import build_quantization_config
from ..errors import UsageError
from ..layouts.versions import DEFAULT_LAYOUT_VERSION
from ..pipeline.devices import resolve_devices
from ..pipeline.executor import ExecOptions, map_input_default
from ..pipeline.options import QuantizeOptions
from ..pipeline.zeros import ZeroTracker
from ..plan.parallel import parallel_report, plan_modules
from ..plan.sparsity import SparseScheme, sparse_config, sparsity_warning
from .job import QuantizeJob, Stage

__all__ = ["QuantizeStage"]


class QuantizeStage(Stage):
    """The options ``device`` (resolved here: :func:`~ctconvert.pipeline.devices.resolve_devices` raises
    :class:`~ctconvert.errors.UsageError`), ``chunk_elems``, ``hold_bytes``, ``impl``, ``map_input``,
    ``allow_nonfinite``; ``tp``/``ep`` and ``target``/``layout_version`` for the tensor-parallel plan (a
    :class:`~ctconvert.errors.UsageError` for a degree it cannot take); ``targets`` for a 2:4 config."""

    def __init__(self, o: QuantizeOptions):
        self.devices = resolve_devices(o.device)
        self.o = o

    def prepare(self, job: QuantizeJob) -> None:
        o = self.o
        job.devices = self.devices
        job.result.device = ",".join(map(str, self.devices))
        if o.dry_run or o.tp > 1 or o.ep is not None:
            self._parallel(job)
        if (warning := sparsity_warning(job.plan.scheme, o.target)) is not None:
            job.result.notes.append(warning)

    def _parallel(self, job: QuantizeJob) -> None:
        """The tensor-parallel plan (:mod:`ctconvert.plan.parallel`); a real run notes the tensors that do not split at ``tp``
        and an uneven expert-parallel split at ``ep``."""
        result, o = job.result, self.o
        kernel, version = (o.target, o.layout_version) if o.target is not None else (None, DEFAULT_LAYOUT_VERSION)
        mods, result.parallel_of = plan_modules(job.plan, job.ckpt.tensors, kernel, version)
        try:
            result.parallel = report = parallel_report(mods, job.ckpt.config, o.tp, o.ep)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not result.dry_run and (not report.ok or report.uneven):
            result.notes.append(report.summary())

    def run(self, job: QuantizeJob) -> None:
        o, plan = self.o, job.plan
        qconfig = build_quantization_config(plan.config_groups, plan.format, plan.ignore)
        if isinstance(plan.scheme, SparseScheme):
            qconfig = sparse_config(qconfig, plan.scheme, list(o.targets or ["Linear"]), plan.ignore)
        if job.kv_cache_scheme is not None:
            qconfig["kv_cache_scheme"] = job.kv_cache_scheme
        job.qconfig = qconfig
        job.exec = ExecOptions(
            device=self.devices[0],
            chunk_elems=o.chunk_elems,
            hold_bytes=o.hold_bytes,
            impl=o.impl,
            map_input=map_input_default() if o.map_input is None else o.map_input,
            allow_nonfinite=o.allow_nonfinite,
            zeros=ZeroTracker(),
            calibrated=job.calibration.tensors if job.calibration is not None else {},
        )
