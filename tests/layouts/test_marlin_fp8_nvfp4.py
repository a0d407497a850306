"""FP8 and NVFP4 Marlin (docs/kernel-layouts.md §5.1, §5.2; ctconvert.layouts.marlin_fp8, marlin_nvfp4) against vLLM 0.33.0 reference vectors."""

from __future__ import annotations

import math

import pytest
import torch

from ctconvert.layouts.marlin_base import marlin_padded_nk
from ctconvert.layouts.marlin_fp8 import (
    fp8_fold_exponent_bias,
    fp8_unfold_exponent_bias,
    marlin_fp8_lost_scales,
    marlin_fp8_permuted_scales,
    marlin_fp8_repack,
    marlin_fp8_unrepack,
)
from ctconvert.layouts.marlin_nvfp4 import (
    marlin_nvfp4_lost_scales,
    marlin_nvfp4_repack,
    marlin_nvfp4_unrepack,
    nvfp4_decode_s0e5m3,
    nvfp4_encode_s0e5m3,
    nvfp4_marlin_global_scale,
    nvfp4_marlin_unglobal_scale,
    nvfp4_scale_factor,
)

from helpers import DEVICES, VECTORS, bits, bitwise_equal, case_on, vector_cases

ACT = {"float16": torch.float16, "bfloat16": torch.bfloat16}


FP8_FILE, NVFP4_FILE = "marlin_fp8.safetensors", "marlin_nvfp4.safetensors"
FP8_CASES = list(vector_cases(FP8_FILE))
NVFP4_CASES = list(vector_cases(NVFP4_FILE))
# skip only when a file is absent: a file without cases fails its *_vector_file_complete test
needs_fp8 = pytest.mark.skipif(not (VECTORS / FP8_FILE).is_file(), reason=f"{FP8_FILE} not found")
needs_nvfp4 = pytest.mark.skipif(not (VECTORS / NVFP4_FILE).is_file(), reason=f"{NVFP4_FILE} not found")


def _nvfp4_flushed(weight_scale: torch.Tensor, sf: float) -> torch.Tensor:
    """Test-side rule (§5.2 step 3.4, marlin_nvfp4.py docstring): the checkpoint block scales that the
    S0E5M3 codes cannot give back. A scale survives iff it is positive and ``scale * sf * 128 >= 2``;
    every other non-zero bit pattern (flushed small scales, negatives, -0.0, NaN) is lost."""
    s = weight_scale.cpu().view(torch.float8_e4m3fn)
    x = s.float()
    kept = (x > 0) & (x * sf * 128.0 >= 2.0)
    return (s.view(torch.uint8) != 0) & ~kept


def _assert_kernel_equal(got: dict, want: dict, ctx) -> None:
    for name, t in want.items():
        assert bitwise_equal(got[name], t), (ctx, name)


# =========================================================================== FP8 vectors


@needs_fp8
def test_fp8_vector_file_complete():
    assert len(FP8_CASES) >= 1  # whatever number of cases the file holds


@needs_fp8
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx", range(len(FP8_CASES)))
def test_fp8_reference_vectors(idx, device):
    i, p, ins, exp = FP8_CASES[idx]
    w, ws = ins["weight"].to(device), ins["weight_scale"].to(device)
    n, k, lw = p["N"], p["K"], p["logical_widths"]
    assert marlin_padded_nk(n, k, -1) == (p["padded_N"], p["padded_K"])
    got = marlin_fp8_repack(w, ws, p["act_dtype"], logical_widths=lw)
    got["scales_permuted"] = marlin_fp8_permuted_scales(ws, k, n, p["act_dtype"], lw)
    assert bitwise_equal(fp8_fold_exponent_bias(got["scales_permuted"]), got["marlin_scales"])
    assert set(exp) == {"marlin_q_w", "marlin_scales", "scales_permuted"}
    for name, t in exp.items():
        assert got[name].device.type == device
        assert bitwise_equal(got[name], t), (i, name, p)

    # inverse: weight bit-exact; scale exact except where the lost-mask says so
    back = marlin_fp8_unrepack(got, n, k, strategy=p["strategy"], logical_widths=lw, scale_dtype=ws.dtype)
    assert bitwise_equal(back["weight"], w)
    lost = marlin_fp8_lost_scales(ws, n, p["act_dtype"], lw)
    assert back["weight_scale"].shape == ws.shape and lost.shape == ws.shape
    same = bits(back["weight_scale"]) == bits(ws)
    assert torch.equal(same, ~lost.cpu())
    assert bool(lost.any()) == (p["scale_dtype"] == "float32" or p["big_scale"])
    if p["big_scale"]:
        # fp16 overflow (§5.1 step 4) is not invertible: exactly the scales above 255.875 come back as inf
        assert torch.equal(torch.isinf(back["weight_scale"]).cpu(), lost.cpu())
        assert torch.equal(lost.cpu(), ws.cpu().float() > 255.875)
    # forward(inverse(kernel)) == kernel, always
    again = marlin_fp8_repack(back["weight"], back["weight_scale"], p["act_dtype"], logical_widths=lw)
    _assert_kernel_equal(again, {k_: got[k_] for k_ in ("marlin_q_w", "marlin_scales")}, i)


# =========================================================================== NVFP4 vectors


@needs_nvfp4
def test_nvfp4_vector_file_complete():
    assert len(NVFP4_CASES) >= 1  # whatever number of cases the file holds
    # the flush branch of §5.2 step 3.4 is exercised by some case (the README's float16 twin of the
    # unnormalized case), judged by the test-side rule from each case's own scale_factor
    assert any(_nvfp4_flushed(ins["weight_scale"], p["scale_factor"]).any() for _, p, ins, _ in NVFP4_CASES)


@needs_nvfp4
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx", range(len(NVFP4_CASES)))
def test_nvfp4_reference_vectors(idx, device):
    i, p, ins, exp = case_on(NVFP4_CASES, idx, device)
    n, k, act = p["N"], p["K"], p["act_dtype"]
    assert marlin_padded_nk(n, k, 16) == (p["padded_N"], p["padded_K"])
    got = marlin_nvfp4_repack(ins["weight_packed"], ins["weight_scale"], ins["weight_global_scale"], act)
    assert set(exp) <= set(got)
    for name, t in exp.items():
        assert got[name].device.type == device
        assert bitwise_equal(got[name], t), (i, name, p)
    assert float(got["scale_factor"]) == p["scale_factor"]

    # inverse with the checkpoint divisors kept
    back = marlin_nvfp4_unrepack(got, n, k, act, weight_global_scale=ins["weight_global_scale"])
    assert bitwise_equal(back["weight_packed"], ins["weight_packed"])
    assert bitwise_equal(back["weight_global_scale"], ins["weight_global_scale"])
    lost = marlin_nvfp4_lost_scales(ins["weight_scale"], act)
    same = bits(back["weight_scale"]) == bits(ins["weight_scale"])
    assert torch.equal(same, ~lost.cpu())
    # which scales are lost, from the case itself: the test-side rule with the case's scale factor ...
    want_lost = _nvfp4_flushed(ins["weight_scale"], p["scale_factor"])
    assert torch.equal(lost.cpu(), want_lost), (i, p)
    assert bool(lost.any()) == bool(want_lost.any())
    # ... and vLLM's own bytes: the permutation only moves codes and the padding is zeros, so the
    # zero codes of expected.marlin_scales are the padding, the zero inputs and the lost scales
    if bool((ins["weight_scale"].cpu().float() >= 0).all()):  # no negative or NaN scale (-0.0 codes as 0)
        zero_codes = int((exp["marlin_scales"].view(torch.uint8) == 0).sum())
        padding = exp["marlin_scales"].numel() - ins["weight_scale"].numel()
        zero_inputs = int((ins["weight_scale"].cpu().view(torch.uint8) == 0).sum())
        assert zero_codes - padding - zero_inputs == int(want_lost.sum()), (i, p)
    if lost.any():
        assert not back["weight_scale"].float()[lost].any()  # flushed scales come back as 0

    # inverse without the divisors: forward(inverse(kernel)) == kernel bit for bit
    back2 = marlin_nvfp4_unrepack(got, n, k, act)
    assert back2["weight_global_scale"].shape == (1,)
    if p["num_global_scales"] == 1:
        assert torch.equal(1.0 / back2["weight_global_scale"], 1.0 / ins["weight_global_scale"])
    again = marlin_nvfp4_repack(back2["weight_packed"], back2["weight_scale"], back2["weight_global_scale"], act)
    _assert_kernel_equal(again, got, i)


# =========================================================================== random round trips


def _rand_fp8_bytes(shape, g) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)


FP8_SHAPES = [(128, 256), (96, 200), (200, 64), (64, 132), (320, 128)]


@pytest.mark.parametrize("act", ["float16", "bfloat16"])
@pytest.mark.parametrize("nk", FP8_SHAPES)
def test_fp8_round_trip_random(nk, act):
    n, k = nk
    g = torch.Generator().manual_seed(n * 7 + k)
    w = _rand_fp8_bytes((n, k), g)
    np_, kp = marlin_padded_nk(n, k, -1)
    for strategy, ws, lw in (
        ("channel", (torch.rand(n, 1, generator=g) * 0.02 + 1e-4).to(ACT[act]), None),
        ("tensor", (torch.rand(2, generator=g) * 0.02 + 1e-4).to(ACT[act]), [n // 2, n - n // 2]),
    ):
        kern = marlin_fp8_repack(w, ws, act, logical_widths=lw)
        assert kern["marlin_q_w"].shape == (kp // 16, 4 * np_) and kern["marlin_q_w"].dtype == torch.int32
        assert kern["marlin_scales"].shape == (1, np_) and kern["marlin_scales"].dtype == ACT[act]
        back = marlin_fp8_unrepack(kern, n, k, strategy=strategy, logical_widths=lw)
        assert bitwise_equal(back["weight"], w)
        assert bitwise_equal(back["weight_scale"], ws)
        assert not marlin_fp8_lost_scales(ws, n, act, lw).any()


def test_fp8_fold_exact_and_overflow():
    x = torch.tensor([1e-7, 0.5, 255.875, 256.0, 0.0], dtype=torch.float16)
    y = fp8_fold_exponent_bias(x)
    assert y[2] == 255.875 * 256 and torch.isinf(y[3]) and y[4] == 0
    assert bitwise_equal(fp8_unfold_exponent_bias(y)[[0, 1, 2, 4]], x[[0, 1, 2, 4]])
    b = torch.tensor([1e-38, 3.0, 255.0], dtype=torch.bfloat16)
    assert bitwise_equal(fp8_unfold_exponent_bias(fp8_fold_exponent_bias(b)), b)
    assert float(fp8_fold_exponent_bias(torch.tensor([1.0], dtype=torch.bfloat16))) == 2.0**120


NVFP4_SHAPES = [(128, 256), (96, 128), (128, 208), (200, 64), (64, 512)]


def _rand_e4m3_scales(shape, g, lo_code: int = 1) -> torch.Tensor:
    """Positive e4m3 scales (codes lo_code..126, no NaN), with a few zeros."""
    s = torch.randint(lo_code, 127, shape, dtype=torch.uint8, generator=g)
    s[torch.rand(shape, generator=g) < 0.02] = 0
    return s.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("act", ["float16", "bfloat16"])
@pytest.mark.parametrize("nk", NVFP4_SHAPES)
def test_nvfp4_round_trip_random(nk, act):
    n, k = nk
    g = torch.Generator().manual_seed(n * 13 + k)
    wp = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    ws = _rand_e4m3_scales((n, k // 16), g, lo_code=1)  # includes subnormals
    gs = torch.rand(3, generator=g) * 2000 + 1
    np_, kp = marlin_padded_nk(n, k, 16)
    kern = marlin_nvfp4_repack(wp, ws, gs, act)
    assert kern["marlin_q_w"].shape == (kp // 16, 2 * np_)
    assert kern["marlin_scales"].shape == (kp // 16, np_) and kern["marlin_scales"].dtype == torch.float8_e4m3fn
    back = marlin_nvfp4_unrepack(kern, n, k, act, weight_global_scale=gs)
    assert bitwise_equal(back["weight_packed"], wp)
    lost = marlin_nvfp4_lost_scales(ws, act)
    assert torch.equal(bits(back["weight_scale"]) == bits(ws), ~lost)
    if act == "float16":  # exactly the e4m3 subnormals (< 2^-6) are flushed
        assert torch.equal(lost, (ws.float() > 0) & (ws.float() < 2.0**-6))
    # normal-range scales are always exact
    ws_normal = _rand_e4m3_scales((n, k // 16), g, lo_code=8)
    kern = marlin_nvfp4_repack(wp, ws_normal, gs[:1], act)
    back = marlin_nvfp4_unrepack(kern, n, k, act)
    assert bitwise_equal(back["weight_scale"], ws_normal)
    assert bitwise_equal(1.0 / back["weight_global_scale"], 1.0 / gs[:1])


def test_nvfp4_old_layout_version_has_no_scale_factor():
    g = torch.Generator().manual_seed(5)
    wp = torch.randint(0, 256, (128, 128), dtype=torch.uint8, generator=g)
    ws = (torch.rand(128, 16, generator=g) * 0.1 + 0.02).to(torch.float8_e4m3fn)
    new = marlin_nvfp4_repack(wp, ws, torch.ones(1), "bfloat16", layout_version="0.33")
    old = marlin_nvfp4_repack(wp, ws, torch.ones(1), "bfloat16", layout_version="0.18")
    assert float(new["scale_factor"]) > 1 and float(old["scale_factor"]) == 1
    assert bitwise_equal(new["marlin_q_w"], old["marlin_q_w"])
    for kern, ver in ((new, "0.33"), (old, "0.18")):
        back = marlin_nvfp4_unrepack(kern, 128, 256, "bfloat16", layout_version=ver)
        assert bitwise_equal(back["weight_scale"], ws)


# =========================================================================== scale rules, exhaustively


def _s0e5m3_reference(x: float, sf: float) -> int:
    """Independent scalar model of §5.2 steps 3.3-3.5 for a positive e4m3 value x."""
    v = x * sf * 128.0
    if not v >= 2.0:
        return 0
    mant, exp = math.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1)
    e = exp - 1 + 15  # fp16 biased exponent
    m3 = int((mant * 2 - 1) * 8)
    assert (mant * 2 - 1) * 8 == m3 and 1 <= e <= 30
    return (e << 3) | m3


ALL_E4M3 = torch.arange(256, dtype=torch.uint8)
POSITIVE_E4M3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("sf_log2", [0, 1, 7, 12, 17])
def test_s0e5m3_codes_exhaustive(sf_log2):
    sf = torch.tensor(2.0**sf_log2)
    # the rule picks sf so that max(scale) * sf <= 448: only those scales can meet this sf
    vals = POSITIVE_E4M3[POSITIVE_E4M3.float() * 2.0**sf_log2 <= 448]
    codes = nvfp4_encode_s0e5m3(vals, sf)
    assert codes.dtype == torch.float8_e4m3fn
    want = torch.tensor([_s0e5m3_reference(float(x), 2.0**sf_log2) for x in vals.float()], dtype=torch.uint8)
    assert torch.equal(codes.view(torch.uint8), want)
    dec = nvfp4_decode_s0e5m3(codes, sf)
    kept = vals.float() * 2.0**sf_log2 * 128 >= 2
    assert torch.equal(bits(dec)[kept], bits(vals)[kept])
    assert not dec.float()[~kept].any()
    # zero, negative, -0.0 all encode to 0
    other = ALL_E4M3[128:].clone()
    other = other[(other & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # negatives and -0.0, no NaN
    assert not nvfp4_encode_s0e5m3(other, sf).view(torch.uint8).any()


def test_scale_factor_rule_exhaustive():
    """sf for every possible e4m3 maximum, against vLLM's literal float expression (§5.2 step 3.2)."""
    for x in POSITIVE_E4M3:
        scales = torch.stack([x, torch.zeros((), dtype=torch.float8_e4m3fn)]).reshape(1, 2)
        m = x.float() * 128
        want = (448 * (2**7) / m).log2().floor().exp2() if float(m) < 448 * 128 else torch.tensor(1.0)
        got = nvfp4_scale_factor(scales, torch.bfloat16)
        assert got.dtype == torch.float32 and got.shape == ()
        assert float(got) == float(want), float(x.float())
        assert float(nvfp4_scale_factor(scales, torch.float16)) == 1.0
        assert float(nvfp4_scale_factor(scales, torch.bfloat16, "0.18")) == 1.0
    assert float(nvfp4_scale_factor(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), "bfloat16")) == 1.0
    assert float(nvfp4_scale_factor(torch.tensor([2.0**-9]).to(torch.float8_e4m3fn), "bfloat16")) == 2.0**17


def test_global_scale_inverse():
    g = torch.Generator().manual_seed(1)
    div = torch.rand(1000, generator=g) * 5000 + 0.5
    for act, b in (("float16", 14), ("bfloat16", 126)):
        for sf in (1.0, 128.0, 4096.0):
            sf_t = torch.tensor(sf)
            for d in div[:50]:
                ct, gsm = nvfp4_marlin_global_scale(d.reshape(1), act, sf_t)
                assert bitwise_equal(gsm, (ct * 2.0 ** (b - 7)) / sf)
                assert bitwise_equal(nvfp4_marlin_unglobal_scale(gsm, act, sf_t), ct)


# =========================================================================== errors


def test_errors():
    w = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    s = torch.ones(64, 1, dtype=torch.float16)
    with pytest.raises(ValueError):
        marlin_fp8_repack(w, s, torch.float32)
    with pytest.raises(ValueError):
        marlin_fp8_repack(torch.zeros(64, 126, dtype=torch.float8_e4m3fn), s, "float16")
    with pytest.raises(ValueError):
        marlin_fp8_repack(w, torch.ones(64, 2), "float16")  # block-wise
    with pytest.raises(ValueError):
        marlin_fp8_repack(w, torch.ones(3), "float16")  # 3 shards do not divide 64
    with pytest.raises(ValueError):
        marlin_fp8_repack(w, torch.ones(2), "float16", logical_widths=[30, 30])
    with pytest.raises(TypeError):
        marlin_fp8_repack(w.float(), s, "float16")
    wp = torch.zeros(64, 64, dtype=torch.uint8)
    ws = torch.zeros(64, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        marlin_nvfp4_repack(wp, ws[:, :7], torch.ones(1), "bfloat16")
    with pytest.raises(ValueError):
        marlin_nvfp4_repack(torch.zeros(64, 60, dtype=torch.uint8), ws, torch.ones(1), "bfloat16")
    with pytest.raises(TypeError):
        marlin_nvfp4_repack(wp, ws.float(), torch.ones(1), "bfloat16")
    with pytest.raises(ValueError):
        marlin_nvfp4_repack(wp, ws, torch.ones(1), "bfloat16", layout_version="latest")
    kern = marlin_nvfp4_repack(wp, ws, torch.ones(1), "bfloat16")
    with pytest.raises(KeyError):
        marlin_nvfp4_unrepack({k: v for k, v in kern.items() if k != "scale_factor"}, 64, 128, "bfloat16")


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float16])
def test_nvfp4_scale_processing_from_e4m3_equals_the_act_dtype_path(act):
    """Scales given as e4m3 (the byte paths: scale factor from the bytes, codes from a 256-entry table) give
    what the act_dtype path (vLLM's: cast, reorder, float passes) gives, for every byte: zeros, negatives,
    NaN bytes, subnormals, and small scales (a large scale factor)."""
    from ctconvert.layouts import marlin_nvfp4 as mn

    g = torch.Generator().manual_seed(17)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for trial in range(4):
        b = torch.cat([every, torch.randint(0, 0x7F if trial % 2 else 256, (4096,), generator=g, dtype=torch.int32).to(torch.uint8)])
        if trial == 3:
            b = b.clamp(max=0x30)
        s = b.view(torch.float8_e4m3fn).reshape(-1, 16)
        for v in ("0.33", "0.20"):
            codes, sf = mn.nvfp4_marlin_process_scales(s, act, v)
            ref_codes, ref_sf = mn.nvfp4_marlin_process_scales(s.to(act), act, v)
            assert torch.equal(sf, ref_sf) and torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), (trial, v)


def test_one_fp4_shape_check_for_nvfp4_and_mxfp4():
    from ctconvert.layouts.common import LayoutTypeError
    from ctconvert.layouts.marlin_nvfp4 import check_fp4

    wp = torch.zeros(4, 16, dtype=torch.uint8)  # K = 32
    assert check_fp4(wp, torch.zeros(4, 2, dtype=torch.float8_e4m3fn), "NVFP4", 16, (torch.float8_e4m3fn, torch.uint8), "be float8_e4m3fn") == (4, 32)
    with pytest.raises(ValueError, match=r"MXFP4 needs non-empty shapes and K % 32 == 0, got \(N, K\) = \(4, 48\)"):
        check_fp4(torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), "MXFP4", 32, (torch.uint8,), "hold E8M0 bytes (uint8)")
    with pytest.raises(LayoutTypeError, match="weight_scale must be float8_e4m3fn, got torch.float16"):
        check_fp4(wp, torch.zeros(4, 2, dtype=torch.float16), "NVFP4", 16, (torch.float8_e4m3fn, torch.uint8), "be float8_e4m3fn")
