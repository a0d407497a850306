"""LayerPrefetcher: groups in order with the bytes the safetensors library reads, bounded lookahead, read errors
raised by the take() of the group that needed the tensor (naming file and tensor), page-locked staging for CUDA,
and the reader stopped by close()."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ctconvert.calibration import prefetch as pf_mod
from ctconvert.calibration.prefetch import ALIGN, LayerPrefetcher, default_threads
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Three 'layers' of mixed dtypes and shapes (a 0-d and an empty tensor among them), seeded."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(3):
        p = f"model.layers.{i}."
        out[p + "big.weight"] = torch.randn(96, 70, generator=g).to(torch.bfloat16)  # 13440 bytes: pieces of 1000
        out[p + "norm.weight"] = torch.randn(70, generator=g).to(torch.float16)
        out[p + "scale"] = torch.randn((), generator=g)
        out[p + "ids"] = torch.randint(-100, 100, (7, 3), generator=g, dtype=torch.int64)
        out[p + "empty"] = torch.empty(0, 5, dtype=torch.float32)
    return out


@pytest.fixture
def ckpt_dir(tmp_path) -> Path:
    """One shard per layer (``model-0000{i+1}-of-00003``)."""
    d = tmp_path / "m"
    d.mkdir()
    t = _tensors()
    weight_map = {}
    for i in range(3):
        f = f"model-0000{i + 1}-of-00003.safetensors"
        part = {n: v for n, v in t.items() if n.startswith(f"model.layers.{i}.")}
        save_file(part, str(d / f))
        weight_map.update(dict.fromkeys(part, f))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    return d


def _groups(ckpt):
    return [[ckpt.tensors[n] for n in sorted(ckpt.tensors) if n.startswith(f"model.layers.{i}.")] for i in range(3)]


def _reference(d: Path) -> dict[str, torch.Tensor]:
    ref = {}
    for f in sorted(d.glob("*.safetensors")):
        ref.update(load_file(str(f)))
    return ref


def _pinned_cases():
    return [pytest.param(False, id="cpu"), pytest.param(True, id="pinned", marks=CUDA)]


@pytest.mark.parametrize("pinned", _pinned_cases())
@pytest.mark.parametrize("threads", [1, 3])
def test_groups_in_order_with_the_stored_bytes(ckpt_dir, pinned, threads):
    ckpt = open_checkpoint(ckpt_dir)
    ref = _reference(ckpt_dir)
    groups = _groups(ckpt)
    with LayerPrefetcher(groups, pin_memory=pinned, unpinned=(1,), threads=threads, piece_bytes=1000) as pf:
        for i, infos in enumerate(groups):
            g = pf.take()
            assert g.index == i
            assert [n for n in g.tensors] == [info.name for info in infos]
            assert g.pinned == (pinned and i != 1)
            for name, t in g.tensors.items():
                assert t.dtype == ref[name].dtype and t.shape == ref[name].shape, name
                assert torch.equal(t, ref[name]), name
                assert t.data_ptr() % ALIGN == 0 or t.numel() == 0
                assert t.is_pinned() == g.pinned or t.numel() == 0
                if pinned:  # the device path: an asynchronous copy from the staging buffer, then the same values
                    dev = torch.empty_like(t, device="cuda").copy_(t, non_blocking=g.pinned)
                    assert torch.equal(dev.cpu(), ref[name]), name
            g.release()
        with pytest.raises(IndexError):
            pf.take()


def _count_reads(monkeypatch) -> dict[str, int]:
    """Reads per layer index, counted where the prefetcher reads."""
    seen: dict[str, int] = {}
    lock = threading.Lock()
    real = pf_mod.read_bytes

    def counting(info, offset, nbytes, out=None):
        with lock:
            layer = info.name.split(".")[2]
            seen[layer] = seen.get(layer, 0) + 1
        return real(info, offset, nbytes, out)

    monkeypatch.setattr(pf_mod, "read_bytes", counting)
    return seen


def _wait_for(cond, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("ahead", [1, 2])
def test_lookahead_is_bounded(ckpt_dir, monkeypatch, ahead):
    ckpt = open_checkpoint(ckpt_dir)
    seen = _count_reads(monkeypatch)
    with LayerPrefetcher(_groups(ckpt), ahead=ahead) as pf:
        g0 = pf.take()  # held, not released
        assert _wait_for(lambda: str(ahead - 1) in seen)
        time.sleep(0.3)  # time for a reader that does not wait to read further
        assert sorted(seen) == [str(i) for i in range(ahead)]  # ahead=1: nothing beyond the held group
        g0.release()
        assert _wait_for(lambda: str(ahead) in seen)  # a released slot lets the reader go on
        time.sleep(0.2)
        assert sorted(seen) == [str(i) for i in range(min(3, ahead + 1))]
        assert pf.take().index == 1  # held, never released explicitly: taking the next group releases it
        got = []
        t = threading.Thread(target=lambda: got.append(pf.take().index), daemon=True)
        t.start()
        t.join(10)
        assert got == [2]


def test_read_error_is_raised_by_the_group_that_needs_it(ckpt_dir):
    ckpt = open_checkpoint(ckpt_dir)
    groups = _groups(ckpt)
    ref = _reference(ckpt_dir)
    bad = max(groups[2], key=lambda i: i.start + i.nbytes)  # the last tensor of layer 2's shard: cut the file inside it
    with open(bad.file, "r+b") as f:
        f.truncate(bad.start + 10)
    with LayerPrefetcher(groups, threads=2, piece_bytes=1000) as pf:
        for i in range(2):  # the layers before it come, whole
            g = pf.take()
            assert g.index == i and set(g.tensors) == {info.name for info in groups[i]}
            assert all(torch.equal(t, ref[n]) for n, t in g.tensors.items())
            g.release()
        with pytest.raises(BadInputError) as e:
            pf.take()
    assert "unexpected end of file" in str(e.value) and str(bad.file) in str(e.value)
    assert e.value.tensor == bad.name


def test_missing_shard_names_file_and_tensor(ckpt_dir):
    ckpt = open_checkpoint(ckpt_dir)
    groups = _groups(ckpt)
    victim = groups[0][0]
    victim.file.unlink()
    with LayerPrefetcher(groups) as pf, pytest.raises(BadInputError) as e:
        pf.take()
    assert "read failed" in str(e.value) and str(victim.file) in str(e.value)
    assert e.value.tensor == next(i.name for i in groups[0] if i.file == victim.file)


def test_close_stops_the_reader(ckpt_dir):
    ckpt = open_checkpoint(ckpt_dir)
    pf = LayerPrefetcher(_groups(ckpt), ahead=1)
    pf.take()  # held: the reader waits for a slot
    pf.close()
    assert not pf._thread.is_alive()


def test_bad_arguments_and_threads():
    with pytest.raises(ValueError, match="must be positive"):
        LayerPrefetcher([], ahead=0)
    assert default_threads(torch.device("cpu")) == 1
    assert 1 <= default_threads(torch.device("cuda")) <= 8
