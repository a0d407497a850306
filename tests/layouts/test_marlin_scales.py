"""Marlin scales, bias and zero points (ctconvert.layouts.marlin_scales): exact inverses, and marlin's re-exports."""

from __future__ import annotations

import pytest
import torch

from ctconvert.layouts import marlin, marlin_scales
from ctconvert.layouts.marlin_scales import (
    marlin_permute_bias,
    marlin_permute_scales,
    marlin_unpermute_bias,
    marlin_unpermute_scales,
    marlin_unzero_points,
    marlin_zero_points,
)


@pytest.mark.parametrize(("k", "n", "group"), [(256, 128, 128), (128, 64, -1), (64, 100, 64)])
def test_scales_and_bias_round_trip(k, n, group):
    g = torch.Generator().manual_seed(1)
    groups = 1 if group == -1 else k // group
    s = torch.randn(groups, n, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.float16)
    ps = marlin_permute_scales(s, k, n, group)
    assert torch.equal(marlin_unpermute_scales(ps, k, n, group), s)
    pb = marlin_permute_bias(b, k, n, group)
    assert pb.dim() == 1 and torch.equal(marlin_unpermute_bias(pb, k, n, group), b)


def test_zero_points_round_trip():
    g = torch.Generator().manual_seed(2)
    k, n, group = 256, 64, 128
    zp = torch.randint(-(2**31), 2**31 - 1, (n * 4 // 32, k // group), dtype=torch.int32, generator=g)
    mz = marlin_zero_points(zp, k, n, 4, group_size=group)
    assert torch.equal(marlin_unzero_points(mz, k, n, 4, group_size=group), zp)


def test_non_zero_padding_is_refused():
    s = torch.ones(1, 100, dtype=torch.float16)
    ps = marlin_permute_scales(s, 128, 100, -1)
    ps.view(-1)[-1] = 1  # a padded column
    with pytest.raises(ValueError, match="padding"):
        marlin_unpermute_scales(ps, 128, 100, -1)


def test_marlin_re_exports_the_same_objects():
    for name in marlin_scales.__all__:
        assert getattr(marlin, name) is getattr(marlin_scales, name)
