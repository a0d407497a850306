"""The index's digest of itself (``file_records.INDEX_DIGEST_KEY``): the records in the index guard the shards, the
config and the other files, and the digest guards the records. A new user's trial deleted a tokenizer file and removed
its entries from both ``ctconvert_files`` and ``ctconvert_file_hashes``: a plain verify passed, of quantized and dense
outputs alike."""

from __future__ import annotations

import hashlib
import json

import pytest
from click.testing import CliRunner

from ctconvert import api
from ctconvert.checkpoint.file_records import FILE_HASHES_KEY, INDEX_DIGEST_KEY
from ctconvert.checkpoint.integrity import INDEX_CHECK
from ctconvert.checkpoint.reader import INDEX_NAME
from ctconvert.checkpoint.writer import FILES_KEY, PROVENANCE_KEY, RECORDS_KEY, config_digest
from ctconvert.cli import main

EDITED = "its ctconvert_index_digest no longer matches it"


@pytest.fixture(params=["quantized", "dense"])
def out(request, tiny_llama, tmp_path):
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "W4A16")
    if request.param == "quantized":
        return q
    api.decompress(q, tmp_path / "d")
    return tmp_path / "d"


def _index(folder) -> dict:
    return json.loads((folder / INDEX_NAME).read_text())


def _errors(folder) -> list[dict]:
    return [p for p in api.verify(folder)["problems"] if p["severity"] == "error"]


def _verify(folder) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["verify", str(folder)])
    return r.exit_code, r.output


def _reference_digest(index: dict) -> str:
    """Independently of the writer: sha256 of the index as JSON with sorted keys and no spaces, the digest left out."""
    doc = json.loads(json.dumps(index))
    del doc["metadata"][INDEX_DIGEST_KEY]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")).hexdigest()


def test_every_output_holds_the_digest_of_its_whole_index(out):
    index = _index(out)
    meta = index["metadata"]
    assert meta[INDEX_DIGEST_KEY] == _reference_digest(index) and len(meta[INDEX_DIGEST_KEY]) == 64
    assert meta[RECORDS_KEY][-1] == INDEX_DIGEST_KEY
    rep = api.verify(out)
    assert rep["ok"], rep["problems"]
    assert INDEX_CHECK in rep["checked"]["checks"]


def test_a_reformatted_index_still_matches(out):
    """Indentation and key order do not count: another JSON writer's copy of the same index passes."""
    index = _index(out)
    (out / INDEX_NAME).write_text(json.dumps(dict(reversed(list(index.items()))), indent=4))
    assert api.verify(out)["ok"]


@pytest.mark.parametrize("edit", ["deleted", "edited"])
def test_a_file_removed_from_both_records_fails(out, edit):
    """The trial's two coordinated edits: the entries gone from ctconvert_files and ctconvert_file_hashes, then the
    file deleted or changed. The index no longer matches its digest: exit 5, the index named."""
    index = _index(out)
    name = "generation_config.json"
    assert name in index["metadata"][FILES_KEY] and name in index["metadata"][FILE_HASHES_KEY]["files"]
    index["metadata"][FILES_KEY].remove(name)
    del index["metadata"][FILE_HASHES_KEY]["files"][name]
    (out / INDEX_NAME).write_text(json.dumps(index))
    if edit == "deleted":
        (out / name).unlink()
    else:
        (out / name).write_text('{"temperature": 9.0}')
    (e,) = [p for p in _errors(out) if p["file"] == str(out / INDEX_NAME)]
    assert EDITED in e["message"] and "cannot be trusted" in e["message"]
    code, text = _verify(out)
    assert code == 5 and EDITED in text


@pytest.mark.parametrize("edit", ["total_size", "weight_map", "added key"])
def test_any_other_edit_of_the_index_fails_once(out, edit):
    """Every edit shows; where another check already names the index (total_size; the reader's, of a weight_map entry
    naming a tensor the shard does not hold), the digest adds no second error."""
    index = _index(out)
    if edit == "total_size":
        index["metadata"]["total_size"] += 4
    elif edit == "weight_map":
        index["weight_map"]["model.norm.bias"] = next(iter(index["weight_map"].values()))
    else:
        index["metadata"]["note"] = "hand-made"
    (out / INDEX_NAME).write_text(json.dumps(index))
    named = [p for p in _errors(out) if p["file"] == str(out / INDEX_NAME)]
    assert len(named) == 1
    said = {"total_size": "the index's total_size is", "weight_map": "index lists this tensor in", "added key": EDITED}
    assert said[edit] in named[0]["message"], named


def test_the_list_of_records_removed_from_a_dense_output_is_an_edit_not_another_tools_folder(tiny_llama, tmp_path):
    """Before, removing only ctconvert_records made a decompress output ask for --reference (exit 3), though every
    record was still there. The digest shows the edit: exit 5, one error, no record called missing."""
    q, d = tmp_path / "q", tmp_path / "d"
    api.quantize(tiny_llama, q, "W4A16")
    api.decompress(q, d)
    index = _index(d)
    del index["metadata"][RECORDS_KEY]
    (d / INDEX_NAME).write_text(json.dumps(index))
    (e,) = _errors(d)
    assert e["file"] == str(d / INDEX_NAME) and EDITED in e["message"]
    assert _verify(d)[0] == 5


def test_the_list_of_records_removed_from_a_quantized_output_is_named_as_such(tiny_llama, tmp_path):
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "W4A16")
    index = _index(q)
    del index["metadata"][RECORDS_KEY]
    (q / INDEX_NAME).write_text(json.dumps(index))
    (e,) = _errors(q)
    assert e["file"] == str(q / INDEX_NAME) and e["message"].startswith(f"the index's list of its records ({RECORDS_KEY}) was removed after the run")


@pytest.mark.parametrize("value", ["removed", None, 7])
def test_the_digest_removed_or_emptied_fails(out, value):
    index = _index(out)
    if value == "removed":
        del index["metadata"][INDEX_DIGEST_KEY]
    else:
        index["metadata"][INDEX_DIGEST_KEY] = value
    (out / INDEX_NAME).write_text(json.dumps(index))
    (e,) = _errors(out)
    assert e["file"] == str(out / INDEX_NAME) and f"{INDEX_DIGEST_KEY}" in e["message"] and "removed or emptied" in e["message"]


def test_the_digest_and_its_listing_removed_fail_beside_a_provenance_that_promises_it(tiny_llama, tmp_path):
    """A quantized output's provenance is of format 5, written only beside an index with its digest."""
    from ctconvert.checkpoint.provenance import INDEX_DIGEST_SINCE_FORMAT

    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "W4A16")
    assert json.loads((q / "ctconvert-provenance.json").read_text())["provenance_format"] >= INDEX_DIGEST_SINCE_FORMAT
    index = _index(q)
    del index["metadata"][INDEX_DIGEST_KEY]
    index["metadata"][RECORDS_KEY].remove(INDEX_DIGEST_KEY)
    index["metadata"][FILES_KEY].remove("generation_config.json")
    del index["metadata"][FILE_HASHES_KEY]["files"]["generation_config.json"]
    (q / INDEX_NAME).write_text(json.dumps(index))
    (q / "generation_config.json").unlink()
    (e,) = _errors(q)
    assert e["file"] == str(q / INDEX_NAME) and INDEX_DIGEST_KEY in e["message"] and "removed or emptied" in e["message"]


def test_an_output_of_the_release_before_the_digest_is_judged_as_before(tiny_llama, tmp_path):
    """No digest, no listing of it, a provenance of format 4 (its record made anew): nothing to compare, the check not
    claimed, and the output passes; its other records are still compared."""
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "W4A16")
    index = _index(q)
    meta = index["metadata"]
    del meta[INDEX_DIGEST_KEY]
    meta[RECORDS_KEY].remove(INDEX_DIGEST_KEY)
    prov = dict(json.loads((q / "ctconvert-provenance.json").read_text()), provenance_format=4)
    (q / "ctconvert-provenance.json").write_text(json.dumps(prov))
    meta[PROVENANCE_KEY] = config_digest(prov)
    (q / INDEX_NAME).write_text(json.dumps(index))
    rep = api.verify(q)
    assert rep["ok"], rep["problems"]
    assert INDEX_CHECK not in rep["checked"]["checks"]
    (q / "generation_config.json").write_text("{}")
    assert any(p["file"] == str(q / "generation_config.json") for p in _errors(q))


def _strip_every_record(folder, keep_marker: bool) -> None:
    """Every ctconvert key removed from the index (the marker kept or not), as a new user's trial did."""
    index = _index(folder)
    index["metadata"] = {k: v for k, v in index["metadata"].items() if not k.startswith("ctconvert_") and (keep_marker or k != "ctconvert")}
    (folder / INDEX_NAME).write_text(json.dumps(index))


@pytest.mark.parametrize("keep_marker", [True, False])
def test_records_stripped_and_the_provenance_format_set_back_fail_where_the_release_writes_them(tiny_llama, tmp_path, keep_marker):
    """The trial's downgrade: every record removed, the provenance's format set back to 2 (release 0.1.0's), and a
    weight's bit flipped: it passed as an earlier release's output. The marker (or, without it, the provenance) names
    the release that wrote it, which always writes the records: exit 5. An output naming 0.1.0 is judged as before."""
    from ctconvert import __version__
    from ctconvert.checkpoint.integrity import RECORDS_SINCE_RELEASE

    assert tuple(map(int, __version__.split(".")[:2])) >= RECORDS_SINCE_RELEASE
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "W4A16")
    _strip_every_record(q, keep_marker)
    prov = json.loads((q / "ctconvert-provenance.json").read_text())
    (q / "ctconvert-provenance.json").write_text(json.dumps(dict(prov, provenance_format=2)))
    (q / "generation_config.json").write_text('{"temperature": 9.0}')
    (e,) = _errors(q)
    assert e["file"] == str(q / INDEX_NAME) and f"though ctconvert {__version__} wrote this output" in e["message"]
    assert _verify(q)[0] == 5
    (q / "ctconvert-provenance.json").write_text(json.dumps(dict(prov, provenance_format=2, ctconvert="0.1.0")))
    index = _index(q)
    if keep_marker:
        index["metadata"]["ctconvert"] = "0.1.0"
    (q / INDEX_NAME).write_text(json.dumps(index))
    assert api.verify(q)["ok"]  # (an output of release 0.1.0: its shards and files were never recorded)


def test_a_dense_output_stripped_of_every_record_is_judged_not_sent_for_a_reference(tiny_llama, tmp_path):
    q, d = tmp_path / "q", tmp_path / "d"
    api.quantize(tiny_llama, q, "W4A16")
    api.decompress(q, d)
    _strip_every_record(d, keep_marker=True)
    (e,) = _errors(d)
    assert "though ctconvert" in e["message"] and _verify(d)[0] == 5


def test_every_trace_but_the_model_card_removed_is_named_in_a_warning(tiny_llama, tmp_path):
    """Marker, records and provenance all removed: nothing ctconvert reads says it wrote the folder, so it is judged as
    another tool's (another tool may copy a ctconvert output's card: not an error), but the card's conversion section
    still names the release, and a warning says what was not compared (the second trial's passing case was silent)."""
    import shutil

    src, q = tmp_path / "src", tmp_path / "q"
    shutil.copytree(tiny_llama, src)
    (src / "README.md").write_text("# a model card\n")
    api.quantize(src, q, "W4A16")
    _strip_every_record(q, keep_marker=False)
    (q / "ctconvert-provenance.json").unlink()
    rep = api.verify(q)
    (w,) = [p for p in rep["problems"] if p["severity"] == "warning" and "README.md says ctconvert" in p["message"]]
    assert "no ctconvert marker or record" in w["message"] and "--reference SRC" in w["message"]
    (q / "README.md").write_text("# another tool's card\n")
    assert not [p for p in api.verify(q)["problems"] if "README.md says" in p["message"]]
