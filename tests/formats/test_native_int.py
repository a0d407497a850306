"""The C integer quantizer and its int32 packing against the torch reference, on row lengths that are not
multiples of a word (the byte-order packing path handles the last partial word and its padding)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats import native
from ctconvert.formats.integer import pack_int32, quantize_int

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [1, 3, 7, 8, 9, 13, 130, 257])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_per_channel_packed_equals_reference(bits, symmetric, k, dtype):
    g = torch.Generator().manual_seed(k * 10 + bits)
    w = (torch.randn(33, k, generator=g) * 0.05).to(dtype)
    w[0] = 0  # a zero row
    w[1, 0] = -1e-3 if k > 1 else w[1, 0]
    ref = quantize_int(w, bits, None, symmetric)
    got = native.int_quant(w, bits, None, symmetric, True)
    packed = pack_int32(ref["weight"], bits)
    assert got["weight_packed"].shape == packed.shape
    assert torch.equal(got["weight_packed"], packed)
    assert torch.equal(got["weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    if not symmetric:
        assert torch.equal(got["weight_zero_point"], ref["weight_zero_point"])


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
def test_grouped_packed_equals_reference(bits, group):
    g = torch.Generator().manual_seed(bits + group)
    w = (torch.randn(70, 3 * group, generator=g) * 0.02).to(torch.bfloat16)
    ref = quantize_int(w, bits, group, True)
    got = native.int_quant(w, bits, group, True, True)
    assert torch.equal(got["weight_packed"], pack_int32(ref["weight"], bits))
    assert torch.equal(got["weight_scale"], ref["weight_scale"])
