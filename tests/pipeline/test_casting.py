"""cast_chunk (--dense-dtype) against an integer-math round-to-nearest-even reference, chunk offsets, overflow."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctconvert.errors import BadInputError
from ctconvert.pipeline.casting import cast_chunk


def _bf16_rne_reference(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits by integer arithmetic: add 0x7FFF plus the lowest kept bit, drop 16 bits (finite values)."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _values(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(4099, generator=g) * torch.logspace(-40, 30, 4099).float()  # every binade, subnormals included
    edge = torch.tensor([0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-133, 65504.0, 65520.0, 3.0e38, -3.0e38, 1e-45])
    return torch.cat([edge, v, torch.zeros(64)])


@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_to_bf16_is_round_to_nearest_even_at_every_offset(seed):
    x = _values(seed)
    raw = x.view(torch.uint8)
    ref = _bf16_rne_reference(x.numpy())
    for start_elem, stop_elem in [(0, x.numel()), (0, 1), (11, 2048), (2047, x.numel())]:  # chunks of a tensor, as the executor reads them
        out, pos = cast_chunk(raw[4 * start_elem : 4 * stop_elem], "F32", "BF16", "m.safetensors", "t", 4 * start_elem)
        assert pos == 2 * start_elem
        assert np.array_equal(out.numpy().view(np.uint16), ref[start_elem:stop_elem])


def test_fp32_to_fp16_overflow_names_the_element():
    x = torch.tensor([1.0, 65504.0, -65519.0, 70000.0, 2.0])  # 65519 still rounds to 65504; 70000 does not fit
    with pytest.raises(BadInputError, match=r"value 70000 \(element 8\) is beyond the range of fp16") as e:
        cast_chunk(x.view(torch.uint8), "F32", "F16", "model.safetensors", "model.norm.weight", 4 * 5)  # a chunk starting at element 5
    assert e.value.file == "model.safetensors" and e.value.tensor == "model.norm.weight"
    with pytest.raises(BadInputError, match="beyond the range of fp16"):
        cast_chunk(torch.tensor([1e5], dtype=torch.bfloat16).view(torch.uint8), "BF16", "F16", "f", "t", 0)


def test_upcasts_are_exact_and_nonfinite_passes():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.5, -(2**-24)], dtype=torch.float16)
    out, pos = cast_chunk(x.view(torch.uint8), "F16", "F32", "f", "t", 6)
    y = out.view(torch.float32)
    assert pos == 12 and torch.isnan(y[0]) and y[1] == float("inf") and y[2] == -float("inf") and torch.equal(y[3:], x[3:].float())
    empty, pos = cast_chunk(torch.empty(0, dtype=torch.uint8), "F32", "BF16", "f", "t", 0)
    assert empty.numel() == 0 and pos == 0
