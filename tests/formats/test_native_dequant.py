"""The fused CPU dequantization kernel (formats/native/dequant.c) gives the torch reference's bytes and compressed-tensors' own.

Stored tensors are made at random (fixed seeds) for every format the kernel takes: random codes over the
whole code range (E4M3 NaN bytes included), zero rows, zero / tiny / huge scales (subnormal and infinite
products, NaN from 0 x inf), N never a multiple of 8, K not a multiple of the group where the format
allows it, bf16/fp16/fp32 scales and every output dtype. ``impl="native"`` is compared bit for bit with
``impl="torch"``, and with compressed-tensors 0.20.1's ``decompress`` (then ``.to(dtype)``, as
``ctconvert decompress`` casts) on the shapes it accepts.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from ctconvert.formats import FORMATS, WeightArgs
from ctconvert.formats.fp4 import pack_nibbles
from ctconvert.formats.integer import pack_int32, pack_int32_dim0
from ctconvert.formats.native import dequant as native_dequant

from helpers import scalar_build

pytestmark = pytest.mark.skipif(not native_dequant.available(), reason="no C compiler: the native kernel is not built")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CASES = ["randn", "zeros", "extreme"]

# name -> (format, QuantizationArgs fields)
LAYOUTS = {
    "w4-g32": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True)),
    "w4-g128-asym": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=128, symmetric=False)),
    "w4-channel": ("pack-quantized", dict(num_bits=4, type="int", strategy="channel", symmetric=True)),
    "w8-g64-asym": ("pack-quantized", dict(num_bits=8, type="int", strategy="group", group_size=64, symmetric=False)),
    "w3-g32": ("pack-quantized", dict(num_bits=3, type="int", strategy="group", group_size=32, symmetric=True)),
    "int8-channel": ("int-quantized", dict(num_bits=8, type="int", strategy="channel", symmetric=True)),
    "int8-g32-asym": ("int-quantized", dict(num_bits=8, type="int", strategy="group", group_size=32, symmetric=False)),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", strategy="channel", symmetric=True)),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", strategy="tensor", symmetric=True)),
    "fp8-block": ("float-quantized", dict(num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True)),
    "nvfp4": ("nvfp4-pack-quantized", dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)),
    "mxfp4": ("mxfp4-pack-quantized", dict(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True)),
    "mxfp8": ("mxfp8-quantized", dict(num_bits=8, type="float", strategy="group", group_size=32, symmetric=True)),
}


def _scale(shape, dtype, case, gen):
    s = torch.rand(shape, generator=gen) * 0.02 + 1e-3
    if case == "zeros":
        s[0] = 0
        s.view(-1)[::7] = 0
    elif case == "extreme":
        tiny, huge = (1e-7, 6e4) if dtype == torch.float16 else (1e-30, 1e30)
        s.view(-1)[::5] = tiny
        s.view(-1)[1::11] = huge  # -> inf products in bf16/fp16 (and inf scales in fp16), NaN where a value is 0
    return s.to(dtype)


def stored(layout: str, n: int, k: int, dtype: torch.dtype, case: str, seed: int) -> dict[str, torch.Tensor]:
    """Random stored tensors of one module, as a compressed-tensors checkpoint holds them."""
    fmt, a = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    g = a.get("group_size")
    bits = a["num_bits"]
    groups = -(-k // g) if g else 1
    if fmt in ("pack-quantized", "int-quantized"):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        q = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
        if case == "zeros":
            q[1] = 0
            q[n // 2, : k // 2] = 0
        scale = _scale((n, groups), dtype, case, gen)
        t = {"weight_scale": scale}
        if fmt == "pack-quantized":
            t["weight_packed"] = pack_int32(q, bits)
            t["weight_shape"] = torch.tensor([n, k])
        else:
            t["weight"] = q
        if not a["symmetric"]:
            zp = torch.randint(lo, hi + 1, (n, groups), generator=gen, dtype=torch.int8)
            t["weight_zero_point"] = pack_int32_dim0(zp, bits) if fmt == "pack-quantized" else zp
        return t
    if fmt in ("float-quantized", "mxfp8-quantized"):
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        if case != "extreme":  # NaN bytes (0x7F, 0xFF) only in the extreme case
            codes[(codes & 0x7F) == 0x7F] = 0x7E
        if case == "zeros":
            codes[1] = 0
            codes[2] = 0x80  # -0.0
        t = {"weight": codes.view(torch.float8_e4m3fn)}
        if fmt == "mxfp8-quantized":
            t["weight_scale"] = torch.randint(100, 150, (n, k // 32), generator=gen, dtype=torch.uint8)
            if case == "extreme":
                t["weight_scale"].view(-1)[::3] = 0
                t["weight_scale"].view(-1)[1::5] = 254
            return t
        s = a["strategy"]
        shape = {"channel": (n, 1), "tensor": (1,), "block": (-(-n // 128), -(-k // 128))}[s]
        t["weight_scale"] = _scale(shape, dtype, case, gen)
        return t
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if case == "zeros":
        codes[1] = 0
        codes[3] = 8  # -0
    t = {"weight_packed": pack_nibbles(codes)}
    if fmt == "nvfp4-pack-quantized":
        t["weight_scale"] = (_scale((n, k // 16), torch.float32, case, gen) * 2e4).clamp(-448, 448).to(torch.float8_e4m3fn)
        t["weight_global_scale"] = torch.tensor([0.0 if case == "extreme" and seed % 2 else 1234.5])  # 0: inf factors
    else:
        t["weight_scale"] = torch.randint(90, 160, (n, k // 32), generator=gen, dtype=torch.uint8)
        if case == "extreme":
            t["weight_scale"].view(-1)[::4] = 0
            t["weight_scale"].view(-1)[1::6] = 254
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same(got: torch.Tensor, want: torch.Tensor, nan_bits: bool = True) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if nan_bits:
        assert torch.equal(_bits(got), _bits(want))
    else:  # NaN where the other has NaN (any payload), the same bits elsewhere
        nan = torch.isnan(want.float())
        assert torch.equal(torch.isnan(got.float()), nan)
        assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def _shape(layout: str, ragged: bool) -> tuple[int, int]:
    if layout == "fp8-block":
        return (200, 300) if ragged else (256, 384)
    if layout in ("nvfp4", "mxfp4", "mxfp8"):
        return 45, 192
    return (45, 203) if ragged else (45, 256)  # K not a multiple of the group nor of 8 (compressed-tensors refuses it)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sd", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_equals_torch(layout, sd, case):
    fmt, a = LAYOUTS[layout]
    args = WeightArgs.from_dict(a)
    f = FORMATS[fmt]
    for seed, ragged in ((1, False), (2, True)):
        n, k = _shape(layout, ragged)
        t = stored(layout, n, k, DTYPES[sd], case, seed)
        for od in (None, *DTYPES.values()):
            want = f.dequantize(t, args, dtype=od, impl="torch")
            assert_same(f.dequantize(t, args, dtype=od, impl="native"), want)
            out = torch.full(want.shape, 7.0, dtype=want.dtype)
            assert f.dequantize(t, args, dtype=od, out=out) is out
            assert_same(out, want)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sd", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_equals_compressed_tensors(layout, sd, case):
    fmt, a = LAYOUTS[layout]
    n, k = _shape(layout, ragged=False)
    t = stored(layout, n, k, DTYPES[sd], case, seed=3)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**a), format=fmt)
    ref = BaseCompressor.get_value_from_registry(fmt).decompress({p: v.clone() for p, v in t.items()}, scheme)["weight"]
    for od in (None, *DTYPES.values()):
        got = FORMATS[fmt].dequantize(t, WeightArgs.from_dict(a), dtype=od, impl="native")
        # NaN payloads are torch's on both sides, but compressed-tensors computes them in its own order
        assert_same(got, ref if od is None else ref.to(od), nan_bits=False)


def test_kernel_runs_where_no_product_is_nan_and_declines_where_one_is():
    """The kernel itself (not the torch fallback) gives the bytes above; a NaN product makes it decline."""
    fmt, a = LAYOUTS["fp8-channel"]
    args, f = WeightArgs.from_dict(a), FORMATS[fmt]
    t = stored("fp8-channel", 45, 256, torch.bfloat16, "randn", seed=4)
    spec = f.dequant_spec(t, args)
    got = native_dequant.dequant(spec.codes, spec.nibbles, spec.k, spec.lut, spec.factor, spec.zero_point, spec.layout, spec.mid, torch.bfloat16)
    assert got is not None
    assert_same(got, f.dequantize(t, args, impl="torch"))
    codes = spec.codes.clone()
    codes[5, 17] = 0x7F  # E4M3 NaN
    assert native_dequant.dequant(codes, spec.nibbles, spec.k, spec.lut, spec.factor, spec.zero_point, spec.layout, spec.mid, torch.bfloat16) is None
    t["weight"] = codes.view(torch.float8_e4m3fn)
    assert torch.isnan(f.dequantize(t, args)[5, 17])  # through the torch reference


def test_layouts_the_kernel_does_not_take_go_to_torch(monkeypatch):
    fmt, a = LAYOUTS["fp8-block"]
    args, f = WeightArgs.from_dict(a), FORMATS[fmt]
    t = stored("fp8-block", 256, 384, torch.bfloat16, "randn", seed=5)
    t["weight_scale"] = t["weight_scale"][:1]  # too few block rows: torch's own error, whatever the impl
    with pytest.raises(ValueError, match="not taken by the native"):
        f.dequantize(t, args, impl="native")
    with pytest.raises(RuntimeError):
        f.dequantize(t, args)
    # no compiler (or CTCONVERT_NATIVE=0): the torch reference, same bytes
    t = stored("w4-g128-asym", 45, 256, torch.float16, "zeros", seed=6)
    args = WeightArgs.from_dict(LAYOUTS["w4-g128-asym"][1])
    want = FORMATS["pack-quantized"].dequantize(t, args, dtype=torch.bfloat16)
    monkeypatch.setattr(native_dequant, "available", lambda: False)
    assert_same(FORMATS["pack-quantized"].dequantize(t, args, dtype=torch.bfloat16), want)


def test_the_scalar_build_gives_the_same_bytes(monkeypatch, tmp_path):
    """Built without the AVX2/F16C flags (another CPU), the kernel's scalar path gives the same bytes."""
    lib = scalar_build(monkeypatch, tmp_path, native_dequant._SRC, native_dequant._LIB.signatures, "dequant")
    monkeypatch.setattr(native_dequant, "_LIB", lib)
    for layout in ("w4-g128-asym", "w3-g32", "int8-g32-asym", "fp8-block", "nvfp4", "mxfp8"):
        fmt, a = LAYOUTS[layout]
        args = WeightArgs.from_dict(a)
        for sd in DTYPES.values():
            t = stored(layout, *_shape(layout, ragged=True), sd, "extreme", seed=8)
            for od in DTYPES.values():
                assert_same(FORMATS[fmt].dequantize(t, args, dtype=od, impl="native"), FORMATS[fmt].dequantize(t, args, dtype=od, impl="torch"))
