"""ShardFile's header: the bytes safetensors' JSON form gives, whatever the names, dtypes and shapes."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
from safetensors import safe_open

from ctconvert.checkpoint.safetensors_io import DTYPES
from ctconvert.checkpoint.shard_file import PlannedTensor, ShardFile


def _reference_header(tensors: list[PlannedTensor], metadata: dict) -> bytes:
    """The header as a dict through json.dumps (the form the writer had before it wrote entries itself)."""
    order = sorted(range(len(tensors)), key=lambda i: -DTYPES[tensors[i].dtype][1])
    header: dict = {"__metadata__": metadata}
    pos = 0
    for i in order:
        t = tensors[i]
        n = (int(torch.tensor(t.shape).prod()) if t.shape else 1) * DTYPES[t.dtype][1]
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_header_bytes_are_the_json_of_the_header_dict(tmp_path, seed):
    rng = random.Random(seed)
    alphabet = 'abcXYZ09._-/ "\\\u00e9\u4e2d\U0001f600\t'
    dtypes = ["F32", "BF16", "F16", "U8", "I8", "I32", "F8_E4M3", "I64"]
    tensors, names = [], set()
    while len(tensors) < 200:
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        if name in names or name == "__metadata__":
            continue
        names.add(name)
        shape = tuple(rng.choice([0, 1, 3, 16, 1000]) for _ in range(rng.randint(0, 3)))
        tensors.append(PlannedTensor(name, rng.choice(dtypes), shape))
    meta = {"format": "pt", "note": 'caf\u00e9 "quoted"'}
    f = ShardFile(tmp_path / "a.safetensors", tensors, metadata=meta)
    head = (tmp_path / "a.safetensors").read_bytes()[: f.data_start]
    want = _reference_header(tensors, meta)
    assert head == struct.pack("<Q", len(want)) + want
    for t in tensors:  # every byte written: safetensors reads it back
        f.write(t.name, torch.zeros(t.nbytes, dtype=torch.uint8))
    f.close()
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as s:
        assert set(s.keys()) == names and s.metadata() == meta


def test_a_name_planned_twice_is_refused(tmp_path):
    ts = [PlannedTensor("a", "U8", (2,)), PlannedTensor("a", "U8", (3,))]
    with pytest.raises(ValueError, match="planned twice"):
        ShardFile(tmp_path / "a.safetensors", ts)
