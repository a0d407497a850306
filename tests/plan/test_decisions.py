"""Every tensor gets an explained decision: fused experts split or kept whole, routers, MTP, explicit targets
over defaults, --no-default-ignore, unclassified tensors refused or kept with --keep-unclassified."""

from __future__ import annotations

import pytest
import torch

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import UnsupportedError, UsageError
from ctconvert.plan.planner import make_plan

from conftest import write_checkpoint

H, I, E = 128, 128, 4  # noqa: E741


def bf(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _gpt_oss(tmp_path, config: dict | None = None, **extra):
    t = {"model.embed_tokens.weight": bf(256, H), "model.norm.weight": bf(H), "lm_head.weight": bf(256, H)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = bf(H, H)
        t[p + "self_attn.q_proj.bias"] = bf(H)  # gpt_oss.py builds the attention projections with a bias
        t[p + "self_attn.sinks"] = bf(2)
        t[p + "mlp.router.weight"] = bf(E, H)
        t[p + "mlp.router.bias"] = bf(E)
        t[p + "mlp.experts.gate_up_proj"] = bf(E, H, 2 * I)
        t[p + "mlp.experts.gate_up_proj_bias"] = bf(E, 2 * I)
        t[p + "mlp.experts.down_proj"] = bf(E, I, H)
        t[p + "mlp.experts.down_proj_bias"] = bf(E, H)
    t.update(extra)
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H, "num_local_experts": E, "num_hidden_layers": 2}
    return open_checkpoint(write_checkpoint(tmp_path / "m", t, {**cfg, **(config or {})}))


#: gpt-oss experts stay dense by default (vLLM 0.33 cannot load them quantized): the split tests name them explicitly
EXPERTS = ["Linear", r"re:.*mlp\.experts\.\d+\..*"]


def test_every_fused_expert_is_split_and_quantized(tmp_path):
    plan = make_plan(_gpt_oss(tmp_path), "W4A16", targets=EXPERTS, allow_unloadable=True)
    rows = {r.name: r for r in plan.rows}
    assert len(rows) == len(plan.rows)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        assert rows[p + "gate_up_proj"].action == "split" and "gpt_oss: transposed, gate/up interleaved" in rows[p + "gate_up_proj"].reason
        for e in range(E):
            for leaf in ("gate_proj", "up_proj", "down_proj"):
                r = rows[f"{p}{e}.{leaf}.weight"]
                assert r.action == "quantize" and r.slice_of in (p + "gate_up_proj", p + "down_proj")
                assert rows[f"{p}{e}.{leaf}.bias"].action == "copy"
            assert rows[f"{p}{e}.gate_proj.weight"].fused_set == f"{p}{e}.{{gate_proj,up_proj}}"
    assert plan.quantized_modules == 2 * (1 + 3 * E)
    assert sorted(plan.ignore) == ["lm_head", "model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    assert plan.defaults == {"router": 2, "lm_head": 1}
    assert all(r.reason or r.scheme for r in plan.rows), [r for r in plan.rows if not (r.reason or r.scheme)]
    outputs = {n for n, _, _ in plan.output_tensors}
    assert "model.layers.0.mlp.experts.gate_up_proj" not in outputs and "model.layers.0.mlp.experts.3.up_proj.weight_packed" in outputs
    assert "model.layers.1.mlp.experts.2.down_proj.bias" in outputs


def test_experts_pattern_matches_the_split_modules(tmp_path):
    plan = make_plan(_gpt_oss(tmp_path), "FP8_DYNAMIC", targets=["re:.*experts.*"], allow_unloadable=True)
    assert plan.quantized_modules == 2 * 3 * E and not any("matched no tensor" in n for n in plan.notes)


def test_experts_kept_dense_stay_fused_and_are_listed(tmp_path):
    plan = make_plan(_gpt_oss(tmp_path), "W4A16", allow_unloadable=True, targets=EXPERTS, ignore=["re:.*experts.*"])
    rows = {r.name: r for r in plan.rows}
    assert not plan.views and plan.quantized_modules == 2
    gu = rows["model.layers.0.mlp.experts.gate_up_proj"]
    assert gu.action == "ignore" and gu.reason == "fused experts kept dense and copied as stored: --ignore re:.*experts.*"
    assert rows["model.layers.0.mlp.experts.gate_up_proj_bias"].action == "copy"
    assert "model.layers.0.mlp.experts" in plan.ignore and "model.layers.1.mlp.experts" in plan.ignore
    assert not any(".experts.0." in n for n in plan.ignore)
    assert "model.layers.0.mlp.experts.gate_up_proj" in {n for n, _, _ in plan.output_tensors}


def test_experts_the_scheme_cannot_take(tmp_path):
    t = {"model.layers.0.mlp.experts.gate_up_proj": bf(E, 2 * 96, 96), "model.layers.0.mlp.experts.down_proj": bf(E, 96, 96)}
    t["model.layers.0.self_attn.o_proj.weight"] = bf(128, 128)
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "gemma4_text", "hidden_size": 96}))
    with pytest.raises(UnsupportedError, match="K=96 is not a multiple of the group size 128") as e:
        make_plan(ck, "W4A16")
    assert e.value.tensor == "model.layers.0.mlp.experts.down_proj" and "its per-expert part model.layers.0.mlp.experts.0.down_proj.weight" in e.value.message
    plan = make_plan(ck, "W4A16", skip_incompatible=True)
    # vLLM picks a fused-MoE layer's method from <experts>.0.gate_proj/up_proj/down_proj: the pattern makes it unquantized
    probe = r"re:model\.layers\.0\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
    assert plan.ignore == ["model.layers.0.mlp.experts", probe] and not plan.views
    assert sorted(plan.notes) == [
        f"model.layers.0.mlp.experts.{m}: K=96 is not a multiple of the group size 128 of W4A16; kept dense and listed in ignore"
        for m in ("down_proj", "gate_up_proj")
    ]


def test_experts_partly_dense_are_split_whole(tmp_path):
    """down_proj ignored, gate/up quantized: the whole experts module is written per expert (no loader may see it
    half fused), the dense parts listed one by one, the experts module itself not."""
    plan = make_plan(_gpt_oss(tmp_path), "W4A16", allow_unloadable=True, targets=EXPERTS, ignore=[r"re:.*experts\.\d+\.down_proj$"])
    rows = {r.name: r for r in plan.rows}
    assert rows["model.layers.0.mlp.experts.down_proj"].action == "split" and plan.quantized_modules == 2 * (1 + 2 * E)
    assert rows["model.layers.0.mlp.experts.1.down_proj.weight"].action == "ignore"
    assert "model.layers.0.mlp.experts.1.down_proj" in plan.ignore and "model.layers.0.mlp.experts" not in plan.ignore


@pytest.mark.parametrize(
    "router",
    ["mlp.gate", "block_sparse_moe.gate", "mlp.router", "router.proj", "feed_forward.router", "mlp.shared_expert_gate", "block_sparse_moe.router.layer"],
)
def test_routers_stay_dense_and_are_listed(tmp_path, router):
    t = {f"model.layers.0.{router}.weight": bf(E, H), "model.layers.0.mlp.gate.e_score_correction_bias": bf(E), "model.layers.0.o_proj.weight": bf(H, H)}
    plan = make_plan(open_checkpoint(write_checkpoint(tmp_path / "m", t, {})), "FP8_DYNAMIC")
    rows = {r.name: r for r in plan.rows}
    assert rows[f"model.layers.0.{router}.weight"].action == "ignore" and rows[f"model.layers.0.{router}.weight"].reason == "router (default)"
    assert rows["model.layers.0.mlp.gate.e_score_correction_bias"].reason == "router parameter"
    assert plan.ignore == [f"model.layers.0.{router}"]


def test_an_explicit_target_beats_the_defaults(minilm_path):
    ck = open_checkpoint(minilm_path)
    assert make_plan(ck, "W8A16").ignore == ["pooler.dense"]
    plan = make_plan(ck, "W8A16", targets=["Linear", "pooler.dense"])
    assert plan.ignore == [] and plan.quantized_modules == 37 and plan.defaults == {}
    assert {r.name: r.action for r in plan.rows}["pooler.dense.weight"] == "quantize"
    assert plan.config_groups["group_0"][1] == ["Linear", "pooler.dense"]


def test_no_default_ignore_drops_every_default(tmp_path):
    t = {
        "lm_head.weight": bf(256, H),
        "model.layers.0.mlp.gate.weight": bf(128, H),
        "model.layers.0.mlp.gate_proj.weight": bf(I, H),
        "model.visual.blocks.0.attn.qkv.weight": bf(3 * H, H),
        "model.layers.2.mlp.gate_proj.weight": bf(I, H),  # MTP: past num_hidden_layers, one of num_nextn_predict_layers
        "model.layers.2.enorm.weight": bf(H),  # (an MTP layer's own norm: without it, a decoder layer the count left out)
        "proj_out.weight": bf(H, H),  # outside the blocks
    }
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    plan = make_plan(ck, "FP8_DYNAMIC")
    assert plan.quantized_modules == 1
    assert plan.defaults == {"lm_head": 1, "router": 1, "vision": 1, "MTP layer; --quantize-mtp quantizes it": 1, "Linear outside the transformer blocks": 1}
    assert set(plan.ignore) == {"lm_head", "model.layers.0.mlp.gate", "model.visual.blocks.0.attn.qkv", "model.layers.2.mlp.gate_proj", "proj_out"}
    plan = make_plan(ck, "FP8_DYNAMIC", quantize_mtp=True)
    assert plan.quantized_modules == 2 and "model.layers.2.mlp.gate_proj" not in plan.ignore
    with pytest.raises(UnsupportedError) as e:  # the head only Linear takes: vLLM 0.33 matches it by name, builds it dense
        make_plan(ck, "FP8_DYNAMIC", default_ignore=False)
    assert "'lm_head.weight'" in str(e.value) and "--lm-head" in e.value.message and "--allow-unloadable" in e.value.message
    plan = make_plan(ck, "FP8_DYNAMIC", default_ignore=False, targets=["Linear", "lm_head"])  # named: vLLM finds its group
    assert plan.quantized_modules == 6 and plan.ignore == [] and plan.defaults == {}
    plan = make_plan(ck, "FP8_DYNAMIC", default_ignore=False, allow_unloadable=True)
    assert plan.quantized_modules == 6 and plan.ignore == [] and plan.defaults == {}


def test_a_vision_tower_can_be_targeted(tmp_path):
    t = {"model.visual.blocks.0.attn.qkv.weight": bf(3 * H, H), "model.language_model.layers.0.mlp.up_proj.weight": bf(I, H)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {}))
    assert make_plan(ck, "FP8_DYNAMIC").ignore == ["model.visual.blocks.0.attn.qkv"]
    plan = make_plan(ck, "FP8_DYNAMIC", targets=["Linear", r"re:.*visual\.blocks\.\d{1,3}\..*"])  # a comma inside the pattern
    assert plan.quantized_modules == 2 and plan.ignore == []


def test_an_unclassified_tensor_is_an_error_naming_it(tmp_path):
    ck = _gpt_oss(tmp_path, **{"model.layers.0.mlp.mystery": bf(4, H)})
    with pytest.raises(UnsupportedError, match="cannot classify this 2-D BF16 tensor") as e:
        make_plan(ck, "W4A16")
    assert e.value.tensor == "model.layers.0.mlp.mystery" and str(e.value.file).endswith("model.safetensors")
    plan = make_plan(ck, "W4A16", keep_unclassified=True)
    row = {r.name: r for r in plan.rows}["model.layers.0.mlp.mystery"]
    assert row.action == "ignore" and "--keep-unclassified" in row.reason
    assert "model.layers.0.mlp" in plan.ignore and any("model.layers.0.mlp.mystery" in n and "no rule classifies" in n for n in plan.notes)
    plan = make_plan(ck, "W4A16", ignore=["re:.*mlp$"])
    assert {r.name: r for r in plan.rows}["model.layers.0.mlp.mystery"].reason == "--ignore re:.*mlp$"


def test_fused_experts_of_an_unknown_family_can_be_kept_with_keep_unclassified(tmp_path):
    t = {"model.layers.0.mlp.experts.gate_up_proj": bf(E, 2 * I, H), "model.layers.0.self_attn.o_proj.weight": bf(H, H)}
    ck = open_checkpoint(write_checkpoint(tmp_path / "m", t, {"model_type": "brand_new_moe"}))
    with pytest.raises(UnsupportedError, match="not in ctconvert's family table"):
        make_plan(ck, "W4A16")
    plan = make_plan(ck, "W4A16", keep_unclassified=True)
    assert plan.ignore == ["model.layers.0.mlp.experts"] and plan.quantized_modules == 1
    assert any("fused experts not split" in n for n in plan.notes)


def test_deepseek_mla_shared_experts_dense_first_layer_and_mtp(tmp_path):
    t = {}
    for layer in range(3):  # layer 2 is the MTP layer of a 2-layer model
        p = f"model.layers.{layer}."
        for m, shape in {"q_a_proj": (H, H), "q_b_proj": (2 * H, H), "kv_a_proj_with_mqa": (H + 64, H), "kv_b_proj": (2 * H, H), "o_proj": (H, 2 * H)}.items():
            t[p + f"self_attn.{m}.weight"] = bf(*shape)
        t[p + "self_attn.q_a_layernorm.weight"] = bf(H)
        if layer == 0:
            t.update({p + f"mlp.{m}.weight": bf(I, H) for m in ("gate_proj", "up_proj")} | {p + "mlp.down_proj.weight": bf(H, I)})
        else:
            t[p + "mlp.gate.weight"] = bf(E, H)
            t[p + "mlp.gate.e_score_correction_bias"] = bf(E)
            for e in range(E):
                t.update({p + f"mlp.experts.{e}.{m}.weight": bf(I, H) for m in ("gate_proj", "up_proj")} | {p + f"mlp.experts.{e}.down_proj.weight": bf(H, I)})
            t.update({p + f"mlp.shared_experts.{m}.weight": bf(I, H) for m in ("gate_proj", "up_proj")} | {p + "mlp.shared_experts.down_proj.weight": bf(H, I)})
    t["model.layers.2.eh_proj.weight"] = bf(H, 2 * H)
    t["model.layers.2.shared_head.head.weight"] = bf(256, H)
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1}
    plan = make_plan(open_checkpoint(write_checkpoint(tmp_path / "m", t, cfg)), "NVFP4A16")
    rows = {r.name: r for r in plan.rows}
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        assert all(rows[p + m + ".weight"].action == "quantize" for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
        assert rows[p + "q_a_proj.weight"].fused_set == p[:-1] + ".{q_a_proj,kv_a_proj_with_mqa}"
    assert rows["model.layers.0.mlp.gate_proj.weight"].action == "quantize"  # the dense first layer
    assert rows["model.layers.1.mlp.shared_experts.up_proj.weight"].action == "quantize"
    assert rows["model.layers.1.mlp.experts.3.down_proj.weight"].action == "quantize"
    mtp = [r for r in plan.rows if r.name.startswith("model.layers.2.") and r.name.endswith("proj.weight")]
    assert mtp and all(r.action == "ignore" and r.reason.startswith("MTP layer") for r in mtp)
    assert rows["model.layers.2.shared_head.head.weight"].action == "ignore"
    dense_mtp = {r.name[: -len(".weight")] for r in plan.rows if r.name.startswith("model.layers.2.") and r.action == "ignore"}
    assert {m for m in plan.ignore if m.startswith("model.layers.2.")} == dense_mtp
    assert "model.layers.1.mlp.gate" in plan.ignore
    plan = make_plan(open_checkpoint(tmp_path / "m"), "NVFP4A16", quantize_mtp=True)
    # vLLM 0.33 deepseek_mtp.py builds eh_proj as a torch nn.Linear and shared_head.head as a ParallelLMHead named
    # model.layers.2.head (no target matches it): both load only dense; the router stays dense; the decoder block
    # (built with the quantization config under the checkpoint's names) is quantized
    assert sorted(m for m in plan.ignore if m.startswith("model.layers.2.")) == [
        "model.layers.2.eh_proj",
        "model.layers.2.mlp.gate",
        "model.layers.2.shared_head.head",
    ]
    rows = {r.name: r for r in plan.rows}
    assert rows["model.layers.2.eh_proj.weight"].reason.startswith("MTP eh_proj: vLLM 0.33 deepseek_mtp.py / glm4_moe_mtp.py build it as a plain")
    assert rows["model.layers.2.shared_head.head.weight"].reason.startswith("MTP shared_head.head: vLLM 0.33")
    mtp_block = [n for n in rows if n.startswith("model.layers.2.") and ("self_attn." in n or "experts" in n) and n.endswith("proj.weight")]
    assert mtp_block and all(rows[n].action == "quantize" for n in mtp_block)
    assert rows["model.layers.2.self_attn.q_a_proj.weight"].fused_set == "model.layers.2.self_attn.{q_a_proj,kv_a_proj_with_mqa}"
    forced = make_plan(open_checkpoint(tmp_path / "m"), "NVFP4A16", quantize_mtp=True, targets=["Linear", "model.layers.2.eh_proj"])
    assert "model.layers.2.eh_proj" not in forced.ignore  # an explicit target still quantizes it
    # calibration runs the model's decoder layers only, never the MTP layer: a scheme with calibrated activation
    # scales cannot quantize it (the run would stop at "no calibration token reached ..."); refused in the plan
    with pytest.raises(UsageError, match=r"--quantize-mtp with NVFP4: the MTP layer \(model\.layers\.2\..* needs calibrated activation scales"):
        make_plan(open_checkpoint(tmp_path / "m"), "NVFP4", quantize_mtp=True)
    assert make_plan(open_checkpoint(tmp_path / "m"), "NVFP4").quantized_modules  # without --quantize-mtp: the MTP layer stays dense


def test_cli_options(tmp_path):
    """--keep-unclassified, --no-default-ignore and --quantize-mtp reach the plan; an unclassified tensor is a one-line
    error naming it (exit 4)."""
    import json

    from click.testing import CliRunner

    from ctconvert.cli import main

    mtp = {"num_nextn_predict_layers": 1}  # (layer 2: an MTP layer the config declares)
    extra = {"model.layers.0.mlp.mystery": bf(4, H), "model.layers.2.mlp.gate_proj.weight": bf(I, H), "model.layers.2.enorm.weight": bf(H)}
    ck = _gpt_oss(tmp_path, mtp, **extra)

    def run(*args):
        r = CliRunner().invoke(main, ["--json", "quantize", str(ck.path), "-s", "FP8_DYNAMIC", "--dry-run", *args])
        return r.exit_code, r.stdout, r.stderr

    code, _, err = run()
    assert code == 4 and "model.layers.0.mlp.mystery" in err and "--keep-unclassified" in err and "Traceback" not in err
    code, out, _ = run("--keep-unclassified")
    doc = json.loads(out)["plan"]
    assert code == 0 and "model.layers.0.mlp" in doc["ignore"] and "model.layers.2.mlp.gate_proj" in doc["ignore"]
    gpt_oss = next(k for k in doc["defaults_applied"] if k.startswith("gpt-oss experts: vLLM 0.33 cannot load them quantized"))
    assert doc["defaults_applied"] == {"router": 2, "lm_head": 1, "MTP layer; --quantize-mtp quantizes it": 1, gpt_oss: 2 * 3 * E}
    code, out, _ = run("--keep-unclassified", "--quantize-mtp")
    assert code == 0 and "model.layers.2.mlp.gate_proj" not in json.loads(out)["plan"]["ignore"]
    code, out, _ = run("--keep-unclassified", "--no-default-ignore")  # the routers and experts vLLM 0.33 builds unquantized
    err = json.loads(out)["error"]
    assert code == 4 and "vLLM 0.33" in err and "--allow-unloadable" in err  # the first: the head, which only Linear takes
    code, out, _ = run("--keep-unclassified", "--no-default-ignore", "--allow-unloadable")
    doc = json.loads(out)["plan"]
    assert code == 0 and doc["ignore"] == ["model.layers.0.mlp"] and doc["defaults_applied"] == {}


def test_split_experts_refresh_and_provenance(tmp_path):
    """--refresh hashes the per-expert parts as it hashed them while streaming (nothing to redo); provenance names
    the stored tensor each part is a slice of."""
    import json

    from ctconvert import api

    ck = _gpt_oss(tmp_path)
    out = tmp_path / "q"
    api.quantize(ck.path, out, "NVFP4A16", targets=EXPERTS, allow_unloadable=True)
    prov = json.loads((out / "ctconvert-provenance.json").read_text())["tensors"]
    src = prov["model.layers.1.mlp.experts.3.up_proj.weight_packed"]
    assert {s["slice_of"] for s in src} == {"model.layers.1.mlp.experts.gate_up_proj"}  # gate and up: one global scale
    assert {s["tensor"] for s in src} == {"model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"}
    res = api.quantize(ck.path, out, "NVFP4A16", targets=EXPERTS, allow_unloadable=True, refresh=True)
    assert res.rewritten_shards == []


def test_a_refused_unloadable_module_is_met_with_one_ignore_entry_for_every_layer(tmp_path):
    """The refusal of modules vLLM 0.33 cannot load quantized suggests one ignore pattern for every layer and expert
    (not layer 0's name, which would leave the next layer to refuse), and that entry, given, plans."""
    import re

    ck = _gpt_oss(tmp_path)
    for targets in (EXPERTS, ["Linear", r"re:.*mlp\.router$"]):
        with pytest.raises(UnsupportedError) as e:
            make_plan(ck, "W4A16", targets=targets)
        entry = re.search(r"--ignore '([^']+)'", e.value.message).group(1)
        assert entry in (r"re:model\.layers\.\d+\.mlp\.experts.*", r"re:model\.layers\.\d+\.mlp\.router$"), entry
        plan = make_plan(ck, "W4A16", targets=targets, ignore=[entry])
        assert plan.quantized_modules > 0 and entry in plan.ignore
        assert not [r for r in plan.rows if r.action == "quantize" and (".experts." in r.name or ".router." in r.name)]


def test_a_recipes_ignore_may_name_an_expert_split_from_fused_experts(tmp_path):
    """A recipe's ignore entry naming a per-expert module of fused 3-D experts (``experts.0.down_proj``) names a module
    of the plan: that expert stays dense, and the config's ignore lists only what is dense (it was dropped before
    the plan and written to the config anyway, beside the expert's quantized tensors: verify refused the output)."""
    from ctconvert import api

    rest = {f"model.layers.{i}.self_attn.{p}_proj.{w}": bf(H, H) if w == "weight" else bf(H) for i in range(2) for p in "kvo" for w in ("weight", "bias")}
    rest |= {f"model.layers.{i}.{n}_layernorm.weight": bf(H) for i in range(2) for n in ("input", "post_attention")}
    ck = _gpt_oss(tmp_path, **rest)  # every parameter of gpt_oss.py's TransformerBlock: verify judges each layer's set
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
        '      ignore: ["lm_head", "re:.*router$", "model.layers.0.mlp.experts.0.down_proj"]\n'
        "      config_groups:\n        g:\n          targets: [Linear]\n"
        "          weights: {num_bits: 4, type: int, symmetric: true, group_size: 32, strategy: group}\n"
    )
    res = api.quantize(ck.path, tmp_path / "out", None, recipe=recipe, allow_unloadable=True)
    rows = {r.name: r for r in res.plan.rows}
    assert rows["model.layers.0.mlp.experts.0.down_proj.weight"].action == "ignore"
    assert rows["model.layers.0.mlp.experts.1.down_proj.weight"].action == "quantize"
    report = api.verify(tmp_path / "out")
    assert all("cannot load" in p["message"] for p in report["problems"] if p["severity"] == "error"), report["problems"]


def test_a_recipe_group_that_quantizes_nothing_is_noted(tmp_path):
    """gpt-oss's experts refused and kept dense (--skip-incompatible): the recipe's MLP group then takes no module and
    is left out of the config, which the plan says instead of leaving the user to find the scheme missing."""
    from ctconvert import api

    ck = _gpt_oss(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n"
        '      ignore: ["lm_head", "re:.*router$"]\n      config_groups:\n'
        '        mlp:\n          targets: ["re:.*(gate|up|down)_proj$"]\n'
        "          weights: {num_bits: 4, type: int, symmetric: true, group_size: 32, strategy: group}\n"
        "        rest:\n          targets: [Linear]\n"
        "          weights: {num_bits: 4, type: int, symmetric: true, group_size: 16, strategy: group}\n"
    )
    res = api.quantize(ck.path, None, None, recipe=recipe, skip_incompatible=True, dry_run=True)
    assert list(res.plan.config_groups) == ["rest"]
    assert "config group 'mlp' quantizes no module (its targets take none, or only modules kept dense): left out of the config" in res.plan.notes
    full = api.quantize(ck.path, None, None, recipe=recipe, allow_unloadable=True, dry_run=True)
    assert list(full.plan.config_groups) == ["mlp", "rest"] and not [n for n in full.plan.notes if "quantizes no module" in n]


def test_copied_tensors_say_what_they_are_rotary_buffers_apart_from_embeddings(tmp_path):
    """A saved RoPE buffer (an older checkpoint's ``rotary_emb.inv_freq``) is copied as a rotary embedding buffer, not
    labelled an embedding; embeddings, norms and the other copies keep their reasons."""
    inv = torch.arange(0, H, 2, dtype=torch.float32) / H
    ck = _gpt_oss(tmp_path, **{"model.layers.0.self_attn.rotary_emb.inv_freq": inv, "model.rotary_emb.inv_freq": inv.clone()})
    rows = {r.name: r for r in make_plan(ck, "W4A16").rows}
    for name in ("model.layers.0.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq"):
        assert rows[name].action == "copy" and rows[name].reason == "rotary embedding buffer", rows[name]
    assert rows["model.embed_tokens.weight"].reason == "embedding" and rows["model.norm.weight"].reason == "norm"


def _qwen3_moe(tmp_path, k_down: int):
    """A Qwen3-MoE whose experts' down_proj has K = ``k_down`` (its moe_intermediate_size)."""
    t = {"model.embed_tokens.weight": bf(256, H), "model.norm.weight": bf(H), "lm_head.weight": bf(256, H)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = bf(H, H)
        t[p + "mlp.gate.weight"] = bf(E, H)
        for x in range(E):
            q = f"{p}mlp.experts.{x}."
            t.update({q + "gate_proj.weight": bf(k_down, H), q + "up_proj.weight": bf(k_down, H), q + "down_proj.weight": bf(H, k_down)})
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": H,
        "num_experts": E,
        "num_hidden_layers": 2,
        "moe_intermediate_size": k_down,
    }
    return write_checkpoint(tmp_path / "moe", t, cfg)


def test_an_expert_the_group_does_not_fit_is_met_with_advice_that_works(tmp_path):
    """An expert whose K the preset's group size does not divide (Qwen3-MoE down_proj, K=64, W4A16's 128): ignoring
    that expert only moves the refusal to the next one and --skip-incompatible leaves the experts quantized unlike
    each other, so the refusal names neither; it names one ignore pattern for the block's experts in every layer and
    a --group-size that divides K, and each of them, given, plans."""
    import re

    from ctconvert import api

    src = _qwen3_moe(tmp_path, 64)
    with pytest.raises(UnsupportedError) as e:
        api.quantize(src, tmp_path / "o1", "W4A16")
    msg = e.value.message
    assert "K=64 is not a multiple of the group size 128" in msg and "--skip-incompatible" not in msg
    entry = re.search(r"--ignore '([^']+)'", msg).group(1)
    assert entry == r"re:model\.layers\.\d+\.mlp\.experts.*" and "--group-size 64" in msg
    dry = api.quantize(src, None, "W4A16", dry_run=True)  # the dry run's rows and notes say the same, not --skip-incompatible
    stopped = [r.reason for r in dry.plan.rows if r.reason and "the run stops here" in r.reason]
    assert stopped and all("experts dense in every layer" in r and "--skip-incompatible" not in r for r in stopped)
    assert not [n for n in dry.notes if "--skip-incompatible" in n]
    res = api.quantize(src, tmp_path / "o2", "W4A16", ignore=[entry])
    assert not [r for r in res.plan.rows if r.action == "quantize" and ".experts." in r.name]
    res = api.quantize(src, tmp_path / "o3", "W4A16", group_size=64)
    assert [r for r in res.plan.rows if r.action == "quantize" and r.name.endswith("experts.3.down_proj.weight")]
    with pytest.raises(UsageError, match="quantized unlike each other"):  # what the refusal no longer suggests does not work
        api.quantize(src, tmp_path / "o4", "W4A16", skip_incompatible=True)
    with pytest.raises(UnsupportedError) as e:  # FP8_BLOCK: K=64 is not a whole block, and it has no --group-size
        api.quantize(src, tmp_path / "o5", "FP8_BLOCK")
    assert "--group-size" not in e.value.message and "--ignore 're:model" in e.value.message
