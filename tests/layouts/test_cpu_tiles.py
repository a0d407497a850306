"""The C Marlin tile kernel (layouts/tiles.c) gives the torch index math's bytes, padding included."""

from __future__ import annotations

import pytest
import torch

from ctconvert.layouts import cpu
from ctconvert.layouts.marlin import marlin_repack, marlin_unrepack
from ctconvert.layouts.marlin_base import marlin_padded_nk

needs_cc = pytest.mark.skipif(not cpu.available(torch.empty(1)), reason="no C compiler")


@needs_cc
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,g", [(256, 256, 128), (200, 72, -1), (384, 1000, 128), (128, 64, -1), (1024, 192, 128), (64, 4096, 64)])
def test_c_tiles_match_torch(monkeypatch, bits, k, n, g):
    gen = torch.Generator().manual_seed(k * 3 + n + bits)
    pf = 32 // bits
    q_w = torch.randint(-(2**31), 2**31 - 1, (k // pf, n), generator=gen, dtype=torch.int64).to(torch.int32)
    native = marlin_repack(q_w, k, n, bits, group_size=g)
    monkeypatch.setenv("CTCONVERT_NATIVE", "0")
    ref = marlin_repack(q_w, k, n, bits, group_size=g)
    assert torch.equal(native, ref)
    assert torch.equal(marlin_unrepack(native, k, n, bits, group_size=g), q_w)
    # a batch of compressed-tensors words (N, K/pf), read in place
    pn, pk = marlin_padded_nk(n, k, g)
    batch = torch.stack([q_w.t().contiguous(), (~q_w).t().contiguous()])
    monkeypatch.setenv("CTCONVERT_NATIVE", "1")
    got = cpu.marlin_tiles(batch, bits, n, k, pn, pk)
    assert torch.equal(got[0], ref)
    monkeypatch.setenv("CTCONVERT_NATIVE", "0")
    assert torch.equal(got[1], marlin_repack(~q_w, k, n, bits, group_size=g))
