"""Marlin scales, bias and zero points (ctconvert.layouts.marlin_scales): exact inverses, and marlin's re-exports."""

from __future__ import annotations

import pytest
import torch

from ctconvert.layouts import marlin
from ctconvert.layouts import marlin_scales as ms


@pytest.mark.parametrize(("k", "n", "group"), [(256, 128, 128), (128, 64, -1), (64, 100, 64)])
def test_scales_and_bias_round_trip(k, n, group):
    g = torch.Generator().manual_seed(1)
    groups = 1 if group == -1 else k // group
    s = torch.randn(groups, n, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.float16)
    ps = ms.marlin_permute_scales(s, k, n, group)
    assert torch.equal(ms.marlin_unpermute_scales(ps, k, n, group), s)
    pb = ms.marlin_permute_bias(b, k, n, group)
    assert pb.dim() == 1 and torch.equal(ms.marlin_unpermute_bias(pb, k, n, group), b)


def test_zero_points_round_trip():
    g = torch.Generator().manual_seed(2)
    k, n, group = 256, 64, 128
    zp = torch.randint(-(2**31), 2**31 - 1, (n * 4 // 32, k // group), dtype=torch.int32, generator=g)
    mz = ms.marlin_zero_points(zp, k, n, 4, group_size=group)
    assert torch.equal(ms.marlin_unzero_points(mz, k, n, 4, group_size=group), zp)


def test_non_zero_padding_is_refused():
    s = torch.ones(1, 100, dtype=torch.float16)
    ps = ms.marlin_permute_scales(s, 128, 100, -1)
    ps.view(-1)[-1] = 1  # a padded column
    with pytest.raises(ValueError, match="padding"):
        ms.marlin_unpermute_scales(ps, 128, 100, -1)


def test_marlin_re_exports_the_same_objects():
    for name in ms.__all__:
        assert getattr(marlin, name) is getattr(ms, name)
