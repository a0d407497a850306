"""The calibrate stage: static activation scales and KV-cache scales from calibration data, entered once.

Plan time (:meth:`CalibrateStage.prepare`, a dry run too): the calibrated tensors' names join the
plan (:func:`ctconvert.calibration.apply.add_outputs`), the model is checked buildable, the cost is
estimated (``result.calibration``). A dry run also reads and tokenizes the data as the real run will;
the real run calibrates layer by layer (:func:`ctconvert.calibration.apply.run`) and hands the
:class:`~ctconvert.calibration.apply.Calibrated` tensors to the quantize stage (``job.calibration``).
Its rule: ``--refresh`` cannot update calibrated scales (they depend on every earlier layer).

A weight observer that needs data (``--observer imatrix_mse`` / ``nvfp4_expanded_imatrix``, or a recipe group's) makes
a data-free scheme calibrated too, as llm-compressor's ``oneshot`` calibrates when a dataset is given (the built-in
corpus when no ``--calibration`` is named): the pass collects every Linear's E[x^2] statistic
(``Calibrated.importance``), which the quantize stage hands to the observer.
"""

from __future__ import annotations

import contextlib
import inspect
import time

from ..calibration import apply as calibration
from ..calibration.data import checkpoint_tokens
from ..calibration.feed import BackgroundCalibration, CalibratedFeed
from ..calibration.worker import CalibrationProcess, CalibrationRequest, take
from ..checkpoint.hashing import file_hash
from ..errors import CTConvertError, UnsupportedError
from ..formats.observers import get_observer
from ..pipeline.options import QuantizeOptions
from .job import QuantizeJob, Stage

__all__ = ["CalibrateStage", "layer_progress"]

#: the options that say which calibration data to use (a note says when a plan needs none)
_DATA_OPTIONS = ("calibration", "calibration_samples", "calibration_seq_len", "calibration_batch_tokens")

_NO_REFRESH = "--refresh cannot update calibrated activation scales (they depend on every earlier layer): convert again"


class CalibrateStage(Stage):
    """The options ``calibration`` (a file, token ids, or None: the built-in corpus), ``calibration_samples``,
    ``calibration_seq_len``, ``calibration_batch_tokens``, ``kv_cache``. Does nothing for a plan that needs no
    calibration (weights and dynamic activation scales only) and no ``--kv-cache``.

    Raises :class:`~ctconvert.errors.UsageError` for an unknown ``kv_cache`` (or one with no attention to
    calibrate), :class:`~ctconvert.errors.UnsupportedError` for a model calibration cannot run, and what
    reading the data and calibrating raise."""

    def __init__(self, o: QuantizeOptions):
        self.file, self.samples, self.seq_len, self.batch_tokens = o.calibration, o.calibration_samples, o.calibration_seq_len, o.calibration_batch_tokens
        self.kv_cache = o.kv_cache.lower()
        self.observer = o.observer
        self.cost: calibration.CalibrationCost | None = None
        self.importance: list[str] = []  # the observers that need calibration data
        self._background: BackgroundCalibration | CalibrationProcess | None = None
        self._process: CalibrationProcess | None = None  # the console script's calibration process, when it started one
        self.built_s: float | None = None
        defaults = QuantizeOptions()
        self.given = [f"--{k.replace('_', '-')}" for k in _DATA_OPTIONS if getattr(o, k) != getattr(defaults, k)]  # named by the user

    def prepare(self, job: QuantizeJob) -> None:
        calibration.add_outputs(job.plan, job.ckpt, self.kv_cache)
        names = {self.observer, *job.plan.observers.values()} if job.plan.observers else {self.observer}
        self.importance = sorted(n for n in names if get_observer(n).needs_data)
        job.calibrated = calibration.needs_calibration(job.plan, self.kv_cache) or bool(self.importance)
        job.kv_cache_scheme = calibration.kv_cache_config(self.kv_cache)
        if not job.calibrated:
            if self.given:
                job.result.notes.append(f"{' and '.join(self.given)} not used: this plan needs no calibration (weights and dynamic activation scales only)")
            return
        # the model is built (transformers imported) here, also for a calibration beside the write stage: beside its
        # threads the GIL-bound imports took longer than the overlap saved (H200, 8B: 6.8-7.0 s, against 3.9-4.7 s first);
        # where the console script started a calibration process, that process imports and builds it instead
        self._process = take(job.ckpt.path) if self._beside(job) and not job.options.dry_run else None
        t0 = time.perf_counter()
        if self._process is not None:
            calibration.check_generative(job.ckpt)  # the rest of check_model: in that process, with the same errors
        else:
            self._check_model(job)
        self.built_s = round(time.perf_counter() - t0, 3)
        cost = calibration.estimate(job.plan, job.ckpt, self.samples, self.seq_len, self.kv_cache, self.batch_tokens)
        cost.schemes += [f"observer {n}" for n in self.importance]
        job.result.calibration = {**cost.to_dict(), "source": str(self.file) if self.file else "built-in English corpus"}
        job.fingerprint["calibration"] = [str(self.file or ""), self.samples, self.seq_len, self.kv_cache, *self.importance]
        if self.file:  # the data itself, not only its name: --resume must not mix shards calibrated on other text
            job.fingerprint["calibration"].append(_content_hash(self.file))
        job.refresh_refused = _NO_REFRESH
        self.cost = cost

    def _check_model(self, job: QuantizeJob) -> None:
        """:func:`calibration.check_model`; when only an observer asks for the calibration pass, its refusal says so."""
        try:
            calibration.check_model(job.ckpt)
        except UnsupportedError as e:
            if not self.importance or calibration.needs_calibration(job.plan, self.kv_cache):
                raise
            why = str(e.message).split(": use a data-free scheme")[0]
            names = " and ".join(self.importance)
            raise UnsupportedError(
                f"--observer {names} needs a calibration pass (each input channel's E[x^2]), and {why}: "
                "use a data-free observer (memoryless_mse, nvfp4_expanded_mse)",
                file=e.file,
            ) from None

    def report(self, job: QuantizeJob) -> None:
        if not job.calibrated:
            if not self.given:  # else prepare's note says it
                job.result.notes.append("no calibration needed (weights and dynamic activation scales only)")
            return
        job.result.notes += [self.cost.describe(), *filter(None, [calibration.attention_note(job.ckpt)])]
        data = self._read_data(job)
        if isinstance(data, CTConvertError):
            job.result.error = job.result.error or data

    def run(self, job: QuantizeJob) -> None:
        """Read the calibration tokens, run the model layer by layer (on the first device), hand the calibrated
        tensors on; with a ``progress`` factory that takes ``unit``/``desc`` keywords, one step per decoder layer.

        Where it can (:meth:`_beside`), calibration runs on its own thread beside the write stage: the executor gets a
        :class:`~ctconvert.calibration.feed.CalibratedFeed` and waits only for each calibrated tensor's layer; the
        write stage waits for the end of calibration before it commits the output (``job.before_commit``), and the
        notes and seconds are those the run in line gives, in the same place."""
        if not job.calibrated:
            return
        t0 = time.perf_counter()
        if self._process is not None and self._start_process(job, t0):
            return
        data = self._read_data(job)
        if isinstance(data, CTConvertError):
            raise data
        if self._beside(job):
            self._start_beside(job, data, t0)
            return
        job.calibration = self._calibrate(job, data)
        self._record(job, job.calibration, t0, len(job.result.notes))

    def _calibrate(self, job: QuantizeJob, data, feed=None, check=None):
        with layer_progress(job.progress, job.result.calibration["layers"], f"calibrate ({self.samples} x {self.seq_len} tokens)") as step:
            return calibration.run(
                job.plan,
                job.ckpt,
                data.tokens,
                job.devices[0],
                self.kv_cache,
                self.batch_tokens,
                progress=step,
                importance=bool(self.importance),
                feed=feed,
                check=check,
            )

    def _record(self, job: QuantizeJob, cal, t0: float, at: int) -> None:
        """Calibration's notes, and its seconds: ``seconds`` from the stage's start to the end of the pass, and
        ``model_seconds`` that building the model took at plan time (transformers imported); ``preloaded_bytes`` 0
        (only the calibration process preloads: it sets its own count after this)."""
        job.result.notes[at:at] = cal.notes
        job.result.calibration["seconds"] = round(time.perf_counter() - t0, 3)
        job.result.calibration["model_seconds"] = self.built_s
        job.result.calibration["preloaded_bytes"] = 0

    def _beside(self, job: QuantizeJob) -> bool:
        """Whether calibration can run beside the write stage: not for the imatrix observers (the weights themselves
        need the statistics), not on Ray (the workers get the calibrated tensors with their task), and not with
        ``--resume`` (a failing calibration must leave the interrupted run's partial folder as it was). The model was
        built at plan time (:meth:`prepare`) in either case."""
        o = job.options
        return not self.importance and o.executor == "local" and not o.resume and not o.refresh

    def _start_beside(self, job: QuantizeJob, data, t0: float) -> None:
        feed = CalibratedFeed(calibration.calibrated_modules(job.plan, self.kv_cache))

        def work(feed, check):
            check()
            return self._calibrate(job, data, feed, check)

        self._background = BackgroundCalibration(feed, work)
        job.calibration = calibration.Calibrated(feed, [], {})
        at = len(job.result.notes)

        def wait() -> None:
            done = self._background.result()
            job.calibration = calibration.Calibrated(done.tensors, done.notes, done.importance)
            self._record(job, done, t0, at)

        job.before_commit.append(wait)

    def _start_process(self, job: QuantizeJob, t0: float) -> bool:
        """:meth:`_start_beside` in the calibration process (:mod:`ctconvert.calibration.worker`): it reads the data,
        builds the model and calibrates; its notes (the data's first) and ``model_seconds`` (its build) are recorded
        as the thread's are. False when the plan cannot be sent to it (then calibration runs on the thread)."""
        feed = CalibratedFeed(calibration.calibrated_modules(job.plan, self.kv_cache))
        request = CalibrationRequest(job.plan, job.ckpt, self.file, self.samples, self.seq_len, job.devices[0], self.kv_cache, self.batch_tokens)
        bar = lambda: layer_progress(job.progress, job.result.calibration["layers"], f"calibrate ({self.samples} x {self.seq_len} tokens)")
        self._background, self._process = self._process.start(request, feed, bar), None
        if self._background is None:  # the request cannot travel: on a thread after all
            return False
        job.calibration = calibration.Calibrated(feed, [], {})
        at = len(job.result.notes)

        def wait() -> None:
            done = self._background.result()
            self.built_s = self._background.model_seconds
            job.calibration = done
            self._record(job, done, t0, at)
            job.result.calibration["preloaded_bytes"] = self._background.preloaded_bytes

        job.before_commit.append(wait)
        return True

    def close(self, job: QuantizeJob, stopped: bool = False) -> None:
        if self._background is not None:
            # ended: at once; else it stops at its next layer, waited for unless the process is being stopped
            self._background.cancel(wait=not stopped)
            self._background = None
        if self._process is not None:  # taken, never started (the run stopped before calibration)
            self._process.cancel(wait=False)
            self._process = None

    def _read_data(self, job: QuantizeJob):
        """Read and tokenize the calibration data as the real run will (a dry run stops where it would stop: no
        tokenizer, too few tokens, ids outside the vocabulary); the data, or the error (returned, not raised)."""
        try:
            data = checkpoint_tokens(job.ckpt, self.file, self.samples, self.seq_len)
        except CTConvertError as e:
            return e
        job.result.notes.append(data.note)
        return data


@contextlib.contextmanager
def layer_progress(progress, layers: int, desc: str):
    """``progress(layers, unit="layer", desc=desc)`` as a ``(layer, layers)`` callback (calibration's), or None
    when there is no factory or it takes only ``(total_bytes)`` (the API's older form: no calibration progress)."""
    if progress is None or not _takes_unit(progress) or layers < 1:
        yield None
        return
    with progress(layers, unit="layer", desc=desc) as bar:
        yield lambda done, total: bar.update(1)


def _takes_unit(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "unit" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _content_hash(path) -> str:
    """:func:`~ctconvert.checkpoint.hashing.file_hash` of a calibration file (the journal's hash of a file's bytes),
    or ``unreadable`` (loading the data then raises the error that names the file)."""
    try:
        return file_hash(path)
    except OSError:
        return "unreadable"
