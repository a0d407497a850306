"""ctconvert batch: one JSON line per job, non-zero exit when one fails, --keep-going."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ctconvert.cli import main


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
    assert [x["status"] for x in lines] == ["ok", "error", "skipped"]
    assert lines[0]["output_bytes"] > 0 and lines[0]["shards"] > 1 and "seconds" in lines[0]
    assert "not a checkpoint folder" in lines[1]["error"] and lines[1]["exit_code"] == 3
    r = CliRunner().invoke(main, ["batch", str(jobs), "--keep-going"])
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    assert r.exit_code == 6 and [x["status"] for x in lines] == ["error", "error", "ok"]  # "a" exists now: exit code of the first failure
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
    line = json.loads(r.stdout)
    assert r.exit_code == 0 and line["scheme"] == "W8A8" and (d / "out-a" / "config.json").exists()
