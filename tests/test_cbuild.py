"""cbuild: a build keyed on its source and local headers; parallel_ranges: every index once, errors re-raised, and
worker threads started once per process, not per call."""

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


def test_a_stalled_thread_holds_up_one_piece_not_its_share(monkeypatch):
    """The thread that takes row 0 stalls until every other row is done: the other threads take the rest
    (with one static range per thread it would wait for its own share and time out)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    n = 4096
    rest_done = threading.Event()
    seen, lock = [], threading.Lock()
    pieces = []

    def fn(a, b):
        with lock:
            pieces.append((a, b))
        if a == 0:
            assert rest_done.wait(10), "the other threads did not take the remaining pieces"
        with lock:
            seen.extend(range(a, b))
            if len(seen) == n - n // (2 * cbuild.PIECES_PER_THREAD):  # everything but the first piece
                rest_done.set()

    cbuild.parallel_ranges(n, 1, fn)
    assert sorted(seen) == list(range(n))
    assert len(pieces) == 2 * cbuild.PIECES_PER_THREAD and all((b - a) == n // len(pieces) for a, b in pieces)


def test_a_build_is_keyed_on_the_local_headers_it_includes(tmp_path, monkeypatch):
    """A changed header (``#include "x.h"``, here one included by another) builds anew: never a stale cached library."""
    monkeypatch.setenv("CTCONVERT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')
    (tmp_path / "inner.h").write_text("static inline int value(void) { return 1; }\n")
    src = tmp_path / "k.c"
    src.write_text('#include "outer.h"\nint ct_value(void) { return value(); }\n')
    lib = cbuild.build(src)
    if lib is None:
        pytest.skip("no C compiler")
    assert lib.ct_value() == 1
    (tmp_path / "inner.h").write_text("static inline int value(void) { return 2; }\n")
    assert cbuild.build(src).ct_value() == 2
    assert len(list((tmp_path / "cache").glob("k-*.so"))) == 2
