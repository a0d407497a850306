"""Bit-level encodings against the worked examples of docs/compressed-tensors-format.md (§5, §6)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats import fp4, integer


def words(t: torch.Tensor) -> list[int]:
    return [x & 0xFFFFFFFF for x in t.reshape(-1).tolist()]


def test_pack_int4_example():  # §5.1
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7, 5, -1]], dtype=torch.int8)
    assert words(integer.pack_int32(q, 4)) == [0xFCBA9810, 0x0000007D]


def test_pack_int8_example():  # §5.1
    q = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    assert words(integer.pack_int32(q, 8)) == [0xFF807F00]


def test_pack_zero_points_dim0_example():  # §5.1
    zp = torch.zeros(9, 2, dtype=torch.int8)
    zp[:, 0] = torch.tensor([-8, 1, 3, 5, 7, 0, 1, 2, 3], dtype=torch.int8)
    packed = integer.pack_int32_dim0(zp, 4)
    assert packed.shape == (2, 2)
    assert words(packed[:, 0]) == [0xA98FDB90, 0x0000000B]


def test_w4_group_worked_example():  # §6.3
    row = [1.0, 0.3008, -0.05, -0.01, 0, 0.5, -1, 0.125, 0.699, -0.4004, 0.2002, 0.8984, -0.6016, 0.05, 0.25, -0.1504]
    w = torch.tensor([row * 8], dtype=torch.bfloat16)
    r = integer.quantize_int(w, 4, 128, True)
    assert r["weight_scale"].item() == 0.1337890625
    assert r["weight"][0, :16].tolist() == [7, 2, 0, 0, 0, 4, -7, 1, 5, -3, 2, 7, -4, 0, 2, -1]
    assert words(integer.pack_int32(r["weight"], 4))[:2] == [0x91C888AF, 0x7A84FA5D]


def test_e2m1_codes_and_nibble_order():  # §5.2
    vals = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    codes = fp4.e2m1_codes(torch.tensor([vals]))
    # -0.0 is not < 0: encodes as 0x0 (the quirk only applies to strictly negative values)
    assert fp4.pack_nibbles(codes)[0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE]


@pytest.mark.parametrize("x,expect", [(0.25, 0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (5.01, 6.0), (100.0, 6.0)])
def test_e2m1_ties_to_even(x, expect):  # §6.4 table
    code = fp4.e2m1_codes(torch.tensor([x]))
    assert fp4.E2M1_VALUES[int(code)] == expect


def test_negative_value_rounding_to_zero_keeps_sign():  # §5.2 quirk
    assert fp4.e2m1_codes(torch.tensor([-0.1])).item() == 0x8


def test_nvfp4_worked_example():  # §6.4 item 4
    group = [1, 0.3008, -0.05, -0.01, 0, 0.5, -1, 0.125, 0.699, -0.4004, 0.2002, 0.8984, -0.6016, 0.05, 0.25, -0.1504]
    w = torch.tensor([group], dtype=torch.bfloat16)
    gs = fp4.nvfp4_global_scale(torch.tensor(2.0), torch.bfloat16)
    assert gs.item() == 1344.0
    r = fp4.quantize_nvfp4(w, gs)
    assert r["weight_scale"].view(torch.uint8).item() == 0x76
    assert r["weight_packed"][0].tolist() == [0x47, 0x89, 0x50, 0x2F, 0xC6, 0x72, 0x1E, 0xA3]


def test_nvfp4_global_scale_rounds_through_bf16_reciprocal():  # §6.4 rounding subtlety
    # gs = bf16(bf16(1/amax) * 2688): an all-zero tensor gets 1.0
    assert fp4.nvfp4_global_scale(torch.tensor(0.0), torch.bfloat16).item() == 1.0
    amax = torch.tensor(0.0951, dtype=torch.bfloat16).float()
    expect = (torch.tensor(1.0) / amax).to(torch.bfloat16).float() * 2688
    assert fp4.nvfp4_global_scale(amax, torch.bfloat16).item() == expect.to(torch.bfloat16).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_pack_unpack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    lo, hi = integer.int_range(bits)
    for cols in (1, 7, 32, 33, 100):
        q = torch.randint(lo, hi + 1, (5, cols), generator=g, dtype=torch.int8)
        packed = integer.pack_int32(q, bits)
        assert packed.shape == (5, -(-cols * bits // 32))
        assert torch.equal(integer.unpack_int32(packed, bits, cols), q)
        # the strided (general bit-offset) path gives the same: 4 and 8 bits also take a byte path when contiguous
        assert torch.equal(integer.unpack_int32(packed.t().contiguous().t(), bits, cols), q)


def test_pack_matches_compressed_tensors_all_widths():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(7)
    for bits in range(1, 9):
        lo, hi = integer.int_range(bits)
        q = torch.randint(lo, hi + 1, (9, 77), generator=g, dtype=torch.int8)
        assert torch.equal(integer.pack_int32(q, bits), pack_to_int32(q, bits))
        assert torch.equal(integer.pack_int32_dim0(q, bits), pack_to_int32(q, bits, packed_dim=0))


def test_fp4_unpack_inverts_pack():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)
    vals = fp4.unpack_e2m1(fp4.pack_nibbles(codes))
    assert torch.equal(fp4.e2m1_codes(vals) & 0x7, codes & 0x7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_global_scale_overflow_is_where_the_scale_is_substituted(dtype):
    """nvfp4_global_scale_overflows says exactly where nvfp4_global_scale stores 1.0 for a scale beyond the dtype's range:
    over a sweep of absmax values (the values of ``dtype``), the stored scale is 1.0 and 2688 / amax far from 1 there, and
    nowhere else (fp16: under ~0.041; bf16 and fp32 only for absmax near their smallest normals)."""
    amax = torch.logspace(-45, 5, 4001, dtype=torch.float64).to(dtype)
    amax = torch.unique(amax[amax > 0]).to(torch.float32)
    gs = fp4.nvfp4_global_scale(amax, dtype)
    got = torch.tensor([fp4.nvfp4_global_scale_overflows(float(a), dtype) for a in amax])
    want = (gs == 1.0) & ((2688.0 / amax.double() - 1).abs() > 0.01)
    assert torch.equal(got, want)
    if dtype == torch.float16:
        assert bool(got[amax < 0.04].all()) and not bool(got[amax > 0.042].any())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_one_global_scale_has_the_bits_of_the_vector_computation(dtype):
    """A 0-d CPU absmax takes a NumPy scalar path (one set's scale, made per tensor); its bits are those the torch
    computation gives the same value in a vector, over random fp32 bit patterns rounded to ``dtype`` (the absmax of
    a tensor of that dtype) and the awkward ones: zeros, subnormals, the smallest normal, values whose scale
    overflows ``dtype``, the largest finite, inf and NaN."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 2**31, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    special = [0.0, -0.0, 1e-45, 1e-40, 1.1754944e-38, 6e-8, 6.1e-5, 0.04, 0.041, 0.0951, 1.0, 2688.0, 65504.0, 3.4028235e38]
    amax = torch.cat([bits.view(torch.float32).abs(), torch.tensor(special + [float("inf"), float("nan")])])
    amax = amax.to(dtype).to(torch.float32)
    want = fp4.nvfp4_global_scale(amax, dtype)  # [n]: the torch path, elementwise
    got = torch.cat([fp4.nvfp4_global_scale(a, dtype) for a in amax])  # each 0-d: the scalar path
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert got[-2].item() == 0.0 and got[-1].item() == 1.0  # an inf absmax: 1 / inf = 0; NaN: 1.0
