"""Joining a Ray cluster and starting its workers, torch-free, so that it can begin as early as the process starts.

A ``--executor ray`` run pays a fixed cost before its first task converts anything: ``import ray``, joining the
cluster (``ray.init``) and, on every node, a worker process that imports Python, Ray, torch and ctconvert's
engine. :class:`Joining` does all of it on a thread (a new local Ray instance on the calling thread: see
:meth:`Joining.__init__`), and :func:`begin_early` starts one from the console script's command line before
the driver imports torch itself (:mod:`ctconvert.__main__`), so that the workers' start-up overlaps the driver's
own; :func:`joining` hands the :class:`~ctconvert.pipeline.ray_executor.RayExecutor` the join begun early for its
address, or a new one. The progress actor (:class:`Progress`) lives here too, torch-free, so that its worker
process starts without importing torch beside the converting workers; it is made only for a run with a progress
bar, one actor serves every run of a driver (:func:`progress_actor`), and it ends with the driver's Ray job, as
Ray ends every actor that is not detached.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading

from ..errors import UsageError

__all__ = [
    "CONNECT_SECONDS",
    "INSTALL_HINT",
    "Joining",
    "Progress",
    "begin_early",
    "connect",
    "joining",
    "on_node",
    "progress_actor",
    "ray_module",
    "resources",
    "warm_once",
    "warm_up",
    "warm_worker",
]

#: how to get the optional extra (the one-line error of ``--executor ray`` without it)
INSTALL_HINT = "pip install 'ctconvert[ray]' (or ./install.sh ray)"
#: seconds to reach a cluster address before giving up on it
CONNECT_SECONDS = 5.0

_LOCK = threading.Lock()
#: the joins begun by :func:`begin_early`, by the address given (None: Ray's default), not yet taken by :func:`joining`
_BEGUN: dict[str | None, Joining] = {}
#: the driver's progress actor: ``(Ray job id, driver node id) -> actor handle`` (one entry at most)
_ACTORS: dict[tuple[str, str], object] = {}
#: the warm-ups done by this driver: ``(Ray job id, driver node id, cuda)`` (a later run's workers are warm already)
_WARMED: set[tuple[str, str, bool]] = set()


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


def resources(ray, cuda: bool, nodes: list[dict] | None = None) -> dict:
    """A task's resources: one GPU (and a CPU) with CUDA; else the CPUs of the smallest node (of ``nodes``, Ray's
    ``ray.nodes()``; None: asked now), so that a node converts one group at a time with all its cores, as a local
    run does. Raises :class:`UsageError` for CUDA on a cluster without GPUs."""
    if cuda:
        if not ray.cluster_resources().get("GPU"):
            raise UsageError("--device cuda with --executor ray: no node of the Ray cluster has a GPU (start its nodes with GPUs, or use --device cpu)")
        return {"num_gpus": 1, "num_cpus": 1}
    cpus = [n["Resources"].get("CPU", 0) for n in (ray.nodes() if nodes is None else nodes) if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1]
    return {"num_cpus": int(min(cpus)) if cpus else 1}


def on_node(ray, node_id: str | None = None, soft: bool = False):
    """A scheduling strategy placing a task or actor on node ``node_id`` (None: the driver's, which outlives the loss of any other)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id or ray.get_runtime_context().get_node_id(), soft=soft)


def warm_up(ray, cuda: bool) -> None:
    """Start one worker per node (with ``cuda``, one per GPU), not waited for: Python, Ray, torch, the kernels
    (:func:`warm_worker`)."""
    warm, nodes = ray.remote(warm_worker), ray.nodes()
    need = {"num_cpus": 1, "num_gpus": 1} if cuda else resources(ray, False, nodes)
    for node in nodes:
        gpus = int(node["Resources"].get("GPU", 0)) if cuda else 0
        if not node.get("Alive") or (cuda and not gpus) or node["Resources"].get("CPU", 0) < 1:
            continue
        for _ in range(gpus or 1):
            warm.options(scheduling_strategy=on_node(ray, node["NodeID"], soft=True), **need).remote(cuda)


def warm_worker(cuda: bool) -> None:
    """A worker's start-up, done before its first task (run on the worker): the engine the tasks of
    :mod:`ctconvert.pipeline.ray_executor` run (torch, the streaming executor, the checkpoint's reading and
    hashing) imported, the C kernels loaded, and with ``cuda`` the device's context made."""
    import torch

    from ..checkpoint import hashing, reader  # noqa: F401 - what the tasks use, imported ahead of them
    from ..formats import native
    from . import executor, zeros  # noqa: F401 - the same

    native.available()
    if cuda and torch.cuda.is_available():
        torch.zeros(1, device="cuda")


class Progress:
    """The progress actor: by task key ``(run, index)`` (a run id of the driver, the task's index in the run), the
    source bytes done so far (the most any attempt of the task reported)."""

    def __init__(self):
        self.done: dict[str, dict[int, int]] = {}

    def report(self, key: tuple[str, int], nbytes: int) -> None:
        done = self.done.setdefault(key[0], {})
        done[key[1]] = max(done.get(key[1], 0), nbytes)

    def total(self, run: str) -> int:
        """The source bytes done by the tasks of ``run``."""
        return sum(self.done.get(run, {}).values())

    def forget(self, run: str) -> None:
        """Drop ``run``'s counts (it has ended)."""
        self.done.pop(run, None)


def progress_actor(ray):
    """The driver's :class:`Progress` actor, on the driver's node (no CPU), made on the first call of the
    driver's Ray job and the same handle after (a new job, after ``ray.shutdown`` and ``ray.init``, makes a new
    one); Ray ends it with the job."""
    key = _job(ray)
    with _LOCK:
        if key not in _ACTORS:
            _ACTORS.clear()
            _ACTORS[key] = ray.remote(num_cpus=0)(Progress).options(scheduling_strategy=on_node(ray)).remote()
        return _ACTORS[key]


def _job(ray) -> tuple[str, str]:
    """This driver's Ray job: ``(job id, the driver's node id)`` (job ids repeat across clusters, node ids do not)."""
    context = ray.get_runtime_context()
    return context.get_job_id(), context.get_node_id()


def warm_once(ray, cuda: bool) -> None:
    """:func:`warm_up`, unless this driver's job has warmed the same kind of workers already (a ``batch``'s later
    jobs, a second API call): Ray keeps a job's idle workers."""
    key = (*_job(ray), cuda)
    with _LOCK:
        if key in _WARMED:
            return
        _WARMED.add(key)
    warm_up(ray, cuda)


class Joining:
    """Joining the cluster at ``address`` (:func:`connect`) and warming its workers (:func:`warm_up`, once per
    driver's job and kind: :func:`warm_once`; or ``warm(ray, cuda)`` where given: ``--ray-keep-workers``' residents,
    :func:`~ctconvert.pipeline.ray_residents.residents`), begun now and waited for by :meth:`wait`. ``cuda``: warm GPU
    workers; None: decided once joined (GPU workers when the cluster has GPUs). A new local Ray instance (no
    ``address``, no ``RAY_ADDRESS``) is started on the calling thread, which should be the main one: Ray starts its
    daemons (GCS, raylet) with ``PR_SET_PDEATHSIG``, which kills them when the *thread* that started them ends; the
    rest runs on a thread."""

    def __init__(self, address: str | None, cuda: bool | None, warm=None):
        self.address, self.cuda, self.warm, self.ray = address, cuda, warm or warm_once, None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if not (address or os.environ.get("RAY_ADDRESS")):
            try:
                self.ray = connect(None)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self.error = e
                return
        self.thread = threading.Thread(target=self._join, daemon=True, name="ctconvert-ray-join")
        self.thread.start()

    def _join(self) -> None:
        try:
            self.ray = self.ray or connect(self.address)
            if self.cuda is None:
                self.cuda = bool(self.ray.cluster_resources().get("GPU"))
            self.warm(self.ray, self.cuda)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self.error = e

    def wait(self, cuda: bool | None = None):
        """The ``ray`` module once joined; with ``cuda`` other than what was warmed, those workers are warmed too.
        Raises what joining raised (:func:`connect`)."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        if cuda is not None and cuda != self.cuda:
            self.cuda = cuda
            self.warm(self.ray, cuda)
        return self.ray


def joining(address: str | None, cuda: bool, warm=None) -> Joining:
    """The join of ``address`` begun early (:func:`begin_early`), taken (the executor's ``cuda`` warmed at its
    :meth:`~Joining.wait`), or a new :class:`Joining`; a join begun early for another address is waited for first
    (one process joins one cluster)."""
    with _LOCK:
        begun = _BEGUN.pop(address, None)
        others = list(_BEGUN.values())
        _BEGUN.clear()
    for other in others:
        if other.thread is not None:
            other.thread.join()
    return begun if begun is not None else Joining(address, cuda, warm)


def begin_early(address: str | None, device: str, warm=None) -> None:
    """Begin joining ``address`` (None: ``RAY_ADDRESS``, else a new local instance) and warming its workers now,
    for the run that :func:`joining` will ask for it (the console script, before it imports torch). ``device``:
    the ``--device`` given; ``cpu`` warms CPU workers, another GPU workers when the cluster has GPUs. Without
    Ray nothing is begun (the run says how to install it). ``warm``: how to warm the workers, ``warm(ray, cuda)``
    (default :func:`warm_once`; ``--ray-keep-workers``: :func:`~ctconvert.pipeline.ray_residents.keeping`)."""
    if importlib.util.find_spec("ray") is None:
        return
    join = Joining(address, False if str(device).lower() == "cpu" else None, warm)
    with _LOCK:
        _BEGUN[address] = join
