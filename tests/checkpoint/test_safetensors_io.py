"""map_bytes: a byte range of a stored tensor as a view of a private mapping, equal to the bytes the file holds
(read independently here with open/seek), at any offset (none page-aligned), whole, empty, and for derived
tensors (gpt-oss experts split from a fused tensor: the read fallback)."""

from __future__ import annotations

import torch

from ctconvert.checkpoint.families import split_fused_experts
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import map_bytes, read_tensor

from conftest import write_checkpoint


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
