"""cbuild: a build keyed on its source and local headers; parallel_ranges: every index once, errors re-raised, and
worker threads started once per process, not per call."""

from __future__ import annotations

import os
import shutil
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


@pytest.mark.parametrize(
    "n, per, grain, threads_used",
    [(64, 128, 1 << 17, 1), (1024, 128, 1 << 17, 1), (1024, 256, 1 << 17, 2), (4096, 2048, 1 << 17, 4), (4096, 2048, 1 << 22, 2), (4096, 0, 1 << 30, 4)],
)
def test_a_small_call_runs_on_the_calling_thread_alone(monkeypatch, n, per, grain, threads_used):
    """With ``per`` (elements an index) a call takes one thread per ``grain`` elements at most: a small expert's
    kernel is not handed to a worker (the hand-off costs more than the work); ``per=0`` keeps every thread."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(cbuild, "PIECES_PER_THREAD", 1)
    names, seen = set(), []
    lock = threading.Lock()
    gate = threading.Barrier(threads_used, timeout=5) if threads_used > 1 else None

    def fn(a, b):
        with lock:
            names.add(threading.current_thread().name)
            seen.extend(range(a, b))
        if gate is not None:
            gate.wait()  # each piece on a thread of its own: all of them meet here

    cbuild.parallel_ranges(n, 1, fn, per=per, grain=grain)
    assert sorted(seen) == list(range(n))
    assert len(names) == threads_used and (threads_used > 1 or names == {threading.current_thread().name})


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


def test_a_wheel_ships_every_file_of_the_package_that_is_not_python():
    """A wheel (``pip install .``, not the README's editable install) holds only the package data pyproject.toml names:
    the C sources that cbuild compiles must be among it, or a wheel install silently runs the slower torch fallbacks."""
    import fnmatch
    from pathlib import Path

    import tomllib

    root = Path(cbuild.__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = [p for p in (root / "ctconvert").rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".py", ".pyc")]
    assert any(p.suffix == ".c" for p in files)
    missing = []
    for p in files:
        package = ".".join(p.parent.relative_to(root).parts)
        if not any(fnmatch.fnmatch(p.name, g) for g in data.get(package, []) + data.get("*", [])):
            missing.append(str(p.relative_to(root)))
    assert not missing, f"package files a wheel would leave out (add them to [tool.setuptools.package-data]): {missing}"


def test_a_missing_source_gives_no_library_not_an_error(tmp_path):
    """An install without a kernel's C source (a wheel that left it out) runs the torch fallbacks: no library, no
    exception (the conversion failed with FileNotFoundError before)."""
    lib = cbuild.Library(tmp_path / "missing.c", {"f": ([], None)})
    assert lib.get() is None
    (tmp_path / "inc.c").write_text('#include "gone.h"\nint f(void) { return 1; }\n')
    assert cbuild.Library(tmp_path / "inc.c", {"f": ([], None)}).get() is None  # a missing local header too


@pytest.mark.parametrize("cc", ["/bin/false", "broken-source"])
def test_a_failed_build_leaves_only_its_marker_and_is_not_tried_again(tmp_path, monkeypatch, cc):
    """A compiler that fails (or a source it cannot build) gives no library and leaves no half-made file behind (a
    trial's cache gained two empty ``tmp*.so`` a run with ``CC=/bin/false``), only the marker that keeps later runs
    from compiling in vain (each run compiled again before), whose text names the compiler; ``why_not`` says so."""
    monkeypatch.setenv("CTCONVERT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.c"
    src.write_text("int ct_value(void) { return 1; }\n" if cc != "broken-source" else "int ct_value(void) { return }\n")
    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc == "broken-source" and not real:
        pytest.skip("no C compiler")
    log = tmp_path / "calls"
    wrapper = tmp_path / "cc.sh"  # counts the compiler's runs, then runs it
    wrapper.write_text(f'#!/bin/sh\necho x >> {log}\nexec {cc if cc == "/bin/false" else real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    for _ in range(3):
        assert cbuild.build(src) is None
    assert log.read_text().count("x") == 1  # tried once
    (marker,) = list((tmp_path / "cache").iterdir())
    assert marker.suffix == ".failed" and marker.name.startswith("k-") and str(wrapper) in marker.read_text()
    lib = cbuild.Library(src, {"ct_value": ([], None)})
    assert lib.get() is None and lib.why_not() == f"k.c did not compile with {wrapper} (not tried again while {marker} exists)"
    marker.unlink()  # what the user does to try again
    src.write_text("int ct_value(void) { return 1; }\n")
    if real:
        monkeypatch.setenv("CC", real)
        assert cbuild.build(src) is not None


def test_why_not_names_a_missing_compiler_and_is_silent_where_native_is_off(tmp_path, monkeypatch):
    monkeypatch.setenv("CTCONVERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    src = tmp_path / "k.c"
    src.write_text("int ct_value(void) { return 1; }\n")
    lib = cbuild.Library(src, {"ct_value": ([], None)})
    assert lib.why_not() == "no C compiler was found (cc, gcc or clang on PATH, or $CC)"
    monkeypatch.setenv("CTCONVERT_NATIVE", "0")
    assert lib.why_not() is None
    assert cbuild.Library(tmp_path / "gone.c", {"f": ([], None)}).why_not() is None  # (native off: no reason to give)
    monkeypatch.delenv("CTCONVERT_NATIVE")
    monkeypatch.setenv("CC", "/bin/false")  # a compiler: the missing source is what stops it
    assert cbuild.Library(tmp_path / "gone.c", {"f": ([], None)}).why_not() == "this installation lacks the C source gone.c"
