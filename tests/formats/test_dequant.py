"""Dequantization equals compressed-tensors' decompress, byte for byte, for every scheme we write."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import preset_name_to_scheme

from ctconvert.formats.dequant import dequantize_weight
from formats.test_bit_exact import SCHEMES, make_weight, shape_for

from ct_reference import PRESET_FORMAT, ct_compress


@pytest.mark.parametrize("case", ["randn", "mixed", "zeros"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequant_matches_compressed_tensors(scheme, dtype, case):
    n, k = shape_for(scheme)
    w = make_weight(case, dtype, n, k, seed=7)
    comp = ct_compress(w, scheme)
    sch = preset_name_to_scheme(scheme, ["Linear"])
    fmt = PRESET_FORMAT[scheme]
    ref = BaseCompressor.get_value_from_registry(fmt).decompress(dict(comp), sch)["weight"]
    got = dequantize_weight(comp, sch.weights.model_dump(), fmt)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert torch.equal(
        got.view(torch.int16) if got.element_size() == 2 else got.view(torch.int32), ref.view(torch.int16) if ref.element_size() == 2 else ref.view(torch.int32)
    )
    # and it is close to the input
    rel = (got.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)
    assert rel < 0.2
