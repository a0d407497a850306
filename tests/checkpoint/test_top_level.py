"""The tensors outside the decoder layers against what the judged family's vLLM 0.33 class builds there
(ctconvert/checkpoint/top_level.py): the new-user trial's ``model.foo`` and ``model.position_ids`` beside
``model.embed_tokens.weight`` passed verify while vLLM refused them ("There is no module or parameter named 'foo'")."""

from __future__ import annotations

import json

import pytest
import torch

from ctconvert import api
from ctconvert.checkpoint.architectures import ARCHITECTURES
from ctconvert.checkpoint.loadable import loadability_problems
from ctconvert.checkpoint.modules import modules_of
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.top_level import rotary_dropped, top_level_problems

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

BF = torch.bfloat16
NO_PARAM = "which vLLM 0.33 {} does not build: its loader has no parameter to load it into"
DROPPED = (
    "extra: {name} is stored, but vLLM 0.33 {owner} builds {module} without a bias: its loader drops this one (utils.py AutoWeightsLoader "
    "ignores an unexpected .bias) while it loads the weight, so vLLM runs without the stored values"
)


def _output(tmp_path, add: dict, config: dict | None = None):
    """A fresh tiny Llama source with ``add`` stored beside its tensors, and its W4A16 output."""
    cfg = dict(LLAMA_CONFIG, **(config or {}))
    src = write_checkpoint(tmp_path / "src", {**llama_tensors(cfg), **add}, cfg)
    api.quantize(src, tmp_path / "out", "W4A16", device="cpu")
    return tmp_path / "out"


def _found(folder) -> list[tuple[str, str | None, str | None, str]]:
    ck = open_checkpoint(folder, strict=False)
    return [(p.severity, p.file, p.tensor, p.message) for p in loadability_problems(ck, modules_of(ck), folder)]


def test_extra_top_level_tensors_fail(tmp_path):
    """The trial's two: each an error naming the tensor, its shard and the class with no parameter for it, in the list
    inspect, quantize and verify share; verify fails the output."""
    out = _output(tmp_path, {"model.foo": torch.ones(256, dtype=BF), "model.position_ids": torch.arange(4)})
    shard = str(out / "model.safetensors")
    assert _found(out) == [
        ("error", shard, "model.foo", f"extra: model.foo is stored outside the decoder layers, {NO_PARAM.format('llama.py LlamaModel')}"),
        ("error", shard, "model.position_ids", f"extra: model.position_ids is stored outside the decoder layers, {NO_PARAM.format('llama.py LlamaModel')}"),
    ]
    rep = api.verify(out)
    assert not rep["ok"]
    assert {p.get("tensor") for p in rep["problems"] if p["severity"] == "error"} == {"model.foo", "model.position_ids"}


def test_outside_the_text_model_names_the_causal_lm(tmp_path):
    out = _output(tmp_path, {"foo.weight": torch.ones(256, dtype=BF)})
    msg = f"extra: foo.weight is stored outside the decoder layers, {NO_PARAM.format('llama.py LlamaForCausalLM')}"
    assert _found(out) == [("error", str(out / "model.safetensors"), "foo.weight", msg)]


def test_biases_outside_the_layers_fail(tmp_path):
    """vLLM 0.33's loader ignores an unexpected .bias below a module it builds: the final norm's or the head's is dropped
    while their weights load (vllm_accept refuses it); one of a module it does not build is refused as any other name."""
    add = {"model.norm.bias": torch.zeros(256, dtype=BF), "lm_head.bias": torch.zeros(384, dtype=BF), "model.foo.bias": torch.zeros(256, dtype=BF)}
    out = _output(tmp_path, add)
    shard = str(out / "model.safetensors")
    assert _found(out) == [
        ("error", shard, "lm_head.bias", DROPPED.format(name="lm_head.bias", owner="llama.py LlamaForCausalLM", module="lm_head")),
        ("error", shard, "model.foo.bias", f"extra: model.foo.bias is stored outside the decoder layers, {NO_PARAM.format('llama.py LlamaModel')}"),
        ("error", shard, "model.norm.bias", DROPPED.format(name="model.norm.bias", owner="llama.py LlamaModel", module="model.norm")),
    ]


@pytest.mark.parametrize("name,owner", [("lm_head.foo", "LlamaForCausalLM"), ("model.norm.weight2", "LlamaModel"), ("model.embed_tokens.foo", "LlamaModel")])
def test_other_names_on_the_modules_built_outside_the_layers_fail(tmp_path, name, owner):
    """A name below the head, the final norm or the embedding that is neither its weight nor its bias: vLLM 0.33 has no
    parameter for it ("There is no module or parameter named 'lm_head.foo'", a new-user trial), an error as any other."""
    out = _output(tmp_path, {name: torch.ones(256, dtype=BF)})
    msg = f"extra: {name} is stored outside the decoder layers, {NO_PARAM.format('llama.py ' + owner)}"
    assert _found(out) == [("error", str(out / "model.safetensors"), name, msg)]
    assert not api.verify(out)["ok"]


def test_a_quantized_head_passes(tmp_path):
    """The head quantized (--lm-head nvfp4a16: weight_packed, weight_scale, weight_global_scale stand for its weight)."""
    cfg = dict(LLAMA_CONFIG)
    src = write_checkpoint(tmp_path / "src", llama_tensors(cfg), cfg)
    api.quantize(src, tmp_path / "out", "NVFP4A16", device="cpu", lm_head="nvfp4a16")
    assert _found(tmp_path / "out") == [] and api.verify(tmp_path / "out")["ok"]


def test_what_vllm_skips_passes(tmp_path):
    """RoPE buffers (utils.py AutoWeightsLoader REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER), at the top level and in every
    layer (the trial's m-llama-inv-freq, which vLLM 0.33 loads): no problem, verify passes."""
    add = {"model.rotary_emb.inv_freq": torch.ones(32), "model.rotary_emb.cos_cached": torch.ones(8, 32)}
    add.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(32) for i in range(2)})
    out = _output(tmp_path, add)
    assert _found(out) == []
    assert api.verify(out)["ok"]
    assert rotary_dropped("model.rotary_pos_emb.inv_freq") and not rotary_dropped("model.rope.inv_freq")


def test_a_rope_buffer_vllm_does_not_drop_fails(tmp_path):
    """``rope.inv_freq``: no name of vLLM 0.33's REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER, so LlamaModel refuses it."""
    out = _output(tmp_path, {"model.rope.inv_freq": torch.ones(32)})
    msg = f"extra: model.rope.inv_freq is stored outside the decoder layers, {NO_PARAM.format('llama.py LlamaModel')}"
    assert _found(out) == [("error", str(out / "model.safetensors"), "model.rope.inv_freq", msg)]


def test_correct_outputs_have_no_top_level_problem(tmp_path):
    """Untied and tied heads: nothing outside the layers is reported."""
    assert _found(_output(tmp_path / "untied", {})) == []
    tied = dict(LLAMA_CONFIG, tie_word_embeddings=True)
    src = write_checkpoint(tmp_path / "tied-src", llama_tensors(tied), tied)
    api.quantize(src, tmp_path / "tied", "FP8_DYNAMIC", device="cpu")
    assert _found(tmp_path / "tied") == []
    assert api.verify(tmp_path / "tied")["ok"]


def test_unknown_family_is_not_judged(tmp_path):
    """A family verify does not know: the extra tensor is not judged (the family's note), as in its decoder layers."""
    out = _output(tmp_path, {"model.foo": torch.ones(256, dtype=BF)})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, model_type="cohere", architectures=["CohereForCausalLM"])))
    assert [p for p in _found(out) if p[2] == "model.foo"] == []


@pytest.mark.parametrize("arch", ["Qwen2VLForConditionalGeneration", "Gemma3ForConditionalGeneration"])
def test_vlm_towers_and_heads(arch):
    """A VLM's tower and projector (its file's mapper, before and after transformers 4.52) and its wrapped head are
    built; another name beside them is not, and under the text model it names the text model's class."""
    cls = ARCHITECTURES[arch]
    stack = "model.language_model.layers."
    names = [f"{stack}0.input_layernorm.weight", "model.language_model.embed_tokens.weight", "model.language_model.norm.weight", "lm_head.weight"]
    names += [f"{t}blocks.0.norm1.weight" for t in cls.towers] + ["language_model.lm_head.weight", "model.language_model.extra", "model.projector.weight"]
    found = top_level_problems(dict(zip(names, names)), stack, cls, lambda n: "f")
    assert [(p.tensor, p.message) for p in found] == [
        ("model.language_model.extra", f"extra: model.language_model.extra is stored outside the decoder layers, {NO_PARAM.format(cls.model)}"),
        ("model.projector.weight", f"extra: model.projector.weight is stored outside the decoder layers, {NO_PARAM.format(cls.where)}"),
    ]
