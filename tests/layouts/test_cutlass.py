"""CUTLASS / FlashInfer NVFP4 layouts (docs/kernel-layouts.md §6) against vLLM 0.33.0 reference vectors."""

from __future__ import annotations

import pytest
import torch

from ctconvert.layouts.cutlass import (
    nvfp4_cutlass_layer,
    nvfp4_cutlass_scalars,
    nvfp4_cutlass_unlayer,
    nvfp4_cutlass_unscalars,
    pad_nvfp4_weight,
    reciprocal_preimage,
    swizzle_blockscale,
    unpad_nvfp4_weight,
    unswizzle_blockscale,
)

from helpers import DEVICES, VECTORS, bitwise_equal, case_on, stable_seed, vector_cases

VECTOR_FILE = "cutlass_nvfp4.safetensors"
CASES = list(vector_cases(VECTOR_FILE))
# skip only when the file is absent: a file without cases fails test_vector_file_complete
needs_vectors = pytest.mark.skipif(not (VECTORS / VECTOR_FILE).is_file(), reason=f"{VECTOR_FILE} not found")


@needs_vectors
def test_vector_file_complete():
    # whatever number of cases the file holds: at least one, and every kind covered
    assert len(CASES) >= 1
    assert {p["kind"] for _, p, _, _ in CASES} == {"swizzle", "pad", "layer"}


@needs_vectors
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx", range(len(CASES)))
def test_reference_vectors(idx, device):
    i, p, ins, exp = case_on(CASES, idx, device)
    kind = p["kind"]
    if kind == "swizzle":
        got = {"scale_swizzled": swizzle_blockscale(ins["scale"])}
        assert got["scale_swizzled"].shape[-2:] == (p["padded_M"], p["padded_K_blocks"])
        back = unswizzle_blockscale(got["scale_swizzled"], p["M"], p["K_blocks"], check_padding=True)
        assert bitwise_equal(back, ins["scale"])
    elif kind == "pad":
        w, nbytes = pad_nvfp4_weight(ins["weight_packed"], p["alignment"])
        assert nbytes == p["weights_padding_bytes"]
        got = {"weight_padded": w, "weights_padding_bytes": torch.tensor(nbytes, dtype=torch.int64, device=device)}
        back = unpad_nvfp4_weight(w, p["N"], p["K"], check_padding=True)
        assert bitwise_equal(back, ins["weight_packed"])
    else:
        assert kind == "layer"
        got = nvfp4_cutlass_layer(
            ins["weight_packed"],
            ins["weight_scale"],
            ins["weight_global_scale"],
            ins["input_global_scale"],
            alignment=p["alignment"],
        )
        assert int(got["weights_padding_bytes"]) == p["weights_padding_bytes"]
        back = nvfp4_cutlass_unlayer(got, p["N"], p["K"], weight_global_scale=ins["weight_global_scale"])
        for name in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
            assert bitwise_equal(back[name], ins[name]), name
    assert set(exp) <= set(got), (i, sorted(exp), sorted(got))
    for name, want in exp.items():
        assert got[name].device.type == device
        assert bitwise_equal(got[name], want), (i, name, p)


# ---------------------------------------------------------------------------
# random round trips and an independent check of the offset formula (§6.1)
# ---------------------------------------------------------------------------


def _swizzle_by_formula(scale: torch.Tensor) -> torch.Tensor:
    """Scatter with the flat byte offset of §6.1 (independent of the reshape/permute)."""
    m, kb = scale.shape
    mp, kp = -(-m // 128) * 128, -(-kb // 4) * 4
    mm = torch.arange(m).view(-1, 1).expand(m, kb)
    kk = torch.arange(kb).view(1, -1).expand(m, kb)
    mt, m4, m32 = mm // 128, (mm % 128) // 32, mm % 32
    kt, k4 = kk // 4, kk % 4
    off = ((mt * (kp // 4) + kt) * 32 + m32) * 16 + m4 * 4 + k4
    flat = torch.zeros(mp * kp, dtype=torch.uint8)
    flat[off.reshape(-1)] = scale.view(torch.uint8).reshape(-1)
    return flat.view(mp, kp)


SHAPES = [(1, 1), (128, 4), (129, 5), (96, 8), (300, 13), (257, 6), (512, 64)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_swizzle_round_trip_random(shape, dtype):
    g = torch.Generator().manual_seed(stable_seed(shape))
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    scale = raw.view(dtype)
    sw = swizzle_blockscale(scale)
    assert sw.dtype == dtype and sw.is_contiguous()
    assert bitwise_equal(sw.view(torch.uint8), _swizzle_by_formula(raw))
    back = unswizzle_blockscale(sw, *shape, check_padding=True)
    assert bitwise_equal(back, scale)


def test_swizzle_batched_and_noncontiguous():
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (3, 10, 77), dtype=torch.uint8, generator=g)
    scale = raw.transpose(1, 2).view(torch.float8_e4m3fn)  # (3, 77, 10), not contiguous
    sw = swizzle_blockscale(scale)
    assert sw.shape == (3, 128, 12)
    for b in range(3):
        assert bitwise_equal(sw[b], swizzle_blockscale(scale[b]))
    assert bitwise_equal(unswizzle_blockscale(sw, 77, 10, check_padding=True), scale.contiguous())


def test_unswizzle_errors():
    sw = swizzle_blockscale(torch.zeros(100, 6, dtype=torch.uint8))
    with pytest.raises(ValueError):
        unswizzle_blockscale(sw, 100, 9)  # K_blocks 9 pads to 12, not 8
    with pytest.raises(ValueError):
        unswizzle_blockscale(sw, 300, 6)
    bad = sw.clone()
    bad[127, 7] = 1
    with pytest.raises(ValueError):
        unswizzle_blockscale(bad, 100, 6, check_padding=True)
    with pytest.raises(TypeError):
        swizzle_blockscale(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError):
        swizzle_blockscale(torch.zeros(4, dtype=torch.uint8))


@pytest.mark.parametrize("alignment", [32, 64])
@pytest.mark.parametrize("nk", [(100, 200), (96, 96), (128, 256), (1, 16), (33, 34)])
def test_pad_round_trip_random(nk, alignment):
    n, k = nk
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    wp, nbytes = pad_nvfp4_weight(w, alignment)
    rows, kp = -(-n // alignment) * alignment, -(-k // alignment) * alignment
    assert wp.shape == (rows, kp // 2) and nbytes == (kp - k) // 2
    assert not wp[n:].any() and not wp[:, k // 2 :].any()
    assert bitwise_equal(unpad_nvfp4_weight(wp, n, k, check_padding=True), w)


def test_pad_errors():
    w = torch.zeros(4, 8, dtype=torch.uint8)
    for a in (0, 3, -32):
        with pytest.raises(ValueError):
            pad_nvfp4_weight(w, a)
    with pytest.raises(ValueError):
        unpad_nvfp4_weight(w, 5, 16)
    with pytest.raises(ValueError):
        unpad_nvfp4_weight(w, 4, 15)


def test_scalars_and_inverse():
    g = torch.Generator().manual_seed(3)
    wgs = torch.rand(3, generator=g) * 3000 + 1
    igs = torch.rand(3, generator=g) * 500 + 1
    s = nvfp4_cutlass_scalars(wgs, igs)
    for v in s.values():
        assert v.shape == () and v.dtype == torch.float32
    assert bitwise_equal(s["input_global_scale_inv"], igs.max())
    back = nvfp4_cutlass_unscalars(s)
    assert bitwise_equal(back["input_global_scale"], igs.max().reshape(1))
    again = nvfp4_cutlass_scalars(back["weight_global_scale"], back["input_global_scale"])
    for k in s:
        assert bitwise_equal(again[k], s[k]), k


def test_reciprocal_preimage_maps_back():
    g = torch.Generator().manual_seed(11)
    x = torch.rand(200_000, generator=g) * 5000 + 1e-3
    y = 1.0 / x
    pre = reciprocal_preimage(y)
    assert torch.equal((1.0 / pre).view(torch.int32), y.view(torch.int32))
    # the double reciprocal is not always the identity: the divisor must be kept for exactness
    assert not torch.equal(1.0 / y, x)
