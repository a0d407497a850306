"""``ctconvert batch``: many conversions in one call: a YAML (or JSON) file of jobs, one JSON line of result per job.

    defaults:            # optional, applied to every job
      scheme: W4A16
      max_shard_size: 5GB
    jobs:
      - model: /models/llama-8b
        output: /out/llama-8b-w4a16
      - model: /models/llama-8b
        output: /out/llama-8b-nvfp4
        scheme: NVFP4A16
        lm_head: nvfp4a16
        ignore: ["re:.*mlp.gate$"]

Keys of a job are ``model``, ``output``, ``scheme`` and the options of
:func:`ctconvert.api.quantize`, the entries of the option table
:data:`ctconvert.options.OPTIONS` (``lm_head``, ``targets``,
``ignore``, ``max_shard_size``, ``overwrite``, ``skip_incompatible``, ``allow_unloadable``, ``device``,
``resume``, ``refresh``, ``dry_run``, ``group_size``, ``symmetric``, ``target``,
``layout_version``, ``act_dtype`` ...; ``allow_non_finite`` spelled as on the
command line). Relative paths are relative to the jobs file; scheme names,
and outputs that two jobs share or that lie inside (or contain) an input, are
refused before any job runs.

The output is JSON Lines: one line per job, every line with the same keys
(:data:`LINE_KEYS`; ``status`` ``ok`` | ``error`` | ``skipped`` |
``interrupted``), then one summary line (``status`` ``summary``, counts).
"""

from __future__ import annotations

import difflib
import os
import time
from collections.abc import Callable
from pathlib import Path

from .. import jsonout
from ..errors import EXIT_INTERNAL, EXIT_INTERRUPTED, CTConvertError, UsageError
from ..options import OPTIONS, job_keys
from ..pipeline.options import QuantizeOptions
from ..plan.recipe import read_recipe
from ..plan.schemes import get_scheme, read_document, resolve_scheme
from ..plan.sparsity import sparse_scheme

__all__ = ["ALLOWED", "LINE_KEYS", "OPTION_OF_KEY", "PATH_KEYS", "load_jobs", "run_jobs"]

#: job key -> the :class:`~ctconvert.pipeline.options.QuantizeOptions` field it sets (every option is a job key)
OPTION_OF_KEY = job_keys()
#: the keys a job may have: the source, output and scheme, and every option
ALLOWED = {"model", "output", "scheme", *OPTION_OF_KEY}
#: the keys that hold paths (relative ones are relative to the jobs file): the source, output and every path option
PATH_KEYS = ("model", "output", *(o.job_key or o.name for o in OPTIONS.values() if o.type in ("path", "file")))
#: the keys of every job line, whatever its status (None where a key does not apply)
LINE_KEYS = (
    "job",
    "status",
    "model",
    "output",
    "scheme",
    "target",
    "dry_run",
    "input_bytes",
    "output_bytes",
    "shards",
    "reused_shards",
    "rewritten_shards",
    "seconds",
    "error",
    "exit_code",
    "notes",
    "warnings",
)


def load_jobs(path: str | Path, emit: Callable | None = None) -> list[dict]:
    """Read and check the jobs file. Raises :class:`UsageError` naming the file and job.

    ``emit``: given, a refused file is reported on it too, as the JSON Lines a run ends with: one ``error``
    line (``job`` None, the message and exit code) and the summary line (``jobs`` 0: none ran)."""
    t0 = time.perf_counter()
    try:
        return _load_jobs(path)
    except CTConvertError as e:
        if emit is not None:
            line = {"status": "error", "dry_run": False, "error": str(e), "exit_code": e.exit_code, "notes": [], "warnings": []}
            emit(jsonout.dumps({**dict.fromkeys(LINE_KEYS), **line}))
            counts = {"ok": 0, "error": 1, "skipped": 0, "interrupted": 0}
            message = "0 ok, 1 failed, 0 skipped: the jobs file was refused, no job ran"
            seconds = round(time.perf_counter() - t0, 3)
            emit(jsonout.dumps({"status": "summary", "jobs": 0, **counts, "exit_code": e.exit_code, "seconds": seconds, "message": message}))
        raise


def _load_jobs(path: str | Path) -> list[dict]:
    p = Path(path)
    doc = read_document(p, "the jobs file")
    if isinstance(doc, list):
        doc = {"jobs": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise UsageError("jobs file needs a 'jobs' list", file=p)
    defaults = doc.get("defaults") or {}
    jobs = []
    for i, j in enumerate(doc["jobs"]):
        if not isinstance(j, dict):
            raise UsageError(f"job {i} is not a mapping", file=p)
        job = {**defaults, **j}
        unknown = set(job) - ALLOWED
        if unknown:
            meant = []
            for k in sorted(map(str, unknown)):  # a typo or the option's spelling (lm-head): the key meant
                close = difflib.get_close_matches(k.lstrip("-").replace("-", "_"), sorted(ALLOWED), n=1, cutoff=0.7)
                meant += [f"{k!r}: did you mean {close[0]!r}?"] if close else []
            hint = f" ({'; '.join(meant)})" if meant else ""
            raise UsageError(f"job {i}: unknown keys {sorted(unknown)}{hint}; a job takes {', '.join(sorted(ALLOWED))}", file=p)
        for k in ("model", "output") if job.get("recipe") else ("model", "output", "scheme"):  # a recipe says the schemes
            if k not in job:
                raise UsageError(f"job {i}: missing {k!r}", file=p)
        for k in PATH_KEYS:  # relative paths are relative to the jobs file; normalised (no ./, .., //)
            if job.get(k) is None:
                continue
            q = Path(str(job[k])).expanduser()
            job[k] = os.path.normpath(os.path.abspath(q if q.is_absolute() else (p.parent / q)))
        try:
            QuantizeOptions(**{OPTION_OF_KEY[k]: v for k, v in job.items() if k in OPTION_OF_KEY})  # the options' own checks (types, --dense-dtype ...)
            if job.get("recipe"):
                if j.get("scheme") is not None:  # a default scheme gives way to a job's recipe
                    raise UsageError("'recipe' and 'scheme' cannot be combined: the recipe's config groups say each module's scheme")
                job["scheme"] = None
                read_recipe(job["recipe"])
            elif job.get("sparsity"):  # 2:4: checked here, named as the user wrote it (plan/sparsity.py)
                sparse_scheme(str(job["scheme"]), str(job["sparsity"]))
                job["scheme"] = str(job["scheme"]).upper()
            elif str(job["scheme"]).lower().endswith((".json", ".yaml", ".yml")):  # a QuantizationScheme file, relative to the jobs file too
                q = Path(str(job["scheme"])).expanduser()
                job["scheme"] = str(q if q.is_absolute() else (p.parent / q))
                resolve_scheme(job["scheme"], job.get("group_size"), job.get("symmetric"))
            else:
                job["scheme"] = get_scheme(str(job["scheme"])).name
                resolve_scheme(job["scheme"], job.get("group_size"), job.get("symmetric"))
        except CTConvertError as e:
            raise UsageError(f"job {i}: {e}", file=p) from None
        jobs.append(job)
    _check_outputs(jobs, p)
    return jobs


def _check_outputs(jobs: list[dict], p: Path) -> None:
    """Refuse, before any job runs, two jobs writing one output and an output inside (or holding) an input."""
    seen: dict[str, int] = {}
    for i, job in enumerate(jobs):
        out = job["output"]
        if out in seen:
            raise UsageError(f"jobs {seen[out]} and {i} both write {out}: give each job its own output", file=p)
        seen[out] = i
    for i, job in enumerate(jobs):
        out = Path(job["output"])
        for j, other in enumerate(jobs):
            src = Path(other["model"])
            if out == src or src in out.parents:
                raise UsageError(f"job {i}: output {out} is inside the input of job {j} ({src}); the input is never written to", file=p)
            if out in src.parents:
                raise UsageError(f"job {i}: output {out} holds the input of job {j} ({src}); writing it would replace that input", file=p)


def _line(i: int, job: dict, status: str, **values) -> dict:
    line = dict.fromkeys(LINE_KEYS)
    line.update(job=i, status=status, model=job["model"], output=job["output"], scheme=job["scheme"], target=job.get("target"))
    line["dry_run"] = bool(job.get("dry_run", False))
    line.update(values)
    return line


def _done_line(i: int, job: dict, r, t0: float) -> dict:
    """The line of a job whose conversion returned ``r``: ``ok``, or ``error`` for a dry run that found what the real run would stop at;
    a job the Ray executor ran adds ``nodes`` (``r.nodes``: the nodes and what each did, as ``quantize --json`` has them)."""
    line = _line(
        i,
        job,
        "ok",
        input_bytes=r.input_bytes,
        output_bytes=r.output_bytes,
        shards=len(r.shards),
        reused_shards=list(r.reused_shards),
        rewritten_shards=list(r.rewritten_shards),
        seconds=round(time.perf_counter() - t0, 3),
        exit_code=0,
        notes=list(r.notes),
        warnings=list(r.warnings),
    )
    if r.nodes is not None:  # --executor ray (a local job's line has no nodes key, as its quantize --json has none)
        line["nodes"] = list(r.nodes)
    if r.error is not None:
        line.update(status="error", error=str(r.error), exit_code=getattr(r.error, "exit_code", EXIT_INTERNAL))
    return line


def run_jobs(
    jobs: list[dict],
    convert: Callable,
    keep_going: bool = False,
    emit=print,
    on_job: Callable | None = None,
    stop_code: Callable[[], int] | None = None,
    executor: str | None = None,
    ray_address: str | None = None,
    ray_keep_workers: int | None = None,
) -> int:
    """Run the jobs in order through ``convert(model, output, scheme, **options)`` (the API's
    ``quantize``; the job keys named by :data:`OPTION_OF_KEY`); ``emit`` gets one JSON line
    per job and a summary line; ``on_job(i, job)`` is called as each job starts. Returns the exit code.
    ``executor``/``ray_address``/``ray_keep_workers`` (``batch --executor ray``): the options of every job that does
    not set its own key of that name; with ``ray`` each job's shards are spread over the cluster, the jobs
    one after the other (the same lines and exit codes as a local batch).

    The exit code is 0 when every job succeeded, else that of the first failure.
    Without ``keep_going`` the jobs after a failure are reported as skipped. An interrupt (Ctrl-C,
    SIGTERM) emits an ``interrupted`` line for the running job (``exit_code``: ``stop_code()``, default
    130), a ``skipped`` line for each job after it and the summary, then propagates.
    """
    code = 0
    t_all = time.perf_counter()
    given = {k: v for k, v in (("executor", executor), ("ray_address", ray_address), ("ray_keep_workers", ray_keep_workers)) if v is not None}
    counts = {"ok": 0, "error": 0, "skipped": 0, "interrupted": 0}

    def put(line: dict) -> None:
        counts[line["status"]] += 1
        emit(jsonout.dumps(line))

    def summary() -> None:
        emit(
            jsonout.dumps(
                {
                    "status": "summary",
                    "jobs": len(jobs),
                    **counts,
                    "exit_code": code,
                    "seconds": round(time.perf_counter() - t_all, 3),
                    "message": f"{counts['ok']} ok, {counts['error']} failed, {counts['skipped']} skipped"
                    + (f", {counts['interrupted']} interrupted" if counts["interrupted"] else ""),
                }
            )
        )

    for i, job in enumerate(jobs):
        if code and not keep_going:
            put(_line(i, job, "skipped"))
            continue
        if on_job is not None:
            on_job(i, job)
        t0 = time.perf_counter()
        kw = {**given, **{OPTION_OF_KEY[k]: v for k, v in job.items() if k not in ("model", "output", "scheme")}}
        if kw.get("layout_version") is not None:  # YAML reads 0.33 as a number
            kw["layout_version"] = str(kw["layout_version"])
        try:
            line = _done_line(i, job, convert(job["model"], job["output"], job["scheme"], **kw), t0)
            code = code or line["exit_code"]
        except CTConvertError as e:
            line = _line(i, job, "error", seconds=round(time.perf_counter() - t0, 3), error=str(e), exit_code=e.exit_code)
            code = code or e.exit_code
        except KeyboardInterrupt:
            stopped = stop_code() if stop_code is not None else EXIT_INTERRUPTED
            put(_line(i, job, "interrupted", seconds=round(time.perf_counter() - t0, 3), error="interrupted", exit_code=stopped))
            for j in range(i + 1, len(jobs)):
                put(_line(j, jobs[j], "skipped"))
            code = code or stopped
            summary()
            raise
        except Exception as e:  # noqa: BLE001 - reported per job
            line = _line(i, job, "error", seconds=round(time.perf_counter() - t0, 3), error=f"internal error: {type(e).__name__}: {e}", exit_code=EXIT_INTERNAL)
            code = code or EXIT_INTERNAL
        put(line)
    summary()
    return code
