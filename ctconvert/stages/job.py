"""What the stages of ``quantize`` hand on to each other (:class:`QuantizeJob`), and what a stage is (:class:`Stage`).

A stage is called in four rounds (:func:`run_stages`): every stage's :meth:`~Stage.prepare` (from the
headers only: open, plan, refuse what cannot run), then each stage's :meth:`~Stage.report` (a dry run:
what it adds to the result) or :meth:`~Stage.run` (the real run), then each stage's :meth:`~Stage.finish`
(the result's last words). :meth:`~Stage.close` ends the real run's rounds, whatever happened. Every hook is optional.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.reader import Checkpoint
from ..pipeline.executor import ExecOptions
from ..pipeline.options import QuantizeOptions
from ..plan.planner import Plan
from ..plan.result import ConversionResult

__all__ = ["QuantizeJob", "Stage", "run_stages"]


@dataclass
class QuantizeJob:
    """One ``quantize`` run as it goes through its stages.

    ``src``: the input folder, or an already opened :class:`~ctconvert.sources.Source`;
    ``src_path``: the input's path; ``source``/``ckpt``: the source and the view the plan reads (the
    dequantized weights of a quantized source, the plan's per-expert views added); ``plan``/``result``:
    the plan and the result (whose ``notes`` are the plan's); ``dry_error``: what the real run would
    stop at (dry run); ``devices``: where it runs; ``calibrated``: whether calibration runs, ``calibration``:
    what it gave (:class:`~ctconvert.calibration.apply.Calibrated`), ``kv_cache_scheme``: the config's
    ``kv_cache_scheme`` (None: no ``--kv-cache``); ``fingerprint``: the options that
    define the output (its fingerprint, what ``--refresh`` must match; stages add their entries);
    ``refresh_refused``: why ``--refresh`` cannot update this output (a stage's rule, checked where the
    output folder is chosen); ``refresh``/``created``: ``--refresh`` of an earlier output, or of none
    (a full conversion); ``qconfig``: the ``quantization_config``; ``layout``: the ``--target`` step
    (:class:`~ctconvert.stages.layout.LayoutStage`, None without one); ``exec``: what the executor is told;
    ``before_commit``: what must have ended before the output folder is committed (each a callable that waits for it
    and raises its error: a calibration running beside the write stage), called in order by the write stage."""

    src: object
    out: Path | None
    options: QuantizeOptions
    progress: object = None
    t0: float = field(default_factory=time.perf_counter)
    src_path: Path | None = None
    source: object = None
    ckpt: Checkpoint | None = None
    plan: Plan | None = None
    result: ConversionResult | None = None
    dry_error: Exception | None = None
    devices: list = field(default_factory=list)
    calibrated: bool = False
    calibration: object = None
    kv_cache_scheme: dict | None = None
    fingerprint: dict = field(default_factory=dict)
    refresh_refused: str | None = None
    refresh: bool = False
    created: bool = False
    old_prov: dict | None = None
    qconfig: dict | None = None
    layout: object = None
    exec: ExecOptions | None = None
    before_commit: list = field(default_factory=list)  # callables the write stage calls before the output is committed


class Stage:
    """One step of ``quantize``; built from the options it takes (:class:`QuantizeOptions`)."""

    def prepare(self, job: QuantizeJob) -> None:
        """Headers only, in a dry run too: open, plan, refuse what the run cannot do."""

    def report(self, job: QuantizeJob) -> None:
        """A dry run: what this stage adds to ``job.result`` (notes, costs, the error the run would stop at)."""

    def run(self, job: QuantizeJob) -> None:
        """The real run."""

    def finish(self, job: QuantizeJob) -> None:
        """After every stage ran (or reported): the result's last words."""

    def close(self, job: QuantizeJob, stopped: bool = False) -> None:
        """After the real run, also when a stage failed or it was interrupted: stop what this stage left running (a
        thread), and wait for it unless the run was ``stopped`` (Ctrl-C, SIGTERM: the process is ending)."""


def run_stages(stages: list[Stage], job: QuantizeJob) -> ConversionResult:
    """Prepare every stage, then report (``--dry-run``) or run each, then finish each; the result."""
    for stage in stages:
        stage.prepare(job)
    stopped = False
    try:
        for stage in stages:
            if job.options.dry_run:
                stage.report(job)
            else:
                stage.run(job)
    except KeyboardInterrupt:  # Ctrl-C and the stop signals (the CLI raises it for SIGTERM/SIGHUP too)
        stopped = True
        raise
    finally:
        for stage in stages:
            stage.close(job, stopped)
    for stage in stages:
        stage.finish(job)
    return job.result
