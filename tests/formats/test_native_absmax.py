"""The C absmax scan (max |x| and the count of NaN/inf) against torch, on awkward inputs of every dtype."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def reference(x: torch.Tensor) -> tuple[float, int]:
    """max |x| over the values that are not NaN (inf included), and the number of NaN/inf values."""
    a = x.float().abs().reshape(-1)
    bad = int((~torch.isfinite(a)).sum())
    a = a[~torch.isnan(a)]
    return (float(a.max()) if a.numel() else 0.0), bad


def awkward(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 8)  # magnitudes over many binades
    info = torch.finfo(dtype)
    x = x.clamp(-info.max, info.max).to(dtype)  # finite in every dtype
    for i, v in zip(torch.randperm(n, generator=g).tolist(), [-0.0, info.smallest_normal / 4, -info.max]):  # -0, a subnormal, the largest
        x[i] = v
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n", [1, 7, 4096, 32768 + 5, 3 * 65536 + 11])  # around the kernel's counting block and the thread pieces
def test_finite_inputs(dtype, n):
    x = awkward(dtype, n, seed=n)
    assert native.absmax(x) == reference(x)
    assert reference(x)[1] == 0
    assert native.absmax(torch.zeros(n, dtype=dtype)) == (0.0, 0)
    neg = -x.abs()
    assert native.absmax(neg) == reference(neg)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "mixed"])
def test_non_finite_inputs_are_counted(dtype, bad):
    n = 70001
    x = awkward(dtype, n, seed=3)
    g = torch.Generator().manual_seed(4)
    where = torch.randperm(n, generator=g)[:9]
    vals = {"nan": [float("nan")] * 9, "inf": [float("inf")] * 9, "-inf": [float("-inf")] * 9, "mixed": [float("nan"), float("-inf"), float("inf")] * 3}[bad]
    x[where] = torch.tensor(vals).to(dtype)
    if dtype != torch.float32:  # NaN patterns other than the default one (payload bits, sign set)
        x.view(torch.int16)[where[0]] = -1  # 0xFFFF
    amax, count = native.absmax(x)
    ref_amax, ref_count = reference(x)
    assert count == ref_count == 9
    assert amax == ref_amax
    assert (amax == float("inf")) == (bad != "nan")
