"""ctconvert batch: one JSON line per job, non-zero exit when one fails, --keep-going."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ctconvert.cli import main
from ctconvert.commands.batch import LINE_KEYS
from ctconvert.errors import UsageError


def test_batch_jobs(tiny_llama, tmp_path):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"""
defaults:
  max_shard_size: 300KB
jobs:
  - model: {tiny_llama}
    output: {tmp_path / "a"}
    scheme: W4A16
  - model: {tmp_path / "missing"}
    output: {tmp_path / "b"}
    scheme: W4A16
  - model: {tiny_llama}
    output: {tmp_path / "c"}
    scheme: nvfp4a16
    lm_head: fp8
""")
    r = CliRunner().invoke(main, ["batch", str(jobs)])
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert r.exit_code == 3
    assert [x["status"] for x in lines] == ["ok", "error", "skipped", "summary"]
    assert lines[-1]["message"] == "1 ok, 1 failed, 1 skipped" and lines[-1]["exit_code"] == 3
    assert all(list(x) == list(LINE_KEYS) for x in lines[:-1])  # one schema for every status
    assert lines[0]["output_bytes"] > 0 and lines[0]["shards"] > 1 and "seconds" in lines[0]
    assert "not a checkpoint folder" in lines[1]["error"] and lines[1]["exit_code"] == 3
    r = CliRunner().invoke(main, ["batch", str(jobs), "--keep-going"])
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert r.exit_code == 6 and [x["status"] for x in lines] == ["error", "error", "ok", "summary"]  # "a" exists now: exit code of the first failure
    assert "--overwrite" in lines[0]["error"]
    assert (tmp_path / "c" / "config.json").exists()


def test_batch_bad_file(tmp_path):
    f = tmp_path / "j.yaml"
    f.write_text("jobs:\n  - model: x\n    scheme: W4A16\n")
    r = CliRunner().invoke(main, ["batch", str(f)])
    assert r.exit_code == 2 and "missing 'output'" in r.stderr
    f.write_text("jobs:\n  - {model: x, output: y, scheme: W4A16, colour: red}\n")
    r = CliRunner().invoke(main, ["batch", str(f)])
    assert r.exit_code == 2 and "unknown keys ['colour']" in r.stderr


def test_batch_checks_schemes_up_front_and_paths_are_relative_to_the_file(tiny_llama, tmp_path):
    d = tmp_path / "jobs"
    d.mkdir()
    f = d / "j.yaml"
    f.write_text(f"jobs:\n  - {{model: {tiny_llama}, output: out-a, scheme: w8a8}}\n  - {{model: {tiny_llama}, output: out-b, scheme: W3A17}}\n")
    r = CliRunner().invoke(main, ["batch", str(f)])
    assert r.exit_code == 2 and "job 1" in r.stderr and "unknown scheme" in r.stderr and not (d / "out-a").exists()
    f.write_text(f"jobs:\n  - {{model: {tiny_llama}, output: out-a, scheme: w8a8}}\n")
    r = CliRunner().invoke(main, ["batch", str(f)])
    line = json.loads(r.stdout.splitlines()[0])
    assert r.exit_code == 0 and line["scheme"] == "W8A8" and (d / "out-a" / "config.json").exists()


def _jobs(tmp_path, jobs, defaults=None):
    f = tmp_path / "jobs.json"
    f.write_text(json.dumps({"defaults": defaults or {}, "jobs": jobs}))
    return f


def test_batch_refuses_conflicting_outputs_before_the_first_job(tiny_llama, tmp_path):
    a = str(tmp_path / "a")
    f = _jobs(tmp_path, [{"model": str(tiny_llama), "output": a, "scheme": "W4A16"}, {"model": str(tiny_llama), "output": a + "/./", "scheme": "W8A16"}])
    r = CliRunner().invoke(main, ["batch", str(f)])
    assert r.exit_code == 2 and f"jobs 0 and 1 both write {a}: give each job its own output" in r.stderr and not (tmp_path / "a").exists()
    f = _jobs(
        tmp_path,
        [
            {"model": str(tiny_llama), "output": str(tmp_path / "x"), "scheme": "W4A16"},
            {"model": str(tiny_llama), "output": str(tiny_llama / "q"), "scheme": "W4A16"},
        ],
    )
    r = CliRunner().invoke(main, ["--json", "batch", str(f)])
    assert r.exit_code == 2 and f"job 1: output {tiny_llama / 'q'} is inside the input of job 0" in r.stderr and not (tmp_path / "x").exists()
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]  # --json batch: JSON Lines, a refused file too
    assert [x["status"] for x in lines] == ["error", "summary"] and [x["exit_code"] for x in lines] == [2, 2]
    f = _jobs(tmp_path, [{"model": str(tiny_llama), "output": str(tmp_path), "scheme": "W4A16"}])
    r = CliRunner().invoke(main, ["batch", str(f)])
    assert r.exit_code == 2 and "holds the input of job 0" in r.stderr


def test_batch_target_dry_run_refresh_and_normalised_paths(tiny_llama, tmp_path):
    f = _jobs(
        tmp_path,
        [
            {"model": str(tiny_llama), "output": "./k//", "scheme": "W4A16", "target": "marlin", "layout_version": "0.29", "act_dtype": "fp16"},
            {"model": str(tiny_llama), "output": "d", "scheme": "W4A16", "dry_run": True},
            {"model": str(tiny_llama), "output": "r", "scheme": "W8A16", "refresh": True},
        ],
    )
    r = CliRunner().invoke(main, ["batch", str(f)])
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert r.exit_code == 0 and [x["status"] for x in lines] == ["ok", "ok", "ok", "summary"], r.stdout
    assert lines[0]["output"] == str(tmp_path / "k") and lines[0]["target"] == "marlin"
    q = json.loads((tmp_path / "k" / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["target"], q["layout_version"], q["act_dtype"]) == ("ctconvert-kernel-native", "marlin", "0.29", "float16")
    assert lines[1]["dry_run"] is True and lines[1]["output_bytes"] > 0 and not (tmp_path / "d").exists()
    assert (tmp_path / "r" / "config.json").exists() and lines[2]["rewritten_shards"] == ["model.safetensors"]  # refresh creates a missing output
    assert any("no earlier output" in n for n in lines[2]["notes"]) and lines[2]["reused_shards"] == []
    assert lines[-1]["message"] == "3 ok, 0 failed, 0 skipped"
    f2 = _jobs(tmp_path, [{"model": str(tiny_llama), "output": "r", "scheme": "W8A16", "refresh": True, "ignore": ["model.layers.0.mlp.down_proj"]}])
    r = CliRunner().invoke(main, ["batch", str(f2)])
    err = json.loads(r.stdout.splitlines()[0])["error"]
    assert r.exit_code == 2 and "these differ: ignore: earlier [], now ['model.layers.0.mlp.down_proj']" in err


def test_batch_interrupt_writes_lines_for_the_stopped_and_skipped_jobs(tiny_llama, tmp_path):
    from ctconvert import api

    jobs = [{"model": str(tiny_llama), "output": str(tmp_path / n), "scheme": "W4A16"} for n in "abc"]
    calls = []

    def convert(model, out, scheme, **kw):
        calls.append(out)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return api.quantize(model, out, scheme, **kw)

    from ctconvert.commands.batch import run_jobs

    out = []
    with pytest.raises(KeyboardInterrupt):
        run_jobs(jobs, convert, emit=out.append, stop_code=lambda: 143)
    lines = [json.loads(x) for x in out]
    assert [x["status"] for x in lines] == ["ok", "interrupted", "skipped", "summary"]
    assert lines[1]["exit_code"] == 143 and lines[-1]["message"] == "1 ok, 0 failed, 1 skipped, 1 interrupted"


def test_the_readme_lists_every_job_key():
    """The README's list of job keys is the batch command's own (a new user found dense_dtype, tp, ep, sparsity missing)."""
    import re
    from pathlib import Path

    from ctconvert.commands import batch

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    para = readme[readme.index("A job's keys are") : readme.index("relative to the jobs file")]
    assert set(re.findall(r"`([a-z_]+)`", para)) - {"quantize"} == set(batch.ALLOWED)


_INTERRUPT_AT_JOB = """
import sys
from ctconvert import api, cli

jobs_file, stopped, shards = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def run_jobs(jobs, keep_going, emit, on_job, stop_code):
    for i, job in enumerate(jobs[: stopped + 1]):
        on_job(i, job)
    raise KeyboardInterrupt

api.run_jobs = run_jobs
api.partial_output = lambda out: {"bytes": 3 * 2**20, "shards": shards, "path": f"{out}.partial"}
sys.argv[1:] = ["batch", jobs_file]
cli.run()
"""


@pytest.mark.parametrize("stopped, shards", [(0, 2), (1, 0), (2, 1)])
def test_batch_interrupt_hint_says_what_works_for_batch(tmp_path, stopped, shards):
    """The interrupt hint of `batch` names the stopped job, advises the jobs file's `resume: true` key
    (batch has no --resume option) and names the finished jobs in words ("job 0", not "jobs 0-0")."""
    import subprocess
    import sys

    outs = [str(tmp_path / n) for n in "abc"]
    f = tmp_path / "jobs.json"
    f.write_text(json.dumps({"defaults": {"scheme": "W8A16"}, "jobs": [{"model": str(tmp_path / "m"), "output": o} for o in outs]}))
    p = subprocess.run([sys.executable, "-c", _INTERRUPT_AT_JOB, str(f), str(stopped), str(shards)], capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 130, p.stderr
    assert last.startswith(f"interrupted; job {stopped} ({outs[stopped]}) was stopped, nothing was written at its output path"), last
    assert "--resume" not in last and "jobs 0-0" not in last
    finished = {0: None, 1: "job 0 finished and its output is in place (drop it from", 2: "jobs 0-1 finished and their outputs are in place (drop them from"}[
        stopped
    ]
    assert (finished is None and "finished and" not in last) or (finished is not None and finished in last), last
    kept = f"partial data (3.0 MiB, {shards} finished shard{'s' if shards != 1 else ''}) is kept in {outs[stopped]}.partial: "
    if shards:
        assert last.endswith(
            kept + "set `resume: true` on this job in the jobs file and run the batch again to reuse the finished shards, or remove that folder"
        ), last
    else:
        assert last.endswith(f"partial data (3.0 MiB, no shard finished yet) is kept in {outs[stopped]}.partial: remove that folder, or run the batch again"), (
            last
        )


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("overwrite", "no", "option overwrite: expected true or false, got 'no'"),
        ("dry_run", "false", "option dry_run: expected true or false, got 'false'"),
        ("group_size", "64", "option group_size: expected an integer, got '64'"),
        ("tp", "two", "option tp: expected an integer, got 'two'"),
        ("tp", 0, "option tp: expected an integer >= 1, got 0"),
        ("allow_non_finite", 1, "option allow_nonfinite (job key allow_non_finite): expected true or false, got 1"),
    ],
)
def test_batch_refuses_a_value_of_the_wrong_type_before_any_job(tiny_llama, tmp_path, key, value, expected):
    """A string is never read as a flag or a number (``overwrite: "no"`` once replaced an output): the jobs file is refused,
    exit 2, with the error and summary lines; an existing output is left as it is."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    f = _jobs(tmp_path, [{"model": str(tiny_llama), "output": str(out), "scheme": "W4A16", key: value}])
    r = CliRunner().invoke(main, ["--json", "batch", str(f)])
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert r.exit_code == 2 and f"job 0: {expected}" in r.stderr
    assert [x["status"] for x in lines] == ["error", "summary"] and lines[1]["jobs"] == 0
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_the_api_refuses_a_value_of_the_wrong_type(tiny_llama, tmp_path):
    from ctconvert import api
    from ctconvert.errors import UsageError

    for kw, msg in ((dict(overwrite="no"), "option overwrite: expected true or false"), (dict(tp="2"), "option tp: expected an integer")):
        with pytest.raises(UsageError, match=msg):
            api.quantize(tiny_llama, tmp_path / "o", "W4A16", **kw)
    assert not (tmp_path / "o").exists()
    assert api.QuantizeOptions(max_shard_size=10_000_000, targets="Linear", symmetric=None, map_input=False).targets == ("Linear",)


def test_batch_executor_is_every_jobs_default_unless_the_job_sets_its_own(tmp_path):
    """``batch --executor ray`` (run_jobs' ``executor``/``ray_address``) reaches each job's conversion; a job's own key wins."""
    from ctconvert.commands.batch import run_jobs

    jobs = [
        {"model": "m", "output": str(tmp_path / "a"), "scheme": "W4A16"},
        {"model": "m", "output": str(tmp_path / "b"), "scheme": "W4A16", "executor": "local"},
        {"model": "m", "output": str(tmp_path / "c"), "scheme": "W4A16", "ray_address": "other:6379"},
    ]
    seen = []

    def convert(model, out, scheme, **kw):
        seen.append((kw.get("executor"), kw.get("ray_address")))
        raise UsageError("stop here")

    run_jobs(jobs, convert, keep_going=True, emit=lambda line: None, executor="ray", ray_address="head:6379")
    assert seen == [("ray", "head:6379"), ("local", "head:6379"), ("ray", "other:6379")]
    seen.clear()
    run_jobs(jobs[:1], convert, emit=lambda line: None)  # not given: the options' defaults apply (no keyword)
    assert seen == [(None, None)]


def test_a_job_the_ray_executor_ran_names_its_nodes(tmp_path):
    """A job whose result has ``nodes`` (the Ray executor ran it) carries them in its line, after the keys every line
    has; a local job's line (``nodes`` None) has exactly :data:`LINE_KEYS`, as before."""
    from ctconvert.commands.batch import run_jobs
    from ctconvert.plan.result import ConversionResult

    nodes = [{"node": "10.0.0.1", "node_id": "a" * 56, "bytes": 1000, "shards": 2}, {"node": "10.0.0.2", "node_id": "b" * 56, "bytes": 24, "shards": 1}]
    jobs = [{"model": "m", "output": str(tmp_path / o), "scheme": "W4A16"} for o in ("ray", "local")]

    def convert(model, out, scheme, **kw):
        ray = out.endswith("ray")
        shards = ["s1", "s2", "s3"] if ray else ["s1"]
        return ConversionResult(out, scheme, "fmt", False, 1024, shards=shards, nodes=[dict(n) for n in nodes] if ray else None)

    lines = []
    assert run_jobs(jobs, convert, emit=lines.append) == 0
    ray, local, summary = (json.loads(x) for x in lines)
    assert list(ray) == [*LINE_KEYS, "nodes"] and ray["nodes"] == nodes and ray["shards"] == 3 and ray["status"] == "ok"
    assert list(local) == list(LINE_KEYS) and local["shards"] == 1
    assert summary["ok"] == 2 and "nodes" not in summary
