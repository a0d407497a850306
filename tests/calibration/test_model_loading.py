"""How calibration loads its layers: from the prefetcher, freed by reference counting (no garbage collection pass
needed), the staging groups covering every tensor it loads, and the model check_buildable built reused by calibrate
(once, for the same checkpoint object) with results equal to a fresh build."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

from ctconvert.calibration import model as cal_model
from ctconvert.calibration.model import CalibrationModel, calibrate, calibrate_whole_model, check_buildable
from ctconvert.checkpoint.reader import open_checkpoint

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

pytest.importorskip("transformers")
warnings.filterwarnings("ignore")

SMALL = dict(LLAMA_CONFIG, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=3)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("load") / "llama", llama_tensors(SMALL, seed=4), SMALL)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("load") / "other", llama_tensors(SMALL, seed=9), SMALL)


def _tokens():
    return torch.randint(0, 380, (4, 16), generator=torch.Generator().manual_seed(2))


def _devices():
    return [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _same(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k].min, b[k].min) and torch.equal(a[k].max, b[k].max), k


def test_staging_groups_cover_what_is_loaded(llama):
    ckpt = open_checkpoint(llama)
    cm = CalibrationModel(ckpt, torch.device("cpu"))
    groups = [{i.name for i in g} for g in cm.staging_groups()]
    assert len(groups) == 1 + SMALL["num_hidden_layers"]
    assert groups[0] == {"model.embed_tokens.weight", "model.norm.weight"}  # the head is not run
    for i, g in enumerate(groups[1:]):
        assert g == {n for n in ckpt.tensors if n.startswith(f"model.layers.{i}.")}


@pytest.mark.parametrize("device", _devices())
def test_layers_are_freed_without_a_collection(llama, monkeypatch, device):
    """Every tensor a layer loaded is gone when the next layer starts, with the garbage collector off: nothing but
    reference counting frees them (a cycle holding one would keep it alive)."""
    loaded: dict[int, list] = {}
    real = CalibrationModel._materialize

    def materialize(self, module, prefix, recurse=True, staged=None):
        real(self, module, prefix, recurse, staged)
        if prefix.startswith("model.layers."):
            layer = int(prefix.split(".")[2])
            assert all(r() is None for i in range(layer) for r in loaded[i]), f"a tensor of an earlier layer is alive at layer {layer}"
            loaded[layer] = [weakref.ref(t) for t in [*module.parameters(), *module.buffers()]]

    monkeypatch.setattr(CalibrationModel, "_materialize", materialize)
    was = gc.isenabled()
    gc.disable()
    try:
        stats = calibrate(open_checkpoint(llama), _tokens(), torch.device(device), kv_cache=True, batch_tokens=32)
        assert all(r() is None for refs in loaded.values() for r in refs)
    finally:
        if was:
            gc.enable()
    assert len(loaded) == SMALL["num_hidden_layers"] and stats.inputs


@pytest.mark.parametrize("device", _devices())
def test_calibrate_reuses_the_checked_model(llama, other, monkeypatch, device):
    ckpt, dev = open_checkpoint(llama), torch.device(device)
    fresh = calibrate(ckpt, _tokens(), dev, kv_cache=True, batch_tokens=32)
    builds = []
    real_init = CalibrationModel.__init__

    def init(self, *a, **k):
        builds.append(a[0])
        real_init(self, *a, **k)

    monkeypatch.setattr(CalibrationModel, "__init__", init)
    check_buildable(ckpt)
    # another model built in between registers its own attention observer: the checked one must register again
    calibrate(open_checkpoint(other), _tokens(), dev, kv_cache=True, batch_tokens=32)
    reused = calibrate(ckpt, _tokens(), dev, kv_cache=True, batch_tokens=32)
    assert [b is ckpt for b in builds] == [True, False]  # the check's build, then the other checkpoint's; none for ckpt
    _same(reused.inputs, fresh.inputs)
    _same(reused.keys, fresh.keys)
    _same(reused.values, fresh.values)
    calibrate(ckpt, _tokens(), dev, kv_cache=True, batch_tokens=32)  # taken once: a second run builds its own
    assert len(builds) == 3 and not cal_model._PREBUILT


def test_layers_out_of_order_are_an_internal_error(llama):
    from ctconvert.errors import CTConvertError

    cm = CalibrationModel(open_checkpoint(llama), torch.device("cpu"))
    with cm.prefetching():
        cm.load_outside()
        with pytest.raises(CTConvertError, match="internal: calibration loads group 3 but the prefetcher read group 1"):
            cm.run_layer(2, [], [])


@pytest.mark.parametrize("device", _devices())
def test_prefetched_equals_whole_model(llama, device):
    ckpt, dev = open_checkpoint(llama), torch.device(device)
    s = calibrate(ckpt, _tokens(), dev, kv_cache=True, batch_tokens=32)
    w = calibrate_whole_model(ckpt, _tokens(), dev, kv_cache=True, batch_tokens=32)
    _same(s.inputs, w.inputs)
    _same(s.keys, w.keys)


def test_every_tensor_comes_from_the_prefetcher(llama, monkeypatch):
    """Inside calibrate nothing is read on the calling thread: every module of a group (the embedding and the final
    norm of group 0 too) takes its tensors from the one staged group."""
    calls = []
    real = cal_model.read_tensor
    monkeypatch.setattr(cal_model, "read_tensor", lambda info: calls.append(info.name) or real(info))
    calibrate(open_checkpoint(llama), _tokens(), torch.device("cpu"), kv_cache=True, batch_tokens=32)
    assert calls == []
