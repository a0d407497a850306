"""The write stage: the output folder (hidden, atomic, resumable) and everything written into it.

Before any work (:meth:`WriteStage.prepare`): an output is required; the options that define the
output are gathered (its fingerprint, what ``--refresh`` must match); ``--refresh`` of a folder that
does not exist converts in full ("create or update"); an earlier output is checked for ``--refresh``,
or the output path for overlap and ``--overwrite``. Then (:meth:`WriteStage.run`): shards are
assigned and opened (reused where ``--resume``/``--refresh`` allow), the executor streams the work
units into them while the source bytes are hashed beside it
(:class:`~ctconvert.checkpoint.hashing.SourceHashes`), the other files, the model card, the config
and the provenance are written, and the folder is renamed into place.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import native_write
from ..checkpoint.config import updated_config
from ..checkpoint.hashing import SourceHashes, hash_tensors
from ..checkpoint.json_text import EncodeAhead
from ..checkpoint.model_card import CARD, append_conversion_section, conversion_section
from ..checkpoint.provenance import PROVENANCE, fingerprint, load_provenance, provenance, refresh_plan, shard_map, sources_by_shard
from ..checkpoint.reader import CONFIG_NAME, Checkpoint
from ..checkpoint.shard_file import PlannedTensor
from ..checkpoint.writer import JOURNAL, OutputFolder, assign_shards, check_output_path, disk_full, parse_size, partial_output, shard_names
from ..errors import OutputError, UsageError, agree, plural
from ..pipeline.executor import ExecOptions
from ..pipeline.local import LocalExecutor
from ..pipeline.options import QuantizeOptions
from ..pipeline.ray_executor import RayExecutor, ShardOutput
from ..plan.planner import Plan
from ..sources import SOURCE_CONFIG_FILES
from .job import QuantizeJob, Stage

__all__ = ["WriteStage", "partial_hint"]

_DEFAULTS = QuantizeOptions()


class WriteStage(Stage):
    """The options ``max_shard_size`` (parsed here: :func:`~ctconvert.checkpoint.writer.parse_size` raises
    :class:`UsageError`), ``overwrite``, ``resume``, ``refresh``, ``keep_other_weights``, and those that define
    the output (its fingerprint: scheme, ``lm_head``, ``targets``, ``ignore``, ``skip_incompatible``,
    ``lm_head_chunk_rows``, ``sparsity`` and the plan rules where not the default).

    Raises :class:`UsageError` (no output, ``--refresh`` refused by a stage or not matching the earlier
    output, an output overlapping the input) and :class:`OutputError` (an existing output without
    ``--overwrite``, a full disk, a failed write: the partial output kept for ``--resume`` is named)."""

    def __init__(self, o: QuantizeOptions):
        self.shard_limit = parse_size(o.max_shard_size)
        self.o = o
        self.executor = RayExecutor(o.ray_address, o.ray_keep_workers) if o.executor == "ray" else LocalExecutor()
        if not o.dry_run:
            self.executor.start(o.device)  # joining the cluster overlaps opening and planning (waited for in prepare)

    def prepare(self, job: QuantizeJob) -> None:
        if self.o.dry_run:
            return
        if job.out is None:
            raise UsageError("an output folder is required (-o/--output)")
        job.out = out = Path(job.out)
        job.fingerprint = {**self._run_options(job.plan), **job.fingerprint}
        job.refresh = self.o.refresh
        job.created = job.refresh and not out.exists()
        if job.created:  # "create or update": nothing to refresh yet, so a full conversion (every shard written)
            job.refresh = False
            job.result.notes.append(f"--refresh: no earlier output at {out}; converted in full")
        if job.refresh and job.refresh_refused is not None:
            raise UsageError(job.refresh_refused)
        job.old_prov = load_provenance(out, job.fingerprint) if job.refresh else None
        if not job.refresh:
            check_output_path(job.src_path, out, self.o.overwrite, resume=self.o.resume)
        self.executor.connect()  # a missing extra or an unreachable cluster fails before the output folder exists

    def report(self, job: QuantizeJob) -> None:
        job.result.output_bytes = sum(PlannedTensor(*t).nbytes for t in job.plan.output_tensors)
        job.result.seconds = time.perf_counter() - job.t0

    def run(self, job: QuantizeJob) -> None:
        result = job.result
        planned = [PlannedTensor(n, d, s) for n, d, s in job.plan.output_tensors]
        assignment = assign_shards(planned, self.shard_limit)
        by_shard = sources_by_shard(job.plan.units, shard_map(assignment))
        hashes = _Hashes()
        folder = None
        try:
            folder = OutputFolder(
                job.out,
                overwrite=self.o.overwrite or job.old_prov is not None,
                fingerprint=fingerprint(job.ckpt, job.fingerprint, planned),
                resume=self.o.resume,
                shard_sources=lambda shard: hashes.journaled(by_shard.get(shard, ())),  # what a finished shard was made from (--resume)
            )
            with folder:  # commits on leaving; an error aborts it (keeping the partial folder where folder.keep_partial says)
                self._stream(job, folder, assignment, by_shard, hashes)
                for wait in job.before_commit:  # a calibration beside the write stage: its error aborts the folder
                    wait()
                total = self._complete(job, folder, planned, hashes)
        except BaseException as e:
            if folder is not None:
                folder.abort_for(e)  # a Ctrl-C between the folder's making and its `with`: __exit__ never ran (else: nothing)
            if isinstance(e, (KeyboardInterrupt, OutputError, OSError)) and (why := _explained(e, job.out, folder is not None and folder.keep_partial)):
                raise why from e
            raise
        result.output_bytes = total
        result.seconds = time.perf_counter() - job.t0

    def _run_options(self, plan: Plan) -> dict:
        """The options that define a run's output (its fingerprint, and what ``--refresh`` must match)."""
        o = self.o
        options = {
            "scheme": plan.scheme.name,
            "lm_head": o.lm_head.lower(),
            "targets": list(o.targets) if o.targets else ["Linear"],
            "ignore": list(o.ignore or []),
            "max_shard_size": self.shard_limit,
            "skip_incompatible": o.skip_incompatible,
            "lm_head_chunk_rows": o.lm_head_chunk_rows,
        }
        if o.sparsity:
            options["sparsity"] = o.sparsity
        if o.recipe is not None:  # what the recipe asks for, not its path: each group's scheme, targets and observer
            options["recipe"] = {g: [s.name, list(t), plan.observers.get(g, "minmax")] for g, (s, t) in plan.config_groups.items()}
        changed = {k: getattr(o, k) for k in ("keep_unclassified", "default_ignore", "quantize_mtp", "dense_dtype", "observer")}
        options.update({k: v for k, v in changed.items() if v != getattr(_DEFAULTS, k)})  # only where not the default: earlier outputs keep their fingerprint
        return options

    def _stream(self, job: QuantizeJob, folder: OutputFolder, assignment, by_shard: dict, hashes: _Hashes) -> None:
        """Open the shards (reused where ``--resume``/``--refresh`` allow) and run the executor on the units still to write."""
        ckpt, plan, result, out = job.ckpt, job.plan, job.result, job.out
        reuse_from, units = None, plan.units
        if job.old_prov is not None:
            reuse_from, units, _, computed = refresh_plan(ckpt, plan.units, assignment, out, job.old_prov)  # (the rewritten shards: _complete)
            hashes.known.update(computed)
        if self.o.resume:
            _drop_stale_shards(ckpt, folder, by_shard, hashes.known, result)
        shards = folder.open_shards(assignment, reuse_from=reuse_from)
        if getattr(folder, "linked_partial", False):
            result.notes.append(f"the interrupted run's folder {folder.tmp.name} was a symlink: removed (its target left as it is); starting over")
        if self.o.resume and getattr(folder, "discarded_partial", False):
            why = "a source file's size or modification time, an option or the ctconvert release differs"
            result.notes.append(f"--resume: the interrupted run used other inputs or options ({why}); starting over")
        if self.o.resume and getattr(folder, "lost_journal", False):
            lost = f"--resume: the interrupted run's journal ({JOURNAL}) is missing or unreadable"
            result.notes.append(f"{lost}, so none of its shards can be trusted; starting over")
        if self.o.resume and (damaged := getattr(folder, "damaged_partial", [])):
            them = "them" if len(damaged) > 1 else "it"
            result.notes.append(f"--resume: {', '.join(damaged)} changed, damaged, linked or removed since the interrupted run finished {them}; written again")
        planned = set(shard_names(len(assignment)))  # (its unfinished shards, written again, go unnamed; a file put there is named)
        if self.o.resume and (removed := [n for n in getattr(folder, "removed_partial", []) if n not in planned]):
            result.notes.append(
                "--resume: removed from the interrupted run's folder what the run did not finish or did not write "
                f"(written or copied again where the source has it): {', '.join(removed)}"
            )
        done = folder.completed  # (a set made per access: once here, not per output tensor)
        todo = [u for u in units if any(folder.weight_map[o[0]] not in done for o in u.outputs)] if done else list(units)
        # every source not hashed yet, in the order the executor reads them (units kept from an interrupted run or by
        # --refresh last): block hashes on the hashing threads, off the executor's path
        todo_ids = {id(u) for u in todo}
        order = [s for u in todo for s in u.sources] + [s for u in plan.units if id(u) not in todo_ids for s in u.sources]
        # (on Ray the workers hash the sources they read: none here)
        hashes.hashing = SourceHashes([ckpt.tensors[s] for s in order if s not in hashes.known] if self.executor.hashes_sources else [])
        opts = job.exec
        if self.executor.hashes_sources:  # the provenance made and encoded once the computing is done, while the last writes drain
            options = copy.deepcopy(job.fingerprint)  # as it is now: _complete checks that it did not change since
            opts.computed = computed = threading.Event()

            def make() -> dict:
                computed.wait()  # not beside the computing thread (the GIL): beside the writers' last bytes and the flushes
                return _provenance(job, hashes.all(ckpt, plan.units), options)

            hashes.ahead = EncodeAhead(make)
        folder.keep_partial = job.layout is None  # an interrupted run is kept for --resume, which --target does not offer
        out = ShardOutput(folder, dict(zip(shard_names(len(assignment)), assignment)), hashes.known)
        result.nodes = _execute(ckpt, dataclasses.replace(plan, units=todo), shards, opts, job.devices, job.progress, self.executor, out)
        cast = {u.outputs[0][0]: u.cast for u in plan.units if u.kind == "copy" and u.cast}  # --dense-dtype
        kept = {n: f"cast to {cast[n]} with its NaN/inf" if n in cast else "copied as it is" for n in opts.nonfinite}
        result.notes += [f"{name}: holds non-finite values (NaN/inf); {kept[name]} (--allow-non-finite)" for name in opts.nonfinite]
        lost = opts.zeros.reports() if opts.zeros is not None else []
        result.notes += [z.note() for z in lost]
        result.zero_quantized = [z.to_dict() for z in lost]

    def _complete(self, job: QuantizeJob, folder: OutputFolder, planned: list[PlannedTensor], hashes: _Hashes) -> int:
        """The other files, the model card, the config and the provenance; the folder renamed into place. The tensor bytes."""
        ckpt, plan, result, source = job.ckpt, job.plan, job.result, job.source
        skip = {CONFIG_NAME, PROVENANCE, *(SOURCE_CONFIG_FILES if source.quantized else ())}
        folder.copy_files(ckpt.path, skip=skip, keep_other_weights=self.o.keep_other_weights)
        derived = source.derived_from() if source.quantized else None
        append_conversion_section(folder.tmp / CARD, _card_section(job, derived))
        if folder.skipped:
            result.notes.append(f"not copied, weights in other formats (--keep-other-weights copies them): {', '.join(folder.skipped)}")
        if folder.links:
            result.notes.append(f"not copied, symlinks to a folder or to nothing: {', '.join(folder.links)}")
        if isinstance(self.executor, LocalExecutor) and (why := native_write.why_not()) is not None:  # (Ray: the workers write)
            result.notes.append(f"the shards were written and hashed from Python, slower beside a GPU: {why}; see CTCONVERT_NATIVE in the README")
        total = sum(t.nbytes for t in planned)
        cfg = updated_config(ckpt.config, job.qconfig, plan.config_updates)
        if job.layout is not None:
            cfg["quantization_config"] = job.layout.config(cfg["quantization_config"])
        if job.exec.computed is not None:
            job.exec.computed.set()  # (an executor that ran no unit: the thread goes on)
        prov = hashes.ahead.result() if hashes.ahead is not None else None
        if prov is None or prov.doc["options"] != job.fingerprint:
            prov = _provenance(job, hashes.all(ckpt, plan.units), job.fingerprint)
        folder.finish(cfg, total, {PROVENANCE: prov})
        result.shards = sorted(set(folder.weight_map.values()))
        result.reused_shards = sorted(folder.reused)  # kept from the interrupted run (--resume) or the old output (--refresh)
        # the shards this run wrote: every one not kept (from the interrupted run, a damaged one too, or the old output)
        result.rewritten_shards = sorted(set(result.shards) - set(result.reused_shards))
        return total


@dataclass
class _Hashes:
    """The content hashes of the run's source tensors: ``known`` already (``--resume``, ``--refresh``), or
    computed by ``hashing`` beside the executor."""

    known: dict[str, str] = field(default_factory=dict)
    hashing: SourceHashes | None = None
    ahead: EncodeAhead | None = None  # the provenance, made on a thread once the computing and the hashes are done

    def journaled(self, names) -> dict[str, str]:
        return {s: self.known[s] if s in self.known else self.hashing.get(s) for s in sorted(names)}

    def all(self, ckpt: Checkpoint, units: list) -> dict[str, str]:
        src_hashes = {**self.known, **self.hashing.all()}
        missing = [ckpt.tensors[s] for u in units for s in u.sources if s not in src_hashes]
        src_hashes.update(hash_tensors(missing))
        return src_hashes


def _provenance(job: QuantizeJob, src_hashes: dict[str, str], options: dict) -> dict:
    """The output's provenance document (:func:`.provenance.provenance` of the run's ``options``), with the tensors
    ``--dense-dtype`` cast."""
    derived = job.source.derived_from() if job.source.quantized else None
    prov = provenance(job.ckpt, job.plan.units, options, src_hashes, derived_from=derived)
    if casts := {r.name: r.cast for r in job.plan.rows if r.cast}:  # --dense-dtype: what inspect reports
        prov["cast"] = casts
    return prov


def _card_section(job: QuantizeJob, derived: dict | None) -> str:
    """The "Conversion (ctconvert)" section of the model card: the scheme, the target, the calibration data
    (a file by its name, not its local path), what a quantized source derived the output from."""
    plan, cal = job.plan, job.result.calibration
    cal_file = (job.fingerprint.get("calibration") or [""])[0]
    data = f"`{Path(cal_file).name}`" if cal_file else "ctconvert's built-in English corpus"
    calibrated_on = f"{data} ({cal['samples']} x {cal['seq_len']} tokens)" if cal else None
    target = job.layout.target if job.layout is not None else None
    return conversion_section(job.ckpt.path, plan.scheme.name, plan.format, plan.ignore, job.fingerprint["lm_head"], target, calibrated_on, derived)


def _explained(e: BaseException, out: Path, kept: bool) -> OutputError | None:
    """The error to raise instead of ``e`` once the output folder is aborted (None: ``e`` as it is): a full
    disk says the partial output was removed; a failed write with a partial folder kept says how to resume."""
    if disk_full(e):
        return OutputError(f"{e}; the partial output was removed to free the disk", file=out)
    if isinstance(e, OutputError) and kept and (left := partial_output(out)) is not None:
        return OutputError(f"{e.message}; {partial_hint(left)}", file=e.file, tensor=e.tensor)
    return None


def partial_hint(left: dict, batch: bool = False) -> str:
    """How to continue from, or remove, what an interrupted or failed run left (:func:`partial_output`).
    ``batch``: the run was a ``batch`` job, which has no ``--resume`` option but a ``resume: true`` job key."""
    size = f"{left['bytes'] / 2**20:.1f} MiB"
    if not left["shards"]:
        again = "run the batch again" if batch else "run the same command again"
        return f"partial data ({size}, no shard finished yet) is kept in {left['path']}: remove that folder, or {again}"
    how = "set `resume: true` on this job in the jobs file and run the batch again" if batch else "run the same command with --resume"
    done = plural(left["shards"], "finished shard")
    return f"partial data ({size}, {done}) is kept in {left['path']}: {how} to reuse the finished shards, or remove that folder"


def _drop_stale_shards(ckpt: Checkpoint, folder: OutputFolder, by_shard: dict, known: dict, result) -> None:
    """``--resume``: hash the sources of every finished shard now, and write again each shard whose sources
    changed since it was made (or whose journal does not say what it was made from)."""
    stale = []
    done = sorted(folder.completed)
    known.update(hash_tensors([ckpt.tensors[s] for name in done for s in sorted(by_shard.get(name, ())) if s not in known]))  # in parallel
    for name in done:
        made_from = folder.journaled(name).get("sources")
        now = {s: known[s] for s in sorted(by_shard.get(name, ()))}
        if made_from != now:
            stale.append(name)
    if stale:
        folder.forget(stale)
        n = len(stale)
        result.notes.append(f"--resume: {plural(n, 'finished shard')} {agree(n, 'was', 'were')} made from source bytes that changed since; written again")


def _execute(ckpt: Checkpoint, plan: Plan, shards, opts: ExecOptions, devs, progress, executor: LocalExecutor | RayExecutor, out: ShardOutput) -> list | None:
    """Run ``plan`` into ``shards`` with ``executor``: on this machine's devices, or as Ray tasks writing the
    shards of ``out``; the progress bar counts source bytes either way. The result's ``nodes`` (None locally)."""
    run = lambda: executor.run(ckpt, plan, shards, opts, devs, out)  # noqa: E731
    if progress is None:
        return run()
    with progress(sum(ckpt.tensors[s].nbytes for u in plan.units for s in u.sources)) as bar:
        opts.progress = bar
        return run()
