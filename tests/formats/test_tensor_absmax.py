"""``formats.common.tensor_absmax`` (the executor's absmax of a chunk on a GPU, and the torch path's) against an
independent reference (numpy, float64) on awkward inputs, on the CPU and on CUDA where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctconvert.formats.common import tensor_absmax

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _reference(x: torch.Tensor) -> float:
    a = np.abs(x.float().cpu().numpy().astype(np.float64))
    return float("nan") if np.isnan(a).any() else (float(a.max()) if a.size else 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (300, 129), (2, 3, 1025)])
def test_the_absmax_is_max_abs_in_every_dtype(device, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    info = torch.finfo(dtype)
    x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 6)).clamp(-info.max, info.max).to(dtype)
    flat = x.reshape(-1)
    if flat.numel() > 3:
        flat[int(torch.randint(0, flat.numel(), (1,), generator=g))] = -info.max  # the largest magnitude, negative
    cases = {"random": x, "negative": -x.abs(), "zeros": torch.zeros(shape, dtype=dtype), "minus zeros": -torch.zeros(shape, dtype=dtype)}
    cases["subnormal"] = torch.full(shape, info.smallest_normal / 4, dtype=dtype)
    cases["strided"] = x.transpose(0, -1) if x.dim() > 1 else x[::1]
    for name, t in cases.items():
        got = tensor_absmax(t.to(device))
        assert got.dtype == torch.float32 and got.shape == () and got.device.type == device, name
        assert got.item() == _reference(t), name
        assert not torch.signbit(got).item(), name  # +0.0 for zeros of either sign
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = x.clone()
        t.reshape(-1)[-1] = bad
        got = tensor_absmax(t.to(device)).item()
        assert (np.isnan(got) and np.isnan(bad)) or got == abs(bad)
    assert tensor_absmax(torch.empty((0, 5), dtype=dtype, device=device)).item() == 0.0
