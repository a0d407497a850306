"""The recorded vLLM 0.33 acceptance (tests/data/vllm_accept_033.json, made by scripts/vllm_accept_matrix.py with vLLM's
own loader, ../shared/tools/vllm_accept.py) covers every family x scheme the tests build, and the README's family
table says what the record says. vLLM itself is never imported here (it lives in its own venv, outside CI)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "tests" / "data" / "vllm_accept_033.json"


def _script():
    spec = importlib.util.spec_from_file_location("vllm_accept_matrix", ROOT / "scripts" / "vllm_accept_matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_record_covers_every_family_and_scheme():
    m = _script()
    record = json.loads(RECORD.read_text())
    assert record["vllm"] == "0.33.0" and all(r["vllm"] == "0.33.0" for r in record["results"])
    got = {(r["family"], r["scheme"], r["capability"]) for r in record["results"]}
    want = {(f, s, c) for f in m.FAMILIES for s in m.SCHEMES for c in m.CAPABILITIES.get(s, [90])}
    want |= {(f, r, 90) for r, (_, fams) in m.RECIPES.items() for f in fams}
    assert got == want and len(got) == len(record["results"])
    verdicts = {"ACCEPT", "REJECT", "not buildable on CPU", "convert failed"}
    assert all(r["verdict"] in verdicts and (r["first_problem"] is None) == (r["verdict"] == "ACCEPT") for r in record["results"])
    assert set(record["notes"]) == set(m.NOT_BUILDABLE)  # what was read in vLLM's model file where it cannot build on a CPU


def test_readme_table_says_what_the_record_says():
    m = _script()
    record = json.loads(RECORD.read_text())
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(m.MARK[0]), readme.index(m.MARK[1]) + len(m.MARK[1])
    assert readme[start:end] == m.readme_table(record)
    rows = {line.split("|")[1].strip(): line for line in readme[start:end].splitlines()[3:-1]}
    for r in record["results"]:  # each verdict, in words a reader finds in the row
        assert f"{r['scheme']} " in rows[r["family"]] and m._SHORT[r["verdict"]] in rows[r["family"]]
