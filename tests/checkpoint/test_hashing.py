"""The block hash of provenance and journals, against an independent computation with xxhash."""

from __future__ import annotations

import os
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


def test_shard_hash_taken_while_writing_equals_the_file_hash(tmp_path):
    """A shard's content hash, taken as its tensors are written (in order, out of order, in pieces across block
    boundaries), equals the one computed from the finished file, and changes with any byte."""
    import torch

    from ctconvert.checkpoint.hashing import shard_hash
    from ctconvert.checkpoint.shard_file import PlannedTensor, ShardFile

    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 255, (HASH_BLOCK_BYTES + 4099,), dtype=torch.uint8, generator=g)
    small = torch.randn(33, 7, generator=g)
    planned = [PlannedTensor("big", "U8", tuple(big.shape)), PlannedTensor("small", "F32", (33, 7)), PlannedTensor("empty", "F32", (0,))]
    for order in ("in order", "out of order"):
        p = tmp_path / f"{order}.safetensors"
        f = ShardFile(p, planned)
        pieces = [(0, 1000), (1000, HASH_BLOCK_BYTES + 17), (HASH_BLOCK_BYTES + 17, big.numel())]
        for a, b in pieces if order == "in order" else pieces[::-1]:
            f.write("big", big[a:b], a)
        f.write("small", small[20:], 20 * 7 * 4)
        f.write("small", small[:20], 0)  # out of order: hashed as written all the same
        f.close()
        assert f.content_hash() == shard_hash(p)
        ref = shard_hash(p)
        data = bytearray(p.read_bytes())
        data[-5] ^= 1
        p.write_bytes(bytes(data))
        assert shard_hash(p) != ref


def test_derived_tensors_hash_the_stored_bytes_they_come_from(tmp_path):
    """An interleaved expert (a ``view``) hashes its whole expert region: a change anywhere in it is seen (its
    own bytes are every other row, not one range). A virtual dequantized weight hashes the stored tensors it is
    computed from, in order."""
    from ctconvert.checkpoint.safetensors_io import SliceView

    data = bytearray(random.Random(7).randbytes(4 * 8 * 2))  # a [4, 8] bf16 region
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(data))
    gate = TensorInfo("gate", p, "BF16", (2, 8), 0, 2 * 8 * 2, base="fused", view=SliceView(4, 8, False, 0, 2))
    before = hash_tensors([gate])["gate"]
    assert before == xxhash.xxh3_128(bytes.fromhex(_reference(bytes(data)))).hexdigest()
    data[-1] ^= 1  # the last row belongs to up, not gate: the region still changed
    p.write_bytes(bytes(data))
    assert hash_tensors([gate])["gate"] != before

    class _Virtual:
        def __init__(self, parts):
            self.parts = parts

        def stored(self):
            return self.parts

    a, b = TensorInfo("a.weight_packed", p, "U8", (10,), 0, 10), TensorInfo("a.weight_scale", p, "U8", (6,), 20, 6)
    virtual = TensorInfo("a.weight", p, "BF16", (4, 8), 0, 64, virtual=_Virtual([a, b]))
    want = xxhash.xxh3_128(bytes.fromhex(_reference(bytes(data[0:10]))) + bytes.fromhex(_reference(bytes(data[20:26])))).hexdigest()
    assert hash_tensors([virtual])["a.weight"] == want


def test_tensors_of_one_region_hash_it_once(tmp_path, monkeypatch):
    """gpt-oss's gate and up of one expert come from one region: each has the region's hash, and the region's blocks
    are read and hashed once, not once per tensor (a transposed expert's own bytes are not one range)."""
    from ctconvert.checkpoint import hashing
    from ctconvert.checkpoint.safetensors_io import SliceView

    monkeypatch.setattr(hashing, "HASH_BLOCK_BYTES", 64)
    monkeypatch.setattr(hashing, "_EARLY", {})
    data = random.Random(5).randbytes(2 * 6 * 8 * 2)  # two [6, 8] bf16 regions: experts 0 and 1 of a fused [2, 6, 8]
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    infos = []
    for e in range(2):
        start = e * 96
        infos += [TensorInfo(f"e{e}.{n}", p, "BF16", (4, 6), start, 48, base="fused", view=SliceView(6, 8, True, j, 2)) for j, n in enumerate(("gate", "up"))]
    jobs = []
    real = hashing._pool().submit
    monkeypatch.setattr(hashing._pool(), "submit", lambda fn, path, spans, *a: jobs.append(spans) or real(fn, path, spans, *a))
    got = hash_tensors(infos)
    for e in range(2):
        want = xxhash.xxh3_128(bytes.fromhex(_reference_blocks(data[e * 96 : e * 96 + 96], 64))).hexdigest()  # of its one range
        assert got[f"e{e}.gate"] == got[f"e{e}.up"] == want
    assert sorted(s for j in jobs for s in j) == [(0, 64), (64, 32), (96, 64), (160, 32)]


def _range_infos(path, spans):
    return [TensorInfo(f"t{i}", path, "U8", (n,), s, n) for i, (s, n) in enumerate(spans)]


def test_early_hashes_are_taken_by_the_same_ranges_of_the_unchanged_file(tmp_path, monkeypatch):
    """hash_early's blocks are what a later hash of the same range takes (the same values as hashing afresh, each
    block taken once); a range it did not begin is hashed as usual; a file rewritten since (another modification
    time) is hashed again, from its new bytes."""
    from ctconvert.checkpoint import hashing

    monkeypatch.setattr(hashing, "HASH_BLOCK_BYTES", 4096)
    monkeypatch.setattr(hashing, "_EARLY", {})
    rng = random.Random(7)
    path = tmp_path / "a.bin"
    path.write_bytes(rng.randbytes(5 * 4096 + 123))
    spans = [(0, 4096 * 2 + 5), (4096 * 2 + 5, 3 * 4096 + 118)]  # blocks of 4096 from each range's start: 3 and 4
    fresh = hash_tensors(_range_infos(path, spans))
    assert hashing.hash_early(path, spans) == 3 + 4 and len(hashing._EARLY) == 7
    submitted = []
    real = hashing._pool().submit
    monkeypatch.setattr(hashing._pool(), "submit", lambda *a: submitted.append(a) or real(*a))
    assert hash_tensors(_range_infos(path, spans)) == fresh and not submitted and not hashing._EARLY
    blocks = lambda: sum(len(a[2]) for a in submitted)  # noqa: E731  (blocks submitted: small ones share a job)
    assert hashing.hash_early(path, spans[:1]) == 3 and blocks() == 3
    assert hash_tensors(_range_infos(path, spans)) == fresh
    assert blocks() == 3 + 4 and not hashing._EARLY  # the second range's blocks, hashed now
    hashing.hash_early(path, spans)
    for f in list(hashing._EARLY.values()):
        f.result()  # the old bytes' blocks, done
    data = rng.randbytes(5 * 4096 + 123)
    path.write_bytes(data)
    os.utime(path, ns=(1, 1))  # another modification time, whatever the clock's resolution
    want = {f"t{i}": _reference_blocks(data[a : a + n], 4096) for i, (a, n) in enumerate(spans)}
    assert hash_tensors(_range_infos(path, spans)) == want != fresh
    assert len(hashing._EARLY) == 7  # the old file's blocks: not taken
    assert hashing.hash_early(tmp_path / "missing.bin", spans) == 0


def _reference_blocks(data: bytes, block: int) -> str:
    digests = b"".join(xxhash.xxh3_128(data[b : b + block]).digest() for b in range(0, len(data), block))
    return xxhash.xxh3_128(digests).hexdigest()


def _pieces(rng: random.Random, n: int, block: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut at random points: some on block edges, pieces smaller and larger than a block."""
    cuts = {0, n}
    for _ in range(rng.randint(0, 12)):
        cuts.add(rng.choice([rng.randrange(n + 1), rng.randrange(n // block + 1) * block]) if n else 0)
    cuts = sorted(c for c in cuts if c <= n)
    return list(zip(cuts, cuts[1:]))


@pytest.mark.parametrize("seed", range(40))
def test_a_stream_hash_fed_in_any_order_is_the_file_hash(monkeypatch, seed):
    """Pieces of a range fed in a random order (writer threads) give :class:`RangeHash`'s block hash of the bytes
    (block size shrunk so that ranges span many blocks); a missing or overlapping piece makes it incomplete."""
    from ctconvert.checkpoint import hashing

    rng = random.Random(seed)
    block = rng.choice([16, 64, 100])
    monkeypatch.setattr(hashing, "HASH_BLOCK_BYTES", block)
    n = rng.choice([0, 1, block - 1, block, block + 1, rng.randrange(1, 12 * block)])
    data = rng.randbytes(n)
    ref = xxhash.xxh3_128(b"".join(xxhash.xxh3_128(data[b : b + block]).digest() for b in range(0, n, block))).digest()
    pieces = _pieces(rng, n, block)
    rng.shuffle(pieces)
    h = hashing.StreamHash()
    for a, b in pieces:
        assert not h.complete(n) or a == b
        h.update_at(a, data[a:b])
    assert h.complete(n) and h.pos == n and h.digest() == ref
    if len(pieces) > 1:  # one piece missing: incomplete
        h = hashing.StreamHash()
        for a, b in pieces[1:]:
            h.update_at(a, data[a:b])
        assert not h.complete(n)
    if n > 2:  # an overlapping piece: never complete
        h = hashing.StreamHash()
        for a, b in pieces:
            h.update_at(a, data[a:b])
        h.update_at(n // 2, data[n // 2 : n // 2 + 1])
        assert not h.complete(n)


def test_a_stream_hash_fed_by_threads_is_the_file_hash(monkeypatch):
    import threading

    from ctconvert.checkpoint import hashing

    monkeypatch.setattr(hashing, "HASH_BLOCK_BYTES", 4096)
    rng = random.Random(7)
    data = rng.randbytes(200_003)
    pieces = [(a, min(a + 3001, len(data))) for a in range(0, len(data), 3001)]
    rng.shuffle(pieces)
    h = hashing.StreamHash()
    threads = [threading.Thread(target=lambda part: [h.update_at(a, data[a:b]) for a, b in part], args=(pieces[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = xxhash.xxh3_128(b"".join(xxhash.xxh3_128(data[b : b + 4096]).digest() for b in range(0, len(data), 4096))).digest()
    assert h.complete(len(data)) and h.digest() == ref


def test_small_ranges_share_jobs_and_hash_as_each_alone(tmp_path, monkeypatch):
    """Many small ranges (a MoE's experts) are hashed by a few jobs of consecutive ranges, never more than
    JOB_SPANS ranges or JOB_BYTES bytes a job (a larger range alone); each range's hash is its own block hash, as
    hashing it alone gives (empty ranges, ranges of several blocks and ranges in two files among them)."""
    from ctconvert.checkpoint import hashing

    monkeypatch.setattr(hashing, "HASH_BLOCK_BYTES", 4096)
    monkeypatch.setattr(hashing, "JOB_BYTES", 4096)
    monkeypatch.setattr(hashing, "JOB_SPANS", 7)
    monkeypatch.setattr(hashing, "_EARLY", {})
    rng = random.Random(11)
    infos, want = [], {}
    for f in ("a.bin", "b.bin"):
        sizes = [rng.choice([0, 1, 5, 300, 1000, 4096, 9000]) for _ in range(40)]
        data = rng.randbytes(sum(sizes) + 17)
        (tmp_path / f).write_bytes(data)
        pos = 17
        for i, n in enumerate(sizes):
            name = f"{f}.{i}"
            infos.append(TensorInfo(name, tmp_path / f, "U8", (n,), pos, n))
            want[name] = _reference_blocks(data[pos : pos + n], 4096)
            pos += n
    jobs = []
    real = hashing._pool().submit
    monkeypatch.setattr(hashing._pool(), "submit", lambda fn, path, spans, *a: jobs.append(spans) or real(fn, path, spans, *a))
    assert hash_tensors(infos) == want
    blocks = sum(-(-i.nbytes // 4096) for i in infos)
    assert sum(len(j) for j in jobs) == blocks and len(jobs) < blocks
    assert all(len(j) <= 7 and (len(j) == 1 or sum(k for _, k in j) <= 4096) for j in jobs)


def test_a_range_the_file_lacks_fails_alone_in_its_job(tmp_path, monkeypatch):
    """Ranges hashed by one job: the one past the end of a truncated file raises its OSError when its hash is
    asked for; the others in the job hash as they would alone (the error belongs to the tensor whose bytes are
    missing, not to its neighbours)."""
    from ctconvert.checkpoint import hashing

    monkeypatch.setattr(hashing, "_EARLY", {})
    data = random.Random(3).randbytes(1000)
    path = tmp_path / "t.bin"
    path.write_bytes(data)
    spans = [(0, 300), (300, 500), (800, 400)]  # the last needs 1200 bytes of 1000
    jobs = []
    real = hashing._pool().submit
    monkeypatch.setattr(hashing._pool(), "submit", lambda fn, p, s, *a: jobs.append(s) or real(fn, p, s, *a))
    h = hashing.SourceHashes(_range_infos(path, spans))
    assert len(jobs) == 1  # all three in one job
    assert h.get("t0") == _reference_blocks(data[:300], hashing.HASH_BLOCK_BYTES)
    assert h.get("t1") == _reference_blocks(data[300:800], hashing.HASH_BLOCK_BYTES)
    with pytest.raises(OSError, match="shorter than expected"):
        h.get("t2")
