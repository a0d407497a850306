"""parallel_ranges: every index once, errors re-raised, and worker threads started once per process, not per call."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ctconvert import cbuild


def test_parallel_ranges_covers_every_index_once_on_long_lived_workers(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    for n, align in [(1, 1), (1000, 1), (1000, 16), (4099, 128)]:
        seen = []
        lock = threading.Lock()

        def fn(a, b, align=align, seen=seen, lock=lock):
            assert a % align == 0
            with lock:
                seen.extend(range(a, b))

        cbuild.parallel_ranges(n, align, fn)
        assert sorted(seen) == list(range(n))
    before = sum(t.name.startswith("ctconvert-cpu-") for t in threading.enumerate())
    for _ in range(50):
        cbuild.parallel_ranges(1000, 1, lambda a, b: None)
    # no thread per call; the pool is the process's (started by the first call, possibly an earlier test's with all cores)
    assert sum(t.name.startswith("ctconvert-cpu-") for t in threading.enumerate()) == before < max(4, os.cpu_count() or 1)


def test_parallel_ranges_reraises_a_worker_error(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)

    def fn(a, b):
        if a > 0:
            raise ValueError(f"range {a}")

    with pytest.raises(ValueError, match="range"):
        cbuild.parallel_ranges(1000, 1, fn)
    cbuild.parallel_ranges(1000, 1, lambda a, b: None)  # the workers survive an error
