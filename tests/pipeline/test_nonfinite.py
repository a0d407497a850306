"""Where a NaN/inf is said to be (``pipeline/nonfinite.py: raise_nonfinite``): an element, a row and column, or the
full index of a 3-D tensor (a new user was told ``row 3, column 32765`` for ``[3, 127, 253]`` of fused experts)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import BadInputError
from ctconvert.pipeline.nonfinite import raise_nonfinite

from conftest import cuda_params, write_checkpoint


@pytest.mark.parametrize(
    "shape, index, where",
    [
        ((7,), (5,), "element 5"),
        ((6, 10), (4, 7), "row 4, column 7"),
        ((4, 128, 256), (3, 127, 253), "index [3, 127, 253]"),
        ((2, 3, 5, 7), (1, 2, 4, 6), "index [1, 2, 4, 6]"),
        ((3, 1, 9), (2, 0, 0), "index [2, 0, 0]"),
    ],
)
@pytest.mark.parametrize("value, kind", [(float("nan"), "NaN"), (float("-inf"), "-inf")])
def test_the_first_non_finite_value_is_named_by_its_index(tmp_path, shape, index, where, value, kind):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    t[index] = value
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "m", {"x.weight": t}, {"model_type": "llama"}))
    with pytest.raises(BadInputError) as e:
        raise_nonfinite(ckpt.tensors["x.weight"])
    assert f"holds 1 non-finite value ({kind}; first at {where})" in str(e.value)
    assert torch.equal(torch.tensor(index), (~torch.isfinite(t.float())).nonzero()[0])  # the index said is the value's


def _biases(tmp_path, poison):
    """Per-expert bias views of gpt-oss-like fused biases (gate and up interleaved in one region per expert), and
    the checkpoint's other small tensors; ``poison``: ``(tensor, index, value)``."""
    from ctconvert.plan.planner import make_plan

    g = torch.Generator().manual_seed(4)
    e, h, i = 4, 32, 16
    p = "model.layers.0.mlp.experts."
    t = {
        p + "gate_up_proj": torch.randn(e, h, 2 * i, generator=g).bfloat16(),
        p + "gate_up_proj_bias": torch.randn(e, 2 * i, generator=g).bfloat16(),
        p + "down_proj": torch.randn(e, i, h, generator=g).bfloat16(),
        p + "down_proj_bias": torch.randn(e, h, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(h, dtype=torch.float32),
    }
    if poison is not None:
        t[poison[0]][poison[1]] = poison[2]
    src = write_checkpoint(tmp_path / "src", t, {"model_type": "gpt_oss", "hidden_size": h, "num_local_experts": e})
    ckpt = open_checkpoint(src)
    plan = make_plan(ckpt, "NVFP4A16", targets=["Linear", r"re:.*mlp\.experts\.\d+\..*"], allow_unloadable=True)
    tensors = {**ckpt.tensors, **plan.views}
    return [tensors[u.sources[0]] for u in plan.units if u.kind == "copy"]


@pytest.mark.parametrize(
    "poison, bad",
    [
        (None, set()),
        (("model.layers.0.mlp.experts.gate_up_proj_bias", (2, 5), float("nan")), {"model.layers.0.mlp.experts.2.up_proj.bias"}),  # odd column: up
        (("model.layers.0.mlp.experts.gate_up_proj_bias", (1, 4), float("inf")), {"model.layers.0.mlp.experts.1.gate_proj.bias"}),
        (("model.layers.0.mlp.experts.down_proj_bias", (3, 31), -float("inf")), {"model.layers.0.mlp.experts.3.down_proj.bias"}),
        (("model.norm.weight", (0,), float("nan")), {"model.norm.weight"}),
    ],
)
@pytest.mark.parametrize("native_checks", [False, True])
def test_read_copies_flags_the_tensors_a_scan_of_each_flags(tmp_path, poison, bad, native_checks):
    """``read_copies`` scans a run once and only a run holding NaN/inf piece by piece: each tensor's flag is the one
    ``copy_nonfinite`` gives its own bytes (also where the NaN sits in bytes of the run that no tensor asked for)."""
    from ctconvert.checkpoint.safetensors_io import read_bytes
    from ctconvert.formats import native
    from ctconvert.pipeline.nonfinite import copy_nonfinite, read_copies

    if native_checks and not native.available():
        pytest.skip("no C compiler")
    infos = _biases(tmp_path, poison)
    got = read_copies(infos, native_checks)
    flagged = {i.name for i, (_, b) in zip(infos, got) if b}
    assert flagged == bad
    for info, (data, b) in zip(infos, got):
        assert torch.equal(data, read_bytes(info, 0, info.nbytes)) and b == copy_nonfinite(info, read_bytes(info, 0, info.nbytes), native_checks)
    gates = [i for i in infos if i.name.endswith("gate_proj.bias")]  # the up half of each region is asked for by none
    assert not any(b for _, b in read_copies(gates, native_checks)) or any("gate_proj" in n for n in bad)


@pytest.mark.parametrize("device", cuda_params())
def test_an_nvfp4_sources_zero_global_scale_is_named_not_its_non_finite_weight(tmp_path, device):
    """compressed-tensors' NVFP4 divides ``weight_scale`` by ``weight_global_scale``: a stored 0 (finite itself) makes
    the dequantized weight NaN/inf, and the error names the 0 and the division, not "N non-finite values". Another
    member's finite scale still converts; nothing is written."""
    from safetensors.torch import load_file, save_file

    from ctconvert import api

    from conftest import LLAMA_CONFIG, llama_tensors

    src = write_checkpoint(tmp_path / "m", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    api.quantize(src, tmp_path / "nv", "NVFP4A16", device=device)
    name = "model.layers.0.self_attn.k_proj.weight_global_scale"
    for f in (tmp_path / "nv").glob("*.safetensors"):
        t = load_file(f)
        if name in t:
            t[name] = torch.zeros_like(t[name])
            save_file(t, f, metadata={"format": "pt"})
            shard = f
    with pytest.raises(BadInputError) as e:
        api.quantize(tmp_path / "nv", tmp_path / "out", "W4A16", device=device)
    msg = str(e.value)
    assert f"{shard}: tensor '{name}': stored tensor is 0: model.layers.0.self_attn.k_proj.weight is dequantized by dividing" in msg
    assert "non-finite values;" in msg and "holds" not in msg and "\n" not in msg
    assert not (tmp_path / "out").exists()
