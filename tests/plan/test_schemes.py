"""Scheme.scale_flags_nonfinite: the scales show NaN/inf exactly where the input has them (so the
pipeline may skip its separate NaN/inf scan), on every CPU implementation."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats import native
from ctconvert.plan.schemes import get_scheme, scheme_names

from helpers import stable_seed

FLAGGING = [n for n in scheme_names() if get_scheme(n).scale_flags_nonfinite]
IMPLS = ["torch"] + (["native"] if native.available() else [])


def test_which_schemes_flag():
    assert {"FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W8A16"} <= set(FLAGGING)
    assert not {"W4A16_ASYM", "NVFP4A16", "MXFP4A16"} & set(FLAGGING)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", FLAGGING)
def test_scales_flag_exactly_the_non_finite_groups(name, dtype, impl):
    s = get_scheme(name)
    gen = torch.Generator().manual_seed(stable_seed(name, str(dtype), impl))
    w = (torch.randn(256, 384, generator=gen) * 0.02).to(dtype)
    w[7] = torch.finfo(dtype).max  # huge but finite: finite scales
    w[9] = 0
    finite = s.quantize_rows(w, None, impl=impl)["weight_scale"]
    assert bool(torch.isfinite(finite.float()).all())
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = w.clone()
        r, c = int(torch.randint(0, 256, (1,), generator=gen)), int(torch.randint(0, 384, (1,), generator=gen))
        x[r, c] = bad
        sc = s.quantize_rows(x, None, impl=impl)["weight_scale"].float()
        bad_groups = (~torch.isfinite(sc)).nonzero().tolist()
        if s.weights.strategy == "block":
            want = [[r // s.block[0], c // s.block[1]]]
        elif s.group_size:
            want = [[r, c // s.group_size]]
        else:
            want = [[r, 0]]
        assert bad_groups == want, (bad, r, c)


@pytest.mark.parametrize("name", scheme_names())
def test_shape_rules_are_the_formats_answers(name):
    s = get_scheme(name)
    for attr in ("scale_flags_nonfinite", "row_align", "k_multiple", "n_multiple"):
        assert getattr(s, attr) == getattr(s.weight_format, attr)(s.weights), attr
    assert type(s).row_align.__doc__.startswith("Row chunks")
