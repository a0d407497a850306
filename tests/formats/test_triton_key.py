"""triton_key: Triton imported on the calling thread and its cache key made once on a thread of its own, only where
a command may launch kernels; a Triton without the function, or one whose function or import raises, changes
nothing."""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading

import pytest

from ctconvert.formats import triton_key


@pytest.fixture
def fake_triton(tmp_path, monkeypatch):
    """A package ``triton`` whose ``runtime.cache.triton_key`` counts its calls (body: the function's source)."""

    def make(body: str):
        pkg = tmp_path / "triton"
        (pkg / "runtime").mkdir(parents=True, exist_ok=True)
        (pkg / "compiler").mkdir(exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "runtime" / "__init__.py").write_text("")
        (pkg / "compiler" / "__init__.py").write_text("")
        (pkg / "compiler" / "compiler.py").write_text("")
        (pkg / "runtime" / "cache.py").write_text(textwrap.dedent(body))
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(triton_key, "_THREAD", None)
        monkeypatch.setattr(triton_key, "ERROR", None)
        importlib.invalidate_caches()

    return make


def test_the_key_is_made_once_on_its_own_thread_after_triton_is_imported_here(fake_triton):
    """``import_here`` (the console script, before torch's import): the import on the calling thread, the key's
    hashing alone on the key's thread."""
    fake_triton("""
        import threading
        IMPORTED_ON = threading.current_thread().name
        CALLS = []
        def triton_key():
            CALLS.append(threading.current_thread().name)
            return "key"
    """)
    t = triton_key.begin(import_here=True)
    assert t is not None and t.name == "ctconvert-triton-key"
    import triton.runtime.cache as cache

    # the import ran here, before the thread began: the thread only hashes (no import on two threads at once)
    assert cache.IMPORTED_ON == threading.current_thread().name != t.name
    t.join(10)
    assert triton_key.begin() is t  # once per process
    assert cache.CALLS == ["ctconvert-triton-key"] and triton_key.ERROR is None


def test_without_import_here_the_thread_imports_triton_and_makes_the_key(fake_triton):
    """The API's quantize stage begins it after torch's import: Triton's import and the key both on the key's thread,
    beside the plan."""
    fake_triton("""
        import threading
        IMPORTED_ON = threading.current_thread().name
        CALLS = []
        def triton_key():
            CALLS.append(threading.current_thread().name)
    """)
    t = triton_key.begin()
    t.join(10)
    import triton.runtime.cache as cache

    assert cache.IMPORTED_ON == cache.CALLS[0] == t.name == "ctconvert-triton-key"


def test_a_triton_without_the_function_or_whose_function_or_import_raises_changes_nothing(fake_triton):
    fake_triton("X = 1  # no triton_key here, nor in the compiler module\n")
    assert triton_key.begin(import_here=True) is None and triton_key.ERROR is None
    fake_triton("X = 1\n")
    triton_key.begin().join(10)  # the import on the key's thread: nothing to make there either
    assert triton_key.ERROR is None
    fake_triton("""
        def triton_key():
            raise OSError("no libtriton here")
    """)
    triton_key.begin().join(10)
    assert isinstance(triton_key.ERROR, OSError)
    fake_triton("raise ImportError('libtriton.so: cannot open shared object file')\n")
    assert triton_key.begin(import_here=True) is None
    assert isinstance(triton_key.ERROR, ImportError) and "libtriton" in str(triton_key.ERROR)
    fake_triton("raise ImportError('libtriton.so: cannot open shared object file')\n")
    triton_key.begin().join(10)  # the same import on the key's thread: kept there
    assert isinstance(triton_key.ERROR, ImportError)
    triton_key.wait()  # nothing begun: at once


def test_no_triton_no_thread(monkeypatch):
    monkeypatch.setattr(triton_key, "_THREAD", None)
    monkeypatch.setattr(triton_key.importlib.util, "find_spec", lambda name: None)
    assert triton_key.begin() is None


@pytest.mark.parametrize(
    "argv, node, want",
    [
        (["quantize", "m", "-o", "o", "--device", "cpu"], True, False),
        (["quantize", "m", "-o", "o", "--device=cpu"], True, False),
        (["quantize", "m", "-o", "o"], True, True),
        (["quantize", "m", "-o", "o", "--dry-run"], True, False),
        (["--json", "quantize", "m", "-o", "o", "--device", "cuda:1"], True, True),
        (["repack", "m", "-o", "o", "--target", "marlin"], True, True),
        (["batch", "jobs.yaml"], True, True),
        (["quantize", "m", "-o", "o"], False, False),
        (["verify", "m"], True, False),
        (["inspect", "m"], True, False),
        (["decompress", "m", "-o", "o"], True, False),
    ],
)
def test_wanted_where_a_command_may_launch_kernels(monkeypatch, argv, node, want):
    from ctconvert.cli import command_word

    monkeypatch.setattr(triton_key.os.path, "exists", lambda p: node and p in ("/dev/nvidiactl", "/dev/nvidia0"))
    assert triton_key.wanted(command_word(argv), argv) is want


def test_wait_holds_until_the_key_is_made_and_returns_at_once_without_it(fake_triton, monkeypatch):
    fake_triton("""
        import threading
        GO = threading.Event()
        DONE = []
        def triton_key():
            GO.wait(10)
            DONE.append(1)
    """)
    monkeypatch.setattr(triton_key, "_THREAD", None)
    triton_key.wait()  # nothing begun: at once
    t = triton_key.begin()
    import triton.runtime.cache as cache

    waiter = __import__("threading").Thread(target=triton_key.wait)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not cache.DONE  # held while the key is being made
    cache.GO.set()
    waiter.join(10)
    assert not waiter.is_alive() and cache.DONE == [1] and not t.is_alive()
