"""``python -m ctconvert`` and the ``ctconvert`` console script.

Every command that reads tensors imports torch, which can take seconds (``--help``, ``--version`` and
``schemes`` import none of it: they answer from the option table and the scheme table). A Ctrl-C that lands
during those imports must still give the one-line message and exit code 130,
never a traceback, and must never be lost: a KeyboardInterrupt raised inside
torch's import can be swallowed, and the conversion then runs to the end. So
the heavy imports happen here, up front, while SIGINT (and SIGTERM, SIGHUP)
only set a flag, which is checked once they are done.

Those imports are also where a process spends most of its time outside the
conversion. Where Python may not write bytecode (``PYTHONDONTWRITEBYTECODE``,
common in container images) and the installed packages ship none, every run
compiles torch's ~2,000 modules again: 3.5 s of a 6 s run on an H200 machine
(``scripts/startup_profile.py``). The console script then keeps the bytecode of
what it imports in its own cache folder instead (``$CTCONVERT_CACHE/pycache``,
default ``~/.cache/ctconvert/pycache``; never next to the sources), unless
``CTCONVERT_BYTECODE_CACHE=0`` or ``PYTHONPYCACHEPREFIX`` says otherwise. The
Python API (``import ctconvert``) leaves the interpreter's settings alone.

Two settings make those imports and the run cheaper, in the console script only: Python's cyclic garbage collector
is off during the heavy imports, which then move to its permanent generation (``gc.freeze``), so that no collection
walks torch's objects again (three full collections during the imports and the gen-0 and gen-1 passes after them
took ~0.2 s of a 2.6 s W8A8 run of the 1.2B benchmark model on 2 cores); and numpy's OpenBLAS, which torch's import
loads and ctconvert never calls (torch computes with its own MKL), starts one thread instead of one per core
(``OPENBLAS_NUM_THREADS=1`` unless the environment sets it), which otherwise spin beside the import. And torch
places its CPU buffers of 2 MiB and more on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1`` unless the
environment sets it; c10 ``alloc_cpu.cpp``: 2 MiB alignment and ``madvise(MADV_HUGEPAGE)``, where the kernel's
``transparent_hugepage`` allows it): each fresh buffer then faults in 2 MiB at a time instead of 4 KiB, which took
most of ``verify --reference``'s time (the 1.2B benchmark model's W4A16 output on 2 cores: 17M page faults, 27 s of
system time and 24 s of wall time; with it 0.9M faults and ~15 s). The calibration process inherits both.

For a command that may launch kernels (``quantize``, ``repack``, ``batch``) on a machine with an NVIDIA device node
(and without ``--device cpu``), CUDA's driver and the primary context of each device ``--device`` names are initialised
on a thread through ctypes (:mod:`ctconvert.pipeline.driver`: without the GIL, beside the imports), and Triton is
imported before torch and its cache key computed on a thread beside torch's
import (:mod:`ctconvert.formats.triton_key`): the first kernel launch of a process spent 1.4 s making it, and begun
after the imports it still held a MoE run's first batch back by 0.3-0.4 s.

``quantize`` reads its source ahead during those imports (:mod:`ctconvert.checkpoint.readahead`: the shard
headers, then the tensor bytes into the page cache, until the engine is imported; ``CTCONVERT_READAHEAD=0``
turns it off). ``CTCONVERT_TRACE=1`` prints when each start-up step happened (:class:`Trace`).
"""

import gc
import os
import signal
import sys
import threading
import time

from .errors import STOP_SIGNALS, stop_exit_code, stop_message, stops_to_handle  # light: no torch


def bytecode_cache(environ=os.environ, probe: str = "torch") -> str | None:
    """Point this process's bytecode cache at ctconvert's cache folder where Python would write none.

    Acts only when ``sys.dont_write_bytecode`` is set (``PYTHONDONTWRITEBYTECODE``/``-B``), no
    ``sys.pycache_prefix`` is set (``PYTHONPYCACHEPREFIX``/``-X pycache_prefix``) and
    ``CTCONVERT_BYTECODE_CACHE`` is not ``0``, and the package ``probe`` (torch, the slowest import by far) was
    installed without bytecode next to its sources (pip writes it unless told not to; then nothing changes
    and the installed bytecode is used); then sets ``sys.pycache_prefix`` to
    ``$CTCONVERT_CACHE/pycache`` (default ``~/.cache/ctconvert/pycache``) and allows writing there.
    Returns that folder, or None when it changed nothing (also when the folder cannot be created).
    Python's import system reads both settings at every import (``importlib.util.cache_from_source``,
    CPython 3.8+), so the imports that follow use them."""
    if not sys.dont_write_bytecode or sys.pycache_prefix or environ.get("CTCONVERT_BYTECODE_CACHE", "1") == "0":
        return None
    import importlib.util

    spec = importlib.util.find_spec(probe)
    if spec is None or not spec.origin or os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    folder = os.path.join(environ.get("CTCONVERT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ctconvert"), "pycache")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    sys.pycache_prefix = folder
    sys.dont_write_bytecode = False
    return folder


#: options that make click answer from the command definitions alone (no command runs, so no torch import)
_HELP_OPTIONS = ("--version", "--help", "-h")
#: commands that read no tensors: their answer comes from torch-free tables (``ctconvert.plan.schemes``)
_LIGHT_COMMANDS = ("schemes",)


def _answers_without_engine(argv: list[str]) -> bool:
    """Whether the command line only asks for the help or the version (or nothing: the help), or names a command
    of :data:`_LIGHT_COMMANDS` (:func:`ctconvert.cli.command_word`). A command that needs the engine after all
    (``--help`` as an option's value) imports it itself, inside ``cli.run``'s handling."""
    from .cli import command_word  # torch-free, as click is

    return not argv or any(a in _HELP_OPTIONS for a in argv) or command_word(argv) in _LIGHT_COMMANDS


#: the threads whose opens of SRC are the read ahead's, not the conversion's (readahead.py; hashing.py's pool)
_AHEAD_THREADS = ("ctconvert-readahead", "ctconvert-hash")


class Trace:
    """``CTCONVERT_TRACE=1``: one stderr line per start-up step, ``ctconvert-trace STEP SECONDS [DETAIL]``, where
    SECONDS is ``time.monotonic()`` (``CLOCK_MONOTONIC``: one clock for every process of the machine, so a parent
    that noted it before starting this process has the time since then). Steps: ``main`` (the console script's
    first line), ``readahead`` (the read ahead's first source read), ``first-open`` (the conversion's own first
    open of a file of SRC, seen by an audit hook, :pep:`578`), ``ray`` (``quantize --executor ray``: joining the cluster
    begun, :func:`join_ray_early`), ``calibration`` (the calibration process started, :func:`start_calibration_early`),
    ``engine`` (torch and the commands imported)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.stamp("main")

    def stamp(self, step: str, detail: str = "") -> None:
        self.stream.write(f"ctconvert-trace {step} {time.monotonic():.6f}{' ' + detail if detail else ''}\n")
        self.stream.flush()

    def watch(self, src: str) -> None:
        """Stamp ``first-open`` at the first open of a path under ``src`` by a thread other than the read ahead's
        (its own, and the hashing threads, which hash what it begins during the imports)."""
        root, seen = os.path.abspath(src), []

        def hook(event, args):
            if event != "open" or seen or not isinstance(args[0], (str, bytes, os.PathLike)):
                return
            path = os.path.abspath(os.fsdecode(args[0]))
            if (path == root or path.startswith(root + os.sep)) and not threading.current_thread().name.startswith(_AHEAD_THREADS):
                seen.append(path)
                self.stamp("first-open", path)

        sys.addaudithook(hook)


def _read_ahead(argv: list[str], trace: Trace | None):
    """Start reading ``quantize``'s SRC ahead (:func:`ctconvert.cli.quantize_reads` says what it reads); None for
    another command, or with ``CTCONVERT_READAHEAD=0``."""
    from .cli import quantize_reads

    reads = quantize_reads(argv)
    if reads is None:
        return None
    if trace is not None:
        trace.watch(reads[0])
    if os.environ.get("CTCONVERT_READAHEAD", "1") == "0":
        return None
    from .checkpoint.readahead import StartupReadAhead  # torch-free

    first = (lambda path: trace.stamp("readahead", str(path))) if trace is not None else None
    # --executor ray: the workers hash, not this process
    return StartupReadAhead(reads[0], data=reads[1], on_first_read=first, hash_sources=not _names_ray(argv)).start()


def _names_ray(argv: list[str]) -> bool:
    """Whether the command line may ask for ``--executor ray`` (a word ``ray`` or ``...=ray``): the cheap test before
    the line is parsed (a false yes only costs the parse, or a read ahead without the early source hashes)."""
    return any(a == "ray" or a.endswith("=ray") for a in argv)


def join_ray_early(argv: list[str], trace: Trace | None) -> None:
    """``quantize --executor ray`` (not a dry run) or ``batch --executor ray``: begin joining the Ray cluster and
    starting its workers now, so that their start-up (Python, Ray, torch) overlaps this process's own heavy imports
    (:func:`ctconvert.pipeline.ray_cluster.begin_early`; the first run takes the join). Nothing for another command."""
    from . import cli

    name = cli.command_word(argv)
    command, needs = {"quantize": (cli.quantize, "src"), "batch": (cli.batch_cmd, "jobs_file")}.get(name, (None, None))
    if command is None or not _names_ray(argv):
        return
    try:
        params = command.make_context(name, argv[argv.index(name) + 1 :], resilient_parsing=True).params
    except Exception:  # noqa: BLE001 - a line click refuses: cli.run says why
        return
    if params.get("executor") != "ray" or params.get("dry_run") or not params.get(needs):
        return
    from .pipeline.ray_cluster import begin_early  # torch-free

    window = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    keep, warm = params.get("ray_keep_workers") or 0, None
    if keep > 0:
        from .pipeline.ray_residents import keeping  # torch-free too

        warm = keeping(keep)
    begin_early(params.get("ray_address"), params.get("device") or "auto", warm)
    for sig, handler in window.items():  # ray.init of a new local instance sets its own SIGTERM handler: the window's stays
        signal.signal(sig, handler)
    if trace is not None:
        trace.stamp("ray", "joining")


def start_calibration_early(argv: list[str], trace: Trace | None) -> None:
    """``quantize`` whose scheme calibrates beside the conversion (:func:`ctconvert.calibration.worker.wanted`): start
    the calibration process now, so that its imports (torch, transformers) overlap this process's imports and
    planning (:mod:`ctconvert.calibration.worker`; the calibrate stage takes it), where the machine has the room for
    two processes (:func:`ctconvert.calibration.worker.has_room`: a CUDA device and 4 CPUs or more).
    ``CTCONVERT_CALIBRATION_PROCESS=1`` starts it anyway, ``0`` never (calibration then runs on a thread of this
    process). Nothing for another command."""
    from . import cli

    choice = os.environ.get("CTCONVERT_CALIBRATION_PROCESS", "auto")
    if cli.command_word(argv) != "quantize" or choice == "0":
        return
    try:
        params = cli.quantize.make_context("quantize", argv[argv.index("quantize") + 1 :], resilient_parsing=True).params
    except Exception:  # noqa: BLE001 - a line click refuses: cli.run says why
        return
    from .calibration import worker  # torch-free

    if worker.wanted(params) and (choice == "1" or worker.has_room(params.get("device") or "auto")):
        worker.prestart(params["src"], params.get("device") or "auto")
        if trace is not None:
            trace.stamp("calibration", "process started")


def main() -> None:
    trace = Trace() if os.environ.get("CTCONVERT_TRACE") == "1" else None
    hits: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: hits.append(signum)) for sig in stops_to_handle()}  # nohup's SIGHUP stays ignored
    ahead = None
    try:
        bytecode_cache()  # inside the window too
        if not _answers_without_engine(sys.argv[1:]):
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # torch's large CPU buffers on huge pages (read at its import)
            ahead = _read_ahead(sys.argv[1:], trace)
            join_ray_early(sys.argv[1:], trace)
            start_calibration_early(sys.argv[1:], trace)
            from .cli import command_word
            from .formats import triton_key  # torch-free

            word = command_word(sys.argv[1:])
            if triton_key.wanted(word, sys.argv[1:]):
                if word != "batch" and not _names_ray(sys.argv[1:]):  # (a batch's jobs name their devices; a Ray driver computes nothing)
                    from .pipeline import driver  # torch-free

                    driver.begin(driver.device_spec(sys.argv[1:]))  # CUDA's driver initialised beside the imports, without the GIL
                triton_key.begin(import_here=True)  # Triton imported here, its cache key hashed beside torch's import (the first launch needs it)
            from . import api

            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS, loaded by torch and never used
            gc.disable()
            try:
                api.preload()  # torch and the rest of the heavy imports, inside the window
            finally:
                gc.freeze()  # what the imports made is never collected again (nor walked by later collections)
                gc.enable()
            if trace is not None:
                trace.stamp("engine")
        from .cli import run
    finally:
        if ahead is not None:
            ahead.stop()  # the engine reads for itself from here
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if hits:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        sys.stderr.write(stop_message(hits[0], sys.argv[1:]) + "\n")
        sys.stderr.flush()
        os._exit(stop_exit_code(hits[0]))  # nothing was written yet (the read ahead only reads)
    run()


if __name__ == "__main__":
    main()
