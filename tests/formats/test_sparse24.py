"""2:4 pruning and ``sparse-24-bitmask``: bit for bit against compressed-tensors 0.14 (tests/data/sparse24_ct014.safetensors,
made by scripts/make_sparse24_reference.py), and on fresh random inputs against an independent reference."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ctconvert.formats import FORMATS, CompressionFormat, WeightArgs, get_format
from ctconvert.formats.sparse24 import TIE_TABLE, compress24, decompress24, is_24, mask24, pack_bitmask, prune24, sparse24_format, unpack_bitmask

REF = Path(__file__).resolve().parents[1] / "data" / "sparse24_ct014.safetensors"
_PRESET_WEIGHTS = {
    "FP8_DYNAMIC": (CompressionFormat.FLOAT_QUANTIZED, {"num_bits": 8, "type": "float", "strategy": "channel"}),
    "W8A8": (CompressionFormat.INT_QUANTIZED, {"num_bits": 8, "type": "int", "strategy": "channel"}),
}


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and bits(a) == bits(b)


def ref_cases():
    with safe_open(REF, "pt") as f:
        meta = f.metadata()
        for i in range(json.loads(meta["file"])["num_cases"]):
            p = json.loads(meta[f"case{i}"])
            t = {k.split(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(f"case{i}.")}
            yield i, p, t


def test_tie_table_is_the_recorded_one():
    with safe_open(REF, "pt") as f:
        assert json.loads(f.metadata()["tie_table"]) == TIE_TABLE
    assert len(TIE_TABLE) == 75  # every weak order of 4 elements
    assert all(bin(v).count("1") == 2 for v in TIE_TABLE.values())


def test_tie_table_matches_torch_topk_here():
    """The table is torch.topk's CPU tie-breaking; the installed torch agrees (rank vectors as values)."""
    for ranks in TIE_TABLE:
        x = torch.tensor([[float(c) for c in ranks]])
        idx = x.topk(2, dim=1).indices[0].tolist()
        assert sum(1 << i for i in idx) == TIE_TABLE[ranks]


@pytest.mark.parametrize("case", list(ref_cases()), ids=lambda c: f"case{c[0]}-{c[1]['scheme']}-{c[1]['kind']}")
def test_against_compressed_tensors_014(case):
    i, p, t = case
    if p["scheme"] == "W4A16":
        pytest.skip("marlin-24: tests/layouts/test_sparse24.py")
    inner = None
    args = WeightArgs.from_dict(None)
    if p["scheme"]:
        fmt, w = _PRESET_WEIGHTS[p["scheme"]]
        inner, args = FORMATS[fmt], WeightArgs.from_dict(w)
    sp = sparse24_format(inner)
    for j in range(len(p["shapes"])):
        w = t[f"input.layers.{j}.weight"]
        pruned = prune24(w)
        assert torch.equal(pruned, t[f"pruned.layers.{j}.weight"])  # by value: CT prunes by multiplying (-0.0)
        for impl in ("torch", "auto"):
            out = sp.quantize(w, args, impl=impl)
            out.update(sp.whole_tensor_outputs(tuple(w.shape), None))
            exp = {k.rsplit(".", 1)[1]: v for k, v in t.items() if k.startswith(f"expected.layers.{j}.")}
            assert sorted(out) == sorted(exp), (i, j)
            for k in exp:
                if k in ("compressed", "bitmask") and p["scheme"] == "W8A8":
                    continue  # below: compressed-tensors drops int8 -128
                assert same(out[k], exp[k]), (i, j, k, impl)
            if p["scheme"] == "W8A8":
                _check_int8_against_ct(out, exp, inner.quantize(pruned, args, impl="torch")["weight"])
            planned = sp.outputs(tuple(w.shape), w.dtype, args)
            assert {k: (dt, tuple(s)) for k, (dt, s) in planned.items()} == {k: (v.dtype, tuple(v.shape)) for k, v in exp.items()}
            # the way back: decompress equals the inner format's dequantization of the pruned weight
            dense = sp.dequantize(out, args)
            q = inner.quantize(pruned, args, impl="torch") if inner else {"weight": pruned}
            back = inner.dequantize(q, args) if inner else pruned
            assert torch.equal(dense, back)


def _check_int8_against_ct(out: dict, exp: dict, q: torch.Tensor) -> None:
    """W8A8: equal to compressed-tensors 0.14 in every group without a -128; where one holds -128, compressed-tensors'
    wrapped ``abs`` drops it (its decompressed weight has 0 there) and ctconvert keeps it (decompresses to ``q``)."""
    n, k = q.shape
    ours = decompress24(out["compressed"], out["bitmask"], (n, k))
    theirs = decompress24(exp["compressed"], exp["bitmask"], (n, k))
    assert torch.equal(ours, q)
    assert torch.equal(theirs, torch.where(q == -128, torch.zeros((), dtype=q.dtype), q))
    clean = ~(q == -128).reshape(n, -1, 4).any(-1, keepdim=True).expand(n, k // 4, 4).reshape(n, k)
    assert torch.equal(unpack_bitmask(out["bitmask"], k)[clean], unpack_bitmask(exp["bitmask"], k)[clean])
    assert bool((q == -128).any())  # the reference data does exercise the difference


def test_config_group_name_round_trip():
    assert get_format("sparse-24-bitmask").inner is None
    assert get_format("sparse-24-bitmask+float-quantized").inner is FORMATS[CompressionFormat.FLOAT_QUANTIZED]
    assert get_format("sparse-24-bitmask+nope") is None
    with pytest.raises(ValueError):
        sparse24_format(FORMATS[CompressionFormat.PACK_QUANTIZED])


# ---------------------------------------------------------------------------- independent reference on fresh inputs


def _ref_mask(x: np.ndarray) -> np.ndarray:
    """Per group: sort positions by (magnitude, then the table's order); a plain-Python reading of the rule."""
    out = np.zeros(x.shape, dtype=bool)
    for r in range(x.shape[0]):
        for g in range(0, x.shape[1], 4):
            m = [abs(float(v)) for v in x[r, g : g + 4]]
            ranks = "".join(str(sum(o < v for o in m)) for v in m)
            keep = TIE_TABLE[ranks]
            for i in range(4):
                out[r, g + i] = bool(keep >> i & 1)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4), (3, 12), (17, 40), (8, 1000)])
def test_prune_random_against_reference(dtype, shape):
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    w = (torch.randint(-3, 4, shape, generator=g).float() * 0.5).to(dtype)  # many ties
    w[0, : min(4, shape[1])] = -0.0
    if shape[0] > 2:
        w[2] = 0
    m = mask24(w)
    assert np.array_equal(m.numpy(), _ref_mask(w.float().numpy()))
    assert (m.reshape(shape[0], -1, 4).sum(-1) == 2).all()
    p = prune24(w)
    assert is_24(p)
    assert same(prune24(p), p)  # already 2:4: kept, no second pruning
    kept = torch.where(m, w, torch.zeros((), dtype=dtype))
    assert same(p, kept)
    # the two kept magnitudes are the largest of each group
    a = w.float().abs().reshape(shape[0], -1, 4)
    km = torch.where(m.reshape(a.shape), a, torch.tensor(-1.0))
    dm = torch.where(~m.reshape(a.shape), a, torch.tensor(-1.0))
    assert (km.topk(2, -1).values.amin(-1) >= dm.amax(-1)).all()


def test_bitmask_bit_order_is_numpy_little():
    g = torch.Generator().manual_seed(3)
    for k in (4, 8, 12, 20, 64):
        m = torch.rand(5, k, generator=g) > 0.5
        assert np.array_equal(pack_bitmask(m).numpy(), np.packbits(m.numpy(), axis=-1, bitorder="little"))
        assert torch.equal(unpack_bitmask(pack_bitmask(m), k), m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_compress_round_trip(dtype):
    g = torch.Generator().manual_seed(4)
    w = prune24(torch.randn(9, 24, generator=g))
    w[1] = 0
    x = w.to(dtype) if dtype != torch.int8 else (w * 50).round().to(torch.int8)
    c = compress24(x)
    assert same(decompress24(c["compressed"], c["bitmask"], x.shape), x)  # x is 2:4 and its zeros are +0
    assert c["compressed"].shape == (9, 12) and c["bitmask"].shape == (9, 3)


def test_int8_minus_128_is_kept():
    """compressed-tensors' abs() wraps int8 -128 and would drop it; ctconvert keeps it (module docstring)."""
    q = torch.tensor([[-128, 5, 0, 0]], dtype=torch.int8)
    c = compress24(q)
    assert c["compressed"].tolist() == [[-128, 5]]


def test_fp8_negative_zero_is_smallest():
    x = torch.tensor([[-0.0, 0.0, 0.0, 1.0]]).to(torch.float8_e4m3fn)
    assert mask24(x).tolist() == [[False, False, True, True]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_refused(bad):
    w = torch.zeros(2, 8)
    w[1, 3] = bad
    with pytest.raises(ValueError, match="NaN/inf"):
        prune24(w)


def test_bad_shapes_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        prune24(torch.zeros(2, 6))
    with pytest.raises(ValueError):
        decompress24(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.uint8), (2, 8))


def test_every_weak_order_exhaustively():
    """All 5^4 patterns of {0, -0, 1, -1, 2} in one group: the kept pair is the two largest |x|."""
    rows = list(itertools.product([0.0, -0.0, 1.0, -1.0, 2.0], repeat=4))
    x = torch.tensor(rows, dtype=torch.bfloat16)
    m = mask24(x)
    assert np.array_equal(m.numpy(), _ref_mask(x.float().numpy()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_same_bytes_as_compressed_tensors():
    """The same rule on the GPU (mask, pruning, inner quantizers through Triton): the CT 0.14 bytes."""
    n = 0
    for i, p, t in ref_cases():
        if p["scheme"] in ("W4A16", "W8A8"):
            continue  # marlin-24: tests/layouts; W8A8: the -128 difference is checked on the CPU above
        fmt, w = _PRESET_WEIGHTS[p["scheme"]] if p["scheme"] else (None, {})
        sp, args = sparse24_format(FORMATS[fmt] if fmt else None), WeightArgs.from_dict(w)
        for j in range(len(p["shapes"])):
            out = sp.quantize(t[f"input.layers.{j}.weight"].cuda(), args)
            for k, v in out.items():
                assert same(v.cpu(), t[f"expected.layers.{j}.{k}"]), (i, j, k)
            n += 1
    assert n > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_bitmask_values_inverts_decompress24(dtype):
    """The bitmask's one home: the values at its positions (what a 2:4 kernel layout gives back) are ``compressed``."""
    from ctconvert.formats.sparse24 import BITMASK, bitmask_values

    w = prune24(torch.randn(16, 32, generator=torch.Generator().manual_seed(7)))
    w = (w * 30).round().to(torch.int8) if dtype == torch.int8 else w.to(dtype)
    c = compress24(w)
    dense = BITMASK.dense(c["compressed"], c["bitmask"], (16, 32))
    assert same(bitmask_values(dense, c["bitmask"]), c["compressed"]) and same(BITMASK.values(dense, c["bitmask"]), c["compressed"])
    assert torch.equal(BITMASK.unpack(BITMASK.pack(mask24(w)), 32), mask24(w))
