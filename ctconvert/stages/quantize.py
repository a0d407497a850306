"""The quantize stage: what the streaming executor is told (:class:`~ctconvert.pipeline.executor.ExecOptions`).

The executor itself runs inside the output folder the write stage opens; this stage resolves the
devices, builds the ``quantization_config`` (compressed-tensors' serialization,
:func:`ctconvert.checkpoint.config.build_quantization_config`; 2:4: compressed-tensors 0.14's,
:func:`ctconvert.plan.sparsity.sparse_config`; the ``kv_cache_scheme`` of ``--kv-cache``) and hands
the executor the calibrated tensors (``job.calibration``).
"""

from __future__ import annotations

from ..checkpoint.config import build_quantization_config
from ..pipeline.devices import resolve_devices
from ..pipeline.executor import ExecOptions, map_input_default
from ..pipeline.options import QuantizeOptions
from ..pipeline.zeros import ZeroTracker
from ..plan.sparsity import SparseScheme, sparse_config
from .job import QuantizeJob, Stage

__all__ = ["QuantizeStage"]


class QuantizeStage(Stage):
    """The options ``device`` (resolved here: :func:`~ctconvert.pipeline.devices.resolve_devices` raises
    :class:`~ctconvert.errors.UsageError`), ``chunk_elems``, ``hold_bytes``, ``impl``, ``map_input``,
    ``allow_nonfinite``; ``targets`` for a 2:4 config."""

    def __init__(self, o: QuantizeOptions):
        self.devices = resolve_devices(o.device)
        self.o = o

    def prepare(self, job: QuantizeJob) -> None:
        job.devices = self.devices
        job.result.device = ",".join(map(str, self.devices))

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
