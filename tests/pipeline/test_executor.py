"""The executor's reading set-up: how many reader threads a CPU run takes (one where chunks are mapped views,
more where sources need work: fused experts' slices, dequantized weights), the read-ahead it starts, and
that a run's region cache is gone after it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

from ctconvert import api
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import REGIONS, read_tensor
from ctconvert.pipeline.executor import READERS, ExecOptions, Executor
from ctconvert.plan.planner import make_plan

from conftest import write_checkpoint

E, H, I = 4, 128, 128  # noqa: E741 - experts, hidden, intermediate

CPU = torch.device("cpu")


def _gpt_oss(tmp_path):
    g = torch.Generator().manual_seed(4)
    p = "model.layers.0.mlp.experts."
    t = {p + "gate_up_proj": torch.randn(E, H, 2 * I, generator=g).bfloat16(), p + "down_proj": torch.randn(E, I, H, generator=g).bfloat16()}
    t["model.layers.0.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    return write_checkpoint(tmp_path / "gpt", t, {"model_type": "gpt_oss", "hidden_size": H, "num_local_experts": E})


EXPERTS = ["Linear", r"re:.*mlp\.experts\.\d+\..*"]


def test_cpu_readers_one_for_mapped_chunks_more_for_expert_slices(tiny_llama, tmp_path):
    ckpt = open_checkpoint(tiny_llama)
    assert Executor(ckpt, make_plan(ckpt, "W4A16"), {}, ExecOptions(device=CPU, map_input=True)).readers == 1
    assert Executor(ckpt, make_plan(ckpt, "W4A16"), {}, ExecOptions(device=CPU, map_input=False)).readers == READERS["cpu"]
    moe = open_checkpoint(_gpt_oss(tmp_path))
    plan = make_plan(moe, "W4A16", targets=EXPERTS, allow_unloadable=True)
    moe = dataclasses.replace(moe, tensors={**moe.tensors, **plan.views})  # as the plan stage hands it on
    assert any(moe.tensors[s].view is not None for u in plan.units for s in u.sources)
    assert Executor(moe, plan, {}, ExecOptions(device=CPU, map_input=True)).readers == READERS["cpu"]


def test_read_ahead_follows_the_option(tiny_llama):
    ckpt = open_checkpoint(tiny_llama)
    plan = make_plan(ckpt, "W4A16")
    assert Executor(ckpt, plan, {}, ExecOptions(device=CPU, read_ahead=0)).ahead is None
    ex = Executor(ckpt, plan, {}, ExecOptions(device=CPU, read_ahead=4096))
    assert ex.ahead.window == 4096 and ex.ahead.pieces[0][0] == 0


def test_fused_experts_quantized_and_no_region_kept_after_the_run(tmp_path):
    src = _gpt_oss(tmp_path)
    out = tmp_path / "q"
    api.quantize(src, out, "W4A16", targets=EXPERTS, allow_unloadable=True)
    assert not len(REGIONS)
    ref = tmp_path / "per-expert"  # the same experts stored one tensor each: the same output tensors, bit for bit
    ck = open_checkpoint(src)
    per = {n: read_tensor(i) for n, i in ck.tensors.items() if ".experts." not in n}
    gu, down = read_tensor(ck.tensors["model.layers.0.mlp.experts.gate_up_proj"]), read_tensor(ck.tensors["model.layers.0.mlp.experts.down_proj"])
    for e in range(E):
        p = f"model.layers.0.mlp.experts.{e}."
        per[p + "gate_proj.weight"] = gu[e][:, 0::2].t().contiguous()
        per[p + "up_proj.weight"] = gu[e][:, 1::2].t().contiguous()
        per[p + "down_proj.weight"] = down[e].t().contiguous()
    write_checkpoint(ref, per, {"model_type": "qwen3_moe", "hidden_size": H, "num_experts": E})
    api.quantize(ref, tmp_path / "r", "W4A16")

    def tensors(folder):
        found = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                found.update({k: h.get_tensor(k) for k in h.keys() if ".experts." in k})
        return found

    a, b = tensors(out), tensors(tmp_path / "r")
    assert set(a) == set(b) and len(a) == 3 * E * 3  # weight_packed, weight_scale, weight_shape per expert Linear
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))])
def test_the_chunks_of_one_tensor_go_to_every_writer_and_hash_as_the_file(tiny_llama, tmp_path, monkeypatch, device):
    """A tensor written in many chunks is taken by all the writer threads from their one queue (not one writer per
    tensor), and each shard's hash taken as the pieces came (in any order) is the finished file's; the bytes are those
    of one writer."""
    from ctconvert.checkpoint.hashing import shard_hash
    from ctconvert.checkpoint.shard_file import ShardFile
    from ctconvert.pipeline import executor

    seen: dict[str, set] = {}
    hashes: dict = {}
    real_write, real_close = ShardFile.write_many, ShardFile.close

    def write_many(self, pieces):
        import threading
        import time

        for name, _, _ in pieces:
            seen.setdefault(name, set()).add(threading.current_thread().name)
        time.sleep(0.002)  # a slow disk: the queue fills, and every writer takes from it
        return real_write(self, pieces)

    def close(self):
        if not self.closed:  # close runs once (the second call does nothing)
            real_close(self)
            hashes[self.path.name] = (self.content_hash(), shard_hash(self.path))  # the finished file, before the rename

    monkeypatch.setattr(ShardFile, "write_many", write_many)
    monkeypatch.setattr(ShardFile, "close", close)
    api.quantize(tiny_llama, tmp_path / "many", "W8A16", chunk_elems=256, device=device)  # a few rows per chunk
    assert max(len(w) for w in seen.values()) == executor.WRITERS[device], seen
    assert set(hashes) == {p.name for p in (tmp_path / "many").glob("*.safetensors")} and all(a == b for a, b in hashes.values())
    monkeypatch.setattr(executor, "WRITERS", {"cpu": 1, "cuda": 1})
    api.quantize(tiny_llama, tmp_path / "one", "W8A16", chunk_elems=256, device=device)
    assert {p.name: p.read_bytes() for p in (tmp_path / "many").iterdir() if p.suffix == ".safetensors"} == {
        p.name: p.read_bytes() for p in (tmp_path / "one").iterdir() if p.suffix == ".safetensors"
    }
