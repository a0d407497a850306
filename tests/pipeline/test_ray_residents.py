"""Resident workers (``--ray-keep-workers``): the dispatch of shard groups to residents and tasks, with a stand-in
Ray (every outcome chosen by the test, no cluster); the code id. The runs on a real multi-node cluster (the same
bytes as the local executor, a second driver served by the first one's residents, residents ending when idle or
lost before a run) are in ``test_ray_executor.py``, beside its cluster."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ctconvert.errors import CTConvertError
from ctconvert.pipeline import ray_residents as rr


class _Exceptions:
    class RayActorError(Exception):
        pass

    class RayTaskError(Exception):
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause


class FakeRay:
    """``get``/``wait``/``cancel``/``kill`` over refs whose outcome the test sets (``done[ref] = value or exception``)."""

    exceptions = _Exceptions

    def __init__(self):
        self.done, self.cancelled, self.killed, self.waited = {}, [], [], []

    def get(self, ref):
        v = self.done[ref]
        if isinstance(v, BaseException):
            raise v
        return v

    def wait(self, refs, num_returns, timeout):
        self.waited.append((list(refs), timeout))
        return [r for r in refs if r in self.done], [r for r in refs if r not in self.done]

    def cancel(self, ref, force):
        self.cancelled.append(ref)

    def kill(self, handle, no_restart):
        self.killed.append(handle)


class Ref:
    def __init__(self, what):
        self.what = what

    def __repr__(self):
        return f"Ref({self.what})"


class Handle:
    """A resident: ``keep_for.remote`` gives a ref that the test resolves (started or not)."""

    def __init__(self, ray, name, starts=True):
        self.name, outer = name, self

        class KeepFor:
            def remote(self, seconds):
                ref = Ref(f"{outer.name}.keep_for")
                ray.done[ref] = "code" if starts else _Exceptions.RayActorError("could not start")
                return ref

        self.keep_for = KeepFor()

    def __repr__(self):
        return self.name


@dataclass
class Spec:
    key: tuple
    shards: dict


def _dispatch(n_residents=2, starts=(True, True), retries=3, specs=5):
    ray = FakeRay()
    handles = [Handle(ray, f"r{i}", starts[i]) for i in range(n_residents)]
    calls, tasks = [], []

    def call(handle, spec):
        ref = Ref(f"{handle.name}:{spec.key[1]}")
        calls.append((handle.name, spec.key[1], ref))
        return ref

    def task(spec):
        ref = Ref(f"task:{spec.key[1]}")
        tasks.append((spec.key[1], ref))
        return ref

    def get(ref):
        return ray.get(ref)  # the executor's _result: the error as raised

    d = rr.Dispatch(ray, handles, 5, call, task, get, retries)
    d.add([Spec(("run", i), {f"s{i}": []}) for i in range(specs)])
    return ray, d, handles, calls, tasks


def _round(ray, d):
    """One round of the driver's loop: every ready ref's result (None where there is none), then fill."""
    ready, _ = ray.wait(d.pending(), num_returns=len(d.pending()), timeout=0)
    out = [d.result(ref) for ref in ready]
    d.fill()
    return out


def test_groups_go_to_ready_residents_depth_at_a_time_and_never_to_tasks():
    ray, d, _, calls, tasks = _dispatch()
    assert calls == [] and tasks == []  # nothing handed out before a resident is ready
    assert _round(ray, d) == [None, None]  # both residents ready
    assert [(h, k) for h, k, _ in calls] == [("r0", 0), ("r0", 1), ("r1", 2), ("r1", 3)]  # DEPTH (2) each
    ray.done[calls[2][2]] = "result-2"  # r1's first finishes: r1, now the least loaded, takes the next
    assert _round(ray, d) == ["result-2"]
    assert [(h, k) for h, k, _ in calls[4:]] == [("r1", 4)]
    for _, _, ref in calls:
        ray.done.setdefault(ref, "ok")
    assert sorted(map(str, _round(ray, d))) == ["ok"] * 4 and d.pending() == [] and tasks == []


def test_a_lost_resident_hands_its_groups_to_the_other_and_is_never_used_again():
    ray, d, _, calls, tasks = _dispatch()
    _round(ray, d)
    ray.done[calls[0][2]] = _Exceptions.RayActorError("node lost")
    ray.done[calls[1][2]] = _Exceptions.RayActorError("node lost")
    assert _round(ray, d) == [None, None]
    assert d.load == {1: 2}  # r0 dropped; r1 full (2, 3); the lost 0 and 1 wait at the head of the queue
    assert [s.key[1] for s in d.queue] == [1, 0, 4]  # each lost group goes back to the head of the queue
    ray.done[calls[2][2]] = "r2"
    assert _round(ray, d) == ["r2"]
    assert [(h, k) for h, k, _ in calls[4:]] == [("r1", 1)] and tasks == []


def test_a_resident_refusing_another_codes_work_counts_as_lost():
    ray, d, _, calls, _ = _dispatch(specs=1)
    _round(ray, d)
    ray.done[calls[0][2]] = _Exceptions.RayTaskError(rr.StaleResident("other code"))
    assert _round(ray, d) == [None]
    assert [(h, k) for h, k, _ in calls] == [("r0", 0), ("r1", 0)]


def test_a_conversion_error_in_a_resident_is_the_runs_error():
    ray, d, _, calls, _ = _dispatch(specs=1)
    _round(ray, d)
    ray.done[calls[0][2]] = _Exceptions.RayTaskError(ValueError("bad tensor"))
    with pytest.raises(_Exceptions.RayTaskError, match="bad tensor"):
        _round(ray, d)


def test_with_every_resident_lost_the_rest_goes_to_ray_tasks():
    ray, d, _, calls, tasks = _dispatch(specs=3)
    _round(ray, d)
    for _, _, ref in calls:
        ray.done[ref] = _Exceptions.RayActorError("gone")
    _round(ray, d)
    assert sorted(k for k, _ in tasks) == [0, 1, 2] and d.load == {}


def test_a_group_lost_more_often_than_the_retries_is_an_error():
    ray, d, _, calls, _ = _dispatch(n_residents=2, retries=0, specs=1)
    _round(ray, d)
    ray.done[calls[0][2]] = _Exceptions.RayActorError("gone")
    with pytest.raises(CTConvertError, match="lost 1 times: s0"):
        _round(ray, d)


def test_no_residents_or_none_that_starts_means_ray_tasks():
    ray, d, _, calls, tasks = _dispatch(n_residents=0, specs=3)
    assert sorted(k for k, _ in tasks) == [0, 1, 2] and calls == []  # at once, as before residents
    ray, d, _, calls, tasks = _dispatch(starts=(False, False), specs=2)
    assert _round(ray, d) == [None, None]
    assert sorted(k for k, _ in tasks) == [0, 1] and calls == []


def test_a_resident_that_never_starts_holds_no_run_once_the_others_are_done():
    ray, d, handles, calls, tasks = _dispatch(specs=2)
    never = next(ref for ref in d.booting if d.booting[ref] == 1)
    del ray.done[never]  # r1's node is full: it is never placed
    _round(ray, d)
    assert [(h, k) for h, k, _ in calls] == [("r0", 0), ("r0", 1)] and never in d.pending()
    for _, _, ref in calls:
        ray.done[ref] = "ok"
    assert _round(ray, d) == ["ok", "ok"] and d.pending() == [] and tasks == []


def test_stop_cancels_running_tasks_and_kills_only_busy_residents():
    ray, d, handles, calls, tasks = _dispatch(starts=(True, True), specs=2)
    _round(ray, d)  # r0 takes both groups, r1 idle
    d.stop(7.0)
    assert ray.killed == [handles[0]] and ray.cancelled == []
    assert ray.waited[-1] == ([ref for _, _, ref in calls], 7.0)
    ray, d, _, _, tasks = _dispatch(n_residents=0, specs=2)
    ray.done[tasks[0][1]] = "finished"  # a finished task is not cancelled (Ray's core worker check)
    d.stop(1.0)
    assert ray.cancelled == [tasks[1][1]] and ray.killed == []


def test_the_code_id_names_these_sources():
    a = rr.code_id()
    assert len(a) == 16 and int(a, 16) >= 0 and rr.code_id() == a
