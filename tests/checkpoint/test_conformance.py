"""Checks of a checkpoint against how its loaders read it (ctconvert/checkpoint/conformance.py): here the MoE
experts' config group as vLLM 0.33 matches it."""

from __future__ import annotations

from ctconvert import api
from ctconvert.checkpoint.conformance import vllm_expert_group

from conftest import moe_checkpoint

RECIPE = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head", "re:.*mlp\\\\.gate$"]
      config_groups:
        mlp:
          targets: ["{mlp}"]
          weights: {{num_bits: 4, type: float, symmetric: true, group_size: 16, strategy: tensor_group, scale_dtype: torch.float8_e4m3fn}}
        attention:
          targets: ["Linear"]
          weights: {{num_bits: 4, type: int, symmetric: true, group_size: 128, strategy: group}}
"""


def test_vllm_matches_targets_in_config_order_then_linear():
    """The first exact name or pattern in the config's order wins (compressed-tensors would take the exact name of
    the later group), then the group that targets Linear; an ignored name has none."""
    name = "model.layers.0.mlp.experts.routed_experts.0.gate_proj"
    qcfg = {"config_groups": {"a": {"targets": ["re:.*gate_proj$"]}, "b": {"targets": [name]}, "c": {"targets": ["Linear"]}}}
    assert vllm_expert_group(name, qcfg) == "a"
    assert vllm_expert_group("model.layers.0.mlp.experts.routed_experts.0.up_proj", qcfg) == "c"
    assert vllm_expert_group(name, {**qcfg, "ignore": ["re:.*experts.*"]}) is None
    assert vllm_expert_group("x.up_proj", {"config_groups": {"a": {"targets": ["re:.*gate_proj$"]}}}) is None


def test_verify_refuses_experts_vllm_would_load_with_another_group(tmp_path):
    """A recipe whose MLP pattern names the experts by index (compressed-tensors' names) gives experts that vLLM
    0.33, which matches `<block>.experts.routed_experts.0.<proj>`, takes for the Linear group: verify names every
    block and projection; a pattern that also matches vLLM's name passes."""
    src = moe_checkpoint(tmp_path)
    outs = {}
    for tag, mlp in (("bad", r"re:.*mlp\\.(experts\\.\\d+\\.)?(gate|up|down)_proj$"), ("good", r"re:.*(gate|up|down)_proj$")):
        recipe = tmp_path / f"{tag}.yaml"
        recipe.write_text(RECIPE.format(mlp=mlp))
        api.quantize(src, tmp_path / tag, None, recipe=recipe)
        outs[tag] = api.verify(tmp_path / tag)
    bad = [p for p in outs["bad"]["problems"] if "vLLM 0.33 loads these experts" in p["message"]]
    assert not outs["bad"]["ok"]
    assert sorted(p["tensor"] for p in bad) == sorted(f"model.layers.{i}.mlp.experts.*.{p}" for i in (0, 1) for p in ("down_proj", "gate_proj", "up_proj"))
    assert all(".mlp.experts.routed_experts.0." in p["message"] and "config group 'attention'" in p["message"] for p in bad)
    assert outs["good"]["ok"], outs["good"]["problems"]
    assert "MoE experts' group as vLLM 0.33 matches them" in outs["good"]["checked"]["checks"]
