"""The quantize stage: what the streaming executor is told (:class:`~ctconvert.pipeline.executor.ExecOptions`).

The executor itself runs inside the output folder the write stage opens; this stage resolves the
devices, plans how the quantized modules split over tensor/expert-parallel ranks (a dry run,
``--tp``/``--ep``: :mod:`ctconvert.plan.parallel`), says what ``--sparsity`` warns about, builds
the ``quantization_config`` (compressed-tensors' serialization,
:func:`ctconvert.checkpoint.config.build_quantization_config`; 2:4: compressed-tensors 0.14's,
:func:`ctconvert.plan.sparsity.sparse_config`; the ``kv_cache_scheme`` of ``--kv-cache``) and hands
the executor the calibrated tensors (``job.calibration``) and the weight observer of ``--observer``
(:mod:`ctconvert.formats.observers`): each config group's scheme is checked to take it (else a
:class:`~ctconvert.errors.UsageError` naming the group, the scheme and why), the plan names it per
config group (``plan.observers``), and the config records it in the group's weights as llm-compressor
does (``observer``, ``observer_kwargs``); ``minmax`` changes nothing. A recipe (``--recipe``) names its own
observer per config group (``plan.observers`` from the plan stage), checked the same way; its min/max groups
record ``memoryless_minmax``, as llm-compressor's output of the recipe does. An observer that needs data (``imatrix_mse``,
``nvfp4_expanded_imatrix``) gets the calibration pass' statistics (``job.calibration.importance``, per Linear), and a
note names the modules it searches unweighted (llm-compressor's fallback: no token reached it, and the like).
"""

from __future__ import annotations

from ..checkpoint.config import build_quantization_config
from ..errors import UsageError, plural
from ..formats import triton_key
from ..formats.observers import WeightObserver, args_refusal, get_observer
from ..layouts.versions import DEFAULT_LAYOUT_VERSION
from ..pipeline.devices import DevicesAhead, begin_contexts
from ..pipeline.executor import ExecOptions, map_input_default
from ..pipeline.options import QuantizeOptions
from ..pipeline.warm import WarmUp
from ..pipeline.zeros import ZeroTracker
from ..plan.parallel import parallel_report, plan_modules
from ..plan.sparsity import SparseScheme, sparse_config, sparsity_warning
from .job import QuantizeJob, Stage

__all__ = ["QuantizeStage"]


class QuantizeStage(Stage):
    """The options ``device`` (resolved on a thread from here, :class:`~ctconvert.pipeline.devices.DevicesAhead`, while
    the run opens its source and plans; :meth:`prepare` raises its :class:`~ctconvert.errors.UsageError`), ``chunk_elems``,
    ``hold_bytes``, ``impl``, ``map_input``, ``allow_nonfinite``; ``tp``/``ep`` and ``target``/``layout_version`` for the tensor-parallel plan (a
    :class:`~ctconvert.errors.UsageError` for a degree it cannot take); ``targets`` for a 2:4 config."""

    def __init__(self, o: QuantizeOptions):
        self.o = o
        local = not o.dry_run and o.executor == "local"  # (a Ray driver computes nothing on its own GPUs)
        self._devices = DevicesAhead(o.device, then=None if o.dry_run else self._begin, contexts=local)  # resolved while the run plans
        observer = get_observer(o.observer)
        self.observer: WeightObserver | None = None if observer.name == "minmax" else observer
        self.group_observers: dict[str, WeightObserver] = {}  # config group -> its observer other than min/max

    def _begin(self, devices: list) -> None:
        """A real run on CUDA devices: Triton's cache key (the console script begins it earlier) and, for a local run,
        the CUDA contexts (a Ray driver computes nothing on its own GPUs), made while the run plans and opens its output."""
        if any(d.type == "cuda" for d in devices):
            triton_key.begin()
            if self.o.executor == "local":
                begin_contexts(devices)

    @property
    def devices(self) -> list:
        """The resolved ``--device`` (:func:`~ctconvert.pipeline.devices.resolve_devices`; waits for the thread resolving
        it and raises its :class:`~ctconvert.errors.UsageError`)."""
        return self._devices.result()

    def prepare(self, job: QuantizeJob) -> None:
        o = self.o
        job.devices = self.devices
        job.result.device = ",".join(map(str, self.devices))
        if self.observer is not None or job.plan.observers:
            self._check_observer(job)
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

    def _check_observer(self, job: QuantizeJob) -> None:
        """Refuse what ``--observer`` (or a recipe's group observers) cannot honour, by name (:class:`UsageError`); name it
        per config group in the plan; each group's observer for the executor (``self.group_observers``)."""
        o, plan = self.o, job.plan
        wanted = {g: self.observer.name for g in plan.config_groups} if self.observer is not None else dict(plan.observers)
        name = ", ".join(sorted(set(wanted.values())))
        if o.sparsity:
            raise UsageError(f"--observer {name} does not take --sparsity {o.sparsity}: 2:4 pruning is not what llm-compressor's observers search")
        if o.kv_cache != "none":
            raise UsageError(f"--observer {name} does not take --kv-cache {o.kv_cache} (calibrated scales are not searched by a weight observer yet)")
        for group, obs in wanted.items():
            scheme = plan.config_groups[group][0]
            why = self._refusal(scheme)
            if why is not None:
                raise UsageError(f"--observer {obs} cannot take scheme {scheme.name} (config group {group}): {why}")
            plan.observers[group] = obs
            self.group_observers[group] = get_observer(obs)

    @staticmethod
    def _refusal(scheme) -> str | None:
        """Why the observers cannot take ``scheme``'s weights in this run (None: they can)."""
        if scheme.needs_calibration:
            return "its activation scales are calibrated, and a calibrated run with an observer is not implemented"
        if scheme.weights.strategy == "tensor":
            return "its per-tensor weight scale would need the whole tensor searched as one group"
        if not scheme.weight_format.takes_ranges:
            return f"its format {scheme.format.value} does not take an observer's ranges"
        return args_refusal(scheme.weights)

    def _bind_data(self, job: QuantizeJob) -> None:
        """The observers that need data, given the calibration pass' statistics; a note per reason a module has none."""
        data = job.calibration.importance if job.calibration is not None else {}
        for group, obs in list(self.group_observers.items()):
            if not obs.needs_data:
                continue
            bound = self.group_observers[group] = obs.with_data(data)
            if self.observer is obs:
                self.observer = bound
            unweighted: dict[str, list[str]] = {}
            for u in job.plan.units:
                if u.kind == "quantize" and u.group == group:
                    for m, src in zip(u.modules, u.sources):
                        info = job.ckpt.tensors.get(src)
                        why = None if info is None else bound.fallback(m, u.scheme.weights, info.shape[-1])
                        if why is not None:
                            unweighted.setdefault(why, []).append(m)
            for why, mods in unweighted.items():
                named = ", ".join(mods[:3]) + (", ..." if len(mods) > 3 else "")
                job.result.notes.append(f"{obs.name}: {why} for {plural(len(mods), 'module')} ({named}): searched unweighted, as llm-compressor does")

    def run(self, job: QuantizeJob) -> None:
        o, plan = self.o, job.plan
        qconfig = build_quantization_config(plan.config_groups, plan.format, plan.ignore)
        if isinstance(plan.scheme, SparseScheme):
            qconfig = sparse_config(qconfig, plan.scheme, list(o.targets or ["Linear"]), plan.ignore)
        if job.kv_cache_scheme is not None:
            qconfig["kv_cache_scheme"] = job.kv_cache_scheme
        for group, observer in self.group_observers.items():  # as llm-compressor records it (none for min/max: today's config)
            qconfig["config_groups"][group]["weights"].update(observer.config_fields())
        if o.recipe is not None:  # a recipe's min/max groups: llm-compressor records its default weight observer
            for group in set(plan.config_groups) - set(self.group_observers):
                qconfig["config_groups"][group]["weights"].update(observer="memoryless_minmax", observer_kwargs={})
        job.qconfig = qconfig
        self._bind_data(job)
        job.exec = ExecOptions(
            device=self.devices[0],
            chunk_elems=o.chunk_elems,
            hold_bytes=o.hold_bytes,
            impl=o.impl,
            map_input=map_input_default() if o.map_input is None else o.map_input,
            allow_nonfinite=o.allow_nonfinite,
            zeros=ZeroTracker(),
            calibrated=job.calibration.tensors if job.calibration is not None else {},
            observer=self.observer,
            group_observers=dict(self.group_observers),
        )
        self._warm_ahead(job)

    def _warm_ahead(self, job: QuantizeJob) -> None:
        """A local GPU run: begin the warm-up (:class:`~ctconvert.pipeline.warm.WarmUp`, the run's kernels launched once on
        zeros) now, while the write stage opens the output (its shards' headers, the source hashes: ~0.2 s of a MoE's
        12,000 tensors on an H200), instead of when the executor starts; the executor of that device adopts it. Not
        where the plan or the options change after this stage (``--target``: the layout stage replaces the plan and
        sets the repack) or the executor runs a part of the plan (``--resume``, ``--refresh``): the executor warms up
        what it runs, as before."""
        o, dev = self.o, job.exec.device
        if o.executor != "local" or dev.type != "cuda" or o.impl == "torch" or o.target is not None or o.resume or job.refresh:
            return
        job.exec.warm = WarmUp(job.ckpt, job.plan, job.exec, dev)
        job.exec.warm.start()

    def close(self, job: QuantizeJob, stopped: bool = False) -> None:
        """A run that failed before its executor adopted the warm-up begun here: wait for it (its device work on zeros),
        unless the run was ``stopped``; the thread does nothing else, and a finished run's executor joined it."""
        warm = getattr(job.exec, "warm", None) if job.exec is not None else None
        if warm is not None and warm.thread is not None and not stopped:
            warm.thread.join()
