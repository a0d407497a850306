"""The read ahead of the console script's start-up (ctconvert/checkpoint/readahead.py): which files, which bytes."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ctconvert.checkpoint.readahead import StartupReadAhead, shard_files
from ctconvert.checkpoint.reader import open_checkpoint

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _layout(path: Path) -> tuple[int, int]:
    """(header bytes incl. the 8-byte length, tensor bytes) of a safetensors file, read with struct alone."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return 8 + n, len(raw) - 8 - n


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_shards_in_the_readers_order(tiny_llama, tmp_path):
    assert shard_files(tiny_llama) == [Path(f) for f in open_checkpoint(tiny_llama).files]  # index order, 3 shards
    one = write_checkpoint(tmp_path / "one", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG, shards=1)
    assert shard_files(one) == [Path(f) for f in open_checkpoint(one).files] == [one / "model.safetensors"]
    assert shard_files(tmp_path / "missing") == []
    assert shard_files(one / "model.safetensors") == []  # a file, not a folder
    (one / "extra.safetensors").write_bytes((one / "model.safetensors").read_bytes())  # several files and no index
    assert shard_files(one) == [Path(f) for f in open_checkpoint(one).files] == [one / "model.safetensors"]
    (tiny_llama / "model.safetensors.index.json").write_text("{not json")
    assert shard_files(tiny_llama) == []  # the reader says what is wrong; nothing is read ahead


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise: only the headers are read ahead")
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_every_header_then_every_tensor_byte(tiny_llama, chunk):
    before = _digest(tiny_llama)
    firsts = []
    ahead = StartupReadAhead(tiny_llama, chunk=chunk, on_first_read=firsts.append).start()
    ahead.join(30)
    layouts = [_layout(p) for p in shard_files(tiny_llama)]
    assert ahead.headers == sum(h for h, _ in layouts)
    assert ahead.requested == sum(d for _, d in layouts) > chunk  # several chunks, each byte once
    assert firsts == [tiny_llama] and ahead.files == shard_files(tiny_llama)  # once, before the index is read
    assert _digest(tiny_llama) == before  # read only


def test_headers_only_and_a_stop_before_the_start(tiny_llama):
    ahead = StartupReadAhead(tiny_llama, data=False).start()
    ahead.join(30)
    assert ahead.requested == 0 and ahead.headers == sum(_layout(p)[0] for p in shard_files(tiny_llama))
    stopped = StartupReadAhead(tiny_llama)
    stopped.stop()
    stopped.start().stop(wait=30)
    assert (stopped.headers, stopped.requested) == (0, 0)


def test_a_file_that_is_not_safetensors_is_left_to_the_reader(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "a.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")  # header longer than the file
    (folder / "b.safetensors").write_bytes(b"abc")  # shorter than the length field
    ahead = StartupReadAhead(folder).start()
    ahead.join(30)
    assert (ahead.headers, ahead.requested) == (0, 0)


def test_importing_it_imports_no_torch():
    code = "import sys, ctconvert.checkpoint.readahead; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.split() == ["False"]


def test_a_local_run_begins_the_source_hashes_the_conversion_takes(tmp_path, monkeypatch):
    """With ``hash_sources`` the read ahead begins the block hash of every tensor under three dimensions (a fused
    3-D experts tensor is hashed by expert region when split: left out), and the provenance hashes of those tensors
    then take them: the same values as hashing afresh, nothing left over."""
    import torch

    from ctconvert.checkpoint import hashing

    monkeypatch.setattr(hashing, "_EARLY", {})
    tensors = llama_tensors(LLAMA_CONFIG)
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    folder = write_checkpoint(tmp_path / "src", tensors, LLAMA_CONFIG, shards=2)
    fresh = hashing.hash_tensors(list(open_checkpoint(folder).tensors.values()))
    ahead = StartupReadAhead(folder, data=False, hash_sources=True).start()
    ahead.join(30)
    assert ahead.hashed == 0 and not hashing._EARLY  # headers only (a dry run, --resume): nothing hashed
    ahead = StartupReadAhead(folder, hash_sources=True).start()
    ahead.join(30)
    infos = open_checkpoint(folder).tensors
    flat = [i for i in infos.values() if len(i.shape) < 3]
    assert ahead.hashed == len(hashing._EARLY) == sum(-(-i.nbytes // hashing.HASH_BLOCK_BYTES) for i in flat) >= len(tensors) - 1
    assert hashing.hash_tensors(list(infos.values())) == fresh and not hashing._EARLY
