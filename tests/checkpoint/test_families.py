"""Fused 3-D MoE experts split per expert: every family layout value for value, against torch slicing of the
stored tensor as the family's transformers module uses it; every read path; refusals."""

from __future__ import annotations

import pytest
import torch

from ctconvert.checkpoint.families import FAMILIES, is_mtp, mtp_part_layers, split_fused_experts
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.safetensors_io import iter_row_chunks, map_rows, read_bytes, read_rows, read_tensor
from ctconvert.errors import BadInputError, UnsupportedError

from conftest import write_checkpoint

E, H, I = 4, 24, 10  # noqa: E741 - experts, hidden, intermediate (not multiples of anything on purpose)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _expected(model_type: str, gate_up: torch.Tensor, down: torch.Tensor, e: int) -> dict[str, torch.Tensor]:
    """Expert ``e``'s Linear weights ``[out, in]`` the way the family's transformers module computes with them
    (transformers 5.24 models/<family>/modeling_*.py; see FAMILIES[...].source)."""
    if model_type == "gpt_oss":  # x @ gate_up[e] -> [..., ::2] gate, [..., 1::2] up; x @ down[e]
        return {"gate_proj": gate_up[e][:, ::2].T, "up_proj": gate_up[e][:, 1::2].T, "down_proj": down[e].T}
    if model_type == "llama4":  # bmm(x, gate_up).chunk(2, -1); bmm(., down)
        return {"gate_proj": gate_up[e][:, :I].T, "up_proj": gate_up[e][:, I:].T, "down_proj": down[e].T}
    names = FAMILIES[model_type].names  # linear(x, gate_up[e]).chunk(2, -1); linear(., down[e])
    return {names[0]: gate_up[e][:I], names[1]: gate_up[e][I:], names[2]: down[e]}


def _layout(model_type):
    return {"gpt_oss": ((E, H, 2 * I), (E, I, H)), "llama4": ((E, H, 2 * I), (E, I, H))}.get(model_type, ((E, 2 * I, H), (E, H, I)))


@pytest.mark.parametrize("model_type,suffix", [("gpt_oss", ""), ("llama4", ""), ("gemma4", ""), ("qwen3_moe", ".weight"), ("mixtral", "")])
def test_split_matches_the_family_math_value_for_value(tmp_path, model_type, suffix):
    gu_shape, d_shape = _layout(model_type)
    gate_up, down = _rand(*gu_shape, seed=1), _rand(*d_shape, seed=2)
    p = "model.layers.0.mlp.experts."
    t = {p + "gate_up_proj" + suffix: gate_up, p + "down_proj" + suffix: down, "model.layers.0.input_layernorm.weight": _rand(H)}
    cfg = {"model_type": model_type, "hidden_size": H, "num_experts": E}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, cfg))
    fused = split_fused_experts(ck.tensors, ck.config)
    assert set(fused) == {p + "gate_up_proj" + suffix, p + "down_proj" + suffix}
    parts = {q.name: q for fe in fused.values() for q in fe.parts}
    names = FAMILIES[model_type].names
    assert len(parts) == 3 * E
    for e in range(E):
        for leaf, want in _expected(model_type, gate_up, down, e).items():
            assert leaf in names
            info = parts[f"{p}{e}.{leaf}.weight"]
            assert info.base in fused and tuple(info.shape) == tuple(want.shape)
            assert torch.equal(read_tensor(info), want)
            assert torch.equal(read_rows(info, 1, 3), want[1:3])  # a row range on its own
            assert torch.equal(map_rows(info, 2, info.shape[0]), want[2:])
            assert torch.equal(torch.cat([c for _, c in iter_row_chunks(info, chunk_bytes=3 * info.nbytes // info.shape[0])]), want)
            raw = want.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(read_bytes(info, 5, 17), raw[5:22])  # a byte range that starts and ends inside rows
            out = torch.zeros(64, dtype=torch.uint8)
            assert torch.equal(read_bytes(info, 3, 30, out=out), raw[3:33]) and torch.equal(out[:30], raw[3:33])


def test_gpt_oss_biases_follow_their_weights(tmp_path):
    p = "model.layers.1.mlp.experts."
    b_gu, b_d = _rand(E, 2 * I, seed=3), _rand(E, H, seed=4)
    t = {p + "gate_up_proj": _rand(E, H, 2 * I), p + "down_proj": _rand(E, I, H), p + "gate_up_proj_bias": b_gu, p + "down_proj_bias": b_d}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "gpt_oss", "hidden_size": H}))
    parts = {q.name: q for fe in split_fused_experts(ck.tensors, ck.config).values() for q in fe.parts}
    for e in range(E):
        assert torch.equal(read_tensor(parts[f"{p}{e}.gate_proj.bias"]), b_gu[e, ::2])
        assert torch.equal(read_tensor(parts[f"{p}{e}.up_proj.bias"]), b_gu[e, 1::2])
        assert torch.equal(read_tensor(parts[f"{p}{e}.down_proj.bias"]), b_d[e])
        assert torch.equal(read_bytes(parts[f"{p}{e}.up_proj.bias"], 2, 6), b_gu[e, 1::2].contiguous().view(torch.uint8)[2:8])


@pytest.mark.parametrize("transposed", [False, True])
def test_a_family_stored_both_ways_is_told_apart_by_the_config(tmp_path, transposed):
    gate_up = _rand(*((E, H, 2 * I) if transposed else (E, 2 * I, H)))
    t = {"model.language_model.layers.0.mlp.experts.gate_up_proj": gate_up}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "qwen3_vl_moe", "text_config": {"hidden_size": H}}))
    (fe,) = split_fused_experts(ck.tensors, ck.config).values()
    assert fe.transposed == transposed
    gate = read_tensor(fe.parts[2])  # expert 1's gate
    assert torch.equal(gate, gate_up[1][:, :I].T if transposed else gate_up[1][:I])


def test_square_experts_of_a_two_way_family_are_refused(tmp_path):
    t = {"model.layers.0.mlp.experts.gate_up_proj": _rand(E, 2 * I, 2 * I)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "qwen3_vl_moe", "hidden_size": 2 * I}))
    with pytest.raises(UnsupportedError, match="fits both orientations") as e:
        split_fused_experts(ck.tensors, ck.config)
    assert e.value.tensor == "model.layers.0.mlp.experts.gate_up_proj"


def test_unknown_family_is_refused_naming_file_and_tensor(tmp_path):
    t = {"model.layers.0.mlp.experts.gate_up_proj": _rand(E, 2 * I, H)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "brand_new_moe"}))
    with pytest.raises(UnsupportedError, match="'brand_new_moe' is not in ctconvert's family table") as e:
        split_fused_experts(ck.tensors, ck.config)
    assert e.value.tensor == "model.layers.0.mlp.experts.gate_up_proj" and str(e.value.file).endswith("model.safetensors")


@pytest.mark.parametrize("cfg,why", [({"num_experts": 8}, "4 experts, config says 8"), ({"hidden_size": 7}, "hidden size 24 where the config")])
def test_shapes_that_disagree_with_the_config_are_refused(tmp_path, cfg, why):
    """A config the fused tensor contradicts is bad input (exit 3), naming the tensor and saying so."""
    t = {"model.layers.0.mlp.experts.gate_up_proj": _rand(E, 2 * I, H)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "gemma4_text", **cfg}))
    with pytest.raises(BadInputError, match=why + ".*describe different models") as e:
        split_fused_experts(ck.tensors, ck.config)
    assert e.value.exit_code == 3 and e.value.tensor == "model.layers.0.mlp.experts.gate_up_proj"


def test_mtp_layers():
    """A layer past num_hidden_layers is an MTP layer only within the num_nextn_predict_layers the config declares (a
    Llama whose config counts fewer layers than it stores has none: verify fails it, the plan keeps nothing quietly),
    and, where the checkpoint's layers are given, only one holding an MTP layer's own modules (eh_proj, enorm, ...)."""
    cfg = {"num_hidden_layers": 61, "num_nextn_predict_layers": 1}
    assert is_mtp("model.layers.61.mlp.experts.3.up_proj.weight", cfg) and not is_mtp("model.layers.60.mlp.gate.weight", cfg)
    assert not is_mtp("model.layers.62.mlp.gate.weight", cfg)  # past the one declared
    for undeclared in ({"num_hidden_layers": 61}, {"num_hidden_layers": 61, "num_nextn_predict_layers": 0}):
        assert not is_mtp("model.layers.61.mlp.experts.3.up_proj.weight", undeclared)
    assert is_mtp("mtp.layers.0.self_attn.q_proj.weight", {}) and is_mtp("mtp.fc.weight", {}) and is_mtp("model.mtp_layers.0.eh_proj.weight", {})
    parts = mtp_part_layers(["model.layers.61.eh_proj.weight", "model.layers.61.mlp.gate.weight", "model.layers.3.enorm.weight", "lm_head.weight"])
    assert parts == {61, 3} and mtp_part_layers(["model.layers.61.mlp.gate.weight"]) == frozenset()
    assert is_mtp("model.layers.61.mlp.gate.weight", cfg, parts) and not is_mtp("model.layers.61.mlp.gate.weight", cfg, frozenset())
    text = {"text_config": {"num_hidden_layers": 4, "num_nextn_predict_layers": 1}}
    assert not is_mtp("model.layers.3.mlp.gate_proj.weight", text)
    assert is_mtp("model.language_model.layers.4.mlp.gate_proj.weight", text)
