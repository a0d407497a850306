"""The reads of a conversion (pipeline/reads.py): small copied tensors read together in "copies" reads, each once,
within the read's limits, and the same output bytes as when each is read alone, on the CPU (mapped and read input)
and on CUDA, with ``--dense-dtype`` casts and NaN/inf named by tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ctconvert import api
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError
from ctconvert.pipeline import reads
from ctconvert.pipeline.executor import ExecOptions
from ctconvert.plan.planner import make_plan
from ctconvert.plan.schemes import resolve_scheme

from conftest import LLAMA_CONFIG, cuda_params, llama_tensors, write_checkpoint


def _model(tmp_path: Path, dtype=torch.bfloat16, poison: list[str] = ()) -> Path:
    """The tiny Llama (2 shards) with a bias on every attention projection (small copied tensors of several sizes)
    and random norms; ``poison``: tensors whose value 3 is set to NaN."""
    cfg = dict(LLAMA_CONFIG, torch_dtype=str(dtype).removeprefix("torch."), attention_bias=True)
    t = llama_tensors(cfg, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    for name in list(t):
        if name.endswith("_proj.weight") and ".self_attn." in name:
            t[name.removesuffix("weight") + "bias"] = (torch.randn(t[name].shape[0], generator=g) * 0.1).to(dtype)
        if name.endswith("norm.weight"):
            t[name] = (1 + torch.randn(t[name].shape, generator=g) * 0.1).to(dtype)
    for name in poison:
        t[name].view(-1)[3] = float("nan")
    return write_checkpoint(tmp_path / "m", t, cfg, shards=2)


def _reads(path: Path, device: str = "cpu", **kw):
    ckpt = open_checkpoint(path)
    plan = make_plan(ckpt, resolve_scheme("W4A16"))
    return ckpt, plan, list(reads.make_reads(ckpt, plan, ExecOptions(device=torch.device(device), **kw)))


@pytest.mark.parametrize(
    "count, limit, window, span", [(3, 2**20, 128, 2**30), (512, 700, 128, 2**30), (2, 300, 128, 2**30), (512, 2**20, 7, 2**30), (512, 2**20, 128, 300_000)]
)
def test_small_copies_are_read_together_each_once_within_the_limits(tmp_path, monkeypatch, count, limit, window, span):
    monkeypatch.setattr(reads, "SMALL_COPY_BYTES", 600)  # the 256-value bf16 norms (512 B) and 128-value biases, not the embedding
    monkeypatch.setattr(reads, "SMALL_COPIES", count)
    monkeypatch.setattr(reads, "SMALL_COPIES_BYTES", limit)
    monkeypatch.setattr(reads, "BATCH_WINDOW", window)
    monkeypatch.setattr(reads, "SMALL_COPIES_SPAN", span)
    ckpt, plan, got = _reads(_model(tmp_path))
    size = {u: reads.unit_bytes(ckpt, plan.units[u]) for u in range(len(plan.units))}  # a copied tensor's: its bytes
    small = [u for u, unit in enumerate(plan.units) if unit.kind == "copy" and 0 < size[u] <= 600]
    groups = [r.units for r in got if r.kind == "copies"]
    assert len(groups) >= 2  # the case fills a read
    assert sorted(u for g in groups for u in g) == small  # each small copied tensor read once, in a "copies" read
    assert all(r.unit == r.units[0] and r.end_of_pass for r in got if r.kind == "copies")
    assert not [r for r in got if r.kind == "copy" and r.unit in small]
    before = [sum(size[v] for v in range(u)) for u in range(len(plan.units) + 1)]  # source bytes ahead of each unit

    def far(g, u):  # unit u lies past the window or the span of the read that began with g[0]
        return u - g[0] >= window or before[u] - before[g[0]] >= span

    for g in groups:
        assert len(g) <= count and sum(size[u] for u in g[:-1]) < limit  # a read closes on the tensor that fills it
        assert list(g) == sorted(g) and not far(g, g[-1])  # in plan order, near its first tensor
    for g, nxt in zip(groups, groups[1:]):  # every read but the last is full, or closed where the plan moved on
        assert len(g) == count or sum(size[u] for u in g) >= limit or far(g, nxt[0])
    if window < len(plan.units) or span < before[-1]:  # the window or the span closes reads
        assert any(len(g) < count and sum(size[u] for u in g) < limit for g in groups[:-1])
    big = [u for u, unit in enumerate(plan.units) if unit.kind == "copy" and size[u] > 600]
    assert big and all(sum(r.stop - r.start for r in got if r.kind == "copy" and r.unit == u) == size[u] for u in big)


def _tensors(path: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k).view(-1).view(torch.uint8).numpy().tobytes() for k in h.keys()})
    return out


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("mapped, dtype, dense_dtype", [("1", torch.bfloat16, None), ("0", torch.bfloat16, None), ("1", torch.float32, "bf16")])
def test_copies_reads_write_the_bytes_of_reads_alone(tmp_path, monkeypatch, device, mapped, dtype, dense_dtype):
    monkeypatch.setenv("CTCONVERT_MMAP", mapped)
    src = _model(tmp_path, dtype)
    kw = dict(device=device, dense_dtype=dense_dtype) if dense_dtype else dict(device=device)
    together = api.quantize(src, tmp_path / "together", "W4A16", **kw)
    monkeypatch.setattr(reads, "SMALL_COPY_BYTES", 0)  # every copied tensor read alone
    alone = api.quantize(src, tmp_path / "alone", "W4A16", **kw)
    a, b = _tensors(tmp_path / "together"), _tensors(tmp_path / "alone")
    assert a == b and together.output_bytes == alone.output_bytes
    assert len([k for k in a if k.endswith("_proj.bias")]) == 4 * LLAMA_CONFIG["num_hidden_layers"]
    name = "model.layers.1.self_attn.q_proj.bias"  # a copied tensor holds its source's values (cast where asked)
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            if name in h.keys():
                want = h.get_tensor(name).to(torch.bfloat16)
    assert a[name] == want.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("device", cuda_params())
def test_nonfinite_small_copies_are_named(tmp_path, device):
    bad = ["model.layers.1.self_attn.k_proj.bias", "model.layers.0.post_attention_layernorm.weight"]
    src = _model(tmp_path, poison=bad)
    with pytest.raises(BadInputError) as e:
        api.quantize(src, tmp_path / "out", "W4A16", device=device)
    assert e.value.tensor in bad and "NaN" in str(e.value)
    assert not (tmp_path / "out").exists()
    r = api.quantize(src, tmp_path / "out", "W4A16", device=device, allow_nonfinite=True)
    assert sorted(n.split(":")[0] for n in r.notes if "non-finite" in n) == sorted(bad)
