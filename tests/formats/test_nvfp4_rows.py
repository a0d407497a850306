"""NVFP4 with one global scale per row (the rows of several fused sets stacked, pipeline/batches.py): every
implementation gives each run of rows the bits it gets alone with its own scale, for scales inside and outside
the reciprocal path's range ([2^-55, 2^55]), rows of zeros, tiny and huge values, row counts that are not a
multiple of the kernel's tile; a count of scales that is neither 1 nor N is refused."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.plan.schemes import resolve_scheme

from conftest import cuda_params

IMPLS = ["auto", "torch"]


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_per_row_global_scales_give_each_set_its_own_bits(device, impl, dtype):
    scheme = resolve_scheme("NVFP4A16")
    g = torch.Generator().manual_seed(21)
    rows = [13, 8, 1, 27, 5]  # not multiples of the kernel's 8-row tile
    mags = [1e-3, 1.0, 0.0, 300.0, 1e-6]
    parts = []
    for r, mag in zip(rows, mags):
        w = torch.randn(r, 96, generator=g) * mag
        if r > 2:
            w[1] = 0
            w[2, 5] = -0.0
        parts.append(w.to(dtype))
    gss = [nvfp4_global_scale(p.abs().amax().float(), dtype) for p in parts]
    gss[1] = torch.tensor([2.0**60])  # outside the reciprocal path's range: that tile takes the exact division
    w = torch.cat(parts).to(device)
    per_row = torch.cat([gs.expand(r) for gs, r in zip(gss, rows)]).reshape(-1, 1)
    got = scheme.quantize_rows(w, per_row.to(device), impl=impl)
    r0 = 0
    for p, gs, r in zip(parts, gss, rows):
        want = scheme.quantize_rows(p.to(device), gs.to(device), impl=impl)
        for k, t in want.items():
            assert torch.equal(_bits(got[k][r0 : r0 + r]), _bits(t)), (k, r0)
        r0 += r


@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("impl", IMPLS)
def test_a_scale_count_that_is_neither_one_nor_the_rows_is_refused(device, impl):
    scheme = resolve_scheme("NVFP4A16")
    w = torch.randn(6, 32).bfloat16().to(device)
    with pytest.raises(ValueError, match="3 for 6 rows"):
        scheme.quantize_rows(w, torch.ones(3, 1, device=device), impl=impl)
