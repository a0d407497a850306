"""The kernel objects: the two CUTLASS 2:4 layouts as one parameterised kernel (planned shapes, exact inverse, refusals)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats.sparse24 import BITMASK, compress24, prune24
from ctconvert.layouts import kernels, sparse24
from ctconvert.layouts.kernels import Sparse24Kernel

SM90 = Sparse24Kernel("cutlass-2of4", sparse24.SM90, BITMASK)
SM80 = Sparse24Kernel("cutlass-2of4-sm80", sparse24.SM80, BITMASK)


def _module(n: int, k: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = prune24(torch.randn(n, k, generator=gen))
    if dtype == torch.int8:
        w = (w * 40).round().clamp(-127, 127).to(torch.int8)
    else:
        w = w.to(dtype)
        w[0, :4] = torch.tensor([-0.0, 1.0, 0.0, -2.0]).to(dtype)  # a stored -0.0: kept by negative_zeros_source
    c = compress24(w)
    t = {**c, "shape": torch.tensor([[n], [k]]), "bias": torch.randn(n, generator=gen)}
    if dtype != torch.bfloat16:
        t["weight_scale"] = torch.rand(n, 1, generator=gen).to(torch.bfloat16)
    return t


def _meta(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {p: torch.empty(x.shape, dtype=x.dtype, device="meta") for p, x in t.items()}


@pytest.mark.parametrize("kernel, dtype", [(SM90, torch.float8_e4m3fn), (SM90, torch.bfloat16), (SM90, torch.int8), (SM80, torch.float16), (SM80, torch.int8)])
def test_sparse24_kernel_plans_repacks_and_inverts(kernel, dtype):
    t = _module(64, 128, dtype, 3)
    w = {"num_bits": 8} if dtype in (torch.int8, torch.float8_e4m3fn) else {}
    planned, prec = kernels.repack_module(kernel, _meta(t), w, "0.33", torch.bfloat16)
    outs, rec = kernels.repack_module(kernel, t, w, "0.33", torch.bfloat16)
    assert rec == prec and rec["kernel"] == kernel.name
    assert {p: (x.dtype, tuple(x.shape)) for p, x in outs.items()} == {p: (x.dtype, tuple(x.shape)) for p, x in planned.items()}
    back = kernels.unrepack_module(kernel, outs, rec)
    assert back.keys() == t.keys()
    for p, x in t.items():
        assert back[p].dtype == x.dtype and torch.equal(back[p].reshape(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8)), p


def test_sparse24_kernel_refusals_name_the_layout():
    t = _module(32, 64, torch.float8_e4m3fn, 1)
    with pytest.raises(ValueError, match="not taken by the SM80 2:4 layout"):
        kernels.repack_module(SM80, t, {"num_bits": 8}, "0.33", torch.bfloat16)
    odd = {"compressed": torch.zeros(8, 6, dtype=torch.float16), "bitmask": torch.zeros(8, 2, dtype=torch.uint8)}
    with pytest.raises(ValueError, match="K=12 is not a multiple of 8"):
        kernels.repack_module(SM90, odd, {}, "0.33", torch.bfloat16)
    bad = {"compressed": torch.zeros(8, 8, dtype=torch.float16), "bitmask": torch.zeros(8, 2, dtype=torch.uint8)}
    with pytest.raises(ValueError, match=r"compressed \(8, 8\) and bitmask do not describe a 2:4 weight \(8, 16\)"):
        kernels.repack_module(SM90, bad, {}, "0.33", torch.bfloat16)


def test_accepts_sparse_24_bitmask_modules_only():
    assert SM90.accepts({"num_bits": 8}, {"compressed", "bitmask", "shape"}) and SM90.accepts({}, {"compressed", "bitmask"})
    assert not SM90.accepts({"num_bits": 4}, {"compressed", "bitmask"}) and not SM80.accepts({}, {"weight"})
