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


def _shard_of_pieces(path, n: int, piece: int):
    """A shard of one U8 tensor of ``n`` pieces of ``piece`` bytes, each a fresh random value (seed 0)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (n * piece,), generator=g, dtype=torch.uint8)
    return ShardFile(path, [PlannedTensor("w", "U8", (n * piece,))], metadata={"format": "pt"}), data


@pytest.mark.parametrize("threaded", ["1", "0"])
def test_writeback_is_started_on_its_own_thread_and_changes_no_byte(tmp_path, monkeypatch, threaded):
    """Every WRITEBACK_BYTES of a shard its writeback is started (sync_file_range) by the process's writeback
    thread, never by the writer (which it blocked for seconds when the disk's queue was full), unless
    CTCONVERT_WRITEBACK_THREAD=0; the file's bytes and hash are the same either way."""
    import threading

    from ctconvert.checkpoint import shard_file as sf

    monkeypatch.setenv("CTCONVERT_WRITEBACK_THREAD", threaded)
    monkeypatch.setattr(sf, "WRITEBACK_BYTES", 4096)
    monkeypatch.setattr(sf, "WRITEBACK", sf.Writeback())
    seen = []
    real = sf.start_writeback
    monkeypatch.setattr(sf, "start_writeback", lambda fd: (seen.append(threading.current_thread().name), real(fd)))
    f, data = _shard_of_pieces(tmp_path / "a.safetensors", 16, 4096)
    for i in range(16):
        f.write("w", data[i * 4096 : (i + 1) * 4096], i * 4096)
        if threaded == "1":  # each request started before the next (a request made while one is pending merges into it)
            for _ in range(200):
                if sf.WRITEBACK.started == len(seen) == i + (i < 15):
                    break
                threading.Event().wait(0.005)
    f.close()
    want = "ctconvert-writeback" if threaded == "1" else threading.current_thread().name
    assert seen == [want] * 15  # not after the last piece (the final fsync writes the rest)
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as s:
        assert torch.equal(s.get_tensor("w"), data)


def test_writeback_skips_a_closed_shard_and_holds_its_descriptor_open_while_it_works(tmp_path, monkeypatch):
    """A shard closed before the writeback thread comes to it is skipped; one being worked on is closed only after
    (the thread's call still finds its descriptor open)."""
    import os
    import threading

    from ctconvert.checkpoint import shard_file as sf

    monkeypatch.setattr(sf, "WRITEBACK", sf.Writeback())
    inside, go, fds = threading.Event(), threading.Event(), []

    def slow(fd):
        inside.set()
        go.wait(10)
        fds.append(os.fstat(fd).st_size)  # raises (EBADF) had close() closed it meanwhile

    monkeypatch.setattr(sf, "start_writeback", slow)
    f, data = _shard_of_pieces(tmp_path / "a.safetensors", 2, 4096)
    f.write_many([("w", data, 0)])
    sf.WRITEBACK.request(f)
    assert inside.wait(10)
    closer = threading.Thread(target=f.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close waits for the thread's call
    go.set()
    closer.join(10)
    assert not closer.is_alive() and fds == [f.size]
    done = sf.WRITEBACK.started
    sf.WRITEBACK.request(f)  # closed: skipped
    for _ in range(100):
        if not sf.WRITEBACK._pending:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.05)
    assert sf.WRITEBACK.started == done and fds == [f.size]


def test_a_forked_child_starts_its_own_writeback_thread(tmp_path):
    """The writeback thread does not survive a fork: a child that writes a shard after its parent started the thread
    gets one of its own (else its requests would wait for a thread that is not there)."""
    import os

    from ctconvert.checkpoint import shard_file as sf

    f, data = _shard_of_pieces(tmp_path / "parent.safetensors", 1, 4096)
    sf.WRITEBACK.request(f)  # the parent's thread exists now
    f.write_many([("w", data, 0)])
    f.close()
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if its own thread started the writeback
        code, before = 1, sf.WRITEBACK.started
        try:
            g, d = _shard_of_pieces(tmp_path / "child.safetensors", 2, 4096)
            g.write_many([("w", d[:4096], 0)])
            sf.WRITEBACK.request(g)
            for _ in range(500):
                if sf.WRITEBACK.started > before:
                    code = 0
                    break
                __import__("time").sleep(0.01)
            g.write_many([("w", d[4096:], 4096)])
            g.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
