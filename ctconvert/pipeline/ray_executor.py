"""The Ray executor (``--executor ray``): a conversion's output shards converted by Ray tasks across a cluster.

The driver (the ``ctconvert`` process) plans as a local run does, opens the output folder and hands
this executor the units still to write (:class:`ShardOutput`). The shards are grouped so that no unit
(a fused set, a tensor) writes into two groups (:func:`shard_groups`; one shard per group, unless a fused
set straddles a shard boundary), and each group becomes one Ray task (:func:`convert_shards`). Paths
travel, not bytes: the checkpoint's headers (:class:`~ctconvert.checkpoint.reader.Checkpoint`, the
tensors' files and byte ranges) go once into Ray's object store, each task gets its units, and the
worker reads its source bytes itself from the storage every node sees, runs the same streaming
:func:`~ctconvert.pipeline.local.execute` on its device (one GPU, ``num_gpus=1``, with ``--device
cuda``; else the node's CPUs), hashes its sources beside it (as the local write stage does), writes
each shard under a temporary name in the partial folder (:data:`TMP_MARK`). It returns the shards' sizes,
content hashes and temporary names and its sources' hashes; the driver then renames each shard into its final
name and journals it (the driver's own shard files of the shards the workers write are removed first), so a
shard under its final name is a journaled one: an interrupted driver leaves a folder whose unfinished shards
are gone (their temporary files removed) and that ``--resume`` continues like a local run. The driver writes
the index, config, provenance and model card last, as a local run does.

Faults: a task whose worker or node is lost is run again elsewhere (Ray's ``max_retries``:
:data:`RETRIES`), rewriting its shards under a new temporary name (the same bytes); a worker that
cannot read a source file raises :class:`BadInputError` naming its node and the path. Progress:
with a progress bar, workers report the source bytes they converted to a small actor on the driver's node
(at most every :data:`REPORT_SECONDS`), which the driver reads into the bar. Joining the cluster, warming its
workers and the progress actor are :mod:`ctconvert.pipeline.ray_cluster`'s (torch-free, so that the console
script can begin them before its own heavy imports). Ray is imported only there and here, and only when this
executor is used (:func:`ray_module`).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.hashing import SourceHashes
from ..checkpoint.reader import Checkpoint
from ..checkpoint.shard_file import PlannedTensor, ShardFile
from ..errors import BadInputError, CTConvertError, OutputError, UsageError
from ..plan.planner import Plan
from .executor import ExecOptions, unit_bytes
from .local import execute
from .ray_cluster import INSTALL_HINT, Joining, connect, joining, progress_actor, ray_module, resources
from .ray_residents import Dispatch, code_id, keeping, residents, retire
from .zeros import ZeroTracker

__all__ = ["INSTALL_HINT", "RETRIES", "RayExecutor", "ShardOutput", "TaskResult", "connect", "convert_shards", "ray_module", "shard_groups"]

#: times Ray runs a task again whose worker or node was lost (its shards are rewritten: the same bytes)
RETRIES = 3
#: a worker reports its progress at most this often (seconds), and once at its end
REPORT_SECONDS = 0.5
#: the driver looks at finished tasks and the progress this often (seconds)
POLL_SECONDS = 0.2
#: on an error or interrupt, the driver waits at most this long for the cancelled tasks to end (their workers killed)
#: before it removes their temporary files: a worker still running could create its file after the removal
CANCEL_WAIT_SECONDS = 30.0
#: a shard written by a task: ``.<shard>.ray-part-<attempt>`` in the partial folder (renamed by the driver when it journals it)
TMP_MARK = ".ray-part-"


@dataclass
class ShardOutput:
    """What the write stage hands an executor besides the shards: the output folder
    (:class:`~ctconvert.checkpoint.writer.OutputFolder`, whose journal records finished shards), each
    shard's planned tensors in order (``{shard name: [PlannedTensor]}``), and the source hashes known
    so far (source tensor -> hex), which a Ray run fills with what its workers hashed."""

    folder: object
    assignment: dict[str, list[PlannedTensor]]
    known: dict[str, str] = field(default_factory=dict)


@dataclass
class TaskSpec:
    """One task: ``shards`` (name -> planned tensors, the header order) and the plan's ``units`` that write
    them, in plan order; ``others``: outputs of those units in shards finished already (dropped)."""

    key: tuple[str, int]
    shards: dict[str, list[PlannedTensor]]
    units: list
    others: list[PlannedTensor]
    folder: str
    cuda: bool
    zeros: bool
    nbytes: int = 0


@dataclass
class TaskResult:
    """What a task returns: each shard's ``(size, content hash)``, its sources' hashes, the pass-through
    tensors it found holding NaN/inf, the zero-quantized rows (``ZeroTracker.found``), its node, each
    shard's temporary file name in the partial folder (``parts``: the driver renames it when it journals it), and
    whether a resident worker (an actor, :mod:`.ray_residents`) ran it rather than a plain task."""

    key: tuple[str, int]
    shards: dict[str, tuple[int, str]]
    hashes: dict[str, str]
    nonfinite: list[str]
    zeros: dict
    node: str
    node_id: str
    nbytes: int
    parts: dict[str, str]
    resident: bool = False


def shard_groups(units: list, weight_map: dict[str, str], done: set[str]) -> list[tuple[list[str], list[int]]]:
    """``[(shard names, unit indices)]``: the shards not in ``done``, grouped so that every unit writes into
    one group only (a unit's outputs may straddle a shard boundary), each group's units in plan order
    (a unit with nothing left to write is in none); groups in the order of their first shard.
    ``weight_map``: output tensor -> its shard."""
    parent: dict[str, str] = {}

    def root(s: str) -> str:
        while parent.setdefault(s, s) != s:
            s = parent[s]
        return s

    todo = [[weight_map[o[0]] for o in u.outputs if weight_map[o[0]] not in done] for u in units]
    for names in todo:
        for s in names:
            parent[root(s)] = root(names[0])
    groups: dict[str, tuple[list[str], list[int]]] = {}
    for s in sorted(parent):
        groups.setdefault(root(s), ([], []))[0].append(s)
    for i, names in enumerate(todo):
        if names:
            groups[root(names[0])][1].append(i)
    return sorted(groups.values(), key=lambda g: g[0][0])


class RayExecutor:
    """Runs a plan's units as Ray tasks, one per group of output shards (:func:`shard_groups`).

    ``address``: the cluster (:func:`connect`). ``keep``: seconds the workers stay after the run as residents, for the
    next run of any driver (:mod:`ctconvert.pipeline.ray_residents`; 0: plain Ray tasks). :meth:`connect` before any
    work (a missing extra or an unreachable cluster fails before the output folder is opened); :meth:`run` returns the
    ``nodes`` of the result: ``[{"node": IP, "node_id": hex, "bytes": source bytes converted, "shards": K,
    "resident_shards": of those, the ones resident workers converted}]``. The
    workers hash the sources they read (``hashes_sources`` False: the driver does not). Raises :class:`UsageError`
    for a negative ``keep``."""

    hashes_sources = False

    def __init__(self, address: str | None = None, keep: int = 0):
        if keep < 0:
            raise UsageError(f"--ray-keep-workers takes seconds >= 0, not {keep}")
        self.address, self.keep = address, keep
        self.ray = None
        self._joining: Joining | None = None
        self._cuda = False

    def start(self, device: str = "cpu") -> None:
        """Begin joining the cluster and warming its workers on a thread (:meth:`connect` waits for it), so that
        this overlaps the driver's own work (opening the source, planning, calibrating); a join the console script
        began for this address is taken instead (:func:`~ctconvert.pipeline.ray_cluster.joining`). ``device``: the
        ``--device`` given; one that can mean CUDA on a machine with CUDA warms GPU workers."""
        self._cuda = str(device).lower() != "cpu" and torch.cuda.is_available()
        self._joining = joining(self.address, self._cuda, keeping(self.keep) if self.keep > 0 else None)

    def connect(self) -> None:
        """Join the cluster (:func:`connect`; begun by :meth:`start`, else now). Raises what joining raised."""
        if self._joining is None:
            self.start()
        self.ray = self._joining.wait(self._cuda)

    def run(self, ckpt: Checkpoint, plan: Plan, shards: dict[str, ShardFile], opts: ExecOptions, devices, out: ShardOutput) -> list[dict]:
        """Convert ``plan``'s units into the shards of ``out`` on the cluster (``devices``: a CUDA one asks
        each task for one GPU). Raises the first task's error (a :class:`~ctconvert.errors.CTConvertError`
        as the worker raised it), having cancelled the others and removed their temporary files."""
        ray = self.ray or connect(self.address)
        folder, cuda = out.folder, any(torch.device(d).type == "cuda" for d in (devices or [opts.device]))
        specs = self._specs(ckpt, plan, out, cuda, opts.zeros is not None)
        for spec in specs:  # the driver's files of the shards the workers write: closed and removed (a final name is a journaled shard)
            for name, tensors in spec.shards.items():
                if tensors:
                    shards[tensors[0].name].abort()
                    (Path(folder.tmp) / name).unlink(missing_ok=True)
        _remove_parts(Path(folder.tmp))
        remote = ray.remote(convert_shards).options(max_retries=RETRIES, retry_exceptions=False, **resources(ray, cuda))
        progress = progress_actor(ray) if opts.progress is not None else None  # a bar to follow: the workers report
        common = ray.put((ckpt, dataclasses.replace(plan, units=[], rows=[], notes=[]), dataclasses.replace(opts, progress=None, zeros=None, nonfinite=[])))
        code = code_id()
        if specs and not self.keep:
            retire(ray)  # residents an earlier run left would hold the CPUs (GPUs) these tasks need
        dispatch = Dispatch(
            ray,
            residents(ray, cuda, self.keep) if self.keep and specs else [],
            self.keep,
            call=lambda handle, spec: handle.convert.remote(convert_shards, common, spec, progress, code),
            task=lambda spec: remote.remote(common, spec, progress),
            get=lambda ref: _result(ray, ref),
            retries=RETRIES,
        )
        dispatch.add(specs)
        try:
            results = self._collect(ray, dispatch, progress, opts.progress, out, specs[0].key[0] if specs else "")
        except BaseException:
            dispatch.stop(CANCEL_WAIT_SECONDS)
            raise
        finally:
            if specs and progress is not None:
                progress.forget.remote(specs[0].key[0])
            _remove_parts(Path(folder.tmp))  # what attempts on lost workers left
        return self._merge(plan, opts, results)

    def _specs(self, ckpt: Checkpoint, plan: Plan, out: ShardOutput, cuda: bool, zeros: bool) -> list[TaskSpec]:
        weight_map = {t.name: name for name, ts in out.assignment.items() for t in ts}
        done = out.folder.completed
        specs = []
        run = uuid.uuid4().hex[:12]
        for key, (names, idx) in enumerate(shard_groups(plan.units, weight_map, done)):
            units = [plan.units[i] for i in idx]
            others = [PlannedTensor(*o) for u in units for o in u.outputs if weight_map[o[0]] in done]
            nbytes = sum(unit_bytes(ckpt, u) for u in units)
            specs.append(TaskSpec((run, key), {n: out.assignment[n] for n in names}, units, others, str(out.folder.tmp), cuda, zeros, nbytes))
        return specs

    def _collect(self, ray, dispatch: Dispatch, progress, bar, out: ShardOutput, run: str) -> list[TaskResult]:
        """Wait for every shard group, renaming each shard into its final name and journaling it as its call returns;
        the bar follows the workers' reports."""
        results, shown = [], 0
        while pending := dispatch.pending():
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            for ref in ready:
                if (r := dispatch.result(ref)) is None:
                    continue
                results.append(r)
                out.known.update(r.hashes)
                for name, (size, digest) in r.shards.items():
                    os.replace(Path(out.folder.tmp) / r.parts[name], Path(out.folder.tmp) / name)
                    out.folder.journal_shard(name, size, digest)
            dispatch.fill()
            if bar is not None:
                now = sum(r.nbytes for r in results) if not dispatch.pending() else ray.get(progress.total.remote(run))
                if now > shown:
                    bar.update(now - shown)
                    shown = now
        return results

    def _merge(self, plan: Plan, opts: ExecOptions, results: list[TaskResult]) -> list[dict]:
        """The tasks' findings into ``opts`` (as one local run leaves them: NaN/inf tensors in plan order,
        zero-quantized rows), and the ``nodes`` entries (by node, in the order of their IP and id)."""
        order = {s: i for i, u in enumerate(plan.units) for s in u.sources}
        opts.nonfinite.extend(sorted((n for r in results for n in r.nonfinite), key=lambda n: order.get(n, -1)))
        if opts.zeros is not None:
            for r in results:
                opts.zeros.found.update(r.zeros)
        nodes: dict[str, dict] = {}
        for r in results:
            entry = nodes.setdefault(r.node_id, {"node": r.node, "node_id": r.node_id, "bytes": 0, "shards": 0, "resident_shards": 0})
            entry["bytes"] += r.nbytes
            entry["shards"] += len(r.shards)
            entry["resident_shards"] += len(r.shards) if r.resident else 0
        return sorted(nodes.values(), key=lambda e: (e["node"], e["node_id"]))


def _result(ray, ref) -> TaskResult:
    """A finished task's result; its error as the worker raised it (a ctconvert error keeps its exit code, an
    ``OSError`` stays one: a full disk is explained as a local run's is)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, (CTConvertError, OSError)):
            raise cause from None
        raise CTConvertError(f"a Ray task failed: {type(cause or e).__name__}: {str(cause or e).strip().splitlines()[-1]}") from None
    except ray.exceptions.RayError as e:
        raise CTConvertError(f"a Ray task failed after {RETRIES} retries: {type(e).__name__}: {str(e).strip().splitlines()[0]}") from None


def _remove_parts(folder: Path) -> None:
    """Remove the temporary shard files of earlier task attempts (lost workers, an interrupted run)."""
    for p in folder.glob(f".*{TMP_MARK}*"):
        p.unlink(missing_ok=True)


class _Reporter:
    """A worker's progress (``.update(n)``, as the executor calls it), sent to the actor every :data:`REPORT_SECONDS`
    (``actor`` None: a run without a progress bar, nothing sent)."""

    def __init__(self, actor, key: tuple[str, int]):
        self.actor, self.key, self.done, self.sent = actor, key, 0, 0.0

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.sent >= REPORT_SECONDS:
            self.flush()

    def flush(self) -> None:
        self.sent = time.monotonic()
        if self.actor is not None:
            self.actor.report.remote(self.key, self.done)


def _where(ray) -> tuple[str, str]:
    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


def _check_visible(ckpt: Checkpoint, units: list, folder: Path, where: str) -> None:
    """Refuse a node that cannot read a source file or see the output folder, by node and path."""
    for path in sorted({str(ckpt.tensors[s].file) for u in units for s in u.sources}):
        try:
            os.close(os.open(path, os.O_RDONLY))
        except OSError as e:
            why = f"{where} cannot read the source ({e.strerror or e}); the source must be on storage every node sees at the same path"
            raise BadInputError(why, file=path) from None
    if not folder.is_dir():
        raise OutputError(f"{where} cannot see the output's partial folder; the output must be on storage every node sees at the same path", file=str(folder))


def convert_shards(common, spec: TaskSpec, progress) -> TaskResult:
    """The Ray task (run on a worker): convert ``spec``'s units into its shards, each written under a
    temporary name in the partial folder (the driver renames it when it journals it). ``common``: ``(checkpoint, plan
    without units, executor options)``, shared by every task. Raises what the executor raises, and
    :class:`BadInputError`/:class:`OutputError` naming the node for a path it cannot reach."""
    import ray

    ckpt, plan, opts = common
    ip, node_id = _where(ray)
    folder = Path(spec.folder)
    _check_visible(ckpt, spec.units, folder, f"Ray node {ip} ({node_id[:12]})")
    cpus = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0))
    if cpus >= 1:
        torch.set_num_threads(cpus)  # Ray sets OMP_NUM_THREADS=1 in its workers
    tag = uuid.uuid4().hex[:12]
    files = {name: ShardFile(folder / f".{name}{TMP_MARK}{tag}", tensors) for name, tensors in spec.shards.items()}
    by_tensor = {t.name: files[name] for name, tensors in spec.shards.items() for t in tensors}
    if spec.others:  # outputs in shards an earlier run finished: dropped, as a local run drops them
        by_tensor.update(dict.fromkeys((t.name for t in spec.others), ShardFile.existing(folder / ".ray-dropped", spec.others)))
    reporter = _Reporter(progress, spec.key)
    device = torch.device("cuda", 0) if spec.cuda else torch.device("cpu")
    wopts = dataclasses.replace(opts, device=device, progress=reporter, zeros=ZeroTracker() if spec.zeros else None, nonfinite=[])
    hashing = SourceHashes([ckpt.tensors[s] for u in spec.units for s in u.sources])
    try:
        execute(ckpt, dataclasses.replace(plan, units=spec.units), by_tensor, wopts)
        done = {}
        for name, f in files.items():
            f.close()
            done[name] = (f.size, f.content_hash())
    except BaseException:
        for f in files.values():
            f.abort()
            f.path.unlink(missing_ok=True)
        raise
    reporter.flush()
    zeros = wopts.zeros.found if wopts.zeros is not None else {}
    parts = {name: f.path.name for name, f in files.items()}
    resident = ray.get_runtime_context().get_actor_id() is not None  # a Resident's call (a plain task has no actor)
    return TaskResult(spec.key, done, hashing.all(), list(wopts.nonfinite), zeros, ip, node_id, spec.nbytes, parts, resident)
