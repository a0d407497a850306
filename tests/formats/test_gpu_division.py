"""The Triton kernels' reciprocal division (gpu._qdiv) against IEEE division, on every bf16 value.

The kernels divide a group by its scale as ``q = RN(x·r); q' = RN(q + RN(x − s·q)·r)``
with ``r = RN(1/s)`` (Markstein), for divisors in [2^-64, 2^64]. This checks the
claim their docstring makes: ``q'`` equals ``div_rn(x, s)`` bit for bit wherever
the quotient can change an output code (2^-12 <= |x / s| <= 2^20: a kernel's
quotients are at most 448 (1 + 2^-7)), and elsewhere below that both are under
2^-11 with the sign of x. CUDA only (the CPU paths divide directly).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")


if torch.cuda.is_available():
    import triton
    import triton.language as tl

    from ctconvert.formats.gpu import _qdiv, _sign_of

    @triton.jit
    def _qdiv_kernel(x_ptr, s_ptr, fast_ptr, ref_ptr, n, BLOCK: tl.constexpr):
        j = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        s = tl.load(s_ptr + j)
        q = _sign_of(_qdiv(x, s, tl.div_rn(1.0, s)), x)
        tl.store(fast_ptr + j * n + offs, q, mask=m)
        tl.store(ref_ptr + j * n + offs, tl.div_rn(x, s), mask=m)


def _divisors(g: torch.Generator) -> torch.Tensor:
    edges = torch.tensor([2.0**-64, 2.0**64, 1.0, 7.5, 6.0, 448.0, 0.125, 3.0, 2.0**-7, 1.5 * 2.0**-64, 2.0**64 * 0.999])
    logs = torch.rand(600, generator=g, dtype=torch.float64) * 128 - 64  # log2 uniform over the whole range
    rand = torch.exp2(logs).float() * (1 + torch.rand(600, generator=g))
    rand = rand.clamp(2.0**-64, 2.0**64)
    return torch.cat([edges, rand, rand.to(torch.bfloat16).float()])


def test_reciprocal_division_is_ieee_division_on_every_bf16_value():
    g = torch.Generator().manual_seed(0)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    x = x[torch.isfinite(x)]
    xr = torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-140, 120, (1 << 16,), generator=g).float())  # fp32 values
    x = torch.cat([x, xr[torch.isfinite(xr)]]).cuda()
    s = _divisors(g).cuda()
    n = x.numel()
    fast = torch.empty(s.numel(), n, device="cuda")
    ref = torch.empty_like(fast)
    _qdiv_kernel[(triton.cdiv(n, 1024), s.numel())](x, s, fast, ref, n, BLOCK=1024)
    big = (ref.abs() >= 2.0**-12) & (ref.abs() <= 2.0**20)
    fb, rb = fast.view(torch.int32), ref.view(torch.int32)
    assert torch.equal(fb[big], rb[big]), f"{(fb[big] != rb[big]).sum().item()} quotients differ"
    small = ref.abs() < 2.0**-12
    assert bool((fast[small].abs() < 2.0**-11).all())
    xs = x.view(torch.int32).expand_as(fb)
    assert torch.equal((fb[small] < 0), (xs[small] < 0)), "sign of a small quotient differs from the sign of x"
    assert big.sum() > 0.1 * big.numel() and small.sum() > 0.1 * small.numel()  # both sides exercised (12% / 48% here)
