"""How the tensor-parallel plan is reported: an uneven expert-parallel split in the dry run, the run and verify."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ctconvert import api
from ctconvert.cli import main

from conftest import moe_checkpoint

UNEVEN = "4 experts over --ep 3: the first rank holds 2, the others 1 (vLLM determine_expert_map)"


def _moe(tmp_path, experts=4, inter=128):
    return moe_checkpoint(tmp_path, experts, inter)


def test_an_uneven_expert_parallel_split_is_said_by_the_dry_run_the_run_and_verify(tmp_path):
    """issue 22: the uneven --ep split was mentioned only by verify and --json, not by the dry run's text or the run's."""
    src = _moe(tmp_path)
    r = CliRunner().invoke(main, ["quantize", str(src), "-s", "W4A16", "--dry-run", "--ep", "3"])
    assert r.exit_code == 0 and any(line.startswith("tensor parallel: ") and line.endswith(f"every tensor splits; {UNEVEN}") for line in r.stdout.splitlines())
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["quantize", str(src), "-s", "W4A16", "-o", str(out), "--ep", "3"])
    assert r.exit_code == 0 and f"at --tp 1 --ep 3: every tensor splits; {UNEVEN}" in r.output
    assert any(UNEVEN in n for n in api.quantize(src, tmp_path / "o2", "W4A16", ep=3).notes)
    doc = json.loads(CliRunner().invoke(main, ["--json", "quantize", str(src), "-s", "W4A16", "--dry-run", "--ep", "3"]).stdout)
    assert [m["warning"] for m in doc["plan"]["parallel"]["model"] if "warning" in m] == [UNEVEN]
    assert [p["message"] for p in api.verify(out, ep=3)["problems"]] == [UNEVEN]
    # an even split says nothing more, and a run without --ep no parallel note at all
    r = CliRunner().invoke(main, ["quantize", str(src), "-s", "W4A16", "--dry-run", "--ep", "2"])
    assert r.exit_code == 0 and "experts over --ep" not in r.stdout
    assert not any(n.startswith("tensor parallel") for n in api.quantize(src, tmp_path / "o3", "W4A16").notes)
