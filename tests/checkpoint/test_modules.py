"""Modules of a checkpoint (ctconvert/checkpoint/modules.py): the shard file named in what verify --reference finds."""

from __future__ import annotations

from safetensors.torch import load_file

from ctconvert import api

from conftest import save_shard


def test_value_errors_against_a_reference_name_the_shard_file(tiny_llama, tmp_path):
    """A module's error, gain, row and value errors and a changed dense tensor name their shard, as every other error of
    a tensor does ("model.safetensors: module: ..."); the trial's showed the module alone."""
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    ts = load_file(out / "model.safetensors")
    ts["model.layers.0.self_attn.q_proj.weight_scale"] *= 1.5
    ts["model.norm.weight"] *= 2
    save_shard(ts, out / "model.safetensors")  # as a writer would have written them: the record matches
    errors = [p for p in api.verify(out, tiny_llama)["problems"] if p["severity"] == "error"]
    assert {p["tensor"] for p in errors} == {"model.layers.0.self_attn.q_proj", "model.norm.weight"}
    assert len(errors) >= 3 and all(p["file"] == str(out / "model.safetensors") for p in errors), errors
