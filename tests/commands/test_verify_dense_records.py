"""A plain ``verify`` of a dense ``decompress`` output: judged by the records its index holds (shard, file and config
hashes) and NaN/inf, with its values left to ``--reference``; a dense folder without ctconvert's records still asks for one."""

from __future__ import annotations

import json
import struct

import pytest
from click.testing import CliRunner

from ctconvert import api
from ctconvert.checkpoint.integrity import SHARDS_CHECK
from ctconvert.cli import main
from ctconvert.commands.verify import VALUES_UNCOMPARED


@pytest.fixture
def dense(tiny_llama, tmp_path):
    q, d = tmp_path / "q", tmp_path / "d"
    api.quantize(tiny_llama, q, "W4A16")
    api.decompress(q, d)
    return d


def _poke(folder, tensor: str, value: bytes, at: int = 0) -> None:
    """Write ``value`` over the bytes of ``tensor`` from element byte ``at``, in place (the header unchanged)."""
    f = folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    start = 8 + n + json.loads(data[8 : 8 + n])[tensor]["data_offsets"][0] + at
    data[start : start + len(value)] = value
    f.write_bytes(bytes(data))


def _run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def test_plain_verify_of_a_decompress_output_passes_on_its_records(dense):
    rep = api.verify(dense)
    assert rep["ok"] and rep["problems"] == [] and rep["summary"] is None and rep["tensors"] == []
    assert SHARDS_CHECK in rep["checked"]["checks"] and "NaN/inf" in rep["checked"]["checks"]
    assert rep["checked"]["not_checked"] == [VALUES_UNCOMPARED] and rep["checked"]["tensors"] > 0
    code, out, _ = _run("verify", dense)
    assert code == 0 and f"not compared: {VALUES_UNCOMPARED} (`ctconvert verify DENSE --reference SRC`" in out and "verify: passed" in out
    assert "kernel-native" not in out


def test_a_flipped_bit_in_a_decompress_output_fails_a_plain_verify(dense):
    _poke(dense, "model.layers.0.mlp.down_proj.weight", bytes([0x01]), at=7)
    code, out, _ = _run("verify", dense)
    assert code == 5 and f"error: {dense / 'model.safetensors'}: bytes differ from those written (content hash)" in out and "verify: FAILED" in out


def test_nan_written_into_a_decompress_output_is_named_with_the_edit(dense):
    _poke(dense, "model.norm.weight", bytes([0xC0, 0x7F]))  # bf16 NaN in the first element
    rep = api.verify(dense)
    said = {(p["severity"], p.get("tensor"), p["message"].split(":")[0]) for p in rep["problems"]}
    assert not rep["ok"] and ("error", "model.norm.weight", "1 NaN/inf values") in said
    assert any("bytes differ from those written" in p["message"] for p in rep["problems"])


def test_an_edited_config_of_a_decompress_output_fails_a_plain_verify(dense):
    cfg = json.loads((dense / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5
    (dense / "config.json").write_text(json.dumps(cfg))
    rep = api.verify(dense)
    assert not rep["ok"] and any(p.get("file") == str(dense / "config.json") and p["severity"] == "error" for p in rep["problems"])


def test_a_quantized_output_whose_quantization_config_was_removed_is_called_edited(tiny_llama, tmp_path):
    """Before, this was "not a quantized checkpoint" (exit 3): its records say the config was edited (exit 5)."""
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "FP8_DYNAMIC")
    cfg = json.loads((q / "config.json").read_text())
    del cfg["quantization_config"]
    (q / "config.json").write_text(json.dumps(cfg))
    code, out, _ = _run("verify", q)
    assert code == 5 and f"error: {q / 'config.json'}: the quantization_config was removed" in out


def test_a_dense_folder_without_ctconvert_records_still_asks_for_a_reference(dense):
    index = dense / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"] = {"total_size": doc["metadata"]["total_size"]}  # another tool's index: nothing to compare with
    index.write_text(json.dumps(doc))
    code, _, err = _run("verify", dense)
    assert code == 3 and "give --reference SRC" in err


def _drop_records(folder, *keys) -> None:
    """Remove ``keys`` from the index's metadata and from its list of records, as a hand edit would."""
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    meta = doc["metadata"]
    for k in keys:
        meta.pop(k, None)
    if "ctconvert_records" in meta:
        meta["ctconvert_records"] = [r for r in meta["ctconvert_records"] if r not in keys]
    index.write_text(json.dumps(doc))


def test_a_quantized_output_stripped_of_its_config_and_its_records_is_not_taken_for_a_dense_one(tiny_llama, tmp_path):
    """A trial removed the quantization_config and the two config records (no hash to compute): it passed as a dense
    output. Its quantized modules say what it is."""
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "W4A16")
    cfg = json.loads((q / "config.json").read_text())
    del cfg["quantization_config"]
    (q / "config.json").write_text(json.dumps(cfg))
    _drop_records(q, "ctconvert_quantization_config", "ctconvert_config")
    rep = api.verify(q)
    said = [p["message"] for p in rep["problems"] if p["severity"] == "error"]
    assert not rep["ok"]
    assert any(m.startswith("config.json has no quantization_config, but ") and "modules are stored quantized" in m for m in said), said
    assert not any("every dense output holds" in m for m in said), said  # (not called a dense output)
    (q / "ctconvert-provenance.json").unlink()  # and the provenance, its record and the list of records too
    _drop_records(q, "ctconvert_provenance", "ctconvert_records")
    code, out, _ = _run("verify", q)
    assert code == 5 and "modules are stored quantized (e.g. model.layers.0." in out and "): removed after the run?" in out, out


@pytest.mark.parametrize("key", ["ctconvert_config", "ctconvert_file_hashes", "ctconvert_shards"])
def test_a_record_removed_from_a_dense_output_with_its_listing_is_an_error(dense, key):
    """Every dense output lists its shard, config and file records: one removed with its listing would leave what it
    guards unjudged (a trial then edited config.json and passed)."""
    _drop_records(dense, key)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5
    (dense / "config.json").write_text(json.dumps(cfg))
    rep = api.verify(dense)
    errors = [p for p in rep["problems"] if p["severity"] == "error"]
    assert not rep["ok"] and any(f"ctconvert_records lacks {key}, which every dense output holds" in p["message"] for p in errors), errors


def test_a_dense_output_missing_a_whole_shard_fails_on_what_the_architecture_builds(tiny_llama, tmp_path):
    """The last shard removed with its index entries, records and bytes of total_size: the records agree with what is
    left, but the final norm the model builds is gone."""
    q, d = tmp_path / "q", tmp_path / "d"
    api.quantize(tiny_llama, q, "W4A16")
    api.decompress(q, d, max_shard_size="200KB")
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    last = doc["weight_map"]["model.norm.weight"]
    gone = [n for n, f in doc["weight_map"].items() if f == last]
    header = json.loads((d / last).read_bytes()[8 : 8 + struct.unpack("<Q", (d / last).read_bytes()[:8])[0]])
    doc["metadata"]["total_size"] -= sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    doc["weight_map"] = {n: f for n, f in doc["weight_map"].items() if n not in gone}
    for key in ("ctconvert_shards", "ctconvert_files"):
        rec = doc["metadata"][key]
        if isinstance(rec, dict):
            rec["files"].pop(last)
        else:
            doc["metadata"][key] = [f for f in rec if f != last]
    index.write_text(json.dumps(doc))
    (d / last).unlink()
    rep = api.verify(d)
    assert not rep["ok"] and any(p.get("tensor") == "model.norm.weight" and "missing" in p["message"] for p in rep["problems"]), rep["problems"]


def test_a_malformed_shard_record_is_called_edited_once(dense):
    index = dense / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"]["ctconvert_shards"]["files"] = "oops"
    index.write_text(json.dumps(doc))
    errors = [p for p in api.verify(dense)["problems"] if p["severity"] == "error"]
    assert [p["message"] for p in errors] == ["the index's ctconvert_shards record is malformed (its files are not a table): the record was edited"]
    assert errors[0]["file"] == str(index)


def test_a_quantized_config_copied_into_a_dense_output_is_named_as_not_the_one_written(tiny_llama, tmp_path):
    q, d = tmp_path / "q", tmp_path / "d"
    api.quantize(tiny_llama, q, "W4A16")
    api.decompress(q, d)
    (d / "config.json").write_bytes((q / "config.json").read_bytes())
    said = [p["message"] for p in api.verify(d)["problems"] if p["severity"] == "error" and p.get("file") == str(d / "config.json")]
    assert any(m.startswith("config.json is not the one ctconvert wrote (the index records its hash)") for m in said), said
