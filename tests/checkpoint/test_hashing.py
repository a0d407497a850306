"""The block hash of provenance and journals, against an independent computation with xxhash."""

from __future__ import annotations

import random

import pytest
import xxhash

from ctconvert.checkpoint.hashing import HASH_BLOCK_BYTES, file_hash, hash_tensors
from ctconvert.checkpoint.safetensors_io import TensorInfo


def _reference(data: bytes) -> str:
    digests = b"".join(xxhash.xxh3_128(data[b : b + HASH_BLOCK_BYTES]).digest() for b in range(0, len(data), HASH_BLOCK_BYTES))
    return xxhash.xxh3_128(digests).hexdigest()


@pytest.mark.parametrize("size", [0, 1, HASH_BLOCK_BYTES, 2 * HASH_BLOCK_BYTES + 123])
def test_block_hash_of_files_and_ranges(tmp_path, size):
    data = random.Random(size).randbytes(size + 78)
    data = data[:76] + bytes([data[77] ^ 1]) + data[77:-1]  # the two offsets compared last hold different bytes
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    assert file_hash(p) == _reference(data)
    infos = [TensorInfo("a", p, "U8", (size,), 77, size), TensorInfo("b", p, "U8", (5,), 3, 5)]
    got = hash_tensors(infos)
    assert got == {"a": _reference(data[77:]), "b": _reference(data[3:8])}
    assert hash_tensors(infos[:1], legacy=True)["a"] == xxhash.xxh3_128(data[77:]).hexdigest()
    assert got["a"] != hash_tensors([TensorInfo("a", p, "U8", (size,), 76, size)])["a"] or size == 0
