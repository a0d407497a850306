"""Shard hashes in the index (checkpoint/integrity.py, writer.SHARDS_KEY): every output records each shard's size and
content hash as written, and verify fails on a shard whose bytes changed afterwards, naming it, with or without a
reference (a changed byte of a packed code or scale that the error statistics cannot see)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

from ctconvert import api
from ctconvert.checkpoint.hashing import HASH_NAME, HASH_SCHEME, shard_hash
from ctconvert.checkpoint.integrity import SHARDS_CHECK
from ctconvert.checkpoint.reader import INDEX_NAME
from ctconvert.checkpoint.writer import SHARDS_KEY


def _index(out: Path) -> dict:
    return json.loads((out / INDEX_NAME).read_text())


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _flip(path: Path, tensor: str, rng: random.Random, mask: int) -> None:
    """XOR one byte of ``tensor``'s data (a random position inside it) with ``mask``."""
    start, header = _header(path)
    a, b = header[tensor]["data_offsets"]
    pos = start + rng.randrange(a, b)
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ mask]))


def _errors(report: dict) -> list[dict]:
    return [p for p in report["problems"] if p["severity"] == "error"]


def _as_earlier_release(out: Path, index: dict) -> None:
    """Make ``out`` look written by release 0.1.0: no list of records (nor the provenance's record) in ``index``,
    written back, and a provenance of format 2 (the format before the one that promises the records)."""
    from ctconvert.checkpoint.file_records import INDEX_DIGEST_KEY
    from ctconvert.checkpoint.writer import PROVENANCE_KEY, RECORDS_KEY

    index["metadata"].pop(RECORDS_KEY, None)
    index["metadata"].pop(PROVENANCE_KEY, None)
    index["metadata"].pop(INDEX_DIGEST_KEY, None)
    if "ctconvert" in index["metadata"]:
        index["metadata"]["ctconvert"] = "0.1.0"  # its marker and its provenance name that release
    (out / INDEX_NAME).write_text(json.dumps(index))
    prov = json.loads((out / "ctconvert-provenance.json").read_text())
    (out / "ctconvert-provenance.json").write_text(json.dumps(dict(prov, provenance_format=2, ctconvert="0.1.0")))


def _as_release_before_the_digest(out: Path, index: dict) -> None:
    """Make ``out`` look written by the release before the index's digest of itself: ``index`` without the digest or its
    listing, written back, and the provenance of format 4 (the one before), its record in the index made anew."""
    from ctconvert.checkpoint.file_records import INDEX_DIGEST_KEY
    from ctconvert.checkpoint.writer import PROVENANCE_KEY, RECORDS_KEY, config_digest

    meta = index["metadata"]
    meta.pop(INDEX_DIGEST_KEY, None)
    meta[RECORDS_KEY] = [k for k in meta[RECORDS_KEY] if k != INDEX_DIGEST_KEY]
    prov = dict(json.loads((out / "ctconvert-provenance.json").read_text()), provenance_format=4)
    (out / "ctconvert-provenance.json").write_text(json.dumps(prov))
    meta[PROVENANCE_KEY] = config_digest(prov)
    (out / INDEX_NAME).write_text(json.dumps(index))


def test_every_output_records_each_shard_as_written(tiny_llama, tmp_path):
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16", max_shard_size="200KB")
    record = _index(out)["metadata"][SHARDS_KEY]
    shards = sorted(set(_index(out)["weight_map"].values()))
    assert len(shards) > 1 and record["hash"] == HASH_SCHEME and sorted(record["files"]) == shards
    for name in shards:  # each hash equals one taken from the file now, independently of the writer's
        assert record["files"][name] == {"size": (out / name).stat().st_size, HASH_NAME: shard_hash(out / name)}
    report = api.verify(out)
    assert report["ok"] and report["checked"]["checks"][0] == "shard bytes against the hashes recorded as they were written"


@pytest.mark.parametrize(
    ("scheme", "part"),
    [
        ("W4A16", "weight_packed"),
        ("W4A16", "weight_scale"),
        ("W4A16", "input_layernorm.weight"),  # a copied dense tensor
        ("NVFP4A16", "weight_packed"),
        ("NVFP4A16", "weight_scale"),
        ("NVFP4A16", "weight_global_scale"),
        ("FP8_DYNAMIC", "weight"),
        ("FP8_DYNAMIC", "weight_scale"),
    ],
)
def test_one_changed_bit_of_an_output_tensor_fails_verify_naming_its_shard(tiny_llama, tmp_path, scheme, part):
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, scheme, max_shard_size="200KB")
    wmap = _index(out)["weight_map"]
    names = sorted(n for n in wmap if n.endswith("." + part) and "layers." in n)
    assert names
    rng = random.Random(f"{scheme}-{part}")
    victim = rng.choice(names)
    _flip(out / wmap[victim], victim, rng, mask=1 << rng.randrange(8))  # one bit: the smallest change
    for ref in (None, tiny_llama):
        report = api.verify(out, ref)
        errors = _errors(report)
        assert not report["ok"]
        assert [e["file"] for e in errors if "changed or damaged" in e["message"]] == [str(out / wmap[victim])]


def test_a_shard_of_another_size_fails(tiny_llama, tmp_path):
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    shard = out / sorted(set(_index(out)["weight_map"].values()))[0]
    with open(shard, "ab") as f:
        f.write(b"\0")
    msgs = [e["message"] for e in _errors(api.verify(out)) if e.get("file") == str(shard)]
    assert any(m.startswith(f"size {shard.stat().st_size} bytes differs from the {shard.stat().st_size - 1} written") for m in msgs)


def test_an_index_without_the_record_is_not_judged_and_says_so(tiny_llama, tmp_path):
    """A record the index lists (writer.RECORDS_KEY) but lacks was removed after the run: an error naming the index
    (exit 5). An index without the record and without the listing (an earlier release) is not judged: a warning."""
    from click.testing import CliRunner

    from ctconvert.checkpoint.file_records import FILE_HASHES_KEY, INDEX_DIGEST_KEY
    from ctconvert.checkpoint.writer import CONFIG_KEY, PROVENANCE_KEY, QCFG_KEY, RECORDS_KEY
    from ctconvert.cli import main

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    index = _index(out)
    assert index["metadata"][RECORDS_KEY] == [SHARDS_KEY, QCFG_KEY, CONFIG_KEY, PROVENANCE_KEY, FILE_HASHES_KEY, INDEX_DIGEST_KEY]
    del index["metadata"][SHARDS_KEY]
    (out / INDEX_NAME).write_text(json.dumps(index))
    (e,) = [p for p in _errors(api.verify(out)) if "record was removed" in p["message"]]
    assert SHARDS_KEY in e["message"] and e["file"] == str(out / INDEX_NAME)
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 5
    index["metadata"][RECORDS_KEY] = None  # emptied, not deleted: still this release's index
    (out / INDEX_NAME).write_text(json.dumps(index))
    assert any("record was removed or emptied" in p["message"] for p in _errors(api.verify(out)))
    index["metadata"][SHARDS_KEY] = None
    _as_earlier_release(out, index)  # as an earlier release wrote it (no list of records)
    report = api.verify(out)
    warnings = [p["message"] for p in report["problems"] if p["severity"] == "warning"]
    assert report["ok"] and any("records no shard hashes" in w for w in warnings)
    assert SHARDS_CHECK not in report["checked"]["checks"]  # nothing compared: not claimed among the checks
    api.quantize(tiny_llama, tmp_path / "out2", "W4A16")
    assert SHARDS_CHECK in api.verify(tmp_path / "out2")["checked"]["checks"]  # a record: compared, and claimed
    index["metadata"] = {"total_size": index["metadata"]["total_size"]}  # another tool's index: nothing to say
    (out / INDEX_NAME).write_text(json.dumps(index))
    report = api.verify(out)
    assert not [p for p in report["problems"] if "shard hashes" in p["message"]] and SHARDS_CHECK not in report["checked"]["checks"]


def test_a_record_of_another_hash_scheme_is_not_compared(tiny_llama, tmp_path):
    """An earlier release's record of another hash scheme: a warning, not compared. In an index that lists its records
    (this release, one scheme) another scheme was written by hand: an error (the trial renamed it to skip the check)."""
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    index = _index(out)
    index["metadata"][SHARDS_KEY]["hash"] = "sha256/blocks-1"
    (out / INDEX_NAME).write_text(json.dumps(index))
    assert any("the record was edited" in p["message"] for p in _errors(api.verify(out)))
    _as_earlier_release(out, index)
    report = api.verify(out)
    assert report["ok"] and any("this installation hashes with" in p["message"] for p in report["problems"])


@pytest.mark.parametrize("record", [SHARDS_KEY, "ctconvert_quantization_config"])
def test_a_record_set_to_null_or_an_index_deleted_fails_verify(tiny_llama, tmp_path, record):
    """The trial's bypasses: a record set to null in this release's index, and the index of a ctconvert output deleted
    (its provenance stays), are errors naming the index (exit 5), not a warning or silence."""
    from click.testing import CliRunner

    from ctconvert.cli import main

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    index = _index(out)
    index["metadata"][record] = None
    (out / INDEX_NAME).write_text(json.dumps(index))
    (e,) = [p for p in _errors(api.verify(out)) if "removed or emptied" in p["message"]]
    assert record in e["message"] and e["file"] == str(out / INDEX_NAME)
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 5
    (out / INDEX_NAME).unlink()
    for f in sorted(out.glob("*.safetensors"))[1:]:  # one shard left, as a single-file checkpoint needs no index
        f.unlink()
    (e,) = [p for p in _errors(api.verify(out)) if "index ctconvert wrote is missing" in p["message"]]
    assert e["file"] == str(out / INDEX_NAME)


def test_a_shard_missing_from_the_record_fails(tiny_llama, tmp_path):
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16", max_shard_size="200KB")
    index = _index(out)
    first = sorted(index["metadata"][SHARDS_KEY]["files"])[0]
    del index["metadata"][SHARDS_KEY]["files"][first]
    (out / INDEX_NAME).write_text(json.dumps(index))
    errors = _errors(api.verify(out))  # (and the index, edited so, no longer matches its digest)
    assert [e["file"] for e in errors] == [str(out / first), str(out / INDEX_NAME)] and "no hash recorded" in errors[0]["message"]
    assert "its ctconvert_index_digest no longer matches it" in errors[1]["message"]


def test_decompress_and_resumed_outputs_record_their_own_shards(tiny_llama, tmp_path):
    q = tmp_path / "q"
    api.quantize(tiny_llama, q, "W4A16", max_shard_size="200KB")
    d = tmp_path / "d"
    api.decompress(q, d)
    record = _index(d)["metadata"][SHARDS_KEY]["files"]
    assert sorted(record) == sorted(set(_index(d)["weight_map"].values()))
    assert all(record[n][HASH_NAME] == shard_hash(d / n) for n in record)
    assert api.verify(d, q)["ok"]


#: weight and activation arguments edited by hand that no tensor contradicts (the shapes and dtypes stay those of the
#: format), each of which vLLM 0.33 loads otherwise or refuses (a new user's trial: verify passed every one)
_CONFIG_EDITS = {
    "type": lambda g: g["weights"].__setitem__("type", "int"),
    "strategy": lambda g: g["weights"].__setitem__("strategy", "group"),
    "dynamic": lambda g: g["weights"].__setitem__("dynamic", True),
    "scale_dtype": lambda g: g["weights"].__setitem__("scale_dtype", None),
    "input_activations": lambda g: g.__setitem__("input_activations", {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
}


@pytest.mark.parametrize("edit", sorted(_CONFIG_EDITS))
@pytest.mark.parametrize("reference", [False, True])
def test_a_quantization_config_edited_after_the_run_fails_verify(tiny_llama, tmp_path, edit, reference):
    """The index records the hash of the quantization_config the run wrote (writer.QCFG_KEY); verify compares
    config.json with it, with or without a reference, and names config.json (exit 5)."""
    from click.testing import CliRunner

    from ctconvert.checkpoint.integrity import CONFIG_CHECK
    from ctconvert.checkpoint.writer import QCFG_KEY, config_digest
    from ctconvert.cli import main

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "NVFP4A16")
    cfg = json.loads((out / "config.json").read_text())
    assert _index(out)["metadata"][QCFG_KEY] == config_digest(cfg["quantization_config"])
    ref = tiny_llama if reference else None
    report = api.verify(out, ref)
    assert report["ok"] and CONFIG_CHECK in report["checked"]["checks"]
    _CONFIG_EDITS[edit](cfg["quantization_config"]["config_groups"]["group_0"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    errors = _errors(api.verify(out, ref))
    assert any("quantization_config is not the one ctconvert wrote" in p["message"] and p["file"].endswith("config.json") for p in errors), errors
    args = ["verify", str(out), *(["--reference", str(tiny_llama)] if reference else [])]
    assert CliRunner().invoke(main, args).exit_code == 5


def test_the_config_record_is_compared_only_where_the_index_holds_one(tiny_llama, tmp_path):
    """Key order and whitespace of config.json are not an edit; a removed quantization_config is named; an index
    without the record lists no such check and gets no error from it, but a warning where it is this release's; a
    decompressed output (no quantization_config) records none."""
    from ctconvert.checkpoint.integrity import CONFIG_CHECK
    from ctconvert.checkpoint.writer import QCFG_KEY

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    api.decompress(out, tmp_path / "dense")
    assert QCFG_KEY not in _index(tmp_path / "dense")["metadata"]
    cfg = json.loads((out / "config.json").read_text())
    qcfg = cfg["quantization_config"]
    cfg["quantization_config"] = dict(reversed(list(qcfg.items())))  # same values, another order and layout
    (out / "config.json").write_text(json.dumps(cfg))
    assert api.verify(out)["ok"]
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert any("quantization_config was removed" in p["message"] for p in _errors(api.verify(out)))
    cfg["quantization_config"] = dict(qcfg, ignore=["lm_head", "model.layers.0.mlp.down_proj"])  # edited, then the record dropped
    (out / "config.json").write_text(json.dumps(cfg))
    index = _index(out)
    del index["metadata"][QCFG_KEY]
    (out / INDEX_NAME).write_text(json.dumps(index))
    (e,) = [p for p in _errors(api.verify(out)) if "record was removed" in p["message"]]  # the index lists it: removed
    assert QCFG_KEY in e["message"] and e["file"].endswith(INDEX_NAME)
    _as_earlier_release(out, index)  # as a release before the listing wrote it
    report = api.verify(out)
    assert CONFIG_CHECK not in report["checked"]["checks"]
    assert not any("quantization_config" in p["message"] and "wrote" in p["message"] for p in report["problems"])
    warned = [p for p in report["problems"] if p["severity"] == "warning" and "no hash of the quantization_config" in p["message"]]
    assert len(warned) == 1 and warned[0]["file"].endswith(INDEX_NAME)  # a ctconvert index of this release: said, not silent


def test_a_shard_dropped_with_its_records_fails_against_the_provenance(tiny_llama, tmp_path):
    """The trial's edit: one shard deleted along with its weight_map entries and its records (ctconvert_shards,
    ctconvert_files): the modules the provenance records without a tensor left are an error naming the provenance;
    the untouched output passes, and so does its decompressed copy (the provenance kept, the parts renamed)."""
    from ctconvert.checkpoint.writer import FILES_KEY

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16", max_shard_size="300KB")
    assert api.verify(out)["ok"]
    api.decompress(out, tmp_path / "dense")
    assert api.verify(tmp_path / "dense", tiny_llama)["ok"]
    index = _index(out)
    gone = sorted(set(index["weight_map"].values()))[-1]
    lost = {n.rpartition(".")[0] for n, f in index["weight_map"].items() if f == gone}
    lost -= {n.rpartition(".")[0] for n, f in index["weight_map"].items() if f != gone}
    assert lost
    (out / gone).unlink()
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != gone}
    del index["metadata"][SHARDS_KEY]["files"][gone]
    index["metadata"][FILES_KEY].remove(gone)
    (out / INDEX_NAME).write_text(json.dumps(index))
    (e,) = [p for p in _errors(api.verify(out)) if "the provenance records hold no tensor" in p["message"]]
    assert e["message"].startswith(f"{len(lost)} modules") and e["file"].endswith("ctconvert-provenance.json")
    assert min(lost) in e["message"]


_WHOLE_EDITS = {  # keys a trial edited after the run: vLLM refused the output or served other numbers, verify passed
    "num_key_value_heads": lambda c: c.__setitem__("num_key_value_heads", 1),
    "rope_theta": lambda c: c.__setitem__("rope_theta", 1234.0),
    "rms_norm_eps": lambda c: c.__setitem__("rms_norm_eps", 0.1),
    "hidden_act": lambda c: c.__setitem__("hidden_act", "gelu"),
    "mlp_bias": lambda c: c.__setitem__("mlp_bias", True),
    "tie_word_embeddings": lambda c: c.__setitem__("tie_word_embeddings", not c.get("tie_word_embeddings", False)),
    "architectures": lambda c: c.__setitem__("architectures", ["MistralForCausalLM"]),
    "added key": lambda c: c.__setitem__("max_position_embeddings", 1 + c.get("max_position_embeddings", 0)),
    "deleted key": lambda c: c.pop("rope_theta", None) or c.pop("rms_norm_eps"),
}


@pytest.mark.parametrize("edit", sorted(_WHOLE_EDITS))
@pytest.mark.parametrize("reference", [False, True])
def test_a_config_edited_after_the_run_fails_verify(tiny_llama, tmp_path, edit, reference):
    """The index records the hash of the whole config.json the run wrote (writer.CONFIG_KEY): any key edited, added
    or deleted afterwards fails verify, with or without a reference, naming config.json (exit 5); the check is
    listed among verify's checks."""
    from click.testing import CliRunner

    from ctconvert.checkpoint.integrity import WHOLE_CONFIG_CHECK
    from ctconvert.checkpoint.writer import CONFIG_KEY, config_digest
    from ctconvert.cli import main

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    cfg = json.loads((out / "config.json").read_text())
    assert _index(out)["metadata"][CONFIG_KEY] == config_digest(cfg)
    ref = tiny_llama if reference else None
    report = api.verify(out, ref)
    assert report["ok"] and WHOLE_CONFIG_CHECK in report["checked"]["checks"]
    _WHOLE_EDITS[edit](cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    errors = _errors(api.verify(out, ref))
    assert any("config.json is not the one ctconvert wrote" in p["message"] and p["file"] == str(out / "config.json") for p in errors), errors
    args = ["verify", str(out), *(["--reference", str(tiny_llama)] if reference else [])]
    assert CliRunner().invoke(main, args).exit_code == 5


def test_the_whole_config_record_is_judged_only_where_the_index_holds_or_lists_it(tiny_llama, tmp_path):
    """Key order and whitespace are not an edit; a decompressed output records its config too; an index that lists the
    record but lacks it is an error naming the index; an index of an earlier release (neither the record nor the
    listing) is not judged and claims no such check."""
    from ctconvert.checkpoint.integrity import WHOLE_CONFIG_CHECK
    from ctconvert.checkpoint.writer import CONFIG_KEY, RECORDS_KEY, config_digest

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    api.decompress(out, tmp_path / "dense")
    dense_cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert _index(tmp_path / "dense")["metadata"][CONFIG_KEY] == config_digest(dense_cfg)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(reversed(list(cfg.items()))), indent=3))  # same values, another layout
    assert api.verify(out)["ok"]
    cfg["rope_theta"] = 1.0
    (out / "config.json").write_text(json.dumps(cfg))
    index = _index(out)
    del index["metadata"][CONFIG_KEY]  # edited, then the record dropped: the index lists it
    (out / INDEX_NAME).write_text(json.dumps(index))
    (e,) = [p for p in _errors(api.verify(out)) if "record was removed" in p["message"]]
    assert CONFIG_KEY in e["message"] and e["file"] == str(out / INDEX_NAME)
    index["metadata"][RECORDS_KEY].remove(CONFIG_KEY)  # as the release before this record wrote its index
    _as_release_before_the_digest(out, index)
    report = api.verify(out)
    assert report["ok"] and WHOLE_CONFIG_CHECK not in report["checked"]["checks"], report["problems"]


def test_records_stripped_beside_a_provenance_of_this_format_fail_verify(tiny_llama, tmp_path):
    """The trial's edit: every record removed from the index (ctconvert_records too), the provenance kept. The provenance's
    format (3) is written only beside an index that lists its records: an error naming the index (exit 5), not an
    earlier release's output passed with a warning. An output of release 0.1.0 (format 2, no records) is still only
    warned about, and passes."""
    from click.testing import CliRunner

    from ctconvert.checkpoint.integrity import PROVENANCE_CHECK
    from ctconvert.checkpoint.provenance import PROVENANCE_FORMAT, RECORDS_SINCE_FORMAT
    from ctconvert.checkpoint.writer import MARKER, RECORDS_KEY
    from ctconvert.cli import main

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    assert json.loads((out / "ctconvert-provenance.json").read_text())["provenance_format"] == PROVENANCE_FORMAT >= RECORDS_SINCE_FORMAT
    report = api.verify(out)
    assert report["ok"] and PROVENANCE_CHECK in report["checked"]["checks"]
    index = _index(out)
    for kept in ({"total_size": index["metadata"]["total_size"]}, {k: v for k, v in index["metadata"].items() if k != RECORDS_KEY}):
        (out / INDEX_NAME).write_text(json.dumps(dict(index, metadata=kept)))
        report = api.verify(out)
        (e,) = _errors(report)
        assert e["file"] == str(out / INDEX_NAME) and "removed after the run" in e["message"]
        if "ctconvert_index_digest" in kept:  # (the records kept, their list removed: the digest shows it)
            assert e["message"].startswith(f"the index's list of its records ({RECORDS_KEY}) was removed after the run")
        else:
            assert e["message"].startswith("the index holds none of the records ctconvert writes")
            assert f"ctconvert-provenance.json is of format {PROVENANCE_FORMAT}" in e["message"]
        assert not [p for p in report["problems"] if "earlier" in p["message"]]  # not taken for an earlier release's output
        assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 5
    index["metadata"] = {"total_size": index["metadata"]["total_size"], MARKER: "0.1.0"}
    _as_earlier_release(out, index)
    report = api.verify(out)
    assert report["ok"] and any("records no shard hashes" in p["message"] for p in report["problems"] if p["severity"] == "warning")
    assert not [p for p in report["problems"] if "neither its marker" in p["message"]]
    # the trial's next edit: the marker stripped too (every ctconvert key gone), the provenance set back to format 2: a
    # warning naming the index (it passed without a word), the tensors judged as another tool's
    index["metadata"] = {"total_size": index["metadata"]["total_size"]}
    _as_earlier_release(out, index)
    report = api.verify(out)
    (w,) = [p for p in report["problems"] if p["severity"] == "warning" and "neither its marker" in p["message"]]
    assert report["ok"] and w["file"] == str(out / INDEX_NAME) and "ctconvert-provenance.json (format 2) is ctconvert's" in w["message"]
    (out / "ctconvert-provenance.json").unlink()  # another tool's folder: nothing to say
    assert not [p for p in api.verify(out)["problems"] if "neither its marker" in p["message"]]


def test_an_edited_provenance_fails_and_switches_no_check_off(tiny_llama, tmp_path):
    """The index records the provenance's hash: a derived_from added by hand (which told verify to judge no value one by
    one against a dense reference) is an error naming the provenance, and the values are judged still; so is a deleted
    provenance. The same document written in another layout passes. A derived_from in an earlier release's provenance
    (no record) switches nothing off either: the values are judged, and a note says why."""
    from ctconvert.checkpoint.writer import PROVENANCE_KEY, config_digest

    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    p = out / "ctconvert-provenance.json"
    prov = json.loads(p.read_text())
    assert _index(out)["metadata"][PROVENANCE_KEY] == config_digest(prov)
    p.write_text(json.dumps(dict(reversed(list(prov.items())))))  # the same values, another layout
    assert api.verify(out)["ok"]
    p.write_text(json.dumps(dict(prov, derived_from={"path": "/elsewhere", "quant_method": "compressed-tensors"}), indent=2))
    report = api.verify(out, tiny_llama)
    (e,) = _errors(report)
    assert e["file"] == str(p) and e["message"].startswith("ctconvert-provenance.json is not the one ctconvert wrote (the index records its hash)")
    assert report["tensors"] and all(r["values_checked"] > 0 for r in report["tensors"])  # not switched off
    p.unlink()
    (e,) = _errors(api.verify(out))
    assert e["file"] == str(p) and "whose hash the index records, is missing" in e["message"]
    p.write_text(json.dumps(dict(prov, derived_from={"path": "/elsewhere", "quant_method": "compressed-tensors"})))
    _as_earlier_release(out, _index(out))
    report = api.verify(out, tiny_llama)
    assert report["ok"] and all(r["values_checked"] > 0 for r in report["tensors"])
    notes = [x for x in report["problems"] if x["severity"] == "note" and "requantized from /elsewhere" in x["message"]]
    assert len(notes) == 1 and "does not take it on trust" in notes[0]["message"] and notes[0]["file"] == str(p)


@pytest.mark.parametrize("edit", [4, -1, "str", None, True, 0.5])
def test_an_edited_total_size_fails_and_the_written_one_passes(tiny_llama, tmp_path, edit):
    """The index's ``total_size`` is the bytes of the tensors the shards hold (each header's data ranges, summed here
    independently of ctconvert's reader); a changed one (a trial's ``+4`` passed verify) is an error naming the index,
    with or without a reference."""
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "NVFP4A16", max_shard_size="300KB")
    index = _index(out)
    held = 0
    for name in sorted(set(index["weight_map"].values())):
        _, header = _header(out / name)
        held += sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")
    assert index["metadata"]["total_size"] == held and not _errors(api.verify(out))
    index["metadata"]["total_size"] = held + edit if isinstance(edit, int) and not isinstance(edit, bool) else edit
    (out / INDEX_NAME).write_text(json.dumps(index))
    for report in (api.verify(out), api.verify(out, reference=tiny_llama)):
        errs = [e for e in _errors(report) if "total_size" in e["message"]]
        assert len(errs) == 1 and errs[0]["file"] == str(out / INDEX_NAME), report["problems"]
        assert f"its shards hold {held} bytes" in errs[0]["message"]


def test_a_missing_shard_is_not_called_an_edited_total_size(tiny_llama, tmp_path):
    """A shard deleted from the folder: verify names it, and says nothing of total_size (the review's case)."""
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16", max_shard_size="300KB")
    shards = sorted(set(_index(out)["weight_map"].values()))
    assert len(shards) > 1
    (out / shards[-1]).unlink()
    errs = _errors(api.verify(out))
    assert any(shards[-1] in e["message"] for e in errs) and not any("total_size" in e["message"] for e in errs), errs
