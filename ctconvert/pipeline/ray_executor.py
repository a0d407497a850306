"""The Ray executor (``--executor ray``): a conversion's output shards converted by Ray tasks across a cluster.

The driver (the ``ctconvert`` process) plans as a local run does, opens the output folder and hands
this executor the units still to write (:class:`ShardOutput`). The shards are grouped so that no unit
(a fused set, a tensor) writes into two groups (:func:`shard_groups`; one shard per group, unless a fused
set straddles a shard boundary), and each group becomes one Ray task (:func:`convert_shards`). Paths
travel, not bytes: the checkpoint's headers (:class:`~ctconvert.checkpoint.reader.Checkpoint`, the
tensors' files and byte ranges) go once into Ray's object store, each task gets its units, and the
worker reads its source bytes itself from the storage every node sees, runs the same streaming
:func:`~ctconvert.pipeline.executor.execute` on its device (one GPU, ``num_gpus=1``, with ``--device
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
workers report the source bytes they converted to a small actor on the driver's node (at most every
:data:`REPORT_SECONDS`), which the driver reads into the progress bar. Ray is imported only here,
and only when this executor is used (:func:`ray_module`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.hashing import SourceHashes
from ..checkpoint.reader import Checkpoint
from ..checkpoint.safetensors_io import PlannedTensor, ShardFile
from ..errors import BadInputError, CTConvertError, OutputError, UsageError
from ..plan.planner import Plan
from .executor import ExecOptions, execute, unit_bytes
from .zeros import ZeroTracker

__all__ = ["INSTALL_HINT", "RETRIES", "RayExecutor", "ShardOutput", "TaskResult", "connect", "convert_shards", "ray_module", "shard_groups"]

#: how to get the optional extra (the one-line error of ``--executor ray`` without it)
INSTALL_HINT = "pip install 'ctconvert[ray]' (or ./install.sh ray)"
#: times Ray runs a task again whose worker or node was lost (its shards are rewritten: the same bytes)
RETRIES = 3
#: a worker reports its progress at most this often (seconds), and once at its end
REPORT_SECONDS = 0.5
#: the driver looks at finished tasks and the progress this often (seconds)
POLL_SECONDS = 0.2
#: a shard written by a task: ``.<shard>.ray-part-<attempt>`` in the partial folder (renamed by the driver when it journals it)
TMP_MARK = ".ray-part-"
#: seconds to reach a cluster address before giving up on it
CONNECT_SECONDS = 5.0


def ray_module():
    """The ``ray`` package, imported now. Raises :class:`UsageError` (exit 2) saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"--executor ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def connect(address: str | None):
    """Join the Ray cluster at ``address`` (``HOST:PORT``, ``ray://HOST:PORT``, ``auto``); None: Ray's own
    default, ``RAY_ADDRESS`` when set, else a new local Ray instance. A process already connected stays
    so. Returns the ``ray`` module. Raises :class:`UsageError` (exit 2) without Ray, or naming an address
    that cannot be reached (tried for :data:`CONNECT_SECONDS`)."""
    ray = ray_module()
    if ray.is_initialized():
        return ray
    given = address or os.environ.get("RAY_ADDRESS") or None
    if given is not None:
        _probe(given)
    local = {"include_dashboard": False} if given is None else {}
    try:
        ray.init(address=address, logging_level=logging.ERROR, **local)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "" if given is None else " (a cluster with token authentication, the default of `ray start --head`, needs RAY_AUTH_MODE=token and its token)"
        raise UsageError(f"cannot join the Ray cluster at {given or 'a new local instance'}: {first}{hint}") from None
    return ray


def _probe(address: str) -> None:
    """A quick TCP connect to ``address``'s host and port, so that a wrong one fails in seconds (``ray.init``
    retries for a minute); ``auto``/``local`` and addresses without a port are left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        raise UsageError(
            f"cannot reach the Ray cluster at {address} (--ray-address or RAY_ADDRESS): {e.strerror or e}; "
            "start one with `ray start --head`, or give the head node's address"
        ) from None


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

    key: int
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
    tensors it found holding NaN/inf, the zero-quantized rows (``ZeroTracker.found``), its node, and each
    shard's temporary file name in the partial folder (``parts``: the driver renames it when it journals it)."""

    key: int
    shards: dict[str, tuple[int, str]]
    hashes: dict[str, str]
    nonfinite: list[str]
    zeros: dict
    node: str
    node_id: str
    nbytes: int
    parts: dict[str, str]


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

    ``address``: the cluster (:func:`connect`). :meth:`connect` before any work (a missing extra or an
    unreachable cluster fails before the output folder is opened); :meth:`run` returns the ``nodes``
    of the result: ``[{"node": IP, "node_id": hex, "bytes": source bytes converted, "shards": K}]``. The
    workers hash the sources they read (``hashes_sources`` False: the driver does not)."""

    hashes_sources = False

    def __init__(self, address: str | None = None):
        self.address = address
        self.ray = None
        self._joining: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, device: str = "cpu") -> None:
        """Begin joining the cluster and warming its workers on a thread (:meth:`connect` waits for it), so that
        this overlaps the driver's own work (opening the source, planning, calibrating). ``device``: the
        ``--device`` given; one that can mean CUDA on a machine with CUDA warms GPU workers."""
        cuda = str(device).lower() != "cpu" and torch.cuda.is_available()
        if not (self.address or os.environ.get("RAY_ADDRESS")):
            # a new local instance: Ray starts its daemons (GCS, raylet) with PR_SET_PDEATHSIG, which kills them
            # when the *thread* that started them ends, so it is started on this (the main) thread
            try:
                self.ray = connect(None)
            except BaseException as e:  # noqa: BLE001 - re-raised by connect()
                self._error = e
                return
        self._joining = threading.Thread(target=self._join, args=(cuda,), daemon=True, name="ctconvert-ray-join")
        self._joining.start()

    def _join(self, cuda: bool) -> None:
        try:
            self.ray = self.ray or connect(self.address)
            _warm_up(self.ray, cuda)
        except BaseException as e:  # noqa: BLE001 - re-raised by connect()
            self._error = e

    def connect(self) -> None:
        """Join the cluster (:func:`connect`; begun by :meth:`start`, else now). Raises what joining raised."""
        if self._joining is None and self._error is None:
            self.start()
        if self._joining is not None:
            self._joining.join()
        if self._error is not None:
            raise self._error

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
        remote = ray.remote(convert_shards).options(max_retries=RETRIES, retry_exceptions=False, **_resources(ray, cuda))
        progress = ray.remote(num_cpus=0)(_Progress).options(scheduling_strategy=_on(ray)).remote()
        common = ray.put((ckpt, dataclasses.replace(plan, units=[], rows=[], notes=[]), dataclasses.replace(opts, progress=None, zeros=None, nonfinite=[])))
        refs = {remote.remote(common, spec, progress): spec for spec in specs}
        try:
            results = self._collect(ray, refs, progress, opts.progress, out)
        except BaseException:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise
        finally:
            ray.kill(progress)
            _remove_parts(Path(folder.tmp))  # what attempts on lost workers left
        return self._merge(plan, opts, results)

    def _specs(self, ckpt: Checkpoint, plan: Plan, out: ShardOutput, cuda: bool, zeros: bool) -> list[TaskSpec]:
        weight_map = {t.name: name for name, ts in out.assignment.items() for t in ts}
        done = out.folder.completed
        specs = []
        for key, (names, idx) in enumerate(shard_groups(plan.units, weight_map, done)):
            units = [plan.units[i] for i in idx]
            others = [PlannedTensor(*o) for u in units for o in u.outputs if weight_map[o[0]] in done]
            nbytes = sum(unit_bytes(ckpt, u) for u in units)
            specs.append(TaskSpec(key, {n: out.assignment[n] for n in names}, units, others, str(out.folder.tmp), cuda, zeros, nbytes))
        return specs

    def _collect(self, ray, refs: dict, progress, bar, out: ShardOutput) -> list[TaskResult]:
        """Wait for every task, renaming each shard into its final name and journaling it as its task returns; the
        bar follows the workers' reports."""
        pending, results, shown = list(refs), [], 0
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            for ref in ready:
                results.append(r := _result(ray, ref))
                out.known.update(r.hashes)
                for name, (size, digest) in r.shards.items():
                    os.replace(Path(out.folder.tmp) / r.parts[name], Path(out.folder.tmp) / name)
                    out.folder.journal_shard(name, size, digest)
            if bar is not None:
                now = sum(r.nbytes for r in results) if not pending else ray.get(progress.total.remote())
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
            entry = nodes.setdefault(r.node_id, {"node": r.node, "node_id": r.node_id, "bytes": 0, "shards": 0})
            entry["bytes"] += r.nbytes
            entry["shards"] += len(r.shards)
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


def _resources(ray, cuda: bool) -> dict:
    """A task's resources: one GPU (and a CPU) with CUDA; else the CPUs of the smallest node, so that a node
    converts one group at a time with all its cores, as a local run does."""
    if cuda:
        if not ray.cluster_resources().get("GPU"):
            raise UsageError("--device cuda with --executor ray: no node of the Ray cluster has a GPU (start its nodes with GPUs, or use --device cpu)")
        return {"num_gpus": 1, "num_cpus": 1}
    cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]
    return {"num_cpus": int(min(cpus)) if cpus else 1}


def _warm_up(ray, cuda: bool) -> None:
    """Start one worker per node (with ``cuda``, one per GPU), not waited for: Python, Ray, torch, the kernels."""
    warm = ray.remote(_warm_worker)
    for node in ray.nodes():
        gpus = int(node["Resources"].get("GPU", 0)) if cuda else 0
        if not node.get("Alive") or (cuda and not gpus) or node["Resources"].get("CPU", 0) < 1:
            continue
        resources = {"num_cpus": 1, "num_gpus": 1} if cuda else _resources(ray, False)
        for _ in range(gpus or 1):
            warm.options(scheduling_strategy=_on(ray, node["NodeID"], soft=True), **resources).remote(cuda)


def _on(ray, node_id: str | None = None, soft: bool = False):
    """A scheduling strategy placing a task or actor on node ``node_id`` (None: the driver's, which outlives the loss of any other)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id or ray.get_runtime_context().get_node_id(), soft=soft)


def _warm_worker(cuda: bool) -> None:
    """A worker's start-up, done before its first task: this module (torch, the executor) is imported to run it; the C
    kernels are loaded, and with ``cuda`` the device's context made."""
    from ..formats import native

    native.available()
    if cuda and torch.cuda.is_available():
        torch.zeros(1, device="cuda")


def _remove_parts(folder: Path) -> None:
    """Remove the temporary shard files of earlier task attempts (lost workers, an interrupted run)."""
    for p in folder.glob(f".*{TMP_MARK}*"):
        p.unlink(missing_ok=True)


class _Progress:
    """The progress actor: each task's source bytes done so far (the most any attempt of it reported)."""

    def __init__(self):
        self.done: dict[int, int] = {}

    def report(self, key: int, nbytes: int) -> None:
        self.done[key] = max(self.done.get(key, 0), nbytes)

    def total(self) -> int:
        return sum(self.done.values())


class _Reporter:
    """A worker's progress (``.update(n)``, as the executor calls it), sent to the actor every :data:`REPORT_SECONDS`."""

    def __init__(self, actor, key: int):
        self.actor, self.key, self.done, self.sent = actor, key, 0, 0.0

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.sent >= REPORT_SECONDS:
            self.flush()

    def flush(self) -> None:
        self.sent = time.monotonic()
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
    return TaskResult(spec.key, done, hashing.all(), list(wopts.nonfinite), zeros, ip, node_id, spec.nbytes, parts)
