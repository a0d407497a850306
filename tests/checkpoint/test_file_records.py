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
    (e,) = [p for p in errors if p["file"] == str(out / name) and p["message"].startswith(f"{name}: ")]
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
    assert any("'../outside.json', outside the folder" in m for m in messages), messages
    assert any(m.startswith("tokenizer.json: its record in the index is not a size and a hash") for m in messages), messages


def test_a_removed_or_other_scheme_record_fails_where_the_index_lists_it(out):
    meta = _meta(out)
    record = meta.pop(FILE_HASHES_KEY)
    _write_meta(out, meta)
    assert any(FILE_HASHES_KEY in p["message"] and "removed" in p["message"] for p in _errors(out))
    meta[FILE_HASHES_KEY] = dict(record, hash="md5/blocks-1")
    _write_meta(out, meta)
    assert any("not compared" in p["message"] and "'md5/blocks-1'" in p["message"] for p in _errors(out))


def test_an_index_of_an_earlier_release_without_the_record_is_not_judged(out):
    """No record and no list of records naming it: nothing is compared, and the check is not claimed."""
    meta = _meta(out)
    meta.pop(FILE_HASHES_KEY)
    meta[RECORDS_KEY] = [k for k in meta[RECORDS_KEY] if k != FILE_HASHES_KEY]
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
    assert any(p["message"].startswith("tokenizer.json: size 2 bytes differs") for p in errors)
