"""Config groups whose weight arguments contradict themselves (ctconvert/checkpoint/group_args.py), through verify."""

from __future__ import annotations

import json

import pytest

from ctconvert import api

from conftest import save_config


@pytest.mark.parametrize("reference", [False, True])
def test_a_strategy_that_contradicts_the_group_size_is_one_error_naming_config_json(tiny_llama, tmp_path, reference):
    """The trial's edit: strategy 'channel' over group-quantized W4A16 tensors (group_size 128 kept). compressed-tensors
    refuses such args; with --reference verify used to dequantize each module as 'channel' and print a torch reshape
    error 14 times. Now: one error naming config.json, the contradiction and what weight_scale holds; no module is
    dequantized (the config written as a writer would: its records match, so this is the only error)."""
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "channel"
    save_config(out, cfg)
    report = api.verify(out, tiny_llama if reference else None)
    (e,) = [p for p in report["problems"] if p["severity"] == "error"]
    assert e["file"] == str(out / "config.json") and "tensor" not in e
    assert e["message"] == (
        "config group 'group_0': weights strategy 'channel' with group_size 128, which compressed-tensors (quant_args.py) and so vLLM 0.33 "
        "refuse: a group_size goes with strategy 'group' or 'tensor_group' only; model.layers.0.mlp.down_proj.weight_scale is BF16[256, 4]: "
        "one scale per 128 columns, where strategy 'channel' stores [256, 1]; its 14 modules are not dequantized"
    )
    assert report["tensors"] == []


def test_a_grouped_strategy_without_a_group_size(tiny_llama, tmp_path):
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = None
    save_config(out, cfg)
    report = api.verify(out, tiny_llama)
    (e,) = [p for p in report["problems"] if p["severity"] == "error"]
    assert e["message"].startswith(
        "config group 'group_0': weights strategy 'group' without a group_size (null), which compressed-tensors (quant_args.py) and so "
        "vLLM 0.33 refuse: strategy 'group' needs a positive group_size;"
    )
    assert "goes with" not in e["message"]  # the rule of the other contradiction, which read backwards here
    assert "model.layers.0.mlp.down_proj.weight_scale is BF16[256, 4]: one scale per 128 columns;" in e["message"]


def test_an_nvfp4_argument_of_null_is_shown_as_config_json_holds_it(tiny_llama, tmp_path):
    """``group_size: null`` in an NVFP4 group (strategy left ``tensor_group``): the strategy error says it needs a group
    size, and no message shows Python's ``None``."""
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "NVFP4A16")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update({"group_size": None, "symmetric": None})
    save_config(out, cfg)
    errors = [p["message"] for p in api.verify(out)["problems"] if p["severity"] == "error" and "config group" in p["message"]]
    assert any("strategy 'tensor_group' without a group_size (null)" in e and "strategy 'tensor_group' needs a positive group_size" in e for e in errors)
    assert any("symmetric null (NVFP4: True)" in e for e in errors) and not any("None" in e for e in errors), errors
