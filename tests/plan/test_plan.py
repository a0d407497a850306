"""The plan from headers alone: defaults, fused sets, ignore rules, shape checks."""

from __future__ import annotations

import re

import pytest
import torch

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import UnsupportedError, UsageError
from ctconvert.plan.planner import make_plan

from conftest import write_checkpoint


def bf(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def moe_vlm_tensors():
    t = {
        "model.language_model.embed_tokens.weight": bf(64, 32),
        "model.language_model.norm.weight": bf(32),
        "lm_head.weight": bf(64, 32),
        "model.visual.blocks.0.attn.qkv.weight": bf(96, 32),
        "model.visual.merger.mlp.0.weight": bf(32, 32),
        "model.multi_modal_projector.linear_1.weight": bf(32, 32),
    }
    p = "model.language_model.layers.0."
    t[p + "self_attn.q_a_proj.weight"] = bf(32, 32)
    t[p + "self_attn.kv_a_proj_with_mqa.weight"] = bf(48, 32)
    t[p + "self_attn.o_proj.weight"] = bf(32, 32)
    t[p + "mlp.gate.weight"] = bf(4, 32)  # router
    t[p + "mlp.shared_expert_gate.weight"] = bf(1, 32)
    for e in range(2):
        for m in ("gate_proj", "up_proj", "down_proj"):
            t[p + f"mlp.experts.{e}.{m}.weight"] = bf(32, 32)
    t[p + "input_layernorm.weight"] = bf(32)
    return t


@pytest.fixture
def moe_vlm(tmp_path):
    cfg = {"architectures": ["Qwen3VLMoeForConditionalGeneration"], "tie_word_embeddings": False}
    return open_checkpoint(write_checkpoint(tmp_path / "m", moe_vlm_tensors(), cfg, shards=3))


def test_defaults_keep_head_router_vision_dense_and_listed(moe_vlm):
    plan = make_plan(moe_vlm, "NVFP4A16")
    acts = {r.name: r.action for r in plan.rows}
    assert acts["lm_head.weight"] == "ignore"
    assert acts["model.language_model.layers.0.mlp.gate.weight"] == "ignore"
    assert acts["model.language_model.layers.0.mlp.shared_expert_gate.weight"] == "ignore"
    assert acts["model.visual.blocks.0.attn.qkv.weight"] == "ignore"
    assert acts["model.multi_modal_projector.linear_1.weight"] == "ignore"
    assert acts["model.language_model.embed_tokens.weight"] == "copy"
    assert acts["model.language_model.norm.weight"] == "copy"
    assert acts["model.language_model.layers.0.mlp.experts.1.down_proj.weight"] == "quantize"
    assert set(plan.ignore) == {
        "lm_head",
        "model.language_model.layers.0.mlp.gate",
        "model.language_model.layers.0.mlp.shared_expert_gate",
        "model.visual.blocks.0.attn.qkv",
        "model.visual.merger.mlp.0",
        "model.multi_modal_projector.linear_1",
    }


def test_fused_sets_found_across_shards(moe_vlm):
    plan = make_plan(moe_vlm, "NVFP4A16")
    fused = sorted(tuple(u.modules) for u in plan.units if u.kind == "quantize" and u.fused)
    p = "model.language_model.layers.0."
    assert fused == [
        (p + "mlp.experts.0.gate_proj", p + "mlp.experts.0.up_proj"),
        (p + "mlp.experts.1.gate_proj", p + "mlp.experts.1.up_proj"),
        (p + "self_attn.q_a_proj", p + "self_attn.kv_a_proj_with_mqa"),
    ]
    files = {moe_vlm.tensors[p + "self_attn.q_a_proj.weight"].file, moe_vlm.tensors[p + "self_attn.kv_a_proj_with_mqa.weight"].file}
    assert len(files) == 2  # the set spans two shards


def test_partly_ignored_fused_set_is_refused(moe_vlm):
    with pytest.raises(UsageError, match=r"only partly quantized \(up_proj would stay dense\)"):
        make_plan(moe_vlm, "FP8_DYNAMIC", ignore=["re:.*experts\\.0\\.up_proj$"])


def test_user_ignore_and_targets(moe_vlm):
    plan = make_plan(moe_vlm, "FP8_DYNAMIC", ignore=["re:.*experts.*"])
    assert plan.quantized_modules == 3
    assert "model.language_model.layers.0.mlp.experts.0.down_proj" in plan.ignore
    plan = make_plan(moe_vlm, "FP8_DYNAMIC", targets=["re:.*o_proj$"])
    assert plan.quantized_modules == 1
    assert plan.config_groups["group_0"][1] == ["re:.*o_proj$"]


def test_3d_weight_needs_a_decision(tmp_path):
    t = {"model.layers.0.mlp.experts.gate_up_proj.weight": bf(4, 64, 32), "model.layers.0.mlp.down_proj.weight": bf(32, 128)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"architectures": ["X"]}))
    with pytest.raises(UnsupportedError, match="3-D weight"):
        make_plan(ck, "W4A16", targets=["re:.*proj$"])


def test_group_divisibility_reported_in_plan_before_reading(tmp_path):
    t = {"model.layers.0.mlp.down_proj.weight": bf(32, 768), "model.layers.0.mlp.up_proj.weight": bf(768, 32)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {}))
    # compressed-tensors #447: 768 % 512 != 0 style; here 32 % 128 != 0 for up_proj
    with pytest.raises(UnsupportedError, match="up_proj.*K=32 is not a multiple of the group size 128"):
        make_plan(ck, "W4A16")
    plan = make_plan(ck, "W4A16", skip_incompatible=True)
    assert plan.ignore == ["model.layers.0.mlp.up_proj"] and plan.notes


def test_bert_names(minilm_path):
    plan = make_plan(open_checkpoint(minilm_path), "w4a16")
    fused = [u.modules for u in plan.units if u.fused]
    assert len(fused) == 6 and fused[0] == [
        "encoder.layer.0.attention.self.query",
        "encoder.layer.0.attention.self.key",
        "encoder.layer.0.attention.self.value",
    ]
    acts = {r.name: r.action for r in plan.rows}
    assert acts["embeddings.word_embeddings.weight"] == "copy"
    assert acts["embeddings.position_embeddings.weight"] == "copy"
    assert plan.ignore == ["pooler.dense"]


def test_user_ignore_patterns_are_kept_even_where_a_default_applies(moe_vlm):
    """A pattern that only matches tensors kept dense by default is still the user's intent: it goes into the
    config's ignore (loaders may name the modules differently) and no 'matched no tensor' note is given."""
    plan = make_plan(moe_vlm, "NVFP4A16", ignore=["re:.*visual.*", "re:.*lm_head"])
    assert "re:.*visual.*" in plan.ignore and "re:.*lm_head" in plan.ignore
    assert not any("visual" in n or "lm_head" in n for n in plan.notes if "matched" in n), plan.notes
    with pytest.raises(UsageError, match=r"--ignore 're:nothing\.\*' matches no module of this checkpoint: entries are full module names \(like 'model\."):
        make_plan(moe_vlm, "NVFP4A16", ignore=["re:.*visual.*", "re:nothing.*"])
    assert "model.visual.blocks.0.attn.qkv" in plan.ignore  # the names stay too
    assert not any(p.startswith("re:(.*") for p in plan.ignore)  # transformers-5 names: no loader patterns needed


def test_a_pattern_matching_nothing_gets_a_linear_example_and_a_re_hint(minilm_path, tmp_path):
    """A new user's find: on BERT names (no module ends in 'q_proj') the message showed a LayerNorm and no re: hint."""
    from ctconvert import api

    with pytest.raises(UsageError) as e:
        api.quantize(minilm_path, tmp_path / "o", "W4A16", targets=["q_proj"], dry_run=True)
    msg = str(e.value)
    assert "LayerNorm" not in msg and "like 'encoder.layer." in msg and "re:.*" in msg, msg
    name = re.search(r"like '([^']+)'", msg).group(1)
    assert name.split(".")[-1] in ("query", "key", "value", "dense") and f"re:.*{name.split('.')[-1]}$" in msg, msg  # a Linear of BERT
