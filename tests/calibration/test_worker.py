"""Calibration in its own process (ctconvert.calibration.worker): which command lines start it, where the machine has
room for it, and that a run calibrated there writes the bytes, notes and errors of a run calibrated on a thread;
a crashed process is one clear error with nothing left at the output; an untaken process ends."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from ctconvert import api
from ctconvert.calibration import worker
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError, CTConvertError, UnsupportedError

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

pytest.importorskip("transformers")
warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[2]
PYPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this tree first, the rest kept


def _params(line: str) -> dict:
    from ctconvert import cli

    argv = line.split()
    return cli.quantize.make_context("quantize", argv, resilient_parsing=True).params


@pytest.mark.parametrize(
    "line,expected",
    [
        ("m -o o -s NVFP4", True),
        ("m -o o -s nvfp4 --device cuda", True),
        ("m -o o -s FP8", True),
        ("m -o o -s W8A8_STATIC", True),
        ("m -o o -s NVFP4A16", False),
        ("m -o o -s FP8_DYNAMIC", False),
        ("m -o o -s W4A16 --kv-cache fp8", True),
        ("m -o o -s NVFP4 --dry-run", False),
        ("m -o o -s NVFP4 --resume", False),
        ("m -o o -s NVFP4 --executor ray", False),
        ("m -o o -s NVFP4 --observer imatrix_mse", False),
        ("m -o o -s no-such-scheme", False),
        ("-o o -s NVFP4", False),
    ],
)
def test_which_command_lines_start_the_calibration_process(line, expected):
    assert worker.wanted(_params(line)) is expected


def test_the_process_needs_a_cuda_device_and_four_cpus():
    assert worker.has_room("cuda", cpus=8) and worker.has_room("cuda:1", cpus=4)
    assert not worker.has_room("cuda", cpus=2)  # the imports and the forward would share the converter's cores
    assert not worker.has_room("cpu", cpus=64)
    assert worker.has_room("auto", cpus=8) == any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0"))


@pytest.fixture
def bytecode_settings():
    saved = sys.dont_write_bytecode, sys.pycache_prefix
    yield
    sys.dont_write_bytecode, sys.pycache_prefix = saved


def test_the_child_writes_the_console_scripts_bytecode_cache(bytecode_settings, tmp_path):
    """Where the console script moved the cache (PYTHONDONTWRITEBYTECODE, packages without bytecode), the child's
    imports read and write that folder; elsewhere the environment's settings pass unchanged."""
    base = {"PYTHONDONTWRITEBYTECODE": "1", "KEEP": "x"}
    sys.dont_write_bytecode, sys.pycache_prefix = False, str(tmp_path / "cache")  # what bytecode_cache() sets
    env = worker.child_env(base)
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "cache") and "PYTHONDONTWRITEBYTECODE" not in env and env["KEEP"] == "x"
    assert base == {"PYTHONDONTWRITEBYTECODE": "1", "KEEP": "x"}  # not changed in place
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe_mod.py").write_text("X = 1\n")
    child = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | env
    subprocess.run([sys.executable, "-c", "import probe_mod"], cwd=src, env=child, check=True)
    assert list((tmp_path / "cache").rglob("probe_mod*.pyc")) and not (src / "__pycache__").exists()
    sys.dont_write_bytecode = True  # a prefix the user set with PYTHONDONTWRITEBYTECODE too: both kept
    assert worker.child_env(base)["PYTHONDONTWRITEBYTECODE"] == "1"
    sys.pycache_prefix = None
    assert worker.child_env(base) == base


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("worker")
    return write_checkpoint(root / "m", llama_tensors(LLAMA_CONFIG, seed=7), LLAMA_CONFIG, shards=2)


def _digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.name != "ctconvert-provenance.json"}


def _ids(tmp_path: Path) -> Path:
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([(i * 7) % 300 for i in range(128)]))
    return ids


@pytest.mark.parametrize("scheme,kv,preloaded", [("NVFP4", "none", "0"), ("FP8", "fp8", "0"), ("NVFP4", "none", "1")])
def test_calibrated_in_the_process_the_bytes_and_notes_are_the_threads(model, tmp_path, monkeypatch, scheme, kv, preloaded):
    """And with the process's device preload (forced on the CPU here: CTCONVERT_CALIBRATION_PRELOAD=1): its pass takes
    every layer's tensors from the preload (``preloaded_bytes``) and writes the same bytes."""
    kw = dict(calibration=_ids(tmp_path), calibration_samples=2, calibration_seq_len=48, kv_cache=kv, max_shard_size="200KB", device="cpu")
    on_thread = api.quantize(model, tmp_path / "thread", scheme, **kw)
    monkeypatch.setenv("CTCONVERT_CALIBRATION_PRELOAD", preloaded)
    p = worker.prestart(str(model), "cpu")
    in_process = api.quantize(model, tmp_path / "process", scheme, **kw)
    assert worker.take(model) is None  # the stage took it
    assert p._proc.wait(timeout=60) == 0  # it ended with the run
    assert _digests(tmp_path / "process") == _digests(tmp_path / "thread")
    assert in_process.notes == on_thread.notes and any(n.startswith("calibration data: ") for n in in_process.notes)
    assert in_process.calibration["layers"] == on_thread.calibration["layers"]
    assert in_process.calibration["model_seconds"] is not None and in_process.calibration["seconds"] > 0
    layers = sum(t.nbytes for n, t in open_checkpoint(model).tensors.items() if ".layers." in n or "embed_tokens" in n)
    assert in_process.calibration["preloaded_bytes"] == (layers if preloaded == "1" else 0)


def _both(fn):
    """``fn()``'s error on a thread and in the process."""
    errors = []
    for process in (False, True):
        if process:
            worker.prestart(fn.src, "cpu")
        with pytest.raises(CTConvertError) as e:
            fn()
        worker._PRESTARTED.clear()
        errors.append(e.value)
    return errors


def test_a_non_finite_layer_is_the_same_error_and_nothing_is_written(tmp_path):
    t = llama_tensors(LLAMA_CONFIG)
    t["model.layers.1.post_attention_layernorm.weight"][3] = float("nan")
    src = write_checkpoint(tmp_path / "m", t, LLAMA_CONFIG)
    ids = _ids(tmp_path)
    kw = dict(calibration=ids, calibration_samples=2, calibration_seq_len=48, device="cpu", allow_nonfinite=True)  # the norm copied: calibration meets it
    fn = lambda: api.quantize(src, tmp_path / "q", "NVFP4", **kw)
    fn.src = str(src)
    thread, process = _both(fn)
    assert type(process) is type(thread) is BadInputError and str(process) == str(thread) and "not finite" in str(process)
    assert not (tmp_path / "q").exists()


def test_a_model_transformers_cannot_build_is_the_same_refusal(tmp_path):
    cfg = {**LLAMA_CONFIG, "architectures": ["NoSuchModelForCausalLM"], "model_type": "no_such_model"}
    src = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG), cfg)
    ids = _ids(tmp_path)
    fn = lambda: api.quantize(src, tmp_path / "q", "NVFP4", calibration=ids, calibration_samples=2, calibration_seq_len=48, device="cpu")
    fn.src = str(src)
    thread, process = _both(fn)
    assert type(process) is type(thread) is UnsupportedError and str(process) == str(thread)
    assert not (tmp_path / "q").exists()


def test_a_process_that_dies_is_one_clear_error_and_nothing_is_left(model, tmp_path, monkeypatch):
    real = worker.CalibrationProcess.start

    def start(self, request, feed, progress=None):
        self._proc.kill()  # as an out-of-memory kill would
        return real(self, request, feed, progress)

    monkeypatch.setattr(worker.CalibrationProcess, "start", start)
    worker.prestart(str(model), "cpu")
    with pytest.raises(CTConvertError, match=r"the calibration process ended before calibration did \(exit code -9\)"):
        api.quantize(model, tmp_path / "q", "NVFP4", calibration=_ids(tmp_path), calibration_samples=2, calibration_seq_len=48, device="cpu")
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q*"))


def test_an_untaken_process_ends_when_its_input_does(model):
    p = worker.CalibrationProcess(str(model), "cpu")
    t0 = time.monotonic()
    p.cancel(wait=True)
    assert p._proc.returncode == 0 and time.monotonic() - t0 < 60
    assert worker.take(model) is None


def test_the_console_script_starts_it_and_writes_the_threads_bytes(model, tmp_path):
    """``python -m ctconvert quantize`` with the process forced on this CPU machine (``CTCONVERT_CALIBRATION_PROCESS=1``):
    the trace names the start, the output equals the API's on a thread."""
    ids = _ids(tmp_path)
    args = ["quantize", str(model), "-s", "NVFP4", "--calibration", str(ids), "--calibration-samples", "2", "--calibration-seq-len", "48"]
    args += ["--max-shard-size", "200KB", "--device", "cpu"]
    env = {**os.environ, "CTCONVERT_CALIBRATION_PROCESS": "1", "CTCONVERT_TRACE": "1", "PYTHONPATH": PYPATH}
    r = subprocess.run([sys.executable, "-m", "ctconvert", *args, "-o", str(tmp_path / "cli")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^ctconvert-trace calibration [\d.]+ process started$", r.stderr, re.M)
    api.quantize(model, tmp_path / "api", "NVFP4", calibration=ids, calibration_samples=2, calibration_seq_len=48, max_shard_size="200KB", device="cpu")
    assert _digests(tmp_path / "cli") == _digests(tmp_path / "api")


def test_the_process_hides_scikit_learn_and_scipy_from_transformers(model):
    """The calibration process's imports skip scikit-learn (transformers' assisted generation only; 3.6 s of an
    H200 machine's 11 s import) and scipy (its object-detection losses), and still build the model."""
    code = "import sys; from ctconvert.calibration import worker; worker._warm(sys.argv[1], 'cpu'); "
    code += "from transformers.utils import is_sklearn_available, is_scipy_available; "
    code += "print(sys.modules['sklearn'], is_sklearn_available(), sys.modules['scipy'], is_scipy_available())"
    r = subprocess.run([sys.executable, "-c", code, str(model)], env={**os.environ, "PYTHONPATH": PYPATH}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "False", "None", "False"]


_NEEDS_SCIPY = """
import importlib.abc, importlib.machinery, sys
class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("transformers.models.needsscipy"):
            return importlib.machinery.ModuleSpec(name, self, is_package=name.endswith("needsscipy"))
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        if module.__name__.endswith("modeling_needsscipy"):
            import scipy.linalg  # what a modeling module may import at its top
            module.linalg = scipy.linalg
sys.meta_path.insert(0, Finder())
from ctconvert.calibration import worker
worker._warm(sys.argv[1], "cpu")
print(type(sys.modules["scipy"]).__name__, hasattr(sys.modules["transformers.models.needsscipy.modeling_needsscipy"], "linalg"))
"""


def test_a_modeling_module_that_needs_a_hidden_package_is_imported_with_it(tmp_path):
    pytest.importorskip("scipy")
    (tmp_path / "config.json").write_text('{"model_type": "needsscipy"}')
    env = {**os.environ, "PYTHONPATH": PYPATH}
    r = subprocess.run([sys.executable, "-c", _NEEDS_SCIPY, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["module", "True"]


def test_a_request_that_cannot_be_pickled_calibrates_on_the_thread(model, tmp_path, monkeypatch):
    kw = dict(calibration=_ids(tmp_path), calibration_samples=2, calibration_seq_len=48, max_shard_size="200KB", device="cpu")
    on_thread = api.quantize(model, tmp_path / "thread", "NVFP4", **kw)
    p = worker.prestart(str(model), "cpu")
    real = worker.pickle.dumps

    def refusing(obj, *a, **k):
        if isinstance(obj, worker.CalibrationRequest):
            raise TypeError("cannot pickle '_thread.lock' object")
        return real(obj, *a, **k)

    monkeypatch.setattr(worker.pickle, "dumps", refusing)
    fallback = api.quantize(model, tmp_path / "fallback", "NVFP4", **kw)
    assert p._proc.wait(timeout=60) is not None  # stopped
    assert _digests(tmp_path / "fallback") == _digests(tmp_path / "thread") and fallback.notes == on_thread.notes


def test_a_process_killed_before_the_request_is_the_one_line_error_even_with_sigpipe_fatal(model, tmp_path):
    """Trial finding: the console script leaves SIGPIPE fatal (cli.run), and a child killed in its first seconds made
    the write of the request end the command silently (exit -13). The request now goes through a socket with
    MSG_NOSIGNAL: the one-line error, nothing left at the output."""
    ids = _ids(tmp_path)
    code = f"""
import signal, sys
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
from ctconvert import api
from ctconvert.calibration import worker
from ctconvert.errors import CTConvertError
p = worker.prestart({str(model)!r}, "cpu")
p._proc.kill(); p._proc.wait()
try:
    api.quantize({str(model)!r}, {str(tmp_path / "q")!r}, "NVFP4", calibration={str(ids)!r}, calibration_samples=2, calibration_seq_len=48, device="cpu")
except CTConvertError as e:
    print("ERROR", e)
"""
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": PYPATH}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "ERROR the calibration process ended before calibration did (exit code -9)" in r.stdout
    assert not (tmp_path / "q").exists()
