"""The console script's start-up (ctconvert/__main__.py): the bytecode cache where Python writes none."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctconvert.__main__ import bytecode_cache

from helpers import tree_hash

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def interpreter_settings():
    saved = sys.dont_write_bytecode, sys.pycache_prefix
    yield
    sys.dont_write_bytecode, sys.pycache_prefix = saved


def _module(tmp_path: Path, name: str) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / f"{name}.py").write_text("VALUE = 41 + 1\n")
    return src


def test_where_python_writes_no_bytecode_it_goes_to_the_cache_folder(tmp_path, interpreter_settings, monkeypatch):
    sys.dont_write_bytecode, sys.pycache_prefix = True, None
    src = _module(tmp_path, "ct_bytecode_probe")
    monkeypatch.syspath_prepend(str(src))
    folder = bytecode_cache({"CTCONVERT_CACHE": str(tmp_path / "cache")}, probe="ct_bytecode_probe")
    assert folder == str(tmp_path / "cache" / "pycache")
    assert sys.pycache_prefix == folder and sys.dont_write_bytecode is False
    mod = importlib.import_module("ct_bytecode_probe")
    assert mod.VALUE == 42
    cached = Path(importlib.util.cache_from_source(str(src / "ct_bytecode_probe.py")))
    assert cached.is_relative_to(folder) and cached.read_bytes()[:4] == importlib.util.MAGIC_NUMBER
    assert not (src / "__pycache__").exists()  # never next to the sources
    sys.modules.pop("ct_bytecode_probe")


@pytest.mark.parametrize(
    "dont_write, prefix, env",
    [
        (False, None, {}),  # Python writes its own bytecode: nothing to do
        (True, "/somewhere/else", {}),  # the user's own prefix wins
        (True, None, {"CTCONVERT_BYTECODE_CACHE": "0"}),  # turned off
    ],
)
def test_settings_are_left_alone_otherwise(tmp_path, interpreter_settings, monkeypatch, dont_write, prefix, env):
    monkeypatch.syspath_prepend(str(_module(tmp_path, "ct_bytecode_probe3")))
    sys.dont_write_bytecode, sys.pycache_prefix = dont_write, prefix
    assert bytecode_cache({"CTCONVERT_CACHE": str(tmp_path / "cache"), **env}, probe="ct_bytecode_probe3") is None
    assert (sys.dont_write_bytecode, sys.pycache_prefix) == (dont_write, prefix)
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_changes_nothing(tmp_path, interpreter_settings, monkeypatch):
    monkeypatch.syspath_prepend(str(_module(tmp_path, "ct_bytecode_probe4")))
    sys.dont_write_bytecode, sys.pycache_prefix = True, None
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert bytecode_cache({"CTCONVERT_CACHE": str(blocker)}, probe="ct_bytecode_probe4") is None
    assert (sys.dont_write_bytecode, sys.pycache_prefix) == (True, None)


def test_a_process_run_with_B_caches_its_imports(tmp_path):
    src = _module(tmp_path, "ct_bytecode_probe2")
    code = "from ctconvert.__main__ import bytecode_cache as b; print(b(probe='ct_bytecode_probe2')); import ct_bytecode_probe2"
    env = {"PYTHONPATH": f"{ROOT}:{src}", "CTCONVERT_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-B", "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(tmp_path / "cache" / "pycache")
    assert list((tmp_path / "cache" / "pycache").rglob("ct_bytecode_probe2.*.pyc"))


def test_packages_installed_with_bytecode_are_left_to_it(tmp_path, interpreter_settings, monkeypatch):
    src = _module(tmp_path, "ct_bytecode_probe5")
    monkeypatch.syspath_prepend(str(src))
    subprocess.run([sys.executable, "-m", "py_compile", str(src / "ct_bytecode_probe5.py")], check=True)  # as pip installs
    sys.dont_write_bytecode, sys.pycache_prefix = True, None
    assert bytecode_cache({"CTCONVERT_CACHE": str(tmp_path / "cache")}, probe="ct_bytecode_probe5") is None
    assert (sys.dont_write_bytecode, sys.pycache_prefix) == (True, None)


def _imported(*args: str) -> tuple[int, str, set[str]]:
    """Exit code, stdout and the top-level packages a ``python -m ctconvert ARGS`` process imported (-X importtime)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "ctconvert", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    mods = {line.rpartition("|")[2].strip().split(".")[0] for line in r.stderr.splitlines() if line.startswith("import time:")}
    return r.returncode, r.stdout, mods


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("quantize", "--help"), ("verify", "-h"), ()])
def test_help_and_version_answer_without_importing_torch(args):
    """``--version`` and ``--help`` are answered from the command definitions: no torch, transformers or
    compressed-tensors import (seconds of start-up on a cold machine)."""
    code, out, mods = _imported(*args)
    assert code == 0 and out.strip()
    assert mods & {"torch", "transformers", "compressed_tensors", "safetensors"} == set(), sorted(mods)
    assert "ctconvert" in mods and "click" in mods


def test_a_command_that_reads_tensors_imports_the_engine_up_front(tmp_path):
    """``inspect`` (any command but ``schemes``) imports torch before it runs, inside the deferred-signal window,
    even when it then fails (a missing folder: exit 3)."""
    code, out, mods = _imported("inspect", str(tmp_path / "missing"))
    assert code == 3 and "torch" in mods


#: runs the console script's main() in this process, then (at its os._exit) prints which heavy packages were
#: imported, as JSON on stderr's last line
_WRAPPER = """
import json, os, sys
_exit = os._exit
def report(code):
    heavy = sorted(m for m in ("torch", "transformers", "compressed_tensors", "safetensors", "numpy") if m in sys.modules)
    sys.stdout.flush()
    sys.stderr.write("\\n" + json.dumps({"code": code, "heavy": heavy}) + "\\n")
    sys.stderr.flush()
    _exit(code)
os._exit = report
sys.argv = ["ctconvert", *sys.argv[1:]]
from ctconvert.__main__ import main
main()
"""


def _heavy(*args: str) -> tuple[int, str, list[str]]:
    """Exit code, stdout and the heavy packages (torch, transformers, compressed-tensors, safetensors, numpy) in
    ``sys.modules`` when the console script's ``main()`` for ``ctconvert ARGS`` exits."""
    r = subprocess.run([sys.executable, "-c", _WRAPPER, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    seen = json.loads(r.stderr.strip().splitlines()[-1])
    return seen["code"], r.stdout, seen["heavy"]


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("schemes",), ("schemes", "--json"), ("--json", "schemes"), ("--plain", "schemes")])
def test_light_commands_leave_torch_transformers_and_compressed_tensors_unimported(args):
    """``--version``, ``--help`` and ``schemes`` answer from torch-free tables: after the whole command, none of the
    heavy packages is in ``sys.modules`` (the import chain of torch is what takes seconds)."""
    code, out, heavy = _heavy(*args)
    assert code == 0 and heavy == [], (code, heavy)
    assert out.strip()


def test_schemes_without_the_engine_lists_what_the_engine_would(tmp_path):
    """The torch-free ``schemes`` answer equals the one computed in a process that has the engine loaded
    (``api.preload()`` first: the format objects, torch)."""
    code, out, heavy = _heavy("--json", "schemes")
    assert code == 0 and heavy == []
    loaded = (
        "import json; from ctconvert import api; from ctconvert.plan.schemes import get_scheme; api.preload(); rows = api.schemes(); "
        "print(json.dumps({'schemes': rows, 'objects': {r['name']: get_scheme(r['name']).weight_format.name.value for r in rows if r['needs'] is None}}))"
    )
    r = subprocess.run([sys.executable, "-c", loaded], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    engine = json.loads(r.stdout)
    rows = json.loads(out)["schemes"]
    assert rows == engine["schemes"]
    assert {s["name"]: s["format"] for s in rows if s["needs"] is None} == engine["objects"]  # each format object's own name
    assert {"W4A16", "NVFP4", "FP8_BLOCK", "DENSE"} <= {s["name"] for s in rows}


def test_the_api_imports_the_engine_on_first_use():
    """``import ctconvert.api`` is torch-free; a public type (``api.QuantizeOptions``) or :func:`api.preload`
    brings the engine in."""
    code = (
        "import sys; from ctconvert import api; a = 'torch' in sys.modules; "
        "o = api.QuantizeOptions; b = 'torch' in sys.modules; "
        "from ctconvert.pipeline.options import QuantizeOptions; print(a, b, o is QuantizeOptions, api.QuantizeResult is api.ConversionResult)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    assert r.stdout.split() == ["False", "True", "True", "True"]


def _quantize_traced(src: Path, out: Path, read_ahead: str) -> tuple[float, dict[str, list[str]]]:
    """``ctconvert quantize SRC -o OUT -s W4A16`` with ``CTCONVERT_TRACE=1``: the parent's monotonic time before the
    start, and each trace step's fields (seconds, detail)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CTCONVERT_TRACE="1", CTCONVERT_READAHEAD=read_ahead)
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "ctconvert", "quantize", str(src), "-o", str(out), "-s", "W4A16", "-q"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    steps = {}
    for line in r.stderr.splitlines():
        if line.startswith("ctconvert-trace "):
            _, step, *rest = line.split(" ", 3)
            steps[step] = rest
    return t0, steps


def test_quantize_reads_its_source_ahead_of_the_engine_and_writes_the_same_bytes(tiny_llama, tmp_path):
    """The read ahead starts before torch is imported, at SRC's index; the conversion's own first open comes
    after the engine; the output is the same bytes without it (``CTCONVERT_READAHEAD=0``)."""
    t0, steps = _quantize_traced(tiny_llama, tmp_path / "ahead", "1")
    main, ahead, engine, first = (float(steps[s][0]) for s in ("main", "readahead", "engine", "first-open"))
    assert t0 < main < ahead < engine <= first
    assert steps["readahead"][1] == str(tiny_llama)
    assert Path(steps["first-open"][1]).parent == tiny_llama
    _, plain = _quantize_traced(tiny_llama, tmp_path / "plain", "0")
    assert "readahead" not in plain and {"main", "engine", "first-open"} <= set(plain)
    assert tree_hash(tmp_path / "ahead") == tree_hash(tmp_path / "plain")


#: runs the console script's main() for ``inspect SRC`` in this process with a gc callback, and prints (at its os._exit)
#: the full collections seen, whether gc is on, how many objects are frozen and the OpenBLAS setting, as JSON
_GC_WRAPPER = """
import gc, json, os, sys
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
_exit = os._exit
def report(code):
    sys.stdout.flush()
    doc = dict(code=code, full=len(full), enabled=gc.isenabled(), frozen=gc.get_freeze_count())
    doc.update(blas=os.environ.get("OPENBLAS_NUM_THREADS"), thp=os.environ.get("THP_MEM_ALLOC_ENABLE"))
    sys.stderr.write("\\n" + json.dumps(doc) + "\\n")
    sys.stderr.flush()
    _exit(code)
os._exit = report
sys.argv = ["ctconvert", *sys.argv[1:]]
from ctconvert.__main__ import main
main()
"""


@pytest.mark.parametrize("blas", [None, "3"])
def test_the_engine_imports_run_without_the_cyclic_gc_and_are_frozen(tiny_llama, blas):
    """The console script's heavy imports make no full collection (the gc is off for them; without that torch's import
    alone triggers several), move to the permanent generation, and leave the gc on; numpy's OpenBLAS gets one thread
    and torch's large buffers huge pages, unless the environment says otherwise."""
    keys = ("OPENBLAS_NUM_THREADS", "THP_MEM_ALLOC_ENABLE")
    env = {k: v for k, v in os.environ.items() if k not in keys} | ({k: blas for k in keys} if blas else {})
    r = subprocess.run([sys.executable, "-c", _GC_WRAPPER, "inspect", str(tiny_llama)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    doc = json.loads(r.stderr.strip().splitlines()[-1])
    assert doc["code"] == 0 and doc["enabled"] and doc["frozen"] > 100_000, doc
    assert doc["full"] == 0 and doc["blas"] == (blas or "1") and doc["thp"] == (blas or "1"), doc


def test_the_read_ahead_hashes_the_sources_of_a_local_run_only(tiny_llama, tmp_path):
    """A local ``quantize`` begins its source hashes during the imports; with ``--executor ray`` the workers hash
    (the driver must not read a whole 1T-parameter source for nothing); a dry run reads headers only."""
    from ctconvert.__main__ import _read_ahead

    runs = {
        "local": ["quantize", str(tiny_llama), "-o", str(tmp_path / "o"), "-s", "W4A16"],
        "ray": ["quantize", str(tiny_llama), "-o", str(tmp_path / "o"), "-s", "W4A16", "--executor", "ray"],
        "ray=": ["quantize", str(tiny_llama), "-o", str(tmp_path / "o"), "-s", "W4A16", "--executor=ray"],
        "dry": ["quantize", str(tiny_llama), "-o", str(tmp_path / "o"), "-s", "W4A16", "--dry-run"],
    }
    got = {}
    for k, argv in runs.items():
        ahead = _read_ahead(argv, None)
        ahead.stop(wait=30)
        got[k] = ahead.hash_sources
    assert got == {"local": True, "ray": False, "ray=": False, "dry": False}


#: the console script's main() for a ``quantize`` that may launch kernels, with a stand-in ``triton`` package (first
#: on the path) that records, as JSON in TRITON_RECORD, whether torch was imported when it was, and on which threads
#: it was imported and its key made
_TRITON_WRAPPER = """
import os, sys
sys.path.insert(0, os.environ["FAKE_TRITON_PATH"])
sys.argv = ["ctconvert", *sys.argv[1:]]
from ctconvert.formats import triton_key
triton_key.wanted = lambda command, argv: command == "quantize"  # as on a machine with an NVIDIA device node
from ctconvert.__main__ import main
main()
"""

_FAKE_CACHE = """
import json, os, sys, threading
RECORD = {"torch_at_import": "torch" in sys.modules, "imported_on": threading.current_thread().name}
def triton_key():
    RECORD["key_on"] = threading.current_thread().name
    RECORD["torch_at_key"] = "torch" in sys.modules
    with open(os.environ["TRITON_RECORD"], "w") as f:
        json.dump(RECORD, f)
    return "key"
"""


def test_quantize_imports_triton_before_torch_and_makes_its_key_on_a_thread(tmp_path):
    """Triton's import runs on the main thread before torch's; its cache key is made on its own thread (beside
    torch's import): a MoE run's first batch no longer waits for it (formats/triton_key.py)."""
    pkg = tmp_path / "fake" / "triton"
    (pkg / "runtime").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "runtime" / "__init__.py"):
        init.write_text("")
    (pkg / "runtime" / "cache.py").write_text(_FAKE_CACHE)
    record = tmp_path / "record.json"
    env = {**os.environ, "FAKE_TRITON_PATH": str(tmp_path / "fake"), "TRITON_RECORD": str(record), "CTCONVERT_READAHEAD": "0"}
    args = ["quantize", str(tmp_path / "missing"), "-o", str(tmp_path / "out"), "--scheme", "W4A16"]
    r = subprocess.run([sys.executable, "-c", _TRITON_WRAPPER, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stderr[-2000:]  # the missing source, after the imports
    seen = json.loads(record.read_text())
    assert seen["torch_at_import"] is False and seen["imported_on"] == "MainThread", seen
    assert seen["key_on"] == "ctconvert-triton-key", seen
