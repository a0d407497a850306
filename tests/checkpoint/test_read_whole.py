"""``read_whole``: whole tensors read together, each span of a file once, the bytes ``read_bytes`` gives each."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ctconvert.checkpoint import safetensors_io as sio
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.plan.planner import make_plan

from conftest import write_checkpoint


def _checkpoint(tmp_path, poison=None):
    """gpt-oss-like fused experts with biases (per-expert views: gate and up share each expert's region), norms and
    biases of three dtypes back to back, and a tensor in a second shard."""
    g = torch.Generator().manual_seed(11)
    e, h, i = 5, 64, 48
    p = "model.layers.0."
    t = {
        p + "mlp.experts.gate_up_proj": (torch.randn(e, h, 2 * i, generator=g) * 0.1).bfloat16(),
        p + "mlp.experts.gate_up_proj_bias": torch.randn(e, 2 * i, generator=g).bfloat16(),
        p + "mlp.experts.down_proj": (torch.randn(e, i, h, generator=g) * 0.1).bfloat16(),
        p + "mlp.experts.down_proj_bias": torch.randn(e, h, generator=g).bfloat16(),
        p + "input_layernorm.weight": torch.randn(h, generator=g).float(),
        p + "post_attention_layernorm.weight": torch.randn(h, generator=g).half(),
        p + "self_attn.sinks": torch.randn(8, generator=g).bfloat16(),
        "model.norm.weight": torch.randn(h, generator=g).bfloat16(),
    }
    if poison is not None:
        name, idx, v = poison
        t[name][idx] = v
    return write_checkpoint(tmp_path / "src", t, {"model_type": "gpt_oss", "hidden_size": h, "num_local_experts": e}, shards=2)


def _views(src):
    ckpt = open_checkpoint(src)
    plan = make_plan(ckpt, "NVFP4A16", targets=["Linear", r"re:.*mlp\.experts\.\d+\..*"], allow_unloadable=True)
    tensors = {**ckpt.tensors, **plan.views}
    return [tensors[u.sources[0]] for u in plan.units if u.kind == "copy"]


def test_each_tensor_gets_the_bytes_read_bytes_gives_it(tmp_path, monkeypatch):
    infos = _views(_checkpoint(tmp_path))
    assert sum(i.view is not None for i in infos) == 10 and sum(i.base is not None and i.view is None for i in infos) == 5  # gate/up, down biases
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, pos: calls.append(pos) or real(fd, bufs, pos))
    shuffled = [infos[j] for j in torch.randperm(len(infos), generator=torch.Generator().manual_seed(3)).tolist()]
    got = sio.read_whole(shuffled)
    runs = len(calls)
    monkeypatch.setattr(os, "preadv", real)
    for info, data, r in zip(shuffled, got.pieces, got.run_of):
        assert torch.equal(data, sio.read_bytes(info, 0, info.nbytes)), info.name
        assert r >= 0 and data.dtype == torch.uint8 and data.numel() == info.nbytes
    # one preadv per run of spans back to back in one file: far fewer than the tensors, at least one per file
    files = {str(i.file) for i in infos}
    assert len(files) <= runs == len(got.runs) < len(infos)
    for buf, dt in got.runs:
        assert dt is None or buf.numel() % sio.DTYPES[dt][1] == 0
    assert any(dt is None for _, dt in got.runs) or len({i.dtype for i in infos}) == 1


def test_a_run_of_one_dtype_is_named_and_mixed_runs_are_not(tmp_path):
    infos = _views(_checkpoint(tmp_path))
    got = sio.read_whole(infos)
    for j, (_, dt) in enumerate(got.runs):
        members = {i.dtype for i, r in zip(infos, got.run_of) if r == j}
        assert dt == (members.pop() if len(members) == 1 else None)


def test_a_computed_tensor_is_read_on_its_own(tmp_path):
    infos = _views(_checkpoint(tmp_path))

    class Virtual:
        def read_bytes(self, offset, nbytes, out=None):
            return torch.arange(nbytes, dtype=torch.uint8)

    v = dataclasses.replace(infos[0], name="computed", virtual=Virtual())
    got = sio.read_whole([v, *infos[1:]])
    assert got.run_of[0] == -1 and torch.equal(got.pieces[0], torch.arange(v.nbytes, dtype=torch.uint8))


def test_a_short_file_names_the_tensor(tmp_path):
    src = _checkpoint(tmp_path)
    infos = _views(src)
    f = infos[-1].file
    os.truncate(f, infos[-1].start + 2)
    with pytest.raises(sio.BadInputError, match="unexpected end of file"):
        sio.read_whole([infos[-1]])
