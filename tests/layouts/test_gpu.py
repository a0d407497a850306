"""The Triton Marlin tile kernel gives the torch path's bytes (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.layouts.marlin import marlin_repack, marlin_unrepack

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,g", [(256, 256, 128), (4096, 11008, 128), (11008, 4096, 128), (200, 72, -1), (384, 1000, 128), (128, 64, -1)])
def test_triton_tiles_match_torch(monkeypatch, bits, k, n, g):
    gen = torch.Generator().manual_seed(k * 7 + n + bits)
    pf = 32 // bits
    q_w = torch.randint(-(2**31), 2**31 - 1, (k // pf, n), generator=gen, dtype=torch.int64).to(torch.int32)
    with monkeypatch.context() as m:  # the torch index math, not the C tile kernel (layouts/cpu.py)
        m.setenv("CTCONVERT_NATIVE", "0")
        cpu = marlin_repack(q_w, k, n, bits, group_size=g)
    gpu = marlin_repack(q_w.cuda(), k, n, bits, group_size=g)
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(marlin_unrepack(gpu, k, n, bits, group_size=g).cpu(), q_w)
