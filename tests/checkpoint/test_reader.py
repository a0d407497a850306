"""Reading and validating checkpoint folders from their headers; faults give one-line errors."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import read_header, read_rows, read_tensor
from ctconvert.checkpoint.shard_file import PlannedTensor, ShardFile
from ctconvert.errors import BadInputError

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint


def test_sharded_headers_and_lazy_rows(tiny_llama):
    ck = open_checkpoint(tiny_llama)
    src = llama_tensors(LLAMA_CONFIG)
    assert set(ck.tensors) == set(src) and len(ck.files) == 3
    info = ck.tensors["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(read_tensor(info), src[info.name])
    assert torch.equal(read_rows(info, 5, 9), src[info.name][5:9])


def test_truncated_file(tiny_llama):
    f = tiny_llama / "model-00002-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(BadInputError, match=r"model-00002-of-00003\.safetensors: tensor '.*': data ends at byte \d+ but the file has"):
        open_checkpoint(tiny_llama)


def test_oversized_and_corrupt_header(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(BadInputError, match="exceeds"):
        read_header(p)
    p.write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(BadInputError, match="not valid JSON"):
        read_header(p)
    p.write_bytes(b"abc")
    with pytest.raises(BadInputError, match="shorter than a safetensors header"):
        read_header(p)
    hdr = json.dumps({"a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 6]}}).encode()
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 6)
    with pytest.raises(BadInputError, match="tensor 'a': byte range"):
        read_header(p)


def test_index_names_missing_shard(tiny_llama):
    (tiny_llama / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(BadInputError, match="index names shard 'model-00003-of-00003.safetensors', which does not exist"):
        open_checkpoint(tiny_llama)
    ck = open_checkpoint(tiny_llama, strict=False)
    assert any("does not exist" in p.message for p in ck.problems)


def test_shard_not_in_index(tiny_llama):
    from safetensors.torch import save_file

    save_file({"stray": torch.zeros(2)}, tiny_llama / "extra.safetensors")
    with pytest.raises(BadInputError, match="'extra.safetensors' is not listed in the index"):
        open_checkpoint(tiny_llama)


def test_duplicate_tensor_across_shards(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"a.weight": torch.zeros(2, 2)}, d / "s1.safetensors")
    save_file({"a.weight": torch.ones(2, 2), "b.weight": torch.ones(2, 2)}, d / "s2.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors"}}))
    with pytest.raises(BadInputError, match="tensor 'a.weight': tensor also stored in s1.safetensors"):
        open_checkpoint(d)


def test_config_missing_or_invalid(tiny_llama):
    (tiny_llama / "config.json").write_text("{oops")
    with pytest.raises(BadInputError, match=r"config\.json: config\.json is not valid JSON"):
        open_checkpoint(tiny_llama)
    (tiny_llama / "config.json").unlink()
    with pytest.raises(BadInputError, match="config.json is missing"):
        open_checkpoint(tiny_llama)


def test_not_a_folder(tmp_path):
    with pytest.raises(BadInputError, match="not a checkpoint folder"):
        open_checkpoint(tmp_path / "nope")


def test_single_file_checkpoint(tmp_path):
    p = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG, shards=1)
    assert len(open_checkpoint(p).files) == 1


def test_shard_file_layout_roundtrips_through_safetensors(tmp_path):
    from safetensors.torch import load_file

    ts = {"b": torch.arange(7, dtype=torch.uint8), "a": torch.randn(3, 5).to(torch.bfloat16), "c": torch.tensor([1, 2], dtype=torch.int64)}
    f = ShardFile(
        tmp_path / "s.safetensors",
        [PlannedTensor(n, {torch.uint8: "U8", torch.bfloat16: "BF16", torch.int64: "I64"}[t.dtype], tuple(t.shape)) for n, t in ts.items()],
    )
    f.write("a", ts["a"][:2])  # row ranges at offsets
    f.write("a", ts["a"][2:], byte_offset=2 * 5 * 2)
    f.write("b", ts["b"])
    f.write("c", ts["c"])
    f.close()
    back = load_file(tmp_path / "s.safetensors")
    assert all(torch.equal(back[k], v) for k, v in ts.items())
    infos, meta = read_header(tmp_path / "s.safetensors")
    assert meta == {"format": "pt"}
    assert all(i.start % i.itemsize == 0 for i in infos.values())  # aligned


def test_incomplete_shard_write_is_detected(tmp_path):
    from ctconvert.errors import EXIT_INTERNAL, CTConvertError, OutputError

    f = ShardFile(tmp_path / "s.safetensors", [PlannedTensor("a", "F32", (4,))])
    f.write("a", torch.zeros(2))
    with pytest.raises(CTConvertError, match="incompletely written") as e:
        f.close()
    assert e.value.exit_code == EXIT_INTERNAL and not isinstance(e.value, OutputError)  # an internal error, not the disk's
