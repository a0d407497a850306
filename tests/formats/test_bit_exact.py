"""Every scheme, every input dtype, awkward inputs: our bytes == compressed-tensors' bytes."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats import native
from ctconvert.formats.common import tensor_absmax
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.plan.schemes import get_scheme

from ct_reference import ct_compress
from helpers import stable_seed

SCHEMES = ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "NVFP4A16", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CASES = ["randn", "zeros", "tiny", "huge", "neg_to_zero", "mixed"]


def make_weight(case: str, dtype: torch.dtype, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    fp16 = dtype == torch.float16
    if case == "zeros":
        w[0] = 0
        w[n // 2, : min(k, 160)] = 0  # zero groups (g16, g32, g128) inside a non-zero row
        w[:, 3] = 0
    elif case == "tiny":
        w[1] = torch.randn(k, generator=g) * (1e-6 if fp16 else 1e-30)
        w[2, :64] = 1e-7 if fp16 else 1e-38
        w[4, 5:40:3] = -1e-7 if fp16 else -1e-40  # subnormal values in a normal row (bf16 and fp32 subnormals)
        # a row at the subnormal floor: its scales (range / Q) underflow to 0 in D, and the asymmetric zero
        # point comes from min / 0 (an H200 run found the GPU kernel giving 0 where the reference gives QMAX)
        w[5] = torch.randn(k, generator=g) * (3e-8 if fp16 else 5e-41 if dtype == torch.bfloat16 else 1e-44)
    elif case == "huge":
        w[1] = (torch.randn(k, generator=g) * (1e4 if fp16 else 1e30)).clamp(-4.8e4, 4.8e4) if fp16 else torch.randn(k, generator=g) * 1e30
        w[3, 7] = 4.8e4 if fp16 else -3e37
    elif case == "neg_to_zero":
        w = w.abs()
        w[:, ::16] = 1.0  # big value per group, the rest tiny and negative
        w[:, 1::16] = -1e-3
        w[:, 2::16] = -0.0
    elif case == "mixed":
        w[0] = 0
        w[1] *= 1e-4
        w[2, 5] = -0.0
        w[3] *= 100
        w[4, :16] = -1e-5
    return w.to(dtype)


_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
IMPLS = [
    "torch",
    pytest.param("native", marks=pytest.mark.skipif(not native.available(), reason="no C compiler")),
    pytest.param("cuda", marks=_no_cuda),
    pytest.param("cuda-torch", marks=_no_cuda),
]


def ours(scheme_name: str, w: torch.Tensor, device: str = "cpu", fused: list[torch.Tensor] | None = None) -> dict:
    """Our full per-module output, as the pipeline writes it. ``device``: torch | native | cuda | cpu (auto)."""
    impl = {"torch": "torch", "native": "native", "cuda-torch": "torch"}.get(device, "auto")
    device = {"torch": "cpu", "native": "cpu", "cuda-torch": "cuda"}.get(device, device)
    s = get_scheme(scheme_name)
    wd = w.to(device)
    gs = None
    if s.global_scale:
        amax = torch.stack([tensor_absmax(m.to(device)) for m in (fused or [w])]).amax()
        gs = nvfp4_global_scale(amax, w.dtype)
    out = {k: v.cpu() for k, v in s.quantize_rows(wd, gs, impl=impl).items()}
    if s.format == "pack-quantized":
        out["weight_shape"] = torch.tensor(list(w.shape))
    if gs is not None:
        out["weight_global_scale"] = gs.cpu()
    return out


def assert_same_bytes(ref: dict, got: dict) -> None:
    assert set(ref) == set(got), (sorted(ref), sorted(got))
    for key in ref:
        a, b = ref[key], got[key]
        assert a.dtype == b.dtype, (key, a.dtype, b.dtype)
        assert tuple(a.shape) == tuple(b.shape), (key, a.shape, b.shape)
        ab = a.contiguous().reshape(-1).view(torch.uint8)
        bb = b.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(ab, bb):
            diff = (ab != bb).nonzero().reshape(-1)
            raise AssertionError(f"{key}: {diff.numel()} of {ab.numel()} bytes differ, first at byte {diff[0].item()}")


def shape_for(scheme: str) -> tuple[int, int]:
    # N never a multiple of 8, 16, 32 or 128; K a multiple of the group only where required
    return (200, 300) if scheme == "FP8_BLOCK" else (37, 256) if scheme == "W4A16_ASYM" else (45, 384)


@pytest.mark.parametrize("device", IMPLS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_matches_compressed_tensors(scheme, dtype, case, device):
    n, k = shape_for(scheme)
    w = make_weight(case, dtype, n, k, seed=stable_seed(scheme, case))
    assert_same_bytes(ct_compress(w, scheme), ours(scheme, w, device))


@pytest.mark.parametrize("device", IMPLS)
@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_fused_set_shares_global_scale(seed, device):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(64, 256, generator=g) * 0.02).to(torch.bfloat16)
    k = (torch.randn(32, 256, generator=g) * 0.07).to(torch.bfloat16)
    v = (torch.randn(32, 256, generator=g) * 0.01).to(torch.bfloat16)
    members = [q, k, v]
    outs = [ours("NVFP4A16", m, device, fused=members) for m in members]
    for m, o in zip(members, outs):
        assert_same_bytes(ct_compress(m, "NVFP4A16", fused_with=members), o)
    gss = {o["weight_global_scale"].item() for o in outs}
    assert len(gss) == 1
    # and it is the scale of the largest member, not each member's own
    assert gss.pop() == ct_compress(k, "NVFP4A16")["weight_global_scale"].item()


@_no_cuda
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpu_kernels_that_loop_over_tiles(scheme, programs, monkeypatch):
    """Few programs, so that each loops over many tiles (rows for FP8) and prefetches the next: same bytes."""
    from ctconvert.formats import gpu

    monkeypatch.setattr(gpu, "_programs", lambda w, tiles, cfg: min(tiles, programs))
    n, k = shape_for(scheme)
    for case in ("mixed", "huge"):
        for dtype in DTYPES:
            w = make_weight(case, dtype, n, k, seed=7)
            assert_same_bytes(ct_compress(w, scheme), ours(scheme, w, "cuda"))


def test_random_shapes_and_scales_many_seeds():
    """Fresh random inputs of varied shape and scale, bf16, every scheme."""
    for seed in range(6):
        g = torch.Generator().manual_seed(1000 + seed)
        n = int(torch.randint(1, 90, (1,), generator=g))
        scale = float(10 ** torch.empty(1).uniform_(-6, 3, generator=g))
        for scheme in SCHEMES:
            k = 128 * int(torch.randint(1, 4, (1,), generator=g)) if scheme != "FP8_BLOCK" else int(torch.randint(1, 400, (1,), generator=g))
            w = (torch.randn(n, k, generator=g) * scale).to(torch.bfloat16)
            ref = ct_compress(w, scheme)
            assert_same_bytes(ref, ours(scheme, w, "torch"))
            if native.available():
                assert_same_bytes(ref, ours(scheme, w, "native"))


@pytest.mark.parametrize("device", IMPLS)
@pytest.mark.parametrize("scheme", ["MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"])
def test_mx_scale_overflow_is_an_error(device, scheme):
    w = torch.full((2, 64), 0.5, dtype=torch.float16)
    w[1, 3] = 60000.0  # rounds up to 2^16, which fp16 cannot hold
    with pytest.raises(ValueError, match=f"{scheme[:5]} scale overflows"):
        ours(scheme, w, device)
    b = torch.full((2, 64), 0.5, dtype=torch.bfloat16)
    b[0, 40] = 3.3e38  # bf16: mantissa 1.94 rounds past 2^127
    with pytest.raises(ValueError, match="scale overflows torch.bfloat16"):
        ours(scheme, b, device)


@pytest.mark.parametrize("device", IMPLS)
def test_mxfp8_scales_and_values_by_hand(device):
    """MXFP8 facts stated independently of compressed-tensors (docs/compressed-tensors-format.md §6.5): the byte
    is 127 + floor(log2 p2) - 8, p2 being the group absmax rounded to a power of two on its bf16 bits with the
    E2M1 half-step (a mantissa of 1.75 or more rounds up, 1.5 does not); the elements are E4M3(w / 2^(byte - 127)).
    An all-zero group gets byte 0 (its scale 2^-127 is a bf16 subnormal, not zero) and zero elements."""
    w = torch.zeros(3, 64, dtype=torch.bfloat16)
    w[0, :32] = 1.5  # p2 = 1 -> byte 119, elements 1.5 * 256 = 384
    w[0, 32:] = 1.75  # rounds up: p2 = 2 -> byte 120, elements 1.75 * 128 = 224
    w[1, :32] = torch.linspace(-3, 3, 32)  # 3 = 1.5 * 2: p2 = 2 -> byte 120, elements w * 128
    out = ours("MXFP8A16", w, device)
    assert out["weight_scale"].tolist() == [[119, 120], [120, 0], [0, 0]]
    q = out["weight"].float()
    assert torch.equal(q[0, :32], torch.full((32,), 384.0)) and torch.equal(q[0, 32:], torch.full((32,), 224.0))
    assert torch.equal(q[1, :32], (w[1, :32].float() * 128).to(torch.float8_e4m3fn).float())
    assert not q[2].any() and not q[1, 32:].any()


@pytest.mark.parametrize("device", IMPLS)
@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8_BLOCK", "MXFP8A16"])
def test_negative_zero_weight_is_0x80_as_compressed_tensors_quantize_writes_it(scheme, device):
    """An exact -0.0 weight is E4M3 byte 0x80 (and +0.0 is 0x00): compressed-tensors 0.20.1's ``quantize()`` called
    as the model-free path calls it for symmetric weights (no zero point) keeps the sign; every dequantized FP8
    source holds -0.0. The expectation is compressed-tensors' own function, not the test's reference driver."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize

    w = make_weight("randn", torch.bfloat16, 128, 256, seed=stable_seed("negzero", scheme))
    w[3, 7], w[3, 8], w[40, :32] = -0.0, 0.0, -0.0  # a -0 beside a +0, and a whole MX group of -0
    got = ours(scheme, w, device)
    args = preset_name_to_scheme(scheme, ["Linear"]).weights
    s = got["weight_scale"]
    if scheme == "MXFP8A16":
        scale = torch.exp2(s.float() - 127).to(torch.bfloat16).repeat_interleave(32, 1)
    elif scheme == "FP8_BLOCK":
        scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:128, :256]
    else:
        scale = s
    want = quantize(w, scale.expand_as(w).contiguous(), None, args.model_copy(update={"strategy": "tensor"}), dtype=torch.float8_e4m3fn)
    b = got["weight"].view(torch.uint8)
    assert b[3, 7] == 0x80 and b[3, 8] == 0x00 and bool((b[40, :32] == 0x80).all())
    assert torch.equal(b, want.view(torch.uint8))
