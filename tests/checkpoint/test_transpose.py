"""transposed: ``src.t().contiguous()`` of strided 2-D CPU tensors, in C and in the torch fallback
(``CTCONVERT_NATIVE=0``), element bits for element bits: every element size, shapes that are not multiples of the
tile, every column offset of an interleaved region, NaN payloads, an ``out`` view, rows split over threads."""

from __future__ import annotations

import pytest
import torch

from ctconvert.checkpoint import transpose
from ctconvert.checkpoint.transpose import transposed


@pytest.fixture(params=["native", "torch"])
def impl(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setenv("CTCONVERT_NATIVE", "0")
    elif transpose._LIB.get() is None:
        pytest.skip("no C compiler")
    return request.param


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape,step", [((300, 96), 2), ((128, 64), 1), ((1, 8), 2), ((257, 10), 1), ((0, 6), 2), ((17, 33), 3), ((2048, 1536), 2)])
def test_transposed_is_the_strided_slice_transposed(impl, dtype, shape, step):
    g = torch.Generator().manual_seed(hash((shape, step)) % 1000)
    region = torch.randint(0, 256, (*shape, torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1), dtype=torch.uint8, generator=g)
    region = region.view(dtype).reshape(shape)  # every bit pattern: NaN payloads, infinities, subnormals
    for off in range(step):
        src = region[:, off::step]
        got = transposed(src)
        assert got.is_contiguous() and got.shape == (src.shape[1], src.shape[0]) and got.dtype == dtype
        assert torch.equal(_bits(got), _bits(src.t().contiguous()))


def test_transposed_a_transposed_view_and_huge_tiny_values(impl):
    x = torch.tensor([[3.0e38, -1.0e-45, 0.0, -0.0], [float("nan"), float("inf"), -float("inf"), 1.0]] * 9).t()  # strides (1, 4)
    assert torch.equal(_bits(transposed(x)), _bits(x.t().contiguous()))


def test_transposed_into_out_and_over_threads(impl, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # rows split over workers (2048 x 768 exceeds the grain)
    g = torch.Generator().manual_seed(3)
    region = torch.randn(2048, 1536, generator=g).to(torch.bfloat16)
    batch = torch.full((2, 768, 2048), 7.0, dtype=torch.bfloat16)
    for m in range(2):
        assert transposed(region[:, m::2], out=batch[m]).data_ptr() == batch[m].data_ptr()
    assert torch.equal(batch, region.view(2048, 768, 2).permute(2, 1, 0))


def test_transposed_refuses_what_it_cannot_write(impl):
    with pytest.raises(ValueError, match="2-D CPU"):
        transposed(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="out must be"):
        transposed(torch.zeros(4, 6), out=torch.zeros(4, 6))
    with pytest.raises(ValueError, match="out must be"):
        transposed(torch.zeros(4, 6), out=torch.zeros(6, 4, dtype=torch.float16))
