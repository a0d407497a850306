"""The quantize kernels of formats/native/quant.c on the paths the tiny shapes of test_bit_exact do not reach: NVFP4
rows of several tiles of groups (the last one partial), asymmetric integer groups whose length is not a multiple
of the 16 min/max lanes, and the build without vector flags (another CPU): every byte equal to the torch reference
(itself checked against compressed-tensors in test_bit_exact) and to compressed-tensors where its reference runs."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats import native
from ctconvert.formats.integer import quantize_int

from .test_bit_exact import CASES, DTYPES, assert_same_bytes, make_weight, ours
from ct_reference import ct_compress
from helpers import scalar_build

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")

#: NVFP4: 16 * 300 columns = a full tile of 256 groups and a partial one of 44 (quant.c NV_TILE)
WIDE = {"NVFP4A16": (7, 16 * 300), "MXFP4A16": (7, 32 * 150), "MXFP8A16": (7, 32 * 150), "W4A16_ASYM": (9, 128 * 37), "FP8_BLOCK": (130, 4100)}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("scheme", sorted(WIDE))
def test_wide_rows_match_the_torch_reference(scheme, dtype, case):
    w = make_weight(case, dtype, *WIDE[scheme], seed=11)
    want = ours(scheme, w, "torch")
    assert_same_bytes(want, ours(scheme, w, "native"))
    if dtype == torch.bfloat16 and case == "mixed":
        assert_same_bytes(ct_compress(w, scheme), want)


@pytest.mark.parametrize("k", [1, 15, 16, 17, 47, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_asymmetric_min_max_over_any_group_length(k, dtype):
    """Per-channel asymmetric int8 (the group is the row, any length): the 16 lanes and the tail give the torch
    reference's scale, zero point and values, with rows of one sign, zeros, -0.0 and tiny values."""
    g = torch.Generator().manual_seed(k)
    w = torch.randn(6, k, generator=g)
    w[1] = w[1].abs() + 0.5  # all positive: min(x, 0) = 0
    w[2] = -w[2].abs() - 0.5  # all negative: max(x, 0) = 0
    w[3] = -0.0
    w[4] *= 1e-30 if dtype != torch.float16 else 1e-6
    w = w.to(dtype)
    want = quantize_int(w, 8, None, symmetric=False)
    got = native.int_quant(w, 8, None, symmetric=False, pack=False)
    for key in ("weight", "weight_scale", "weight_zero_point"):
        assert torch.equal(got[key].view(torch.uint8), want[key].reshape(got[key].shape).to(got[key].dtype).view(torch.uint8)), key


def test_the_scalar_build_gives_the_same_bytes(monkeypatch, tmp_path):
    """Built without the vector flags (AVX2/F16C/FMA/AVX-512: another CPU), every quantize kernel gives the bytes of
    the build with them, on the awkward inputs of test_bit_exact and on wide rows."""
    lib = scalar_build(monkeypatch, tmp_path, native._SRC, native._LIB.signatures, "quant")
    cases = []
    for scheme in ("FP8_DYNAMIC", "FP8_BLOCK", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16", "MXFP8A16"):
        shape = WIDE.get(scheme, (9, 512))
        for dtype in DTYPES:
            for case in ("tiny", "huge", "mixed"):
                w = make_weight(case, dtype, *shape, seed=5)
                cases.append((scheme, w, ours(scheme, w, "native")))
    monkeypatch.setattr(native, "_LIB", lib)
    for scheme, w, want in cases:
        assert_same_bytes(want, ours(scheme, w, "native"))
