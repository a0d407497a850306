"""Batched repack (layouts.batched) == per-module repack (layouts.kernels), bit for bit.

On the CPU ``repack_batch`` runs module by module; on CUDA it runs the Triton
kernels (one launch per batch). Both are compared with the per-module torch
path computed on the CPU, on fresh random inputs, with shapes that need
padding, scales that give an NVFP4 scale factor > 1, and both activation dtypes.
"""

from __future__ import annotations

import pytest
import torch

from ctconvert.layouts import batched, kernels
from ctconvert.plan.kernel_targets import KERNELS

from helpers import DEVICES, bitwise_equal

B = 3


def _rint(gen, shape):
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)


def _bytes(gen, shape, hi=256):
    return torch.randint(0, hi, shape, generator=gen, dtype=torch.int64).to(torch.uint8)


def _int_case(gen, n, k, g, bits, asym=False, scale_dtype=torch.bfloat16):
    pf = 32 // bits
    groups = k // g if g > 0 else 1
    w = {"num_bits": bits, "type": "int", "strategy": "group" if g > 0 else "channel", "group_size": g if g > 0 else None, "symmetric": not asym}
    t = {
        "weight_packed": _rint(gen, (B, n, k // pf)),
        "weight_scale": torch.randn(B, n, groups, generator=gen).to(scale_dtype),
        "weight_shape": torch.tensor([[n, k]] * B),
    }
    if asym:
        t["weight_zero_point"] = _rint(gen, (B, n // pf, groups))
    return "marlin-int", t, w, "pack-quantized"


def _fp8_case(gen, n, k):
    t = {"weight": _bytes(gen, (B, n, k)).view(torch.float8_e4m3fn), "weight_scale": torch.rand(B, n, 1, generator=gen) * 0.1}
    return "marlin-fp8", t, {"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized"


def _nvfp4_case(gen, n, k):
    sc = _bytes(gen, (B, n, k // 16), 0x7F)  # every e4m3 value >= 0: zero, subnormals, normals up to 448
    sc[1] = sc[1].clamp(max=20)  # small scales: scale factor > 1 (§5.2 step 3.2)
    sc[2, 0, 0] = 0x7E  # 448: scale factor 1
    t = {
        "weight_packed": _bytes(gen, (B, n, k // 2)),
        "weight_scale": sc.view(torch.float8_e4m3fn),
        "weight_global_scale": torch.rand(B, 1, generator=gen) * 1000 + 1,
    }
    return "marlin-nvfp4", t, {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, "nvfp4-pack-quantized"


def _with(case, gen, n, copied):
    """A case whose modules also have a bias (rebuilt by the kernel) and ``copied`` (a tensor it copies as it is)."""
    kernel, t, w, fmt = case
    t = {**t, "bias": torch.randn(B, n, generator=gen).to(torch.bfloat16), copied: torch.rand(B, 1, generator=gen) * 100}
    return kernel, t, w, fmt


def _cases():
    gen = torch.Generator().manual_seed(1234)
    out = [
        _int_case(gen, n, k, g, bits) for n, k, g, bits in [(256, 256, 128, 4), (72, 200, -1, 4), (1000, 384, 128, 4), (192, 1024, 128, 8), (64, 128, -1, 8)]
    ]
    out.append(_int_case(gen, 256, 512, 128, 4, asym=True))
    out.append(_int_case(gen, 256, 256, 128, 4, scale_dtype=torch.float32))  # a model quantized from fp32 weights
    out += [_fp8_case(gen, n, k) for n, k in [(256, 256), (72, 200), (1000, 384)]]
    out += [_nvfp4_case(gen, n, k) for n, k in [(256, 256), (72, 208), (1000, 384), (64, 64)]]
    # biases and tensors the kernel does not use (issue 22: they were dropped)
    out += [_with(_int_case(gen, 72, 256, 128, 4), gen, 72, "input_scale"), _with(_fp8_case(gen, 72, 200), gen, 72, "input_scale")]
    out.append(_with(_nvfp4_case(gen, 72, 208), gen, 72, "input_global_scale"))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(_cases())))
def test_batch_equals_per_module(device, act, case):
    kernel, t, w, fmt = _cases()[case]
    outs, recs = batched.repack_batch(KERNELS[kernel], {p: x.to(device) for p, x in t.items()}, w, "0.33", act)
    for i in range(B):
        ref, rec = kernels.repack_module(KERNELS[kernel], {p: x[i] for p, x in t.items()}, w, "0.33", act)
        assert outs.keys() == ref.keys() and ("bias" in t) == ("bias" in ref)
        for p in ref:
            assert bitwise_equal(outs[p][i], ref[p]), (kernel, p, i)
        assert recs[i] == rec
    if kernel == "marlin-nvfp4" and act == torch.bfloat16:
        assert recs[1]["scale_factor"] > 1 and recs[2]["scale_factor"] == 1  # both branches of the sf rule ran


def test_batch_of_mixed_shapes_is_refused():
    _, t, w, fmt = _int_case(torch.Generator().manual_seed(0), 64, 128, -1, 4)
    t["weight_shape"][1] = torch.tensor([64, 120])
    with pytest.raises(ValueError, match="one shape"):
        batched.repack_batch(kernels.MARLIN_INT, t, w, "0.33", torch.bfloat16)
