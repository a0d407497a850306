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


@pytest.mark.parametrize("shape", [(256, 384), (128, 128), (200, 300), (384, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", ["randn", "mixed", "zeros", "tiny", "huge"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fp8_block_dequant_matches_compressed_tensors_in_whole_and_cut_blocks(shape, case, dtype):
    """FP8_BLOCK's torch dequantization (a GPU run's, pipeline/stored.py) broadcasts each block scale over a blocked
    view where the shape is whole blocks (formats/base.py: dequantize_unpacked), else expands it; both, and the
    format's own path (the C kernel on the CPU), give compressed-tensors' decompress bit for bit. On CUDA the same
    torch path is compared with the C kernel's bytes: tests/pipeline/test_stored.py."""
    from ctconvert.formats.base import WeightArgs, dequantize_unpacked

    n, k = shape
    w = make_weight(case, dtype, n, k, seed=11)
    comp = ct_compress(w, "FP8_BLOCK")
    assert tuple(comp["weight_scale"].shape) == (-(-n // 128), -(-k // 128))
    sch = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    ref = BaseCompressor.get_value_from_registry(PRESET_FORMAT["FP8_BLOCK"]).decompress(dict(comp), sch)["weight"]
    bits = {2: torch.int16, 4: torch.int32}[ref.element_size()]
    args = sch.weights.model_dump()
    for got in (dequantize_unpacked(comp, WeightArgs.from_dict(args)), dequantize_weight(comp, args, PRESET_FORMAT["FP8_BLOCK"])):
        assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
        assert torch.equal(got.view(bits), ref.view(bits))
    if case != "zeros":
        assert ref.float().abs().max() > 0
