"""Rows quantized to all zeros: the scale prefilter finds every such row, and the deferred (GPU) path counts as the direct one."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.formats.common import tensor_absmax
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.pipeline.zeros import ZeroTracker, candidate_rows, zero_rows
from ctconvert.plan.schemes import get_scheme, scheme_names

SCHEMES = [n for n in scheme_names() if n != "INT8"]  # every scheme (INT8 is W8A8's alias)


def weight(dtype, seed=0):
    """256 x 256 with rows of every kind: normal (std 0.02), tiny (about 3e-8, and 1e-6), exactly zero,
    and one row with a single tiny value beside zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 256, generator=g) * 0.02
    w[3] = torch.randn(256, generator=g) * 3e-8
    w[7] = torch.randn(256, generator=g) * 1e-6
    w[9] = 0
    w[11] = 0
    w[11, 5] = 4e-8
    w[128:] *= 1e-6  # a whole block of 128 rows of small values
    return w.to(dtype)


def quantize(scheme, w):
    gs = nvfp4_global_scale(tensor_absmax(w), w.dtype) if scheme.global_scale else None
    out = scheme.quantize_rows(w, gs, impl="torch")
    parts = {**out, **scheme.whole_tensor_outputs(tuple(w.shape), gs)}
    return out, scheme.weight_format.dequantize(parts, scheme.weights), gs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", SCHEMES)
def test_prefilter_covers_every_row_quantized_to_zero(name, dtype):
    scheme = get_scheme(name)
    w = weight(dtype)
    out, deq, _ = quantize(scheme, w)
    cand = candidate_rows(out, scheme.weight_format, scheme.weights, dtype, w.shape[0])
    assert cand is not None and cand.shape == (256,)
    zero, lost = zero_rows(deq, w)
    if scheme.weights.strategy == "tensor":
        # FP8's one scale per tensor (the calibrated FP8 preset): the unit is the tensor; its tiny rows beside
        # normal ones round to zero as ordinary quantization error, below E4M3's range relative to the tensor's scale
        assert bool(cand.all()) == bool(zero.all()) and not bool(cand.any())
        return
    if scheme.weights.strategy == "block":
        # the unit is the 128-row block: rows of a block quantized to zeros are candidates; a row that
        # rounds to zero beside larger rows of its own block is ordinary rounding, not a candidate
        for b in (0, 1):
            blk = slice(128 * b, 128 * (b + 1))
            assert bool(cand[blk].all()) == bool(zero[blk].all())
        assert not bool(cand[:128].any())
    else:
        assert bool((cand | ~zero).all()), "a row quantized to zeros escaped the prefilter"
        assert not bool(cand[:3].any()) and bool(cand[9])  # normal rows are not candidates; a zero row is
    if dtype == torch.float16 or scheme.global_scale:
        # values of about 2e-8 vanish in fp16 with every format, and with NVFP4 in any dtype (its group scales
        # are E4M3 relative to the tensor's global scale: 2e-8 / 0.08 is below their smallest step)
        assert bool(lost[128:].all())
        if scheme.weights.strategy != "block":
            assert bool(lost[3]) and bool(lost[11])
    else:
        assert not bool(lost[128:].any())  # bf16 keeps their scales


@pytest.mark.parametrize("name", ["W4A16", "NVFP4A16", "FP8_BLOCK"])
def test_deferred_path_counts_as_the_direct_one(tmp_path, name):
    scheme = get_scheme(name)
    w = weight(torch.float16, seed=2)
    save_file({"m.weight": w}, tmp_path / "model.safetensors")
    info = open_checkpoint(tmp_path, strict=False).tensors["m.weight"]
    direct, deferred = ZeroTracker(), ZeroTracker()
    gs = amax = None
    for r0 in (0, 128):  # two chunks, as the executor feeds them
        rows = w[r0 : r0 + 128]
        if scheme.global_scale:
            amax = tensor_absmax(w)
            gs = nvfp4_global_scale(amax, w.dtype)
        out = scheme.quantize_rows(rows, gs, impl="torch")
        direct.observe(info, r0, rows, out, scheme, gs, amax)
        mask = candidate_rows(out, scheme.weight_format, scheme.weights, w.dtype, rows.shape[0])
        clean = torch.zeros(int(mask.numel()) // 3 + r0 // 128 * 5, dtype=torch.bool)  # other tensors' entries, no candidate
        empty = torch.zeros(0, dtype=torch.bool)
        for m in (clean, mask, empty):  # what observe keeps for a GPU chunk, between entries without candidates
            deferred.pending.setdefault("cuda:0", []).append((info, r0, m, scheme, gs, amax))
    deferred.resolve(torch.device("cuda:0"))
    assert [r.to_dict() for r in direct.reports()] == [r.to_dict() for r in deferred.reports()]
    (rep,) = direct.reports()
    _, deq, _ = quantize(scheme, w)
    zero, lost = zero_rows(deq, w)
    if name != "FP8_BLOCK":
        assert rep.zero_rows == int(lost.sum()) and rep.all_zero_rows == int(zero.sum())
    assert rep.zero_rows >= 2 and not rep.whole


@pytest.mark.parametrize(
    ("name", "dtype", "scale"),
    [(n, d, s) for n in ("NVFP4A16", "NVFP4") for d in (torch.bfloat16, torch.float16) for s in (1.0, 0.02)]
    + [("W4A16", torch.float16, 1.0), ("FP8_BLOCK", torch.float16, 1.0)],
)
def test_note_names_the_cause_that_applies(tmp_path, name, dtype, scale):
    """NVFP4's rows vanish under the global scale that the tensor's largest value sets (the note names that value,
    exactly); in fp16, a tensor whose largest value is under ~0.04 needs a global scale beyond fp16's range, stored
    as 1, and the dtype's range is the cause; the other formats' rows vanish because their scales underflow the
    weight's dtype (the note names the dtype)."""
    scheme = get_scheme(name)
    w = (weight(torch.float32, seed=3) * scale).to(dtype)  # largest |value| ~0.09, or ~0.002
    save_file({"m.weight": w}, tmp_path / "model.safetensors")
    info = open_checkpoint(tmp_path, strict=False).tensors["m.weight"]
    tracker = ZeroTracker()
    amax = tensor_absmax(w)
    gs = nvfp4_global_scale(amax, w.dtype) if scheme.global_scale else None
    tracker.observe(info, 0, w, scheme.quantize_rows(w, gs, impl="torch"), scheme, gs, amax if gs is not None else None)
    (rep,) = tracker.reports()
    note, d = rep.note(), rep.to_dict()
    overflow = scheme.global_scale and dtype == torch.float16 and scale < 1
    assert overflow == (scheme.global_scale and float(gs) == 1.0)  # the stored global scale says which case this is
    if scheme.global_scale:
        assert rep.set_max == d["set_max"] == float(w.abs().max())
    if scheme.global_scale and not overflow:
        assert d["cause"] == "global_scale" and "weight can take" not in note and "range" not in note
        assert f"largest |value| {rep.set_max:.3g} of the tensor or its fused set" in note
    elif overflow:
        assert d["cause"] == "scale_range" and f"2688 / {rep.set_max:.3g}" in note and "beyond float16's range, so it is stored as 1" in note
    else:
        assert d["cause"] == "scale_range" and d["set_max"] is None
        assert f"scales computed for a {str(dtype).removeprefix('torch.')} weight" in note and "global scale" not in note
