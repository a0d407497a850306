"""The hashes of an output's other files (``checkpoint/file_records.py``), recorded as the run wrote them, and verify's
comparison of each file with them (``integrity.file_hash_problems``): an edited ``generation_config.json`` or tokenizer
fails a plain ``verify``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ctconvert import api
from ctconvert.checkpoint.file_records import FILE_HASHES_KEY, FILES_CHECK, file_records, mismatch
from ctconvert.checkpoint.hashing import HASH_BLOCK_BYTES, HASH_NAME, HASH_SCHEME
from ctconvert.checkpoint.reader import INDEX_NAME
from ctconvert.checkpoint.writer import RECORDS_KEY
from ctconvert.cli import main

#: what every output holds with a record of its own (or is the record): never in this one
OWN = {INDEX_NAME, "config.json", "ctconvert-provenance.json"}


def _meta(out: Path) -> dict:
    return json.loads((out / INDEX_NAME).read_text())["metadata"]


def _write_meta(out: Path, meta: dict) -> None:
    index = json.loads((out / INDEX_NAME).read_text())
    index["metadata"] = meta
    (out / INDEX_NAME).write_text(json.dumps(index))


def _errors(out: Path) -> list[dict]:
    return [p for p in api.verify(out)["problems"] if p["severity"] == "error"]


def _block_hash(data: bytes) -> str:
    """The block hash of ``data`` computed here (hashing.py's scheme: each block's digest, then the digest of those
    digests), from the library's own functions: an independent reference for the recorded hash."""
    if HASH_NAME == "xxh3_128":
        import xxhash

        new = xxhash.xxh3_128
    else:
        new = hashlib.sha256
    outer = new()
    for start in range(0, len(data), HASH_BLOCK_BYTES):
        outer.update(new(data[start : start + HASH_BLOCK_BYTES]).digest())
    return outer.hexdigest()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A W4A16 output of a tiny Llama whose source holds a generation config, a tokenizer, a chat template in a
    subfolder, an empty file and a model card."""
    from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

    src = write_checkpoint(
        tmp_path_factory.mktemp("src") / "llama",
        llama_tensors(LLAMA_CONFIG),
        LLAMA_CONFIG,
        shards=2,
        extra_files={
            "generation_config.json": '{"bos_token_id": 1, "temperature": 0.6}',
            "tokenizer.json": json.dumps({"model": {"vocab": {f"t{i}": i for i in range(3000)}}}),
            "templates/chat_template.jinja": "{{ messages }}",
            "empty.txt": "",
            "README.md": "# tiny\n",
        },
    )
    out = tmp_path_factory.mktemp("out") / "w4a16"
    api.quantize(src, out, "W4A16")
    return out


@pytest.fixture
def out(converted, tmp_path) -> Path:
    """A fresh copy of the output for a test to damage."""
    import shutil

    return Path(shutil.copytree(converted, tmp_path / "out"))


def test_the_record_lists_every_other_file_with_its_size_and_hash(converted):
    meta = _meta(converted)
    record = meta[FILE_HASHES_KEY]
    assert record["hash"] == HASH_SCHEME and FILE_HASHES_KEY in meta[RECORDS_KEY]
    on_disk = {str(p.relative_to(converted)) for p in converted.rglob("*") if p.is_file()}
    shards = set(json.loads((converted / INDEX_NAME).read_text())["weight_map"].values())
    assert set(record["files"]) == on_disk - shards - OWN
    assert {"generation_config.json", "tokenizer.json", "templates/chat_template.jinja", "empty.txt", "README.md"} <= set(record["files"])
    for name, rec in record["files"].items():
        data = (converted / name).read_bytes()
        assert rec == {"size": len(data), HASH_NAME: _block_hash(data)}, name
    report = api.verify(converted)
    assert report["ok"] and FILES_CHECK in report["checked"]["checks"], report["problems"]


def test_file_records_hash_blocks_of_a_file_over_one_block(tmp_path):
    """A file of more than one hash block (and one exactly a block long) against the reference's hash."""
    rng = __import__("random").Random(3)
    for name, size in (("big.bin", HASH_BLOCK_BYTES + 12345), ("block.bin", HASH_BLOCK_BYTES), ("one.bin", 1)):
        (tmp_path / name).write_bytes(rng.randbytes(size))
    rec = file_records(tmp_path, ["big.bin", "block.bin", "one.bin"])
    for name in ("big.bin", "block.bin", "one.bin"):
        data = (tmp_path / name).read_bytes()
        assert rec["files"][name] == {"size": len(data), HASH_NAME: _block_hash(data)}
        assert mismatch(tmp_path / name, rec["files"][name]) is None


@pytest.mark.parametrize(
    "name, edit, says",
    [
        ("generation_config.json", lambda p: p.write_text(p.read_text().replace("0.6", "0.9")), "bytes differ from those written"),
        ("tokenizer.json", lambda p: p.write_bytes(p.read_bytes()[:-1]), "differs from the"),
        ("templates/chat_template.jinja", lambda p: p.unlink(), "missing: the run wrote it"),
        ("empty.txt", lambda p: p.write_text("x"), "size 1 bytes differs from the 0 written"),
        ("README.md", lambda p: p.write_text(p.read_text() + "\n"), "differs from the"),
    ],
)
def test_an_edited_or_removed_file_fails_a_plain_verify(out, name, edit, says):
    edit(out / name)
    errors = _errors(out)
    (e,) = [p for p in errors if p["file"] == str(out / name)]
    assert says in e["message"] and "changed after the run" in e["message"]
    from click.testing import CliRunner

    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 5


def test_a_file_with_the_same_size_and_other_bytes_fails(out):
    path = out / "generation_config.json"
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    assert [p["file"] for p in _errors(out)] == [str(path)]


def test_an_edited_record_fails(out):
    meta = _meta(out)
    files = meta[FILE_HASHES_KEY]["files"]
    files["../outside.json"] = {"size": 1, HASH_NAME: "0" * 32}
    files["tokenizer.json"] = "not a record"
    _write_meta(out, meta)
    messages = [p["message"] for p in _errors(out)]
    assert any("names ../outside.json, outside the folder" in m for m in messages), messages
    assert any(m.startswith(f"tokenizer.json: its record in the index is not a size and a {HASH_NAME} hash") for m in messages), messages


@pytest.mark.parametrize(
    "edit",
    ["upper-case hash", "no hash", "size a string", "negative size"],
)
def test_a_malformed_entry_is_called_an_edited_record_not_an_edited_file(out, edit):
    meta = _meta(out)
    rec = meta[FILE_HASHES_KEY]["files"]["README.md"]
    if edit == "upper-case hash":
        rec[HASH_NAME] = rec[HASH_NAME].upper()
    elif edit == "no hash":
        del rec[HASH_NAME]
    elif edit == "size a string":
        rec["size"] = str(rec["size"])
    else:
        rec["size"] = -1
    _write_meta(out, meta)
    (e,) = _errors(out)
    assert e["message"].startswith("README.md: its record in the index is not a size and a") and "the record was edited" in e["message"]


@pytest.mark.parametrize("edit", ["entry deleted", "files emptied", "entry renamed, a copy added"])
def test_a_record_that_lacks_a_file_the_run_wrote_fails(out, edit):
    """The index lists every file the run wrote (``ctconvert_files``): an entry taken out of the record (to hide an
    edit of its file) is an error naming the index, and the edited file is not vouched for."""
    meta = _meta(out)
    files = meta[FILE_HASHES_KEY]["files"]
    if edit == "entry deleted":
        del files["generation_config.json"]
    elif edit == "files emptied":
        files.clear()
    else:
        files["copy_generation_config.json"] = files.pop("generation_config.json")
        (out / "copy_generation_config.json").write_bytes((out / "generation_config.json").read_bytes())
    _write_meta(out, meta)
    (out / "generation_config.json").write_text('{"temperature": 9.0}')
    errors = _errors(out)
    (e,) = [p for p in errors if "record lacks files the run wrote" in p["message"]]
    assert "generation_config.json" in e["message"] and e["file"] == str(out / INDEX_NAME)


def test_the_record_and_its_listing_removed_fail_beside_a_provenance_that_promises_it(out):
    from ctconvert.checkpoint.provenance import FILE_HASHES_SINCE_FORMAT, PROVENANCE_FORMAT

    assert json.loads((out / "ctconvert-provenance.json").read_text())["provenance_format"] == PROVENANCE_FORMAT >= FILE_HASHES_SINCE_FORMAT
    meta = _meta(out)
    meta.pop(FILE_HASHES_KEY)
    meta[RECORDS_KEY].remove(FILE_HASHES_KEY)
    _write_meta(out, meta)
    (out / "generation_config.json").write_text("{}")
    assert any(FILE_HASHES_KEY in p["message"] and "removed" in p["message"] for p in _errors(out))


def test_files_added_afterwards_are_named_in_a_warning_not_judged(out):
    """One warning names them; a name holding a line break stays on one line in the CLI's report."""
    (out / "hf_quant_config.json").write_text("{}")
    (out / "extra").mkdir()
    (out / "extra" / "new\nline.txt").write_text("x")
    report = api.verify(out)
    assert report["ok"], report["problems"]
    (w,) = [p for p in report["problems"] if p["severity"] == "warning" and "files the run did not write" in p["message"]]
    assert "hf_quant_config.json" in w["message"] and "extra/new\nline.txt" in w["message"]
    from click.testing import CliRunner

    r = CliRunner().invoke(main, ["verify", str(out)])
    (line,) = [x for x in r.output.splitlines() if "files the run did not write" in x]
    assert line.endswith("extra/new\\nline.txt, hf_quant_config.json") and r.exit_code == 0, r.output


def test_an_index_of_an_earlier_release_without_the_record_is_not_judged(out):
    """No record, no list of records naming it, and a provenance of the format before it (the nineteenth session's
    release): nothing is compared, and the check is not claimed."""
    from ctconvert.checkpoint.file_records import INDEX_DIGEST_KEY

    meta = _meta(out)
    meta.pop(FILE_HASHES_KEY), meta.pop(INDEX_DIGEST_KEY)  # (that release wrote no digest of its index either)
    meta[RECORDS_KEY] = [k for k in meta[RECORDS_KEY] if k not in (FILE_HASHES_KEY, INDEX_DIGEST_KEY)]
    prov = json.loads((out / "ctconvert-provenance.json").read_text())
    (out / "ctconvert-provenance.json").write_text(json.dumps(dict(prov, provenance_format=3), indent=2))
    from ctconvert.checkpoint.writer import PROVENANCE_KEY, config_digest

    meta[PROVENANCE_KEY] = config_digest(dict(prov, provenance_format=3))
    _write_meta(out, meta)
    (out / "generation_config.json").write_text("{}")
    report = api.verify(out)
    assert not [p for p in report["problems"] if p["severity"] == "error" and "generation_config" in p["file"]]
    assert FILES_CHECK not in report["checked"]["checks"]


def test_a_decompress_output_records_its_files(converted, tmp_path):
    """Every writer of an output records its other files: decompress's copy is judged as quantize's is (a dense
    output is verified against its source)."""
    dense = tmp_path / "dense"
    api.decompress(converted, dense)
    assert set(_meta(dense)[FILE_HASHES_KEY]["files"]) >= {"generation_config.json", "tokenizer.json"}
    assert api.verify(dense, reference=converted)["ok"]
    (dense / "tokenizer.json").write_text("{}")
    errors = [p for p in api.verify(dense, reference=converted)["problems"] if p["severity"] == "error"]
    assert {p["file"] for p in errors} == {str(dense / "tokenizer.json")}
    assert any(p["message"].startswith("size 2 bytes differs") and p["file"] == str(dense / "tokenizer.json") for p in errors)


def test_a_subfolder_safetensors_is_copied_and_links_it_cannot_follow_are_named(tmp_path):
    """A sentence-transformers module's ``2_Dense/model.safetensors`` is the model's, not a shard: it is copied,
    recorded and judged (a trial's was dropped without a word, and verify --reference passed); symlinks to a folder
    or to nothing are named in a note."""
    import os

    from safetensors.torch import save_file

    from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

    src = write_checkpoint(tmp_path / "st", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG, extra_files={"2_Dense/config.json": "{}"})
    import torch

    save_file({"linear.weight": torch.randn(8, 16, generator=torch.Generator().manual_seed(0))}, src / "2_Dense" / "model.safetensors")
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", src / "linkdir")
    os.symlink(tmp_path / "nothing", src / "dangling")
    out = tmp_path / "out"
    notes = api.quantize(src, out, "W4A16").notes
    assert (out / "2_Dense" / "model.safetensors").read_bytes() == (src / "2_Dense" / "model.safetensors").read_bytes()
    assert "2_Dense/model.safetensors" in _meta(out)[FILE_HASHES_KEY]["files"]
    assert "not copied, symlinks to a folder or to nothing: dangling, linkdir" in notes, notes
    assert api.verify(out, reference=src)["ok"]
    (out / "2_Dense" / "model.safetensors").unlink()
    assert str(out / "2_Dense" / "model.safetensors") in {p["file"] for p in _errors(out)}
    errors = [p for p in api.verify(out, reference=src)["problems"] if p["severity"] == "error"]
    assert any("2_Dense/model.safetensors of the reference is missing from the output" in p["message"] for p in errors), errors


def test_a_file_or_shard_replaced_by_a_link_to_the_same_bytes_is_named_in_a_warning(out, tmp_path):
    import shutil

    shard = sorted(p for p in out.iterdir() if p.suffix == ".safetensors")[0]
    for victim in (out / "tokenizer.json", shard, out / "config.json", out / INDEX_NAME):
        copy = tmp_path / f"elsewhere-{victim.name}"
        shutil.copyfile(victim, copy)
        victim.unlink()
        victim.symlink_to(copy)
    report = api.verify(out)
    assert report["ok"], report["problems"]  # the same bytes: not an error
    (w,) = [p for p in report["problems"] if "symlinks where ctconvert wrote files" in p["message"]]
    assert f"({', '.join(sorted(['config.json', INDEX_NAME, shard.name, 'tokenizer.json']))})" in w["message"]


def test_a_recorded_file_turned_into_a_folder_link_and_added_links_are_named(out, tmp_path):
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to(tmp_path)
    (out / "added-link.json").symlink_to(tmp_path / "nothing")
    report = api.verify(out)
    (e,) = [p for p in report["problems"] if p["severity"] == "error"]
    assert e["file"] == str(out / "tokenizer.json") and e["message"].startswith("a folder (or a link to one) where the run wrote a file")
    assert any("files the run did not write" in p["message"] and "added-link.json" in p["message"] for p in report["problems"])


def test_a_note_or_error_naming_a_file_with_a_line_break_stays_one_line(tmp_path):
    """Every line the CLI prints (notes, errors) writes a control character of a name as its escape."""
    import os

    from click.testing import CliRunner

    from ctconvert.errors import one_line

    from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

    assert one_line("a\nb\tc\x00d") == "a\\nb\\tc\\x00d" and one_line("plain ü") == "plain ü"
    src = write_checkpoint(tmp_path / "nl", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    os.symlink(tmp_path / "nothing", src / "dang\nling")
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "out"), "-s", "W4A16"])
    assert r.exit_code == 0, r.output
    (line,) = [x for x in r.output.splitlines() if "symlinks to a folder or to nothing" in x]
    assert line.endswith("dang\\nling")
    (tmp_path / "out" / "x\ny.json").write_text("{}")
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "out")])
    assert [x for x in r.output.splitlines() if "files the run did not write" in x][0].endswith("x\\ny.json")
