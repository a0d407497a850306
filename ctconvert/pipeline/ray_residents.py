"""Resident workers (``--ray-keep-workers SECONDS``): converting workers that outlive the driver, for the next run.

A ``--executor ray`` run's fixed cost is mostly its workers' start-up: on every node a Python that imports Ray,
torch and the engine, every time, since Ray ties a worker to the driver's job (measured: +61% of a 3.5 s conversion
of the 1.2B benchmark checkpoint on 2 cores, +87% of the 8B one on an H200, for a new driver; a few percent once its
workers are up). A *resident* is a detached Ray actor (``lifetime="detached"``: it outlives the job that made it),
one per node, or one per GPU with CUDA, named after the node, the device kind and the ctconvert code it runs
(:func:`code_id`, a hash of the package's sources), in the namespace :data:`NAMESPACE`. A run with ``keep`` > 0
finds the residents of its code or makes them (:func:`residents`), and converts its tasks' shard groups in them
(:class:`Dispatch`), the same :func:`~ctconvert.pipeline.ray_executor.convert_shards` a Ray task runs, so the
bytes are the same. Each resident ends itself once it has been idle ``keep`` seconds (the latest run's ``keep``;
every run renews it), and holds its CPUs (its GPU) meanwhile: other Ray work on the cluster waits for them.

Faults: a resident lost with its node (or one that ended between a run's lookup and its call) fails its call with
``RayActorError``; the shard group goes to another resident, or to a plain Ray task once none is left (its node's
resources are then free), within the run's retries. A resident that runs other code than the driver's (a name
collision across installs) refuses the call (:class:`StaleResident`) and is treated as lost. On an interrupt or an
error, a resident with a call in flight is killed (a running actor call cannot be cancelled otherwise), so that no
file is written after the driver has removed the temporary ones; the next run makes it again.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

from .ray_cluster import on_node, resources, warm_worker

__all__ = ["NAMESPACE", "PREFIX", "Dispatch", "Resident", "StaleResident", "code_id", "keeping", "residents", "retire", "stop_residents"]

#: the Ray namespace of the residents (named actors are looked up by namespace and name)
NAMESPACE = "ctconvert"
#: a resident's name: ``PREFIX-<code id>-<cpu|cuda>-<node id>-<slot>``
PREFIX = "ctconvert-resident"
#: how often a resident looks whether it has been idle long enough (seconds)
WATCH_SECONDS = 0.25
#: calls a resident takes at once: one conversion running, one queued behind it, and its control calls
CONCURRENCY = 4
#: shard groups handed to one resident at a time (one running, one waiting for it)
DEPTH = 2

_CODE: list[str] = []


def code_id() -> str:
    """A hash (16 hex digits) of the ctconvert package's Python and C sources (relative names and bytes): a resident
    converts for drivers of the same code only. Computed once per process (a few ms)."""
    if not _CODE:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for p in sorted(root.rglob("*")):
            if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
        _CODE.append(h.hexdigest()[:16])
    return _CODE[0]


class StaleResident(RuntimeError):
    """A resident asked to convert for a driver of other ctconvert code than its own."""


class Resident:
    """The resident actor: imports the engine at its start (:func:`~ctconvert.pipeline.ray_cluster.warm_worker`),
    converts one shard group at a time (:meth:`convert`), and ends itself after ``keep`` idle seconds."""

    def __init__(self, cuda: bool, keep: float):
        warm_worker(cuda)
        self.code, self.keep, self.busy, self.last, self.calls = code_id(), float(keep), 0, time.monotonic(), 0
        self.lock, self.state = threading.Lock(), threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="ctconvert-resident-watch").start()

    def keep_for(self, seconds: float) -> str:
        """Stay ``seconds`` after the last conversion (a run's ``keep``; the latest wins), counted from now at least.
        Returns the resident's :func:`code_id`."""
        with self.state:
            self.keep, self.last = float(seconds), max(self.last, time.monotonic())
        return self.code

    def where(self) -> tuple[int, str, int]:
        """``(process id, node id, shard groups converted)``: which process converts, and how much (tests)."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id(), self.calls

    def convert(self, run, common, spec, progress, code: str):
        """``run(common, spec, progress)`` (:func:`~ctconvert.pipeline.ray_executor.convert_shards`, which Ray sends by
        name), one call at a time. Raises :class:`StaleResident` when ``code`` (the driver's :func:`code_id`) is
        not this resident's."""
        if code != self.code:
            raise StaleResident(f"resident of ctconvert code {self.code} asked to convert for code {code}")
        with self.state:
            self.busy += 1
            self.calls += 1
        try:
            with self.lock:
                return run(common, spec, progress)
        finally:
            with self.state:
                self.busy -= 1
                self.last = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            with self.state:
                idle = self.busy == 0 and time.monotonic() - self.last > self.keep
            if idle:
                break
        try:  # an intended end (no "worker died" line on a driver's console); detached, never restarted: its name is free
            import ray

            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            time.sleep(10)
        finally:
            os._exit(0)


_CLASS: dict[int, object] = {}


def _actor(ray):
    """The :class:`Resident` class as a Ray actor class (made once per ``ray`` module)."""
    if id(ray) not in _CLASS:
        _CLASS[id(ray)] = ray.remote(Resident)
    return _CLASS[id(ray)]


def residents(ray, cuda: bool, keep: float) -> list:
    """The residents of this code for ``cuda`` on every live node (one per GPU with CUDA; none on a node without
    one), found by name or made now (not waited for), each told to stay ``keep`` seconds after its last conversion;
    every other resident is told to end once idle (:func:`retire`). Returns their handles; :class:`Dispatch` waits
    for each to be ready before it hands it work."""
    nodes = ray.nodes()
    need = {"num_gpus": 1, "num_cpus": 1} if cuda else resources(ray, False, nodes)
    kind, code, out, names = "cuda" if cuda else "cpu", code_id(), [], set()
    for node in nodes:
        gpus = int(node["Resources"].get("GPU", 0)) if cuda else 0
        if not node.get("Alive") or (cuda and not gpus) or node["Resources"].get("CPU", 0) < need["num_cpus"]:
            continue
        for slot in range(gpus or 1):
            name = f"{PREFIX}-{code}-{kind}-{node['NodeID']}-{slot}"
            names.add(name)
            handle = (
                _actor(ray)
                .options(
                    name=name,
                    namespace=NAMESPACE,
                    lifetime="detached",
                    get_if_exists=True,
                    max_restarts=0,
                    max_concurrency=CONCURRENCY,
                    scheduling_strategy=on_node(ray, node["NodeID"]),
                    **need,
                )
                .remote(cuda, keep)
            )
            out.append(handle)
    retire(ray, names)
    return out


def retire(ray, keep: set[str] = frozenset()) -> int:
    """Tell every resident not named in ``keep`` to end as soon as it is idle (``keep_for(0)``: at once, or after the
    conversion it is running): one of other ctconvert code (an upgrade), of the other device kind, or any resident
    for a run without ``--ray-keep-workers``, would otherwise hold the CPUs (GPUs) this run's workers need until its
    own keep ran out. Returns how many were told."""
    told = [h.keep_for.remote(0) for name, h in _alive(ray) if name not in keep]
    return len(told)


def keeping(keep: float):
    """The warm-up of a run with ``--ray-keep-workers keep`` (:class:`~ctconvert.pipeline.ray_cluster.Joining`'s
    ``warm``): its residents found or made (:func:`residents`) instead of warm tasks, which would hold the CPUs they
    need meanwhile."""
    return lambda ray, cuda: residents(ray, cuda, keep)


def stop_residents(ray) -> int:
    """End every resident of the cluster (any code): returns how many. For tests and for an operator
    (``python -c "import ray; ray.init(ADDRESS); from ctconvert.pipeline.ray_residents import stop_residents; stop_residents(ray)"``)."""
    handles = [h for _, h in _alive(ray)]
    for h in handles:
        ray.kill(h, no_restart=True)
    return len(handles)


def _alive(ray):
    """``(name, handle)`` of every resident of the cluster (any code), one that ended meanwhile left out."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and entry["name"].startswith(PREFIX):
            try:
                yield entry["name"], ray.get_actor(entry["name"], namespace=NAMESPACE)
            except ValueError:  # ended meanwhile
                pass


class Dispatch:
    """Hands a run's shard groups (task specs) out and takes their results back: to the ``handles`` (residents) as each
    becomes ready, :data:`DEPTH` at a time each, or to plain Ray tasks (``task``: ``spec -> ref``) where there are no
    residents or none is left. ``call(handle, spec) -> ref`` submits a spec to a resident; ``get(ref)``: a finished
    call's result, raising its error as the driver reports it. The driver waits on :meth:`pending`, passes each
    ready ref to :meth:`result` and calls :meth:`fill` after each round; :meth:`stop` on an error or interrupt."""

    def __init__(self, ray, handles: list, keep: float, call, task, get, retries: int):
        self.ray, self.handles, self.call, self.task, self.get, self.retries = ray, handles, call, task, get, retries
        self.queue: list = []
        self.load: dict[int, int] = {}  # ready resident -> its calls in flight
        self.booting = {h.keep_for.remote(keep): i for i, h in enumerate(handles)}  # its keep_for's ref -> resident
        self.inflight: dict = {}  # ref -> (spec, resident, or None for a task)
        self.lost: dict = {}  # spec key -> times its resident was lost

    def add(self, specs: list) -> None:
        self.queue.extend(specs)
        self.fill()

    def pending(self) -> list:
        """The refs to wait on while work is left (a resident that never starts, its node full, ends no run)."""
        return [*self.inflight, *self.booting] if self.queue or self.inflight else []

    def result(self, ref):
        """The :class:`~ctconvert.pipeline.ray_executor.TaskResult` of a ready ref, or None: a resident became ready
        (or could not start: not used), or a resident was lost with the call (its spec handed out again).
        Raises the call's error, and :class:`~ctconvert.errors.CTConvertError` for a group lost more than
        ``retries`` times."""
        if ref in self.booting:
            i = self.booting.pop(ref)
            try:
                self.ray.get(ref)
                self.load[i] = 0
            except Exception:  # noqa: BLE001 - it could not start (its node lost, a name held by a dying one): not used
                pass
            return None
        spec, i = self.inflight.pop(ref)
        if i is None:
            return self.get(ref)
        try:
            out = self.ray.get(ref)
            self.load[i] -= 1
            return out
        except self.ray.exceptions.RayActorError:
            pass
        except self.ray.exceptions.RayTaskError as e:
            if not isinstance(getattr(e, "cause", None), StaleResident):
                return self.get(ref)
        self.load.pop(i, None)  # lost: never used again
        n = self.lost[spec.key] = self.lost.get(spec.key, 0) + 1
        if n > self.retries:
            from ..errors import CTConvertError

            raise CTConvertError(f"a shard group's Ray worker was lost {n} times: {', '.join(spec.shards)}")
        self.queue.insert(0, spec)
        return None

    def fill(self) -> None:
        """Hand queued specs to ready residents with room (the least loaded first), or to tasks where no resident
        is ready or starting."""
        for i in sorted(self.load, key=self.load.get):
            while self.queue and self.load[i] < DEPTH:
                spec = self.queue.pop(0)
                self.inflight[self.call(self.handles[i], spec)] = (spec, i)
                self.load[i] += 1
        if self.queue and not self.load and not self.booting:  # no resident: Ray tasks (a lost resident's resources are free)
            for spec in self.queue:
                self.inflight[self.task(spec)] = (spec, None)
            self.queue.clear()

    def stop(self, wait_seconds: float) -> None:
        """On an error or interrupt: the tasks still running cancelled (their workers killed), the residents with a
        call in flight killed (an actor's running call cannot be cancelled), and each waited for up to
        ``wait_seconds``, so that none writes a file after the driver removes the temporary ones."""
        ray, refs = self.ray, list(self.inflight)
        if not refs:
            return
        # only the tasks still running: cancelling one whose reply is arriving trips a check in Ray's core worker
        # that ends this process (task_manager.cc "Tried to complete task that was not pending"; seen once in CI)
        _, running = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in running:
            i = self.inflight[ref][1]
            if i is None:
                ray.cancel(ref, force=True)
        for i in {self.inflight[ref][1] for ref in running} - {None}:
            ray.kill(self.handles[i], no_restart=True)
        if running:
            ray.wait(running, num_returns=len(running), timeout=wait_seconds)
