"""Marlin WNA16 layouts (ctconvert.layouts.marlin) against vLLM's reference vectors, bit for bit.

Every case of marlin_int_weights / marlin_scales / marlin_zero_points
(/work/shared/testvectors, override with $CTCONVERT_TESTVECTORS) is checked with
the parameters from its metadata, plus round trips on fresh random inputs and an
independent per-lane transcription of docs/kernel-layouts.md §3.1 on small shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ctconvert.layouts.marlin import (
    gptq_to_pack_quantized,
    marlin_padded_nk,
    marlin_permute_bias,
    marlin_permute_scales,
    marlin_repack,
    marlin_sort_g_idx,
    marlin_unpermute_bias,
    marlin_unpermute_scales,
    marlin_unrepack,
    marlin_unzero_points,
    marlin_zero_points,
    pack_quantized_to_gptq,
)

from helpers import INT_BY_SIZE, VECTORS, bitwise_equal, vector_cases

INT_WEIGHTS = VECTORS / "marlin_int_weights.safetensors"
SCALES = VECTORS / "marlin_scales.safetensors"
ZERO_POINTS = VECTORS / "marlin_zero_points.safetensors"

VERSION_OF_LAYOUT = {"current": "0.33", "act_order": "0.29"}


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.stride() == torch.empty(got.shape, device="meta").stride(), f"{what}: not row-major {got.stride()}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert bitwise_equal(got, want), f"{what}: bytes differ"


def load_cases(path: Path) -> tuple:
    """All cases of a vector file: ((params, inputs, expected), ...)."""
    return tuple((p, ins, exp) for _, p, ins, exp in vector_cases(path.name))


def case_ids(path: Path) -> list[int]:
    if not path.exists():
        return []
    with safe_open(str(path), "pt") as f:
        return list(range(json.loads(f.metadata()["file"])["num_cases"]))


def get_case(path: Path, i: int):
    if not path.exists():
        pytest.skip(f"test vectors not found: {path}")
    return load_cases(path)[i]


def test_vector_files_present():
    # whatever number of cases each file holds (the vector tests run every one): at least one
    for path in (INT_WEIGHTS, SCALES, ZERO_POINTS):
        assert path.exists(), f"missing {path} (set $CTCONVERT_TESTVECTORS)"
        assert len(case_ids(path)) >= 1, f"{path} holds no case"
        assert len(load_cases(path)) == len(case_ids(path))
    # both weight layouts (vLLM >= 0.30 and the act-order one of <= 0.29) are covered
    assert {p["layout"] for p, _, _ in load_cases(INT_WEIGHTS)} == set(VERSION_OF_LAYOUT)


# ----------------------------------------------------------------- independent test-side helpers


def unpack_along_last(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 (R, C) packed along dim 1, value e at bit e*bits -> int64 (R, count) (shift-and-mask)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    pf = 32 // bits
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return v.reshape(words.shape[0], -1)[:, :count]


def reference_repack(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Literal, loop-per-lane transcription of docs/kernel-layouts.md §3.1 (small shapes only).

    w: int (K, N) unsigned values, K % 16 == 0 and N % 64 == 0 (already padded/permuted).
    """
    k, n = w.shape
    pf = 32 // bits
    words_per_tile = 16 * 64 // pf
    out = [[0] * (n // 64 * words_per_tile) for _ in range(k // 16)]
    W = w.tolist()
    for kt in range(k // 16):
        for nt in range(n // 64):
            base = nt * words_per_tile
            for warp in range(4):
                for th in range(32):
                    col, r0 = th // 4, 2 * (th % 4)
                    c0 = 16 * warp + col

                    def at(r, c):
                        return W[16 * kt + r][64 * nt + c]

                    a = [at(r0, c0), at(r0 + 1, c0), at(r0 + 8, c0), at(r0 + 9, c0)]
                    b = [at(r0, c0 + 8), at(r0 + 1, c0 + 8), at(r0 + 8, c0 + 8), at(r0 + 9, c0 + 8)]
                    if bits == 4:
                        slots = {4 * th + warp: [a[0], a[2], b[0], b[2], a[1], a[3], b[1], b[3]]}
                    else:
                        slots = {8 * th + 2 * warp: [a[0], a[2], a[1], a[3]], 8 * th + 2 * warp + 1: [b[0], b[2], b[1], b[3]]}
                    for word, vals in slots.items():
                        x = sum(v << (bits * j) for j, v in enumerate(vals))
                        out[kt][base + word] = x - (1 << 32) if x >= 1 << 31 else x
    return torch.tensor(out, dtype=torch.int64).to(torch.int32)


def random_words(shape, gen: torch.Generator) -> torch.Tensor:
    """Random int32 words covering every bit pattern (including the sign bit)."""
    return torch.randint(0, 256, (*shape, 4), dtype=torch.uint8, generator=gen).view(torch.int32).squeeze(-1)


def random_float_bits(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns in a float dtype: NaN payloads, infinities, -0.0, subnormals included."""
    size = torch.finfo(dtype).bits // 8
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=gen)
    return raw.view(INT_BY_SIZE[size]).squeeze(-1).view(dtype)


def unpacked_gptq(q_w: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ int32 (K/pf, N) -> int64 (K, N) with test-side shifts."""
    return unpack_along_last(q_w.t().contiguous(), bits, q_w.shape[0] * 32 // bits).t()


# ----------------------------------------------------------------- reference vectors


@pytest.mark.parametrize("i", case_ids(INT_WEIGHTS))
def test_int_weights_vectors(i):
    p, ins, exp = get_case(INT_WEIGHTS, i)
    k, n, bits, group = p["K"], p["N"], p["bits"], p["group_size"]
    version = VERSION_OF_LAYOUT[p["layout"]]

    assert marlin_padded_nk(n, k, group, version) == (p["padded_N"], p["padded_K"])

    q_w = pack_quantized_to_gptq(ins["weight_packed"], bits, k)
    assert_bitwise(gptq_to_pack_quantized(q_w, bits, k), ins["weight_packed"], "weight_packed round trip")
    # the GPTQ words hold input.q_w (unsigned, (K, N)): a check on the inputs themselves
    assert torch.equal(unpacked_gptq(q_w, bits), ins["q_w"].to(torch.int64))

    perm = ins.get("g_idx_sort_indices")
    if p["layout"] == "act_order":
        sorted_g_idx, sort_indices = marlin_sort_g_idx(ins["weight_g_idx"])
        assert_bitwise(sorted_g_idx, exp["g_idx"], "g_idx")
        assert_bitwise(sort_indices, exp["g_idx_sort_indices"], "g_idx_sort_indices")
        s = marlin_permute_scales(ins["weight_scale"].t().contiguous(), k, n, group, version)
        assert_bitwise(s, exp["marlin_scales"], "marlin_scales")
        back = marlin_unpermute_scales(s, k, n, group, version).t().contiguous()
        assert_bitwise(back, ins["weight_scale"], "scales round trip")
        # §3.3: repack(W, perm) == repack(W[perm, :])
        if k * n <= 256 * 64:  # the loop reference is slow: smallest case only
            w_sorted = ins["q_w"][perm.long()].to(torch.int64)
            got = marlin_repack(q_w, k, n, bits, perm, version, group_size=group)
            assert torch.equal(got, reference_repack(w_sorted, bits))
    else:
        assert perm is None

    got = marlin_repack(q_w, k, n, bits, perm=perm, layout_version=version, group_size=group)
    assert_bitwise(got, exp["marlin_q_w"], "marlin_q_w")
    back = marlin_unrepack(got, k, n, bits, perm=perm, layout_version=version, group_size=group)
    assert_bitwise(back, q_w, "unrepack")


@pytest.mark.parametrize("i", case_ids(SCALES))
def test_scales_vectors(i):
    p, ins, exp = get_case(SCALES, i)
    k, n, group = p["K"], p["N"], p["group_size"]
    assert marlin_padded_nk(n, k, group) == (p["padded_N"], p["padded_K"])
    assert str(ins["weight_scale"].dtype) == f"torch.{p['dtype']}"

    s = ins["weight_scale"].t().contiguous()  # (G, N)
    got = marlin_permute_scales(s, k, n, group)
    assert_bitwise(got, exp["marlin_scales"], "marlin_scales")
    assert_bitwise(marlin_unpermute_scales(got, k, n, group), s, "scales round trip")

    bias = marlin_permute_bias(ins["bias"], k, n, group)
    assert_bitwise(bias, exp["marlin_bias"], "marlin_bias")
    assert_bitwise(marlin_unpermute_bias(bias, k, n, group), ins["bias"], "bias round trip")


@pytest.mark.parametrize("i", case_ids(ZERO_POINTS))
def test_zero_points_vectors(i):
    p, ins, exp = get_case(ZERO_POINTS, i)
    k, n, bits, group = p["K"], p["N"], p["bits"], p["group_size"]
    assert marlin_padded_nk(n, k, group) == (p["padded_N"], p["padded_K"])
    # input check: weight_zero_point is packed along N (dim 0) and holds input.zp
    zp_t = unpack_along_last(ins["weight_zero_point"].t().contiguous(), bits, n)
    assert torch.equal(zp_t, ins["zp"].to(torch.int64))

    got = marlin_zero_points(ins["weight_zero_point"], k, n, bits, group_size=group)
    assert_bitwise(got, exp["marlin_zp"], "marlin_zp")
    assert got.shape[0] == p["padded_G"]
    back = marlin_unzero_points(got, k, n, bits, group_size=group)
    assert_bitwise(back, ins["weight_zero_point"], "weight_zero_point round trip")


# ----------------------------------------------------------------- padding rule (§3.4)


@pytest.mark.parametrize(
    "n,k,group,expected",
    [
        # examples from vLLM's own tests of marlin_padded_nk, (size_n, size_k)
        (64, 128, -1, (64, 128)),
        (128, 64, -1, (128, 64)),
        (200, 288, 32, (256, 320)),
        (256, 208, -1, (256, 256)),
        (200, 384, 128, (256, 384)),
        # tie: equal area and sum, the first family wins (README, int case 8)
        (64, 64, -1, (64, 128)),
        (128, 320, -1, (128, 320)),  # the (N % 128, K % 64) family (README, int case 5)
        (128, 64, 128, (128, 128)),  # a group >= K still rounds K up to lcm(64, group)
        (128, 64, -1, (128, 64)),
    ],
)
def test_padded_nk(n, k, group, expected):
    assert marlin_padded_nk(n, k, group, "0.33") == expected
    assert marlin_padded_nk(n, k, group, "0.25.0") == expected


def test_padded_nk_rejects_straddling_groups():
    with pytest.raises(ValueError):
        marlin_padded_nk(128, 320, 128)  # a group of 128 does not divide K=320
    with pytest.raises(ValueError):
        marlin_padded_nk(128, 256, 0)


def test_padded_nk_before_025_has_no_padding():
    assert marlin_padded_nk(128, 256, 128, "0.21") == (128, 256)
    for n, k in [(96, 256), (128, 320), (64, 64)]:
        with pytest.raises(ValueError):
            marlin_padded_nk(n, k, -1, "0.21.0")


# ----------------------------------------------------------------- random round trips

SHAPES = [  # (K, N, group_size): aligned, padded in K, in N, in both, tie-break, grouped/channelwise
    (128, 64, -1),
    (256, 192, 128),
    (320, 256, 64),
    (64, 64, -1),
    (200, 128, -1),
    (256, 96, 128),
    (96, 40, 32),
    (1000, 72, -1),
    (512, 520, 128),
    (1024, 1024, 128),
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,group", SHAPES)
def test_weight_round_trip_random(bits, k, n, group):
    gen = torch.Generator().manual_seed(k * 7919 + n * 31 + bits)
    pf = 32 // bits
    weight_packed = random_words((n, k // pf), gen)
    q_w = pack_quantized_to_gptq(weight_packed, bits, k)
    pn, pk = marlin_padded_nk(n, k, group)

    m = marlin_repack(q_w, k, n, bits, group_size=group)
    assert m.dtype == torch.int32 and tuple(m.shape) == (pk // 16, pn * 16 // pf)
    back = marlin_unrepack(m, k, n, bits, group_size=group)  # check_padding: zero padding
    assert_bitwise(back, q_w, "unrepack")
    assert_bitwise(gptq_to_pack_quantized(back, bits, k), weight_packed, "to pack-quantized")

    if k * n <= 128 * 128:  # independent transcription of §3.1 on the padded matrix
        w = torch.zeros(pk, pn, dtype=torch.int64)
        w[:k, :n] = unpacked_gptq(q_w, bits)
        assert torch.equal(m, reference_repack(w, bits))

    if k % 128 == 0 and n % 64 == 0:  # before 0.25: no padding, the same tiles for accepted shapes
        assert torch.equal(marlin_repack(q_w, k, n, bits, layout_version="0.21", group_size=group), m)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,group", [(128, 64, 32), (256, 192, 128), (512, 128, 64), (384, 256, 128)])
def test_act_order_round_trip_random(bits, k, n, group):
    gen = torch.Generator().manual_seed(k + n + bits)
    pf = 32 // bits
    q_w = random_words((k // pf, n), gen)
    g_idx = torch.randint(0, k // group, (k,), dtype=torch.int32, generator=gen)
    sorted_g_idx, perm = marlin_sort_g_idx(g_idx)
    assert perm.dtype == torch.int32 and torch.all(sorted_g_idx[1:] >= sorted_g_idx[:-1])
    assert torch.equal(g_idx[perm.long()], sorted_g_idx)

    m = marlin_repack(q_w, k, n, bits, perm, "0.29", group_size=group)
    assert_bitwise(marlin_unrepack(m, k, n, bits, perm, "0.29", group_size=group), q_w, "act-order unrepack")
    # §3.3: repack(W, perm) == repack(W[perm, :]) without perm
    w_sorted = unpacked_gptq(q_w, bits)[perm.long()]
    q_sorted = (w_sorted.reshape(k // pf, pf, n) << (torch.arange(pf).view(1, pf, 1) * bits)).sum(1)
    q_sorted = torch.where(q_sorted >= 2**31, q_sorted - 2**32, q_sorted).to(torch.int32)
    assert torch.equal(m, marlin_repack(q_sorted, k, n, bits, layout_version="0.29", group_size=group))
    # an empty perm means "no act-order", as in vLLM
    empty = torch.empty(0, dtype=torch.int32)
    assert torch.equal(marlin_repack(q_w, k, n, bits, empty, group_size=group), marlin_repack(q_w, k, n, bits, group_size=group))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,n,group", SHAPES + [(128, 128, 128), (64, 64, 64), (100, 128, 128)])
def test_scales_and_bias_round_trip_random(dtype, k, n, group):
    gen = torch.Generator().manual_seed(k * 13 + n + (group % 97))
    g = 1 if group == -1 or group >= k else k // group
    s = random_float_bits((g, n), dtype, gen)
    pn, pk = marlin_padded_nk(n, k, group)
    pg = 1 if group == -1 else pk // group

    ms = marlin_permute_scales(s, k, n, group)
    assert ms.dtype == dtype and tuple(ms.shape) == (pg, pn)
    assert_bitwise(marlin_unpermute_scales(ms, k, n, group), s, "scales round trip")
    # the permutation only moves values: same multiset of bit patterns plus zero padding
    bits_sorted = torch.sort(ms.reshape(-1).view(torch.int16)).values
    padded = torch.cat([s.reshape(-1).view(torch.int16), torch.zeros(pg * pn - g * n, dtype=torch.int16)])
    assert torch.equal(bits_sorted, torch.sort(padded).values)

    b = random_float_bits((n,), dtype, gen)
    mb = marlin_permute_bias(b, k, n, group)
    assert mb.dtype == dtype and tuple(mb.shape) == (pn,)
    assert_bitwise(marlin_unpermute_bias(mb, k, n, group), b, "bias round trip")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n,group", [(256, 256, 128), (512, 128, 64), (256, 96, 32), (64, 64, 64), (200, 72, -1), (1024, 1024, 128)])
def test_zero_points_round_trip_random(bits, k, n, group):
    gen = torch.Generator().manual_seed(k * 3 + n + bits)
    pf = 32 // bits
    g = 1 if group == -1 or group >= k else k // group
    zp = random_words((n // pf, g), gen)
    pn, pk = marlin_padded_nk(n, k, group)
    pg = 1 if group == -1 else pk // group
    mz = marlin_zero_points(zp, k, n, bits, group_size=group)
    assert mz.dtype == torch.int32 and tuple(mz.shape) == (pg, pn // pf)
    assert_bitwise(marlin_unzero_points(mz, k, n, bits, group_size=group), zp, "zero points round trip")


def test_odd_strides():
    """Inputs that are views with odd strides (size-1 dims, transposes) give row-major outputs."""
    gen = torch.Generator().manual_seed(5)
    for bits in (4, 8):
        pf = 32 // bits
        zp = random_words((1, 96 // pf), gen).t()  # (N/pf, 1) with strides (1, N/pf)
        mz = marlin_zero_points(zp, 200, 96, bits, group_size=-1)
        assert_bitwise(marlin_unzero_points(mz, 200, 96, bits, group_size=-1), zp.contiguous(), "zp")
        wp = random_words((256 // pf, 64), gen).t()  # (N, K/pf) transposed view
        q = pack_quantized_to_gptq(wp, bits, 256)
        m = marlin_repack(q.t().contiguous().t(), 256, 64, bits, group_size=128)
        assert_bitwise(marlin_unrepack(m, 256, 64, bits, group_size=128), q, "weights")
    s = torch.randn(1, 200).to(torch.bfloat16).t().contiguous().t()  # (1, N), strides (1, 1)
    ms = marlin_permute_scales(s, 200, 200, -1)
    assert_bitwise(marlin_unpermute_scales(ms, 200, 200, -1), s.contiguous(), "scales")


# ----------------------------------------------------------------- errors


def test_errors():
    q4 = torch.zeros(256 // 8, 128, dtype=torch.int32)
    with pytest.raises(ValueError):
        marlin_repack(q4, 256, 128, 3, group_size=-1)  # bits
    with pytest.raises(ValueError):
        marlin_repack(q4.to(torch.int64), 256, 128, 4, group_size=-1)  # dtype
    with pytest.raises(ValueError):
        marlin_repack(q4, 256, 64, 4, group_size=-1)  # shape
    with pytest.raises(ValueError):
        marlin_repack(q4, 256, 128, 4, group_size=48)  # group does not divide K
    with pytest.raises(ValueError):
        marlin_repack(q4, 256, 128, 4, layout_version="latest", group_size=-1)
    perm = torch.arange(256, dtype=torch.int32).flip(0)
    with pytest.raises(ValueError):
        marlin_repack(q4, 256, 128, 4, perm, "0.33", group_size=128)  # act-order gone in 0.30
    bad = perm.clone()
    bad[0] = 1
    with pytest.raises(ValueError):
        marlin_repack(q4, 256, 128, 4, bad, "0.29", group_size=128)  # not a permutation
    q320 = torch.zeros(320 // 8, 128, dtype=torch.int32)
    with pytest.raises(ValueError):  # act-order shapes are never padded and need K % 128 == 0
        marlin_repack(q320, 320, 128, 4, torch.arange(320), "0.29", group_size=64)
    with pytest.raises(ValueError):
        marlin_repack(torch.zeros(200 // 8, 96, dtype=torch.int32), 200, 96, 4, layout_version="0.21", group_size=-1)
    with pytest.raises(ValueError):
        pack_quantized_to_gptq(torch.zeros(128, 25, dtype=torch.int32), 4, 196)  # K % pf
    with pytest.raises(ValueError):
        marlin_permute_scales(torch.zeros(128, 2, dtype=torch.float16), 256, 128, 128)  # (N, G) given
    with pytest.raises(ValueError):
        marlin_zero_points(torch.zeros(16, 2, dtype=torch.int32), 256, 128, 8, group_size=128)  # 8-bit needs N/4 rows
    with pytest.raises(ValueError):
        marlin_sort_g_idx(torch.zeros(4, 2, dtype=torch.int32))

    # non-zero padding is reported (a tensor vLLM cannot have built), or dropped on request
    q = torch.ones(200 // 8, 96, dtype=torch.int32)
    m = marlin_repack(q, 200, 96, 4, group_size=-1)
    full = marlin_repack(torch.ones(256 // 8, 128, dtype=torch.int32), 256, 128, 4, group_size=-1)
    with pytest.raises(ValueError):
        marlin_unrepack(full, 200, 96, 4, group_size=-1)
    assert torch.equal(marlin_unrepack(full, 200, 96, 4, group_size=-1, check_padding=False), q)
    assert torch.equal(marlin_unrepack(m, 200, 96, 4, group_size=-1), q)
    s = torch.full((1, 128), -0.0, dtype=torch.bfloat16)  # -0.0 is non-zero bits
    with pytest.raises(ValueError):
        marlin_unpermute_scales(s, 200, 96, -1)


# ----------------------------------------------------------------- device agnostic


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vectors_on_cuda():
    if not all(path.exists() for path in (INT_WEIGHTS, SCALES, ZERO_POINTS)):
        pytest.skip(f"test vectors not found under {VECTORS}")
    dev = torch.device("cuda")
    for p, ins, exp in load_cases(INT_WEIGHTS):
        k, n, bits, group = p["K"], p["N"], p["bits"], p["group_size"]
        version = VERSION_OF_LAYOUT[p["layout"]]
        perm = ins.get("g_idx_sort_indices")
        perm = None if perm is None else perm.to(dev)
        q_w = pack_quantized_to_gptq(ins["weight_packed"].to(dev), bits, k)
        got = marlin_repack(q_w, k, n, bits, perm, version, group_size=group)
        assert got.device.type == "cuda"
        assert_bitwise(got, exp["marlin_q_w"], "marlin_q_w (cuda)")
        assert_bitwise(marlin_unrepack(got, k, n, bits, perm, version, group_size=group), q_w, "unrepack (cuda)")
    for p, ins, exp in load_cases(SCALES):
        k, n, group = p["K"], p["N"], p["group_size"]
        s = ins["weight_scale"].t().contiguous().to(dev)
        got = marlin_permute_scales(s, k, n, group)
        assert_bitwise(got, exp["marlin_scales"], "marlin_scales (cuda)")
        assert_bitwise(marlin_unpermute_scales(got, k, n, group), s, "scales (cuda)")
        mb = marlin_permute_bias(ins["bias"].to(dev), k, n, group)
        assert_bitwise(mb, exp["marlin_bias"], "marlin_bias (cuda)")
        assert_bitwise(marlin_unpermute_bias(mb, k, n, group), ins["bias"], "bias (cuda)")
    for p, ins, exp in load_cases(ZERO_POINTS):
        k, n, bits, group = p["K"], p["N"], p["bits"], p["group_size"]
        got = marlin_zero_points(ins["weight_zero_point"].to(dev), k, n, bits, group_size=group)
        assert_bitwise(got, exp["marlin_zp"], "marlin_zp (cuda)")
        back = marlin_unzero_points(got, k, n, bits, group_size=group)
        assert_bitwise(back, ins["weight_zero_point"], "zero points (cuda)")
