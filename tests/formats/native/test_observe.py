"""The imatrix observers' C kernel (ctconvert/formats/native/observe.c ``ct_imatrix_search``, observe.py ``imatrix_search``)
against their torch reference (``IMatrixMSEObserver._torch``, itself checked against llm-compressor in
tests/formats/observers/test_imatrix.py): the same ranges, steps, improvements, hits and compressed bytes on fixed-seed
weights with zero rows, ties, tiny and huge values, and importances with zero channels."""

from __future__ import annotations

import pytest
import torch

from ctconvert.formats import WeightArgs, get_format
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.formats.native import observe as native_observe
from ctconvert.formats.observers import OBSERVERS, Importance, range_absmax

from ..test_observers import NVFP4, W4, W4_ASYM, awkward_weights, bits_of
from helpers import scalar_build

pytestmark = pytest.mark.skipif(not native_observe.available(), reason="no C compiler")

MXFP4 = WeightArgs(type="float", num_bits=4, strategy="group", group_size=32)
MXFP8 = WeightArgs(type="float", num_bits=8, strategy="group", group_size=32)
FP8_G128 = WeightArgs(type="float", num_bits=8, strategy="group", group_size=128)
W8_G32 = WeightArgs(type="int", num_bits=8, strategy="group", group_size=32)
W4_G32_ASYM = WeightArgs(type="int", num_bits=4, strategy="group", group_size=32, symmetric=False)
FORMAT = {"int": "pack-quantized", "nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}


def _weights(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """:func:`awkward_weights` (zero row, constant row, mirrored halves, tiny, non-negative) plus huge rows: near D's
    largest values (fp32 ``|q - x| ** norm`` overflows: torch's error is inf, never better) and a row of ones."""
    w = awkward_weights(n, k, dtype, seed).float()
    big = torch.finfo(dtype).max
    w[5] = torch.linspace(-1, 1, k) * big  # huge
    w[6] = w[6] * 1e4  # large, finite errors
    w[7] = 1.0  # ties: every candidate of a constant row
    return w.to(dtype)


def _importance(k: int, seed: int) -> Importance:
    """A heavy-tailed importance sum over 5 tokens with every third channel zero."""
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(k, generator=g) ** 4 * 5
    s[::3] = 0
    return Importance(s, 5)


def _same(a, b) -> None:
    assert torch.equal(a.min, b.min) and torch.equal(a.max, b.max)
    assert torch.equal(a.step, b.step) and torch.equal(a.improved, b.improved)
    assert (a.hits is None) == (b.hits is None)
    if a.hits is not None:
        assert torch.equal(a.hits, b.hits)


def _compressed(w: torch.Tensor, args: WeightArgs, found) -> dict[str, torch.Tensor]:
    """The compressed tensors of ``w`` from the searched ranges, or the format's refusal (FP8 of a group strategy: none)."""
    if args.type == "float" and args.num_bits == 8:
        return {}
    kind = "int" if args.type == "int" else ("nvfp4" if args.strategy == "tensor_group" else "mxfp4")
    fmt = get_format(FORMAT[kind])
    gs = nvfp4_global_scale(range_absmax(*found.ranges), w.dtype) if fmt.needs_global_scale else None
    try:
        return {k: bits_of(v) for k, v in fmt.quantize(w, args, gs, ranges=found.ranges).items()}
    except ValueError as e:  # e.g. an MX scale of an expanded huge range overflowing D: the same refusal either way
        return {"refused": str(e)}


# (observer, scheme, dtype): every kind of the kernel (int sym/asym, FP8, MXFP8, MXFP4, NVFP4), both dtypes, both norms
CASES = [
    ("imatrix_mse", W4, torch.bfloat16),
    ("imatrix_mse", W4, torch.float16),
    ("imatrix_mse", W4_ASYM, torch.bfloat16),
    ("imatrix_mse", W4_G32_ASYM, torch.float16),
    ("imatrix_mse", W8_G32, torch.bfloat16),
    ("imatrix_mse", FP8_G128, torch.float16),
    ("imatrix_mse", MXFP8, torch.bfloat16),
    ("imatrix_mse", MXFP4, torch.float16),
    ("imatrix_mse", NVFP4, torch.bfloat16),
    ("nvfp4_expanded_imatrix", NVFP4, torch.bfloat16),
    ("nvfp4_expanded_imatrix", NVFP4, torch.float16),
    ("nvfp4_expanded_imatrix", MXFP4, torch.bfloat16),
]


@pytest.mark.parametrize("seed", range(len(CASES)))
def test_native_equals_torch(seed):
    """Weighted and unweighted (no statistic: the uniform fallback), whole-tensor (early stop) and fixed-step
    searches of 37 rows (not a multiple of anything): every field of the search and the compressed bytes are torch's."""
    name, args, dtype = CASES[seed]
    w = _weights(37, 512, dtype, seed)
    for obs in (OBSERVERS[name].with_importance(_importance(512, seed)), OBSERVERS[name]):
        for steps in (None, 7):
            a, b = obs.search(w, args, steps, impl="torch"), obs.search(w, args, steps, impl="native")
            _same(a, b)
        ta, tb = _compressed(w, args, a), _compressed(w, args, b)
        assert ta.keys() == tb.keys() and all(ta[k] == tb[k] if isinstance(ta[k], str) else torch.equal(ta[k], tb[k]) for k in ta)


def test_auto_takes_the_kernel(monkeypatch):
    """``impl="auto"`` calls the C kernel for a CPU bf16 chunk of a group strategy (and not for fp32 or the channel
    strategy), and its result is the kernel's."""
    calls = []
    real = native_observe.imatrix_search
    monkeypatch.setattr(native_observe, "imatrix_search", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    obs = OBSERVERS["nvfp4_expanded_imatrix"].with_importance(_importance(256, 3))
    w = _weights(16, 256, torch.bfloat16, 3)
    _same(obs.search(w, NVFP4, impl="auto"), obs.search(w, NVFP4, impl="torch"))
    assert calls == [torch.bfloat16]
    obs.search(w.float(), NVFP4, impl="auto")
    obs.search(w, WeightArgs(type="int", num_bits=8, strategy="channel"), impl="auto")
    assert calls == [torch.bfloat16]


def test_uncertain_groups_are_settled_by_torch():
    """Huge rows leave groups the kernel cannot vouch for (a sum that may overflow fp32); the torch re-search of
    those groups, each weighted by its own columns' importance, gives the whole-tensor torch result."""
    obs = OBSERVERS["imatrix_mse"].with_importance(_importance(512, 4))
    w = _weights(24, 512, torch.bfloat16, 4)
    imp = obs.stat.weights(W4, 512)[0]
    p = torch.tensor([1 - i / obs.grid for i in range(obs.total_steps)], dtype=torch.float32)
    *_, unsure, _ = native_observe.imatrix_search(w, (128, "int", True, -8.0, 7.0, 7.5, 15.0, 1.0, p), imp, obs.norm)
    assert bool(unsure[5].all()) and 0 < int(unsure.sum()) < unsure.numel() // 2
    _same(obs.search(w, W4, impl="torch"), obs.search(w, W4, impl="native"))


def test_kernel_against_a_written_out_group():
    """One group searched by hand (W4 symmetric, norm 3, the error summed in double): the kernel's step, range and hits."""
    w = torch.tensor([[0.5, -0.25, 0.125, 1.0, -0.75, 0.3, 0.0, -1.0]], dtype=torch.bfloat16)
    imp = torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0, 0.5, 1.0, 1.0])
    p = torch.tensor([1 - i / 20 for i in range(10)], dtype=torch.float32)
    step, mn, mx, improved, unsure, hits = native_observe.imatrix_search(w, (8, "int", True, -8.0, 7.0, 7.5, 15.0, 1.0, p), imp, 3.0)
    x = w.float()[0]
    best, best_i, bits = torch.finfo(torch.float32).max, -1, 0
    for i in range(10):
        a = (torch.tensor(1.0, dtype=torch.bfloat16) * p[i].item()).float()  # absmax 1.0 shrunk, in D
        s = (a / 7.5).to(torch.bfloat16).float()
        q = ((x / s).to(torch.bfloat16).float().clamp(-8, 7).round() * s).to(torch.bfloat16).float()
        err = float(((q - x).abs() ** 3 * imp).double().sum())
        if err < best:
            best, best_i, bits = err, i, bits | (1 << i)
    assert not bool(unsure.any())
    assert int(step[0, 0]) == best_i and int(hits[0, 0]) == bits and bool(improved[best_i])
    assert best_i >= 0 and float(mx[0, 0]) == float((torch.tensor(1.0, dtype=torch.bfloat16) * p[best_i].item()).float())
    assert float(mn[0, 0]) == float((torch.tensor(-1.0, dtype=torch.bfloat16) * p[best_i].item()).float())


def test_refusals():
    """NaN weights refused as the torch path refuses them; a K not a multiple of the group size, an fp32 weight for
    ``impl="native"`` and an importance of the wrong size refused with their messages."""
    obs = OBSERVERS["imatrix_mse"].with_importance(_importance(256, 5))
    w = _weights(8, 256, torch.bfloat16, 5)
    bad = w.clone()
    bad[2, 7] = float("nan")
    for impl in ("torch", "native"):
        with pytest.raises(ValueError, match="NaN or inf"):
            obs.search(bad, W4, impl=impl)
        with pytest.raises(ValueError, match="not a multiple of the group size"):
            obs.search(w[:, :200], W4, impl=impl)
    with pytest.raises(ValueError, match="native observer kernel"):
        obs.search(w.float(), W4, impl="native")
    p = torch.ones(3)
    with pytest.raises(ValueError, match="importance must be fp32"):
        native_observe.imatrix_search(w, (128, "int", True, -8.0, 7.0, 7.5, 15.0, 1.0, p), torch.ones(128), 3.0)


def test_global_scale_of_searched_ranges_is_torch():
    """NVFP4's global scale from the searched ranges (the fused partners' absmax) is the same from either search."""
    obs = OBSERVERS["nvfp4_expanded_imatrix"].with_importance(_importance(256, 6))
    w = _weights(12, 256, torch.float16, 6)[6:]  # no huge row: a finite global scale
    a, b = obs.search(w, NVFP4, impl="torch"), obs.search(w, NVFP4, impl="native")
    assert bool(torch.isfinite(range_absmax(*a.ranges)))
    assert torch.equal(nvfp4_global_scale(range_absmax(*a.ranges), w.dtype), nvfp4_global_scale(range_absmax(*b.ranges), w.dtype))


def test_the_scalar_build_gives_the_same_search(monkeypatch, tmp_path):
    """Built without the AVX2/F16C flags (another CPU), the kernel's scalar path gives the torch search too."""
    lib = scalar_build(monkeypatch, tmp_path, native_observe._SRC, native_observe._LIB.signatures, "observe")
    monkeypatch.setattr(native_observe, "_LIB", lib)
    for name, args, dtype in (("imatrix_mse", W4_G32_ASYM, torch.float16), ("nvfp4_expanded_imatrix", NVFP4, torch.bfloat16)):
        obs = OBSERVERS[name].with_importance(_importance(256, 7))
        w = _weights(12, 256, dtype, 7)
        _same(obs.search(w, args, impl="torch"), obs.search(w, args, impl="native"))
