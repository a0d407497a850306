"""The Triton kernels' reciprocal division and NVFP4 sign rule against IEEE division, on every bf16 value.

The kernels divide a group by its scale as ``q = RN(x·r); q' = RN(q + RN(x − s·q)·r)``
with ``r = RN(1/s)`` (Markstein), for divisors in [2^-64, 2^64]. Checked here on
every finite bf16 value and on random fp32 values (subnormals included), for
random and edge divisors over that whole range:

* ``q'`` equals ``div_rn(x, s)`` bit for bit wherever ``|x| >= 2^-100`` and the
  quotient is a normal number up to 2^20: the quotients the kernels rely on
  (integer codes and E2M1 magnitudes need ``|x / s| >= 2^-3``; FP8 rows and
  blocks take this path only when every non-zero quotient is at least 2^-60;
  NVFP4's amax / 6 and s / gs have ``x >= 2^-100`` or do not matter; no
  quotient exceeds 448 (1 + 2^-7));
* the NVFP4 sign rule (``bits(x) > neg_nonzero_bound(s)`` as unsigned) is set
  exactly where ``div_rn(x, s) < 0``.

CUDA only (the CPU paths divide directly).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    from ctconvert.formats.gpu_math import neg_nonzero_bound, qdiv

    @triton.jit
    def _qdiv_kernel(x_ptr, s_ptr, fast_ptr, ref_ptr, neg_ptr, n, BLOCK: tl.constexpr):
        j = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        s = tl.load(s_ptr + j)
        tl.store(fast_ptr + j * n + offs, qdiv(x, s, tl.div_rn(1.0, s)), mask=m)
        tl.store(ref_ptr + j * n + offs, tl.div_rn(x, s), mask=m)
        neg = x.to(tl.uint32, bitcast=True) > neg_nonzero_bound(s)
        tl.store(neg_ptr + j * n + offs, neg.to(tl.int8), mask=m)


def _divisors(g: torch.Generator) -> torch.Tensor:
    edges = torch.tensor(
        [2.0**-64, 2.0**64, 1.0, 7.5, 6.0, 448.0, 0.125, 3.0, 2.0**-7, 1.5 * 2.0**-64, 2.0**64 * 0.999, 2.0**24, 2.0**24 * 1.5, 2.0**23 * 1.75]
    )
    logs = torch.rand(600, generator=g, dtype=torch.float64) * 128 - 64  # log2 uniform over the whole range
    rand = (torch.exp2(logs).float() * (1 + torch.rand(600, generator=g))).clamp(2.0**-64, 2.0**64)
    return torch.cat([edges, rand, rand.to(torch.bfloat16).float()])


def test_reciprocal_division_and_nvfp4_sign_match_ieee_division():
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
    neg = torch.empty(s.numel(), n, dtype=torch.int8, device="cuda")
    _qdiv_kernel[(triton.cdiv(n, 1024), s.numel())](x, s, fast, ref, neg, n, BLOCK=1024)
    used = (x.abs() >= 2.0**-100) & (ref.abs() >= 2.0**-126) & (ref.abs() <= 2.0**20)  # normal quotients
    fb, rb = fast.view(torch.int32), ref.view(torch.int32)
    assert torch.equal(fb[used], rb[used]), f"{(fb[used] != rb[used]).sum().item()} quotients differ"
    assert used.sum() > 0.2 * used.numel()
    assert torch.equal(neg.bool(), ref < 0), f"{(neg.bool() != (ref < 0)).sum().item()} sign bits differ"
    assert bool(((ref == 0) & (x < 0)).any())  # quotients of negative x that round to zero were exercised
