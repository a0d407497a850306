"""ShardFile's header: the bytes safetensors' JSON form gives, whatever the names, dtypes and shapes."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ctconvert.checkpoint.safetensors_io import DTYPES
from ctconvert.checkpoint.shard_file import PlannedTensor, ShardFile, host_bytes


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


@pytest.mark.parametrize("seed", [0, 1])
def test_pieces_given_as_arrays_write_the_bytes_tensors_do(tmp_path, seed):
    """write_many takes a piece as a CPU tensor or as a uint8 array of its bytes (the executor's staged views): the
    same file, hash and values either way, for dtypes of every width, non-contiguous tensors, empty ones and pieces
    written at byte offsets, in any order."""
    g = torch.Generator().manual_seed(seed)
    values = {
        "bf16": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "f32_t": torch.randn(8, 23, generator=g).t(),  # not contiguous
        "i8": torch.randint(-128, 128, (5, 7), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (333,), generator=g, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int8: "I8", torch.uint8: "U8"}
    planned = [PlannedTensor(n, names[t.dtype], tuple(t.shape)) for n, t in values.items()]
    files = {}
    for kind in ("tensor", "array"):
        f = ShardFile(tmp_path / f"{kind}.safetensors", planned, metadata={"format": "pt"})
        pieces = []
        for n, t in values.items():
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            if n == "bf16":  # two pieces at byte offsets
                cut = raw.numel() // 2
                pieces += [(n, raw[:cut].numpy() if kind == "array" else raw[:cut], 0), (n, raw[cut:].numpy() if kind == "array" else raw[cut:], cut)]
            else:  # the tensor itself, or its bytes
                pieces.append((n, raw.numpy() if kind == "array" else t, 0))
        random.Random(seed).shuffle(pieces)
        f.write_many(pieces)
        f.close()
        files[kind] = ((tmp_path / f"{kind}.safetensors").read_bytes(), f.content_hash())
    assert files["tensor"] == files["array"]
    with safe_open(str(tmp_path / "array.safetensors"), "pt") as s:
        for n, t in values.items():
            assert torch.equal(s.get_tensor(n), t.contiguous()), n


def test_host_bytes_views_contiguous_tensors_and_arrays():
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    a = host_bytes(t)
    assert a.dtype == np.uint8 and a.shape == (24,) and a.tobytes() == t.numpy().tobytes()
    t[0, 0] = 7  # a view of the tensor's storage, not a copy
    assert a[0] == 7
    assert host_bytes(t.t()).tobytes() == t.t().contiguous().numpy().tobytes()  # not contiguous: a copy, row-major
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert host_bytes(arr).tobytes() == arr.tobytes() and np.shares_memory(host_bytes(arr), arr)
    assert host_bytes(torch.zeros(0, 5)).shape == (0,)
