"""Calibration in its own process, started with the command: :class:`CalibrationProcess`.

Calibration runs the checkpoint's own transformers architecture, and importing transformers (with what it pulls in:
its generation and loss utilities, scipy, torch's distributed tensors) is the slowest step of a calibrated run: 3.9-4.7 s
of a 10.6 s 8B NVFP4 run on an H200 (``scripts/bench_calibration.py --ratio``), against 3.5 s for the whole NVFP4A16
conversion. Inside the converting process that import holds the GIL, so neither a thread beside the conversion nor
one beside torch's import hides it. A second Python process does: the ``ctconvert`` console script starts it
before its own imports (:func:`prestart`, for a ``quantize`` line whose scheme needs calibration); it imports torch,
transformers and the model's modeling module, and opens the device, while the first process imports, plans and
starts converting. The calibrate stage then hands it the plan (:func:`take`, :meth:`CalibrationProcess.start`): it
reads and tokenizes the data, builds the model, runs it layer by layer, and sends each module's calibrated tensors
back as its layer is done. They fill the same :class:`~ctconvert.calibration.feed.CalibratedFeed` a calibration
thread fills, so the executor, the bytes and the errors are those of a calibration beside the conversion in the
same process (:class:`~ctconvert.calibration.feed.BackgroundCalibration`, which the Python API and every other
case keep using).

The two processes talk over the child's standard input and output, one pickled message at a time (both ends are
this package, in one interpreter version): to the child one request, then (only) the end of its input, which stops
it at its next layer; from it ``("put", module, parts)``, ``("layer", done, total)`` and lastly ``("done", value)`` or
``("error", exception)``. Its standard error goes to a temporary file, whose last line names a crash. It ignores
SIGINT (a Ctrl-C reaches the whole process group; the first process decides), and it ends when its input ends,
also when the first process is killed.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["CalibrationProcess", "CalibrationRequest", "child_env", "has_room", "prestart", "take", "wanted"]


@dataclass
class CalibrationRequest:
    """What the child needs: the plan and the checkpoint (with the plan's per-expert views) as the calibrate stage has
    them, the data options (``file``: a text or token-id file, None: the built-in corpus), the device (a
    ``torch.device``), ``kv_cache`` and ``batch_tokens``."""

    plan: object
    ckpt: object
    file: str | None
    samples: int
    seq_len: int
    device: object
    kv_cache: str
    batch_tokens: int


def wanted(params: dict) -> bool:
    """Whether a ``quantize`` command line (its click parameters, parsed resiliently) will calibrate beside its
    conversion: a local, not dry, not resumed run whose preset scheme has static or ``local`` activation scales
    (:attr:`ctconvert.plan.schemes.Scheme.needs_calibration`) or that asks for ``--kv-cache``, with a data-free
    observer. A recipe, a scheme file or an imatrix observer: no (the stage then calibrates on a thread of the
    converting process, or in line, as before). Torch-free."""
    if not params.get("src") or params.get("dry_run") or params.get("resume") or params.get("refresh") or params.get("recipe"):
        return False
    if (params.get("executor") or "local") != "local" or "imatrix" in str(params.get("observer") or ""):
        return False
    if str(params.get("kv_cache") or "none").lower() != "none":
        return True
    from ..plan.schemes import resolve_scheme  # torch-free

    try:
        return resolve_scheme(params.get("scheme") or "").needs_calibration
    except Exception:  # noqa: BLE001 - a scheme file, or a name the command will refuse itself
        return False


def has_room(device: str, cpus: int | None = None) -> bool:
    """Whether a second process helps: calibration runs on a CUDA device (``device`` names one, or is ``auto`` on a
    machine with an NVIDIA device node) and the machine has 4 CPUs or more. On 2 CPUs the two processes' imports
    and compute share the same cores (1.2B NVFP4 on 2 cores: 11.6 s against 10.4 s on a thread). Torch-free."""
    cpus = cpus if cpus is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if cpus < 4 or device == "cpu":
        return False
    return device.startswith("cuda") or (device == "auto" and any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0")))


def child_env(environ) -> dict:
    """The calibration process's environment: ``environ`` with this process's bytecode settings. Where the console
    script moved the bytecode cache to its own folder (:func:`ctconvert.__main__.bytecode_cache`: Python may write
    none, ``PYTHONDONTWRITEBYTECODE``, and the installed packages ship none), the child reads *and writes* that folder
    too: the child is the only process that imports transformers, and with the environment's
    ``PYTHONDONTWRITEBYTECODE`` it compiled transformers' modules from source on every run (an H200 machine, 8B
    NVFP4: ~2 s of its ~10 s of imports, ``scripts/profile_site``)."""
    env = dict(environ)
    if sys.pycache_prefix:
        env["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
        if not sys.dont_write_bytecode:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


#: the process :func:`prestart` started, until the calibrate stage takes it
_PRESTARTED: list[CalibrationProcess] = []


def prestart(src: str, device: str) -> CalibrationProcess:
    """Start the calibration process for ``src`` now (the console script, before its heavy imports); the calibrate
    stage takes it (:func:`take`). One left untaken at exit is stopped."""
    p = CalibrationProcess(src, device)
    _PRESTARTED[:] = [p]
    atexit.register(p.cancel, False)
    return p


def take(src) -> CalibrationProcess | None:
    """The process :func:`prestart` started for the checkpoint folder ``src`` (once), else None."""
    for p in _PRESTARTED:
        if os.path.realpath(p.src) == os.path.realpath(src):
            _PRESTARTED.clear()
            return p
    return None


class CalibrationProcess:
    """A child Python running :func:`main` on ``src`` and ``device`` (this package, as this process imported it),
    whose imports begin at once; :meth:`start` hands it a :class:`CalibrationRequest` and a feed. Then, as
    :class:`~ctconvert.calibration.feed.BackgroundCalibration`:
    :meth:`result` waits for the end and returns the :class:`~ctconvert.calibration.apply.Calibrated` (or raises what
    calibration raised there: the same :class:`~ctconvert.errors.CTConvertError`), :meth:`cancel` stops it.
    ``model_seconds``: how long the child took to build the model (after its imports); ``preloaded_bytes``: the
    checkpoint bytes its pass took from the device preload (:mod:`.preload`) instead of reading them itself."""

    def __init__(self, src: str, device: str = "auto"):
        self.src = str(src)
        self.model_seconds: float | None = None
        self.preloaded_bytes = 0
        self._err = tempfile.TemporaryFile()
        env = child_env(os.environ)
        # the request goes through a socket, sent with MSG_NOSIGNAL: a child that died early is an EPIPE error here, not
        # a SIGPIPE, which the console script leaves fatal (cli.run: `ctconvert inspect | head` ends quietly)
        self._sock, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD.format(root=_package_root()), self.src, str(device)],
                stdin=theirs,
                stdout=subprocess.PIPE,
                stderr=self._err,
                env=env,
            )
        finally:
            theirs.close()
        self._reader: threading.Thread | None = None
        self._value = None
        self._error: BaseException | None = None

    def start(self, request: CalibrationRequest, feed, progress=None) -> CalibrationProcess | None:
        """Send ``request``; a thread then puts each module the child sends into ``feed`` (``feed.fail`` on an error),
        and steps ``progress`` (a context manager factory giving a ``(done, total)`` callback or None,
        :func:`ctconvert.stages.calibrate.layer_progress`) at each layer. None (the child stopped) when the request
        cannot be pickled (a source whose tensors hold what cannot travel): the caller calibrates on a thread."""
        try:
            payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - any object pickle refuses
            self.cancel(wait=False)
            return None
        try:
            self._sock.sendall(payload, getattr(socket, "MSG_NOSIGNAL", 0))
        except OSError:  # it ended already: the reader says why
            pass
        self._reader = threading.Thread(target=self._read, args=(feed, progress), name="ctconvert-calibrate", daemon=True)
        self._reader.start()
        return self

    def _read(self, feed, progress) -> None:
        from contextlib import nullcontext

        tensors: dict = {}
        try:
            with progress() if progress is not None else nullcontext() as step:
                while True:
                    kind, *rest = pickle.load(self._proc.stdout)
                    if kind == "put":
                        tensors[rest[0]] = rest[1]
                        feed.put(rest[0], rest[1])
                    elif kind == "layer" and step is not None:
                        step(*rest)
                    elif kind == "done":
                        notes, self.model_seconds, self.preloaded_bytes = rest
                        from .apply import Calibrated

                        self._value = Calibrated(tensors, notes, {})
                        return
                    elif kind == "error":
                        raise rest[0]
        except (EOFError, pickle.UnpicklingError, OSError):
            self._error = self._crashed()
        except BaseException as e:  # noqa: BLE001 - calibration's own error, handed to the feed's readers and to result()
            self._error = e
        feed.fail(self._error)

    def _crashed(self):
        from ..errors import CTConvertError

        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        self._err.seek(0)
        lines = [x for x in self._err.read().decode(errors="replace").splitlines() if x.strip()]
        last = f": {lines[-1].strip()[:300]}" if lines else ""
        if code is not None and code < 0:  # a signal: SIGKILL is what the kernel's out-of-memory killer sends
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            last = f": killed by {name}{' (out of memory?)' if name == 'SIGKILL' else ''}{last}"
        return CTConvertError(f"the calibration process ended before calibration did (exit code {code}){last}")

    def result(self):
        """The :class:`~ctconvert.calibration.apply.Calibrated` (tensors, notes), once the child has ended; raises what
        calibration raised."""
        self._reader.join()
        self._close()
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self, wait: bool = True) -> None:
        """Stop the child: its input ends (it stops at its next layer), and it is waited for (``wait``), else killed."""
        self._close()
        if wait:
            try:
                self._proc.wait(timeout=30)
                return
            except subprocess.TimeoutExpired:
                pass
        if self._proc.poll() is None:
            self._proc.kill()

    def _close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)  # the child's input ends
        except OSError:
            pass
        self._sock.close()


#: the child's program: this package's worker, imported from the folder this process imported it from
_CHILD = "import sys; sys.path.insert(0, {root!r}); from ctconvert.calibration import worker; sys.path.remove({root!r}); worker.main()"


def _package_root() -> str:
    """The folder holding this ``ctconvert`` package (the child must import the same code)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- the child ---------------------------------------------------------------------------------------------------


#: packages the calibration process hides from transformers (:func:`_warm`): it never generates nor trains
_HIDDEN = ("sklearn", "scipy")


def _warm(src: str, device: str) -> None:
    """Import what calibrating ``src`` needs (torch, transformers, the model's modeling module, this package's
    calibration) and open the CUDA device ``device`` names (``auto``: the first, where there is one)."""
    import gc
    import importlib
    import json

    gc.disable()  # as the console script does during its imports (ctconvert.__main__)
    # scikit-learn serves only transformers' assisted generation (generation/candidate_generator.py imports
    # sklearn.metrics when it is installed): 3.6 s of the 11.1 s import of modeling_llama on an H200 machine
    # (python -X importtime, with pandas and scipy under it). This process never generates: hidden from it, the
    # import is skipped (importlib.util.find_spec answers None for a name whose sys.modules entry is None). So is
    # scipy, which transformers' object-detection losses import (loss/loss_for_object_detection.py, through
    # modeling_utils: 0.27 of 2.4 s on a 2-core machine): a modeling module that needs it is imported with it
    hidden = [name for name in _HIDDEN if sys.modules.setdefault(name, None) is None]
    opening = None
    try:
        import torch

        dev = None
        if (device == "auto" or device.startswith("cuda")) and torch.cuda.is_available():  # the context, beside the imports
            dev = "cuda" if device == "auto" else device.split(",")[0]
        elif os.environ.get("CTCONVERT_CALIBRATION_PRELOAD") == "1":  # the preload forced on the CPU (tests)
            dev = "cpu"
        if dev is not None:
            opening = threading.Thread(target=_open_device, args=(src, dev), name="ctconvert-cuda-init", daemon=True)
            opening.start()
        from . import apply, model  # noqa: F401

        try:
            with open(os.path.join(src, "config.json")) as f:
                cfg = json.load(f)
            kind = (cfg.get("text_config") or {}).get("model_type") or cfg.get("model_type")
            if kind:
                try:
                    importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
                except ImportError:  # it needs what is hidden: shown again
                    for name in hidden:
                        if name in sys.modules and sys.modules[name] is None:
                            del sys.modules[name]
                    importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        except Exception:  # noqa: BLE001 - the build names what is wrong, with the real run's message
            pass
        if opening is not None:
            opening.join()
    finally:
        gc.freeze()
        gc.enable()


def _open_device(src: str, dev: str) -> None:
    """Open the CUDA context of ``dev``, then begin reading ``src``'s embedding and decoder layers onto it
    (:class:`~.preload.DevicePreload`, within half the device's free memory less 8 GiB), beside the imports; not
    with ``CTCONVERT_CALIBRATION_PRELOAD=0``, nor for a quantized checkpoint. ``dev`` ``cpu`` (the preload forced
    with ``CTCONVERT_CALIBRATION_PRELOAD=1`` on a machine without CUDA: tests): into host memory, within 2 GiB. A
    failure here costs only the preload (the pass reads what it needs and reports what is wrong)."""
    import torch

    torch.empty(1, device=dev)
    if os.environ.get("CTCONVERT_CALIBRATION_PRELOAD", "1") == "0":
        return
    try:
        from ..checkpoint.reader import open_checkpoint
        from . import preload

        ckpt = open_checkpoint(src)
        if ckpt.quantization_config is not None:
            return
        if dev == "cpu":
            budget = 2 * 2**30
        else:
            free, _ = torch.cuda.mem_get_info(torch.device(dev))
            budget = min(free // 2, free - 8 * 2**30)
        if budget > 0:
            preload.install(preload.DevicePreload(preload.choose(ckpt.tensors.values(), budget), torch.device(dev)))
    except Exception:  # noqa: BLE001 - the conversion's own reading says what is wrong with the checkpoint
        pass


def _serve(req: CalibrationRequest, send, stopped: threading.Event) -> tuple[list[str], float]:
    """Read the data, build the model, calibrate (sending each module as its layer is done); the notes and the
    build's seconds."""
    from . import apply
    from .data import checkpoint_tokens
    from .feed import Cancelled

    ckpt = req.ckpt
    data = checkpoint_tokens(ckpt, req.file, req.samples, req.seq_len)
    t0 = time.perf_counter()
    apply.build_model(ckpt)
    built = round(time.perf_counter() - t0, 3)

    def check() -> None:
        if stopped.is_set():
            raise Cancelled("the run stopped")

    cal = apply.run(
        req.plan, ckpt, data.tokens, req.device, req.kv_cache, req.batch_tokens, progress=lambda i, n: send(("layer", i, n)), feed=_Sender(send), check=check
    )
    return [data.note, *cal.notes], built


class _Sender:
    """The child's feed: each module once, to the first process."""

    def __init__(self, send):
        self.send, self.sent = send, set()

    def put(self, module: str, parts: dict) -> None:
        if module not in self.sent:
            self.sent.add(module)
            self.send(("put", module, {k: v.cpu() for k, v in parts.items()}))


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a :class:`~ctconvert.errors.CTConvertError` with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        from ..errors import CTConvertError

        return CTConvertError(f"calibration failed: {type(e).__name__}: {e}")


def main() -> None:
    """The child (``sys.argv``: ``[-c, SRC, DEVICE]``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what a library prints goes to stderr, never into the messages
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    _warm(sys.argv[1], sys.argv[2])
    inp = sys.stdin.buffer
    try:
        req = pickle.load(inp)
    except (EOFError, pickle.UnpicklingError):
        return  # the command did not calibrate after all
    stopped = threading.Event()
    threading.Thread(target=lambda: (inp.read(), stopped.set()), daemon=True).start()
    try:
        notes, built = _serve(req, send, stopped)
        from . import preload

        p = preload.active()
        send(("done", notes, built, p.taken_bytes if p is not None else 0))
    except BaseException as e:  # noqa: BLE001 - every failure goes to the first process, which reports it
        try:
            send(("error", _portable(e)))
        except OSError:
            pass
    out.close()
    os._exit(0)  # not through the interpreter's shutdown: the daemon thread holds standard input's lock
