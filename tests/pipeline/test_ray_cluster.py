"""Joining a Ray cluster ahead of the run (ctconvert/pipeline/ray_cluster.py): the progress counts, a task's
resources, the warm-up's tasks, the join begun early and taken by the run, and the console script's part.

The Ray calls are stood in for by small fakes (what was asked of Ray is recorded); the conversions through a
real cluster are tests/pipeline/test_ray_executor.py's.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import types
import uuid
from pathlib import Path

import pytest

from ctconvert import __main__ as entry
from ctconvert.errors import UsageError
from ctconvert.pipeline import ray_cluster
from ctconvert.pipeline.ray_cluster import Joining, Progress, begin_early, joining, resources, warm_up

ROOT = Path(__file__).resolve().parents[2]


def _node(node_id, cpus, gpus=0, alive=True):
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {"NodeID": node_id, "Alive": alive, "Resources": res}


class _Remote:
    """``ray.remote(fn)``: records each ``.options(**o).remote(*args)``."""

    def __init__(self, calls):
        self.calls = calls

    def options(self, **o):
        return _Call(self.calls, o)


class _Call:
    def __init__(self, calls, options):
        self.calls, self.o = calls, options

    def remote(self, *args):
        self.calls.append((self.o, args))


class _Ray:
    """The parts of the ``ray`` module that warm-up and resources use; each a driver of its own Ray job."""

    def __init__(self, nodes, gpus=0):
        self._nodes, self.gpus, self.calls, self.asked = nodes, gpus, [], 0
        self.job = uuid.uuid4().hex

    def get_runtime_context(self):
        return types.SimpleNamespace(get_job_id=lambda: self.job, get_node_id=lambda: "driver-node")

    def nodes(self):
        self.asked += 1
        return self._nodes

    def cluster_resources(self):
        return {"CPU": sum(n["Resources"]["CPU"] for n in self._nodes), **({"GPU": self.gpus} if self.gpus else {})}

    def remote(self, fn):
        assert fn is ray_cluster.warm_worker
        return _Remote(self.calls)


def test_progress_counts_the_most_each_attempt_reported_by_run():
    p = Progress()
    p.report(("a", 0), 100)
    p.report(("a", 1), 50)
    p.report(("a", 0), 70)  # a retried attempt starts again from zero: the most reported counts
    p.report(("b", 0), 9)
    assert (p.total("a"), p.total("b"), p.total("c")) == (150, 9, 0)
    p.forget("a")
    assert (p.total("a"), p.total("b")) == (0, 9)


def test_resources_are_the_smallest_live_nodes_cpus_or_one_gpu():
    ray = _Ray([_node("h", 8), _node("w1", 4), _node("w2", 2, alive=False), _node("w3", 0.5)])
    assert resources(ray, False) == {"num_cpus": 4}
    assert ray.asked == 1
    assert resources(ray, False, [_node("x", 3)]) == {"num_cpus": 3} and ray.asked == 1  # the nodes given: Ray not asked
    assert resources(_Ray([]), False) == {"num_cpus": 1}
    with pytest.raises(UsageError, match="no node of the Ray cluster has a GPU"):
        resources(ray, True)
    assert resources(_Ray([_node("g", 8, gpus=2)], gpus=2), True) == {"num_gpus": 1, "num_cpus": 1}


def test_warm_up_starts_one_worker_per_live_node_or_per_gpu(monkeypatch):
    monkeypatch.setattr(ray_cluster, "on_node", lambda ray, node_id=None, soft=False: (node_id, soft))
    ray = _Ray([_node("h", 4), _node("w1", 2), _node("dead", 8, alive=False), _node("tiny", 0)])
    warm_up(ray, False)
    assert ray.calls == [({"scheduling_strategy": ("h", True), "num_cpus": 2}, (False,)), ({"scheduling_strategy": ("w1", True), "num_cpus": 2}, (False,))]
    assert ray.asked == 1  # one look at the cluster
    ray = _Ray([_node("h", 4), _node("g", 8, gpus=2)], gpus=2)
    warm_up(ray, True)
    assert ray.calls == [({"scheduling_strategy": ("g", True), "num_cpus": 1, "num_gpus": 1}, (True,))] * 2


@pytest.fixture
def fake_join(monkeypatch):
    """``connect`` and ``warm_up`` recorded instead of done; RAY_ADDRESS unset."""
    log = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake = _Ray([_node("h", 2)])
    monkeypatch.setattr(ray_cluster, "connect", lambda address: log.append(("connect", address, threading.current_thread().name)) or fake)
    monkeypatch.setattr(ray_cluster, "warm_up", lambda ray, cuda: log.append(("warm", cuda)))
    return log, fake


def test_a_join_connects_on_a_thread_and_warms_what_the_run_needs(fake_join):
    log, fake = fake_join
    j = Joining("h:1", False)
    assert j.wait() is fake
    assert log == [("connect", "h:1", "ctconvert-ray-join"), ("warm", False)]
    assert j.wait(True) is fake and log[-1] == ("warm", True)  # the run wants GPU workers: warmed too
    assert j.wait(True) is fake and len(log) == 3


def test_a_driver_warms_each_kind_of_worker_once_per_job(fake_join):
    log, fake = fake_join
    for cuda in (False, False, True, False, True):
        Joining("h:1", cuda).wait()
    assert [e for e in log if e[0] == "warm"] == [("warm", False), ("warm", True)]
    fake.job = "a-new-job"  # after ray.shutdown and ray.init: the workers are new
    Joining("h:1", False).wait()
    assert log[-1] == ("warm", False)


def test_a_new_local_instance_is_started_on_the_calling_thread(fake_join):
    log, _ = fake_join
    Joining(None, False).wait()
    assert log[0] == ("connect", None, threading.current_thread().name)


def test_cuda_undecided_warms_gpu_workers_when_the_cluster_has_gpus(fake_join):
    log, fake = fake_join
    j = Joining("h:1", None)
    j.wait()
    assert j.cuda is False and log[-1] == ("warm", False)
    fake.gpus = 1
    j = Joining("h:1", None)
    j.wait()
    assert j.cuda is True and log[-1] == ("warm", True)


def test_a_join_that_failed_raises_at_wait(monkeypatch):
    def refuse(address):
        raise UsageError(f"cannot reach the Ray cluster at {address}")

    monkeypatch.setattr(ray_cluster, "connect", refuse)
    j = Joining("h:1", False)
    with pytest.raises(UsageError, match="at h:1"):
        j.wait()


def test_the_run_takes_the_join_begun_early_for_its_address(fake_join):
    log, _ = fake_join
    begin_early("h:1", "cpu")
    early = joining("h:1", False)
    assert early.address == "h:1" and early.cuda is False
    assert joining("h:1", False) is not early  # taken once: the next run makes its own
    begin_early("h:1", "cuda")
    joining("h:1", True).wait(True)  # GPUs decided once joined (the cluster has none: warm already), then the run's GPU workers
    assert [e for e in log if e[0] == "warm"] == [("warm", False), ("warm", True)]
    begin_early("h:2", "cpu")
    other = joining("h:3", False)  # another address: the early join is waited for, a new one made
    assert other.address == "h:3" and ("connect", "h:2", "ctconvert-ray-join") in log


def test_without_ray_nothing_is_begun(monkeypatch, fake_join):
    log, _ = fake_join
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails; find_spec says None
    begin_early("h:1", "cpu")
    j = joining("h:1", False)
    j.wait()
    assert log[0] == ("connect", "h:1", "ctconvert-ray-join")  # a new join, made by the run


@pytest.mark.parametrize(
    "argv, begun",
    [
        (["quantize", "SRC", "-o", "OUT", "--executor", "ray", "--ray-address", "h:1", "--device", "cpu"], [("h:1", "cpu")]),
        (["--json", "quantize", "SRC", "-o", "OUT", "--executor=ray"], [(None, "auto")]),
        (["quantize", "SRC", "-o", "OUT", "--executor", "ray", "--dry-run"], []),
        (["quantize", "SRC", "-o", "OUT"], []),
        (["quantize", "SRC", "-o", "ray"], []),  # "ray" as another option's value
        (["inspect", "ray"], []),
        (["batch", "jobs.yaml", "--executor", "ray", "--ray-address", "h:2"], [("h:2", "auto")]),
        (["batch", "jobs.yaml"], []),
        (["quantize", "--executor", "ray"], []),  # no SRC: cli.run says so
    ],
)
def test_the_console_script_begins_joining_only_for_a_ray_quantize_or_batch(monkeypatch, argv, begun):
    calls = []

    def begin(address, device, warm=None):
        assert warm is None  # no --ray-keep-workers: the default warm-up
        calls.append((address, device))

    monkeypatch.setattr(ray_cluster, "begin_early", begin)
    entry.join_ray_early(argv, None)
    assert calls == begun


def test_joining_is_torch_free():
    code = "import sys, ctconvert.pipeline.ray_cluster; assert 'torch' not in sys.modules and 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(ROOT)}, timeout=60)
