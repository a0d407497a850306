"""DevicePreload: the chosen tensors in layer order within the budget, each taken once with the stored bytes (as the
safetensors library reads them), pieces that do not divide a tensor, unreadable tensors not offered (the pass's own
read then names them), and the LayerPrefetcher taking preloaded tensors instead of reading them again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ctconvert.calibration import preload
from ctconvert.calibration.prefetch import LayerPrefetcher
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _model(tmp_path: Path, seed: int = 3) -> Path:
    """Two shards: the embedding, 3 layers (odd sizes, a 0-d and an empty tensor, an awkward dtype), a head."""
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(37, 24, generator=g).to(torch.bfloat16), "lm_head.weight": torch.randn(37, 24, generator=g)}
    for i in range(3):
        p = f"model.layers.{i}."
        t[p + "mlp.up_proj.weight"] = torch.randn(53, 24, generator=g).to(torch.float16)
        t[p + "input_layernorm.weight"] = torch.randn(24, generator=g)
        t[p + "scale"] = torch.randn((), generator=g).to(torch.bfloat16)
        t[p + "empty"] = torch.empty(0, 3)
        t[p + "ids"] = torch.randint(-9, 9, (5, 7), generator=g, dtype=torch.int64)
    d = tmp_path / "m"
    d.mkdir()
    first = {n: v for n, v in t.items() if "layers.2" not in n and "lm_head" not in n}
    save_file(first, str(d / "model-00001-of-00002.safetensors"))
    save_file({n: v for n, v in t.items() if n not in first}, str(d / "model-00002-of-00002.safetensors"))
    wm = {n: "model-00001-of-00002.safetensors" if n in first else "model-00002-of-00002.safetensors" for n in t}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    return d


def _stored(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_choose_orders_embedding_then_layers_and_stops_at_the_budget(tmp_path):
    ckpt = open_checkpoint(_model(tmp_path))
    every = preload.choose(ckpt.tensors.values(), 1 << 40)
    names = [t.name for t in every]
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" not in names
    layers = [int(n.split(".")[2]) for n in names[1:]]
    assert layers == sorted(layers) and set(layers) == {0, 1, 2} and len(names) == 1 + 3 * 5
    budget = sum(t.nbytes for t in every[:4])
    assert [t.name for t in preload.choose(ckpt.tensors.values(), budget)] == names[:4]
    assert [t.name for t in preload.choose(ckpt.tensors.values(), budget - 1)] == names[:3]
    assert preload.choose(ckpt.tensors.values(), 0) == [t for t in every if t.nbytes == 0][:0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("piece", [7, 1000, preload.PIECE_BYTES])
def test_each_tensor_taken_once_with_its_stored_bytes(tmp_path, device, piece):
    d = _model(tmp_path)
    ckpt = open_checkpoint(d)
    ref = _stored(d)
    chosen = preload.choose(ckpt.tensors.values(), 1 << 40)
    p = preload.DevicePreload(chosen, torch.device(device), threads=3, piece_bytes=piece)
    try:
        for info in reversed(chosen):  # any order: take waits for what is still being read
            got = p.take(info)
            assert got is not None and got.device.type == device and got.dtype == torch.uint8 and got.numel() == info.nbytes
            assert torch.equal(got.cpu().view(info.torch_dtype).reshape(info.shape), ref[info.name])
            assert p.take(info) is None  # once
        assert p.take(ckpt.tensors["lm_head.weight"]) is None  # not chosen
        assert p.read_bytes == sum(t.nbytes for t in chosen)
    finally:
        p.close()


def test_an_unreadable_tensor_is_not_offered_and_the_pass_reads_and_names_it(tmp_path):
    d = _model(tmp_path)
    ckpt = open_checkpoint(d)
    chosen = preload.choose(ckpt.tensors.values(), 1 << 40)
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-200])  # truncated after the headers were read: the last tensors are short
    p = preload.DevicePreload(chosen, torch.device("cpu"), threads=2, piece_bytes=64)
    preload.install(p)
    try:
        late = [t for t in chosen if t.file == shard and t.start + t.nbytes > shard.stat().st_size]
        assert late and all(p.take(t) is None for t in late)
        groups = [[t for t in chosen if f"layers.{i}." in t.name] for i in range(3)]
        with LayerPrefetcher(groups) as pf:
            pf.take()
            pf.take()
            with pytest.raises(BadInputError) as e:
                pf.take()
        assert str(shard) in str(e.value) and late[-1].name.split(".")[2] == "2"
    finally:
        preload.install(None)
    assert preload.active() is None


@pytest.mark.parametrize("device", DEVICES)
def test_the_prefetcher_takes_preloaded_tensors_with_the_same_values(tmp_path, device):
    d = _model(tmp_path, seed=11)
    ckpt = open_checkpoint(d)
    ref = _stored(d)
    groups = [[ckpt.tensors["model.embed_tokens.weight"]]] + [[t for n, t in sorted(ckpt.tensors.items()) if f"layers.{i}." in n] for i in range(3)]
    budget = sum(t.nbytes for g in groups[:2] for t in g)  # the embedding and layer 0 preloaded, the rest read
    chosen = preload.choose(ckpt.tensors.values(), budget)
    preload.install(preload.DevicePreload(chosen, torch.device(device), threads=2, piece_bytes=100))
    try:
        with LayerPrefetcher(groups, pin_memory=device == "cuda") as pf:
            for gi, g in enumerate(groups):
                staged = pf.take()
                for info in g:
                    v = staged.get(info.name)
                    assert torch.equal(v.cpu(), ref[info.name]), info.name
                    assert v.device.type == (device if gi < 2 else "cpu"), (gi, info.name)
                staged.release()
        assert preload.active().read_bytes == budget
    finally:
        preload.install(None)


def test_bad_arguments():
    with pytest.raises(ValueError, match="threads"):
        preload.DevicePreload([], torch.device("cpu"), threads=0)
    p = preload.DevicePreload([], torch.device("cpu"))
    p.close()
