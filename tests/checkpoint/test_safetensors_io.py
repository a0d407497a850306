"""safetensors_io's helpers for derived expert tensors and mapped rows: the blocked transpose, the region cache
(one read per region while a run is active, none kept outside one), and the populating of mappings; map_bytes: a
byte range of a stored tensor as a view of a private mapping, equal to the bytes the file holds (read independently
here with open/seek), at any offset (none page-aligned), whole, empty, and for derived tensors (gpt-oss experts
split from a fused tensor: the read fallback)."""

from __future__ import annotations

import mmap

import pytest
import torch

from ctconvert.checkpoint import safetensors_io as sio
from ctconvert.checkpoint.families import split_fused_experts
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import REGIONS, RegionCache, SliceView, TensorInfo, map_bytes, map_rows, populate, read_rows, read_tensor

from conftest import write_checkpoint


def _gpt_oss_expert(tmp_path, h=130, i=48, experts=3):
    """A raw file holding a fused [E, H, 2I] bf16 tensor (gpt-oss: x @ W, gate/up interleaved) and the derived
    TensorInfos of expert 1's gate and up, as checkpoint/families.py makes them."""
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(experts, h, 2 * i, generator=g).to(torch.bfloat16)
    path = tmp_path / "experts.bin"
    pad = 24  # data does not start at 0
    path.write_bytes(b"\0" * pad + fused.reshape(-1).view(torch.uint8).numpy().tobytes())
    per = h * 2 * i * 2
    views = [SliceView(h, 2 * i, True, j, 2) for j in (0, 1)]
    return fused, [TensorInfo(f"e.1.{n}", path, "BF16", (i, h), pad + per, i * h * 2, base="e", view=v) for n, v in zip(("gate", "up"), views)]


def test_transposed_expert_rows_and_one_read_per_region(tmp_path, monkeypatch):
    fused, (gate, up) = _gpt_oss_expert(tmp_path)
    reads = []
    real = sio.read_span

    def counting(info, pos, nbytes, out=None):
        reads.append((pos, nbytes))
        return real(info, pos, nbytes, out)

    monkeypatch.setattr(sio, "read_span", counting)
    with REGIONS.active():
        g, u = read_rows(gate, 0, gate.shape[0]), read_rows(up, 5, 20)
    assert torch.equal(g, fused[1][:, 0::2].t()) and torch.equal(u, fused[1][:, 1::2].t()[5:20])
    assert len(reads) == 1  # gate and up: one region read
    reads.clear()
    assert torch.equal(read_rows(up, 0, up.shape[0]), fused[1][:, 1::2].t())
    assert torch.equal(read_rows(up, 0, up.shape[0]), fused[1][:, 1::2].t())
    assert len(reads) == 2  # no run active: every read goes to the file, nothing is kept
    assert not len(REGIONS)


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("h,i,rows", [(130, 48, None), (64, 17, (3, 11)), (1, 5, (0, 5)), (40, 8, (7, 7))])
def test_rows_of_a_region_on_any_device_are_read_rows(tmp_path, device, h, i, rows):
    """rows_of_region (a GPU gathers a transposed expert's columns itself; read_rows takes it too for a transposed view)
    gives the expert's own rows, sliced independently out of the fused tensor, and read_rows' values, for transposed
    gate/up views (every other column) and a plain strided view, whole or a row range (empty too), for shapes that
    are not multiples of anything."""
    fused, views = _gpt_oss_expert(tmp_path, h=h, i=i)
    n = h // 2 or 1
    plain = TensorInfo("e.1.rows", views[0].file, "BF16", (n, 2 * i), views[0].start, n * 2 * i * 2, base="e", view=SliceView(h, 2 * i, False, h % 2, 2))
    for info in [*views, plain] if h > 1 else views:
        r0, r1 = rows or (0, info.shape[0])
        region = sio.read_region(info)
        assert region.numel() == sio.region_bytes(info) == h * 2 * i * 2 and torch.equal(region.view(torch.bfloat16).reshape(h, 2 * i), fused[1])
        got = sio.rows_of_region(info, region.to(device), r0, r1)
        want = read_rows(info, r0, r1)
        v = info.view
        own = (fused[1][:, v.offset :: v.step].t() if v.transpose else fused[1][v.offset :: v.step])[r0:r1]  # the reference
        assert torch.equal(want.view(torch.int16), own.contiguous().view(torch.int16)), info.name
        assert got.device.type == device and got.is_contiguous() and got.shape == want.shape == (r1 - r0, *info.shape[1:])
        assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)), info.name
    pinned = torch.empty(sio.region_bytes(views[0]) + 7, dtype=torch.uint8)  # into a larger buffer, as the executor's pool gives
    assert torch.equal(sio.read_region(views[0], out=pinned)[: sio.region_bytes(views[0])], sio.read_region(views[0]))


def test_region_cache_keeps_at_most_size_regions_and_sees_a_changed_file_after_a_run(tmp_path):
    fused, (gate, _) = _gpt_oss_expert(tmp_path)
    cache = RegionCache(size=1)
    other = TensorInfo("e.0.gate", gate.file, "BF16", gate.shape, gate.start - gate.view.rows * gate.view.cols * 2, gate.nbytes, base="e", view=gate.view)
    with cache.active():
        a = cache.get(gate)
        assert cache.get(gate) is a
        b = cache.get(other)
        assert len(cache) == 1 and cache.get(other) is b and cache.get(gate) is not a
        with cache.active():  # nested (two executors): the inner one leaving keeps the regions
            pass
        assert len(cache)
    assert not len(cache)
    assert torch.equal(a.view(torch.bfloat16).reshape(fused.shape[1:]), fused[1])
    with open(gate.file, "r+b") as f:  # the file changes between runs: the next run reads it again
        f.seek(gate.start)
        f.write(b"\x11" * 64)
    with cache.active():
        assert cache.get(gate)[:64].tolist() == [0x11] * 64


def test_populate_falls_back_to_willneed_and_ignores_refusals():
    seen = []

    class Refusing:
        def __init__(self, refuse):
            self.refuse = refuse

        def madvise(self, advice):
            seen.append(advice)
            if advice in self.refuse:
                raise OSError(22, "Invalid argument")

    populate(Refusing({sio.MADV_POPULATE_READ}))
    assert seen == [sio.MADV_POPULATE_READ, mmap.MADV_WILLNEED]
    seen.clear()
    populate(Refusing({sio.MADV_POPULATE_READ, mmap.MADV_WILLNEED}))  # advice only: no error
    assert seen == [sio.MADV_POPULATE_READ, mmap.MADV_WILLNEED]


def test_mapped_rows_are_the_file_bytes(tmp_path):
    g = torch.Generator().manual_seed(2)
    t = torch.randn(70, 33, generator=g).to(torch.bfloat16)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 8 + t.reshape(-1).view(torch.uint8).numpy().tobytes())
    info = TensorInfo("t", path, "BF16", (70, 33), 8, t.numel() * 2)
    assert torch.equal(map_rows(info, 3, 61), t[3:61]) and torch.equal(map_rows(info, 0, 70), t)


def _file_bytes(info, offset, nbytes) -> bytes:
    with open(info.file, "rb") as f:
        f.seek(info.start + offset)
        return f.read(nbytes)


def test_map_bytes_equals_the_file_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = {"a.weight": torch.randn(300, 77, generator=g).to(torch.bfloat16), "b.weight": torch.randn(5, generator=g), "c.weight": torch.randn(3, 4)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "llama"}))
    for name in t:
        info = ck.tensors[name]
        for off, n in [(0, info.nbytes), (1, info.nbytes - 1), (3, 5), (info.nbytes - 7, 7), (info.nbytes // 2, 0)]:
            got = map_bytes(info, off, n)
            assert got.dtype == torch.uint8 and got.numel() == n
            assert bytes(got.numpy()) == _file_bytes(info, off, n), (name, off, n)


def test_map_bytes_of_a_derived_tensor_reads_its_own_bytes(tmp_path):
    gate_up = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # gpt-oss: [E, H, 2I] interleaved
    t = {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": torch.randn(2, 3, 4).to(torch.bfloat16)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "gpt_oss", "hidden_size": 4, "num_experts": 2}))
    part = next(q for fe in split_fused_experts(ck.tensors, ck.config).values() for q in fe.parts if q.view is not None)
    want = read_tensor(part).contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(map_bytes(part, 2, want.numel() - 2), want[2:])


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("short", [False, True], ids=["whole", "short-writes"])
def test_write_many_writes_neighbours_by_one_pwritev_and_the_file_reads_back(tmp_path, monkeypatch, short, native):
    """ShardFile.write_many: pieces in any order, empty ones, pieces of one tensor and neighbours in the file, give the
    same file and the same content hash as writing each alone, read back independently (safetensors' own loader); runs
    of neighbours go by one pwritev (counted), and a pwritev that writes less than asked (``short``) is finished.
    ``native``: each write_many is one call of :func:`.native_write.write_item` (counted; ``short``: at most 5 bytes a
    pwritev), else ``os.pwritev`` from Python."""
    import os
    import random

    from safetensors.torch import load_file

    from ctconvert.checkpoint.hashing import shard_hash
    from ctconvert.checkpoint.shard_file import PlannedTensor, ShardFile

    g = torch.Generator().manual_seed(3)
    tensors = {f"e{i}.weight_packed": torch.randint(0, 255, (5 + i, 24), dtype=torch.uint8, generator=g) for i in range(6)}
    tensors |= {f"e{i}.weight_scale": torch.randint(0, 255, (5 + i, 3), dtype=torch.uint8, generator=g) for i in range(6)}
    tensors |= {f"e{i}.weight_global_scale": torch.rand(1, generator=g) for i in range(6)}
    tensors["empty"] = torch.empty(0, dtype=torch.float32)
    order = [f"e{i}.{p}" for i in range(6) for p in ("weight_packed", "weight_scale", "weight_global_scale")] + ["empty"]
    planned = [PlannedTensor(n, {torch.uint8: "U8", torch.float32: "F32"}[tensors[n].dtype], tuple(tensors[n].shape)) for n in order]
    calls = []
    real = os.pwritev

    def pwritev(fd, bufs, offset):
        calls.append(len(bufs))
        if short and len(bufs) > 1:  # a short write: the first buffer and part of the second
            return real(fd, [bufs[0], memoryview(bufs[1]).cast("B")[: len(bufs[1]) // 2]], offset)
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    from ctconvert.checkpoint import native_write, shard_file

    if native and not native_write.available():
        pytest.skip("no C compiler, CTCONVERT_NATIVE=0, or xxhash without XXH3_128bits")
    monkeypatch.setattr(shard_file, "native_available", lambda: native)
    items = []
    real_item = shard_file.write_item

    def write_item(fd, whole, runs, cap=0):
        items.append([len(bufs) for _, bufs in runs])
        return real_item(fd, whole, runs, cap=5 if short else 0)

    monkeypatch.setattr(shard_file, "write_item", write_item)
    one = ShardFile(tmp_path / "one.safetensors", planned)
    for n in order:
        one.write(n, tensors[n])
    one.close()
    many = ShardFile(tmp_path / "many.safetensors", planned)
    pieces = [(n, tensors[n], 0) for n in order if n != "e5.weight_packed"]
    pieces += [("e5.weight_packed", tensors["e5.weight_packed"][:4], 0), ("e5.weight_packed", tensors["e5.weight_packed"][4:], 4 * 24)]
    random.Random(5).shuffle(pieces)
    many.write_many(pieces[:9])
    many.write_many(pieces[9:])
    many.close()
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "many.safetensors").read_bytes()
    assert many.content_hash() == one.content_hash() == shard_hash(tmp_path / "many.safetensors")
    back = load_file(tmp_path / "many.safetensors")
    assert set(back) == set(tensors) and all(torch.equal(back[n], tensors[n]) for n in tensors)
    if native:
        assert not calls and len(items) == len(order) + 1  # one call a write_many of bytes (not the empty tensor's)
        assert max(max(r, default=0) for r in items) > 1  # neighbours went together
    else:
        assert calls and max(calls) > 1 and not items  # neighbours went together
