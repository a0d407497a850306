"""native_write: a writer's item in one call without the GIL. The digests are xxhash's own (``xxhash.xxh3_128``), the
file bytes those the runs name, and a ShardFile written through it holds the same bytes and content hash as one
written piece by piece in Python (fresh random tensors, fixed seeds; awkward sizes: 1 byte, odd, around xxhash's
64 KiB GIL threshold, a whole 16 MiB hash block, runs of more buffers than ``IOV_MAX``)."""

from __future__ import annotations

import errno
import os
import random

import numpy as np
import pytest

from ctconvert.checkpoint import native_write
from ctconvert.checkpoint.hashing import HASH_BLOCK_BYTES, StreamHash, shard_hash
from ctconvert.checkpoint.shard_file import IOV_MAX, PlannedTensor, ShardFile

xxhash = pytest.importorskip("xxhash")
needs_native = pytest.mark.skipif(not native_write.available(), reason="no C compiler, CTCONVERT_NATIVE=0, or xxhash without XXH3_128bits")


def _bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


@needs_native
@pytest.mark.parametrize("cap", [0, 1, 7, 100_000], ids=["whole-writes", "cap-1", "cap-7", "cap-100k"])
@pytest.mark.parametrize("seed", [0, 1])
def test_digests_are_xxhash_and_the_runs_land_at_their_offsets(tmp_path, seed, cap):
    """``cap`` > 0 makes every pwritev short (at most ``cap`` bytes, a buffer cut where longer): each run is finished."""
    rng = np.random.default_rng(seed)
    sizes = [1, 3, 4, 65535, 65536, 65537, 786432, int(rng.integers(1, 3_000_000)), HASH_BLOCK_BYTES]
    if cap == 1:  # a byte a call: smaller buffers
        sizes = [1, 3, 4, 4097, int(rng.integers(1, 20_000))]
    whole = [_bytes(rng, n) for n in sizes]
    whole.append(np.zeros(1000, np.uint8))  # a tensor of zeros
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        tiny = [_bytes(rng, int(rng.integers(1, 5))) for _ in range(IOV_MAX + 37)]  # one run of more than IOV_MAX buffers
        a, b = whole[-3], whole[1]
        runs = [(5, [a, b]), (5 + a.nbytes + b.nbytes + 11, tiny)]
        digests = native_write.write_item(fd, whole, runs, cap=cap)
    finally:
        os.close(fd)
    assert digests == [xxhash.xxh3_128(w).digest() for w in whole]
    data = path.read_bytes()
    assert data[5 : 5 + a.nbytes + b.nbytes] == a.tobytes() + b.tobytes()
    start = 5 + a.nbytes + b.nbytes + 11
    assert data[start:] == b"".join(t.tobytes() for t in tiny)
    assert data[:5] == bytes(5) and data[start - 11 : start] == bytes(11)  # the gaps untouched (a sparse hole reads zeros)


@needs_native
def test_a_failed_pwritev_raises_with_its_errno_and_run(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # writing it fails with EBADF
    try:
        with pytest.raises(OSError) as got:
            native_write.write_item(fd, [np.ones(3, np.uint8)], [(0, [np.ones(3, np.uint8)])])
    finally:
        os.close(fd)
    assert got.value.errno == errno.EBADF and got.value.run == 0


def _tensors(rng: random.Random) -> list[PlannedTensor]:
    out = []
    for i in range(60):  # MoE-like: packed, scale and global scale of each expert; a few large ones cut in pieces
        e = i // 3
        out.append(PlannedTensor(f"experts.{e}.weight_packed.{i}", "U8", (rng.choice([1, 7, 64, 300]), rng.choice([1, 16, 512]))))
        out.append(PlannedTensor(f"experts.{e}.weight_scale.{i}", "F8_E4M3", (rng.choice([1, 5, 64]), rng.choice([1, 8]))))
        out.append(PlannedTensor(f"experts.{e}.weight_global_scale.{i}", "F32", (1,)))
    out.append(PlannedTensor("big", "BF16", (HASH_BLOCK_BYTES // 2048 + 3, 1024)))  # over one hash block: written in pieces
    out.append(PlannedTensor("block", "U8", (HASH_BLOCK_BYTES,)))  # exactly one block, whole
    out.append(PlannedTensor("empty", "F32", (0,)))
    return out


def _write(path, tensors, seed: int, native: bool, monkeypatch) -> ShardFile:
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    f = ShardFile(path, tensors)
    monkeypatch.setattr(f, "_native", native)
    items = []
    for t in tensors:
        raw = _bytes(nrng, t.nbytes)
        if t.name == "big":  # row ranges in any order, several to an item
            cuts = sorted({0, t.nbytes, *(rng.randrange(0, t.nbytes) for _ in range(5))})
            items += [[(t.name, raw[a:b], a)] for a, b in zip(cuts, cuts[1:])]
        else:
            items.append([(t.name, raw, 0)])
    rng.shuffle(items)
    while items:  # a writer's item: several pieces of several tensors
        k = rng.randint(1, 12)
        f.write_many([p for item in items[:k] for p in item])
        items = items[k:]
    return f


@needs_native
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_shard_written_natively_equals_one_written_piece_by_piece(tmp_path, seed, monkeypatch):
    tensors = _tensors(random.Random(seed))
    a = _write(tmp_path / "a.safetensors", tensors, seed, True, monkeypatch)
    b = _write(tmp_path / "b.safetensors", tensors, seed, False, monkeypatch)
    ha, hb = a.content_hash(), b.content_hash()
    a.close()
    b.close()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert ha == hb == shard_hash(tmp_path / "a.safetensors")
    native = {n for n, h in a._hashes.items() if 0 in h._open and type(h._open[0][0]).__name__ == "_Digested"}
    assert native == {t.name for t in tensors if 0 < t.nbytes < HASH_BLOCK_BYTES and t.name != "big"}  # the whole small tensors, in C
    assert type(a._hashes["block"]._open.get(0)).__name__ == "NoneType" and 0 in a._hashes["block"]._done  # one full block, whole
    assert not any(type(h._open[0][0]).__name__ == "_Digested" for h in b._hashes.values() if 0 in h._open)


@needs_native
def test_a_tensor_written_whole_twice_is_hashed_from_the_file(tmp_path):
    t = PlannedTensor("w", "U8", (4, 4))
    f = ShardFile(tmp_path / "a.safetensors", [t])
    f.write_many([("w", np.arange(16, dtype=np.uint8), 0)])
    f.written["w"] = 0  # (as though the count were not yet complete: the close check is not what this tests)
    f.remaining += 16
    f.write_many([("w", np.arange(16, dtype=np.uint8)[::-1].copy(), 0)])
    assert not f._hashes["w"].complete(16)  # overlapping: unknown, so content_hash reads the file
    h = f.content_hash()
    f.close()
    assert h == shard_hash(tmp_path / "a.safetensors")


def test_set_whole_after_other_bytes_makes_the_hash_unknown():
    h = StreamHash()
    h.update_at(0, b"ab")
    h.set_whole(xxhash.xxh3_128(b"abcd").digest(), 4)
    assert not h.ok and not h.complete(4)
    g = StreamHash()
    g.set_whole(xxhash.xxh3_128(b"abcd").digest(), 4)
    ref = StreamHash()
    ref.update_at(0, b"abcd")
    assert g.complete(4) and g.digest() == ref.digest()
    g.update_at(2, b"cd")  # a second piece over it: overlapping
    assert not g.ok
    with pytest.raises(ValueError, match="one block"):
        StreamHash().set_whole(b"x" * 16, HASH_BLOCK_BYTES + 1)


@needs_native
def test_a_strided_array_is_written_as_its_elements(tmp_path):
    """A strided uint8 array given to write_many is copied, never read from its address as nbytes contiguous bytes
    (the review's case: every other byte of 0..19 must be 0, 2, 4 ..., not 0..9); write_item refuses one."""
    f = ShardFile(tmp_path / "a.safetensors", [PlannedTensor("w", "U8", (10,))])
    f.write_many([("w", np.arange(20, dtype=np.uint8)[::2], 0)])
    h = f.content_hash()
    f.close()
    assert h == shard_hash(tmp_path / "a.safetensors")
    data = (tmp_path / "a.safetensors").read_bytes()
    assert data[-10:] == bytes(range(0, 20, 2))
    fd = os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match="C-contiguous"):
            native_write.write_item(fd, [np.arange(20, dtype=np.uint8)[::2]], [])
    finally:
        os.close(fd)


def test_a_run_without_the_c_writer_says_so_in_a_note_and_writes_the_same_bytes(tiny_llama, tmp_path, monkeypatch):
    """Where the C writer did not build (here: a compiler that fails, a fresh cache), quantize's notes say the shards
    were written from Python and why; the output is the same as with it, and ``CTCONVERT_NATIVE=0`` (asked for) gives
    no note."""
    from pathlib import Path

    from ctconvert import api, cbuild

    def run(name: str) -> tuple[list[str], Path]:
        out = tmp_path / name
        return api.quantize(tiny_llama, out, "W4A16").notes, out

    notes, fast = run("default")
    assert not [n for n in notes if "written and hashed from Python" in n] or not native_write.available()
    monkeypatch.setenv("CTCONVERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(native_write, "_LIB", cbuild.Library(native_write._LIB.src, native_write._LIB.signatures))
    notes, slow = run("python")
    (note,) = [n for n in notes if "written and hashed from Python" in n]
    assert "write_item.c did not compile with /bin/false" in note and "CTCONVERT_NATIVE" in note
    for f in sorted(p.name for p in fast.iterdir()):
        if f.endswith(".safetensors"):
            assert (fast / f).read_bytes() == (slow / f).read_bytes(), f
    monkeypatch.setenv("CTCONVERT_NATIVE", "0")
    notes, _ = run("asked")
    assert not [n for n in notes if "written and hashed from Python" in n]


@needs_native
def test_native_turned_off_while_a_shard_is_open_writes_the_rest_from_python(tmp_path, monkeypatch):
    """``CTCONVERT_NATIVE=0`` set after a ShardFile opened (an embedder's switch): its next writes go through Python
    (they raised before), and the shard equals one written wholly either way."""
    tensors = _tensors(random.Random(5))
    b = _write(tmp_path / "b.safetensors", tensors, 5, False, monkeypatch)
    hb = b.content_hash()
    b.close()
    monkeypatch.delenv("CTCONVERT_NATIVE", raising=False)
    rng = np.random.default_rng(5)
    data = {t.name: _bytes(rng, t.nbytes) for t in tensors}
    f = ShardFile(tmp_path / "a.safetensors", tensors)
    half = len(tensors) // 2
    f.write_many([(t.name, data[t.name], 0) for t in tensors[:half]])
    monkeypatch.setenv("CTCONVERT_NATIVE", "0")
    f.write_many([(t.name, data[t.name], 0) for t in tensors[half:]])
    ha = f.content_hash()
    f.close()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert ha == hb == shard_hash(tmp_path / "a.safetensors")
