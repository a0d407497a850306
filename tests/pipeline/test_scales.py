"""The executor's absmax pass (pipeline/scales.py): NVFP4's set scale and the FP8 preset's per-tensor
``weight_scale``, gathered chunk by chunk, equal the whole-tensor formulas bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from ctconvert import api
from ctconvert.formats.common import tensor_absmax
from ctconvert.formats.fp4 import nvfp4_global_scale
from ctconvert.formats.fp8 import fp8_scale
from ctconvert.pipeline.scales import UnitScales, fp8_tensor_scale, needs_absmax_pass, per_tensor_scale
from ctconvert.plan.schemes import get_scheme


def _whole(w: torch.Tensor) -> torch.Tensor:
    """The scale the FP8 preset wrote before the absmax pass computed it (read whole, outside the executor)."""
    return fp8_scale(tensor_absmax(w), w.dtype).reshape(1).to(w.dtype)


@pytest.mark.parametrize(
    ("name", "pass_", "per_tensor"),
    [("FP8", True, True), ("NVFP4", True, False), ("NVFP4A16", True, False), ("FP8_DYNAMIC", False, False), ("W4A16", False, False)],
)
def test_which_schemes_have_an_absmax_pass(name, pass_, per_tensor):
    scheme = get_scheme(name)
    assert needs_absmax_pass(scheme) is pass_
    assert per_tensor_scale(scheme) is per_tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunked_scales_equal_the_whole_tensor_formulas(dtype):
    g = torch.Generator().manual_seed(0)
    members = [(torch.randn(37, 64, generator=g) * s).to(dtype) for s in (0.02, 3.0, 0.5)]
    scales = UnitScales()
    for m, w in enumerate(members):
        for r0 in range(0, w.shape[0], 10):  # uneven row chunks
            scales.observe(m, tensor_absmax(w[r0 : r0 + 10]))
    scales.finish(get_scheme("FP8"), dtype, [w.dtype for w in members])
    assert scales.global_scale is None
    for m, w in enumerate(members):
        got, want = scales.weight_scale[m], _whole(w)
        assert got.dtype == want.dtype == dtype and got.shape == (1,)
        assert torch.equal(got.view(torch.uint8) if dtype != torch.float32 else got, want.view(torch.uint8) if dtype != torch.float32 else want)
    nv = UnitScales()
    for m, w in enumerate(members):
        nv.observe(m, tensor_absmax(w))
    nv.finish(get_scheme("NVFP4A16"), dtype, [w.dtype for w in members])
    assert nv.weight_scale == {}
    assert torch.equal(nv.global_scale, nvfp4_global_scale(tensor_absmax(torch.cat(members)), dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_all_zero_tensor_gets_eps_whatever_the_sign_of_its_zeros(dtype):
    for w in (torch.zeros(4, 8, dtype=dtype), torch.full((4, 8), -0.0, dtype=dtype)):
        got = fp8_tensor_scale(tensor_absmax(w), dtype)
        assert torch.equal(got.view(torch.int16), _whole(w).view(torch.int16))
        assert got.item() == torch.finfo(dtype).eps


def test_fp8_weight_scales_do_not_depend_on_chunks_or_holding(tiny_llama, tmp_path):
    """The FP8 preset through the executor: read whole, in small chunks held for the pass, and in small chunks
    read twice (nothing held): the same bytes, and each ``weight_scale`` is the whole tensor's."""
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i % 200) for i in range(64)))
    outs = []
    for i, kw in enumerate([{}, {"chunk_elems": 4096}, {"chunk_elems": 4096, "hold_bytes": 0}]):
        out = tmp_path / f"q{i}"
        api.quantize(tiny_llama, out, "FP8", calibration=ids, calibration_samples=2, calibration_seq_len=32, device="cpu", **kw)
        outs.append(out)
    src = {}
    for f in tiny_llama.glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            src.update({k: s.get_tensor(k) for k in s.keys()})
    tensors = []
    for out in outs:
        got = {}
        for f in out.glob("*.safetensors"):
            with safe_open(f, "pt") as s:
                got.update({k: s.get_tensor(k) for k in s.keys()})
        tensors.append(got)
    scales = [k for k in tensors[0] if k.endswith(".weight_scale")]
    assert len(scales) == 14  # 7 Linear layers x 2 blocks
    for k in scales:
        want = _whole(src[k.removesuffix("_scale")])
        for t in tensors:
            assert torch.equal(t[k].view(torch.int16), want.view(torch.int16)), k
    for t in tensors[1:]:
        assert t.keys() == tensors[0].keys()
        assert all(torch.equal(t[k].view(torch.uint8), tensors[0][k].view(torch.uint8)) for k in t)


@pytest.mark.parametrize(("name", "observer"), [("NVFP4A16", "nvfp4_expanded_mse"), ("NVFP4A16", "memoryless_mse"), ("W4A16", "memoryless_mse")])
def test_the_observers_pre_pass_equals_one_search_of_each_tensor(name, observer):
    """With an observer, uneven row chunks through the pre-pass (``search``) give each chunk the ranges of one
    search of its whole tensor, and NVFP4's set scale the absmax of every member's searched ranges."""
    from ctconvert.formats.observers import OBSERVERS, range_absmax

    scheme, obs = get_scheme(name), OBSERVERS[observer]
    g = torch.Generator().manual_seed(1)
    members = [(torch.randn(40, 256, generator=g) * s).to(torch.bfloat16) for s in (0.02, 0.07)]
    scales = UnitScales(obs)
    assert needs_absmax_pass(scheme, obs) is (scheme.global_scale or obs.needs_stop_pass)
    for m, w in enumerate(members):
        for r0 in range(0, 40, 13):
            scales.observe(m, tensor_absmax(w[r0 : r0 + 13]))
            scales.search(m, r0, w[r0 : r0 + 13], scheme)
    scales.finish(scheme, torch.bfloat16, [w.dtype for w in members])
    whole = [obs.ranges(w, scheme.weights) for w in members]
    if scheme.global_scale:
        want = nvfp4_global_scale(torch.stack([range_absmax(*r) for r in whole]).max(), torch.bfloat16)
        assert torch.equal(scales.global_scale, want)
    for m, w in enumerate(members):
        for r0 in range(0, 40, 13):
            mn, mx = scales.ranges(m, r0, w[r0 : r0 + 13], scheme)
            assert torch.equal(mn, whole[m][0][r0 : r0 + 13]) and torch.equal(mx, whole[m][1][r0 : r0 + 13])
    assert UnitScales().ranges(0, 0, members[0], scheme) is None  # min/max: the quantizers' own
