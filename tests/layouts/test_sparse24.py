"""2:4 kernel layouts bit for bit against the reference vectors (every case of each file, expectations from the
case's parameters), exact inverses, fresh random inputs, and the marlin-24 writer against compressed-tensors 0.14."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ctconvert.formats.sparse24 import prune24
from ctconvert.layouts import marlin24 as M
from ctconvert.layouts import sparse24 as L

DATA = Path(__file__).resolve().parents[1] / "data"
VEC = DATA / "testvectors"
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def bitwise_equal(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(INT[a.element_size()]).cpu(), b.contiguous().reshape(-1).view(INT[b.element_size()]).cpu())


def cases(name):
    with safe_open(VEC / name, "pt") as f:
        meta = f.metadata()
        for i in range(json.loads(meta["file"])["num_cases"]):
            p = json.loads(meta[f"case{i}"])
            yield i, p, {n: f.get_tensor(f"case{i}.input.{n}") for n in p["inputs"]}, {n: f.get_tensor(f"case{i}.expected.{n}") for n in p["expected"]}


def zero_signless(x):
    """``x`` with every zero (either sign) as +0: what the kernels give back."""
    if x.dtype == torch.int8:
        return x
    bits = x.view(INT[x.element_size()])
    mask = 0x7F if x.element_size() == 1 else 0x7FFF
    return torch.where((bits & mask) == 0, torch.zeros((), dtype=bits.dtype), bits).view(x.dtype)


def _sm90_expect(out, p, back, dense):
    assert list(out["values"].shape) == p["values_shape"] and list(out["meta"].shape) == p["meta_shape"]
    assert bitwise_equal(back, zero_signless(dense).to(back.device))


def _sm80_expect(out, p, back, dense):
    assert str(out["meta"].dtype) == "torch." + p["meta_dtype"]
    assert torch.equal(back.cpu(), dense)  # by value: a stored zero may be -0.0


_VECTORS = [(L.SM90, "cutlass_sm90_2of4.safetensors", _sm90_expect), (L.SM80, "torch_sparse24.safetensors", _sm80_expect)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout, vectors, expect", _VECTORS, ids=["sm90", "sm80"])
def test_layout_against_reference_vectors(device, layout, vectors, expect):
    """SM90 against CUTLASS's compressor, SM80 against PyTorch's converter: every case of the file, and back."""
    n = 0
    for i, p, ins, exp in cases(vectors):
        out = layout.compress(ins["dense"].to(device))
        for name in p["expected"]:
            assert bitwise_equal(out[name], exp[name]), (i, name)
        expect(out, p, layout.decompress(out["values"], out["meta"], p["M"], p["K"]), ins["dense"])
        n += 1
    assert n > 0


@pytest.mark.parametrize("device", DEVICES)
def test_marlin24_against_vllm_vectors(device):
    n = 0
    for i, p, ins, exp in cases("marlin24.safetensors"):
        q = (ins["q_w"].t().to(torch.int16) - 8).to(torch.int8).contiguous().to(device)
        g = None if p["group_size"] == -1 else p["group_size"]
        out = M.marlin24_pack(q, ins["scales"].t().contiguous().to(device), g)
        for name in p["expected"]:
            assert bitwise_equal(out[name], exp[name]), (i, name)
        assert torch.equal(prune24(ins["weight_unpruned"]), ins["weight"]), i  # pruning, by value
        assert torch.equal(M.marlin24_unpack(out["weight_packed"], out["meta"], p["N"], p["K"]), q), i
        assert bitwise_equal(M.marlin24_unpermute_scales(out["scale_packed"], p["K"], g), ins["scales"].t().contiguous().to(device)), i
        n += 1
    assert n > 0


def _random_24(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = prune24(torch.randn(m, k, generator=g))
    drop = torch.rand(m, k, generator=g) < 0.2  # groups with one or no non-zero
    w = torch.where(drop, torch.zeros(()), w)
    w[0] = 0
    if dtype == torch.int8:
        return (w * 60).round().clamp(-128, 127).to(torch.int8)
    w = w.to(dtype)
    if dtype != torch.float8_e4m3fn and m > 1:
        w[1, :4] = torch.tensor([-0.0, 1.0, -0.0, 0.0], dtype=dtype)
    return w


@pytest.mark.parametrize("dtype", L.SM90_DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (37, 72), (65, 136), (130, 264)])
def test_sm90_random_round_trip(dtype, shape):
    w = _random_24(*shape, dtype, 11)
    out = L.sm90_compress(w)
    assert bitwise_equal(L.sm90_decompress(out["values"], out["meta"], *shape), zero_signless(w))
    assert bitwise_equal(out["values"], zero_signless(out["values"]))  # never -0.0


@pytest.mark.parametrize("dtype", L.SM80_DTYPES)
def test_sm80_random_round_trip(dtype):
    m, k = (64, 128) if dtype == torch.int8 else (96, 96)
    w = _random_24(m, k, dtype, 12)
    out = L.sm80_compress(w)
    assert torch.equal(L.sm80_decompress(out["values"], out["meta"]), w)


def test_not_24_refused():
    w = torch.ones(32, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="more than 2 non-zeros"):
        L.sm90_compress(w)
    with pytest.raises(ValueError, match="more than 2 non-zeros"):
        L.sm80_compress(w)


def test_shape_rules():
    with pytest.raises(ValueError, match="multiple of 32"):
        L.sm80_compress(torch.zeros(16, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 32"):
        L.sm80_compress(torch.zeros(32, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 128"):
        M.marlin24_pack(torch.zeros(128, 64, dtype=torch.int8), torch.ones(128, 1, dtype=torch.float16), None)
    with pytest.raises(ValueError, match="group size"):
        M.marlin24_pack(torch.zeros(128, 128, dtype=torch.int8), torch.ones(128, 2, dtype=torch.float16), 64)


def test_marlin24_against_compressed_tensors_014():
    """The marlin-24 writer end to end (prune, fp16 quantization as compressed-tensors' Marlin24Compressor, pack)."""
    from ctconvert.formats.sparse24 import marlin24_quantize

    n = 0
    with safe_open(DATA / "sparse24_ct014.safetensors", "pt") as f:
        meta = f.metadata()
        for i in range(json.loads(meta["file"])["num_cases"]):
            p = json.loads(meta[f"case{i}"])
            if p["scheme"] != "W4A16":
                continue
            for j in range(len(p["shapes"])):
                w = f.get_tensor(f"case{i}.input.layers.{j}.weight")
                q = marlin24_quantize(w, 128)
                assert bitwise_equal(q["weight_scale"].to(w.dtype), f.get_tensor(f"case{i}.scale.layers.{j}.weight_scale"))
                out = M.marlin24_pack(q["weight"], q["weight_scale"], 128)
                for name in ("weight_packed", "meta", "scale_packed"):
                    assert bitwise_equal(out[name], f.get_tensor(f"case{i}.expected.layers.{j}.{name}")), (i, j, name)
                n += 1
    assert n > 0


@pytest.mark.parametrize("dtype", L.SM80_DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_sm80_against_torch_on_fresh_inputs(dtype, seed):
    """PyTorch's own converter (torch.sparse._semi_structured_conversions) is the reference, on new random inputs."""
    conv = pytest.importorskip("torch.sparse._semi_structured_conversions")
    m, k = (48, 192) if dtype == torch.int8 else (96, 160)
    w = _random_24(m, k, dtype, 100 + seed)
    values, meta = conv.sparse_semi_structured_from_dense_cutlass(w)
    out = L.sm80_compress(w)
    assert bitwise_equal(out["values"], values) and bitwise_equal(out["meta"], meta)


def _sm90_reference(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/kernel-layouts.md §8.1 written out element by element (slow, plain Python)."""
    m, k = dense.shape
    eight = dense.element_size() == 1
    vk = -(-k // (32 if eight else 16)) * (32 if eight else 16) // 2
    me, ke = -(-m // 64) * 64, -(-k // 128) * 128 // 8
    raw = dense.view(torch.uint8) if dense.dtype == torch.float8_e4m3fn else dense
    rows = raw.tolist()
    values = [[0] * vk for _ in range(m)]
    meta = [0] * (me * ke)
    for r in range(me):
        for b in range(ke):
            byte = 0
            for half in (0, 1):
                gidx = 2 * b + half
                code = 0
                if r < m and 4 * gidx < k:
                    g = rows[r][4 * gidx : 4 * gidx + 4]
                    if dense.dtype == torch.float8_e4m3fn:
                        nz = [i for i in range(4) if int(g[i]) & 0x7F]
                    else:
                        nz = [i for i in range(4) if float(g[i]) != 0]  # -0.0 == 0
                    if len(nz) == 2:
                        idx, vals = nz, [g[nz[0]], g[nz[1]]]
                    elif len(nz) == 1:
                        idx = [0, 3] if nz[0] == 3 else [nz[0], 3]
                        vals = [0, g[3]] if nz[0] == 3 else [g[nz[0]], 0]
                    else:
                        idx, vals = [0, 0], [0, 0]
                    values[r][2 * gidx] = vals[0]
                    values[r][2 * gidx + 1] = vals[1]
                    code = idx[0] | idx[1] << 2
                byte |= code << (4 * half)
            atom = ((b // 16) * (me // 64) + r // 64) * 1024
            rr, c = r % 64, b % 16
            if eight:
                off = 16 * rr + c
            else:
                off = c % 2 + 2 * ((rr // 8) % 2) + 4 * (c // 4) + 16 * (rr % 8) + 128 * ((c // 2) % 2) + 256 * (rr // 16)
            meta[atom + off] = byte
    values = torch.tensor(values, dtype=raw.dtype)
    return (values.view(dense.dtype) if values.dtype != dense.dtype else values), torch.tensor(meta, dtype=torch.uint8).reshape(me, ke)


@pytest.mark.parametrize("dtype", L.SM90_DTYPES)
def test_sm90_against_the_written_rule_on_fresh_inputs(dtype):
    w = _random_24(66, 136, dtype, 5)
    values, meta = _sm90_reference(w)
    out = L.sm90_compress(w)
    assert bitwise_equal(out["values"], zero_signless(values)) and bitwise_equal(out["meta"], meta)
