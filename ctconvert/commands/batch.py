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

Keys of a job are the keyword arguments of :func:`ctconvert.api.quantize`
(``scheme``, ``lm_head``, ``targets``, ``ignore``, ``max_shard_size``,
``overwrite``, ``skip_incompatible``, ``device``, ``resume``, ``refresh``)
plus ``model`` and ``output``. Relative paths are relative to the jobs file;
scheme names are checked before any job runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import EXIT_INTERNAL, CTConvertError, UsageError
from ..plan.schemes import get_scheme, resolve_scheme
from ..plan.sparsity import sparse_scheme

__all__ = ["ALLOWED", "load_jobs", "run_jobs"]

ALLOWED = {
    "model",
    "output",
    "scheme",
    "lm_head",
    "targets",
    "ignore",
    "max_shard_size",
    "overwrite",
    "skip_incompatible",
    "device",
    "resume",
    "refresh",
    "lm_head_chunk_rows",
    "allow_non_finite",
    "keep_other_weights",
    "sparsity",
    "group_size",
    "symmetric",
}


def load_jobs(path: str | Path) -> list[dict]:
    """Read and check the jobs file. Raises :class:`UsageError` naming the file and job."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UsageError(f"cannot read the jobs file: {e.strerror or e}", file=p) from e
    try:
        if p.suffix == ".json":
            doc = json.loads(text)
        else:
            import yaml

            doc = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - yaml and json raise different classes
        first = " ".join(str(e).split())
        raise UsageError(f"jobs file is not valid YAML/JSON ({first})", file=p) from e
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
            raise UsageError(f"job {i}: unknown keys {sorted(unknown)}", file=p)
        for k in ("model", "output", "scheme"):
            if k not in job:
                raise UsageError(f"job {i}: missing {k!r}", file=p)
        for k in ("model", "output"):  # relative paths are relative to the jobs file
            q = Path(str(job[k])).expanduser()
            job[k] = str(q if q.is_absolute() else (p.parent / q))
        try:
            if job.get("sparsity"):  # 2:4: checked here, named as the user wrote it (plan/sparsity.py)
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
    return jobs


def run_jobs(jobs: list[dict], convert: Callable, keep_going: bool = False, emit=print, on_job: Callable | None = None) -> int:
    """Run the jobs in order through ``convert(model, output, scheme, **options)`` (the API's
    ``quantize``); ``emit`` gets one JSON line per job; ``on_job(i, job)`` is called as each job starts.
    Returns the exit code.

    The exit code is 0 when every job succeeded, else that of the first failure.
    Without ``keep_going`` the jobs after a failure are reported as skipped.
    """
    code = 0
    for i, job in enumerate(jobs):
        if code and not keep_going:
            emit(json.dumps({"job": i, "status": "skipped", "model": str(job["model"]), "output": str(job["output"])}))
            continue
        if on_job is not None:
            on_job(i, job)
        t0 = time.perf_counter()
        kw = {k: v for k, v in job.items() if k not in ("model", "output", "scheme")}
        if "allow_non_finite" in kw:  # the option's name on the command line
            kw["allow_nonfinite"] = kw.pop("allow_non_finite")
        line = {"job": i, "model": str(job["model"]), "output": str(job["output"]), "scheme": job["scheme"]}
        try:
            r = convert(job["model"], job["output"], job["scheme"], **kw)
            line.update(
                status="ok",
                input_bytes=r.input_bytes,
                output_bytes=r.output_bytes,
                shards=len(r.shards),
                seconds=round(time.perf_counter() - t0, 3),
                error=None,
                exit_code=0,
            )
        except CTConvertError as e:
            line.update(status="error", seconds=round(time.perf_counter() - t0, 3), error=str(e), exit_code=e.exit_code)
            code = code or e.exit_code
        except Exception as e:  # noqa: BLE001 - reported per job
            line.update(status="error", seconds=round(time.perf_counter() - t0, 3), error=f"internal error: {type(e).__name__}: {e}", exit_code=EXIT_INTERNAL)
            code = code or EXIT_INTERNAL
        emit(json.dumps(line))
    return code
