"""config.json's layer and expert counts against the stored tensors (ctconvert/checkpoint/depth.py), unit and through verify."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctconvert import api
from ctconvert.checkpoint.depth import COUNTS_CHECK, SIZE_KEYS, expert_count_problems, layer_count_problems
from ctconvert.checkpoint.safetensors_io import TensorInfo

from conftest import moe_checkpoint


def _infos(shapes: dict[str, tuple[int, ...]]) -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, Path("model.safetensors"), "BF16", s, 0, 2 * max(1, len(s))) for n, s in shapes.items()}


def _stack(prefix: str, layers, experts: dict[int, list[int]] | None = None) -> dict[str, tuple[int, ...]]:
    """Names of a decoder stack: the embedding, ``layers`` (indices) each with a norm, and per-expert Linears."""
    out = {f"{prefix}embed_tokens.weight": (32, 8), "lm_head.weight": (32, 8)}
    for i in layers:
        out[f"{prefix}layers.{i}.input_layernorm.weight"] = (8,)
        for e in (experts or {}).get(i, []):
            out[f"{prefix}layers.{i}.mlp.experts.{e}.down_proj.weight"] = (8, 4)
    return out


@pytest.mark.parametrize("prefix", ["model.", "model.language_model.", "language_model.model."])
def test_layer_counts(prefix):
    """Every index below num_hidden_layers must be stored and none past it but the MTP layers; the message names them."""
    rng = random.Random(7)
    n = rng.randint(3, 40)
    assert layer_count_problems({"num_hidden_layers": n}, _infos(_stack(prefix, range(n)))) == []
    assert layer_count_problems({"text_config": {"num_hidden_layers": n}, "num_hidden_layers": 1}, _infos(_stack(prefix, range(n)))) == []
    gone = sorted(rng.sample(range(n), 2))
    (p,) = layer_count_problems({"num_hidden_layers": n}, _infos(_stack(prefix, [i for i in range(n) if i not in gone])), "cfg")
    assert p.severity == "error" and p.file == "cfg" and f"num_hidden_layers is {n}" in p.message and "2 of them" in p.message
    assert all(str(g) in p.message for g in gone)
    (p,) = layer_count_problems({"num_hidden_layers": n - 2}, _infos(_stack(prefix, range(n))))  # the config shrunk by hand
    assert f"stores 2 layers past them ({n - 2}..{n - 1})" in p.message and "refuses" in p.message
    (p,) = layer_count_problems({"num_hidden_layers": n + 1}, _infos(_stack(prefix, range(n))))
    assert f"1 of them ({n}) has no tensors" in p.message and "random weights" in p.message
    mtp = {"num_hidden_layers": n - 1, "num_nextn_predict_layers": 1}  # DeepSeek-V3's MTP layer after the decoder: stored or not
    names = _stack(prefix, range(n))
    names[f"{prefix}layers.{n - 1}.eh_proj.weight"] = (8, 16)  # an MTP layer stored after the decoder (its own eh_proj)
    assert layer_count_problems(mtp, _infos(names)) == layer_count_problems(mtp, _infos(_stack(prefix, range(n - 1)))) == []
    (p,) = layer_count_problems(dict(mtp, num_hidden_layers=n - 2), _infos(names))
    assert f"1 layer past them ({n - 1}) (after the decoder, num_nextn_predict_layers 1 MTP layers may be stored)" in p.message
    (p,) = layer_count_problems(mtp, _infos(_stack(prefix, range(n))))  # the count shrunk by one: a decoder layer, no MTP layer
    assert f"layer {n - 1} past them holds no eh_proj/enorm/hnorm/shared_head, so it is no MTP layer" in p.message
    (p,) = layer_count_problems(dict(mtp, num_hidden_layers=n, num_nextn_predict_layers=0), _infos(names))  # counted as a decoder layer
    assert f"layer {n - 1} holds an MTP layer's eh_proj" in p.message
    (p,) = layer_count_problems({"num_hidden_layers": 0}, _infos(_stack(prefix, range(2))))
    assert "num_hidden_layers is 0, but" in p.message and "stores 2 layers past them (0..1)" in p.message


def test_layer_counts_judge_only_the_text_decoder():
    """A vision tower's layers and MTP modules under their own prefix are not the decoder's; no embedding or no
    num_hidden_layers: nothing judged."""
    names = _stack("model.language_model.", range(4))
    names.update({f"model.vision_tower.encoder.layers.{i}.norm.weight": (8,) for i in range(9)})
    names.update({"mtp.layers.0.norm.weight": (8,), "model.mtp_layers.0.norm.weight": (8,)})
    assert layer_count_problems({"text_config": {"num_hidden_layers": 4}, "vision_config": {"num_hidden_layers": 9}}, _infos(names)) == []
    assert layer_count_problems({}, _infos(names)) == []
    no_emb = {n: s for n, s in names.items() if "embed_tokens" not in n}
    assert layer_count_problems({"text_config": {"num_hidden_layers": 2}}, _infos(no_emb)) == []
    assert layer_count_problems({"num_hidden_layers": 2}, _infos({"embeddings.word_embeddings.weight": (32, 8), "encoder.layer.0.x.weight": (8,)})) == []


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts", "n_routed_experts"])
def test_expert_counts(key):
    """Each per-expert block holds experts 0..n-1 exactly; each fused 3-D weight has n rows; dense layers (no experts) are not MoE blocks."""
    rng = random.Random(11)
    n = rng.randint(3, 64)
    experts = {0: [], 1: list(range(n)), 2: list(range(n))}  # layer 0 dense (DeepSeek's first_k_dense_replace)
    assert expert_count_problems({key: n}, _infos(_stack("model.", range(3), experts))) == []
    assert expert_count_problems({"text_config": {key: n}}, _infos(_stack("model.", range(3), experts))) == []
    assert expert_count_problems({}, _infos(_stack("model.", range(3), experts))) == []
    (p,) = expert_count_problems({key: n + 4}, _infos(_stack("model.", range(3), experts)), "cfg")
    assert (
        f"{key} is {n + 4}" in p.message
        and "2 of 2 MoE blocks stored per expert do not hold" in p.message
        and f"model.layers.1.mlp.experts holds {n} (0..{n - 1})" in p.message
    )
    gap = {**experts, 2: [e for e in range(n) if e != n // 2]}
    (p,) = expert_count_problems({key: n}, _infos(_stack("model.", range(3), gap)))
    assert "1 of 2 MoE blocks stored per expert does not hold" in p.message and f"model.layers.2.mlp.experts holds {n - 1}" in p.message
    fused = _stack("model.", range(2))
    fused.update({f"model.layers.{i}.mlp.experts.gate_up_proj": (n, 8, 16) for i in range(2)})
    fused.update({f"model.layers.{i}.mlp.experts.down_proj": (n, 8, 8) for i in range(2)})
    fused.update({f"model.layers.{i}.mlp.experts.gate_up_proj_bias": (n, 16) for i in range(2)})
    assert expert_count_problems({key: n}, _infos(fused)) == []
    (p,) = expert_count_problems({key: n - 1}, _infos(fused))
    assert "4 of 4 fused expert weights" in p.message and f"model.layers.0.mlp.experts.down_proj holds {n}" in p.message


def test_every_expert_key_is_compared_and_counts_must_be_integers():
    """A config holding two expert keys (transformers maps one onto the other) is judged on each; a count written as a
    string, a float or a boolean is an error of its own (vLLM refuses the config), and is not read as a count."""
    from ctconvert.checkpoint.depth import count_type_problems

    names = _infos(_stack("model.", range(2), {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}))
    assert expert_count_problems({"num_experts": 4, "num_local_experts": 4}, names) == []
    (p,) = expert_count_problems({"num_experts": 4, "num_local_experts": 8}, names)
    assert "num_local_experts is 8" in p.message
    assert len(expert_count_problems({"text_config": {"num_experts": 2}, "n_routed_experts": 8}, names)) == 2
    for bad in ("4", 4.0, True):
        (p,) = count_type_problems({"text_config": {"num_experts": bad}}, "cfg")
        assert p.message.startswith(f"config.json's text_config.num_experts is {json.dumps(bad)}, not an integer") and p.file == "cfg"
        assert expert_count_problems({"num_experts": bad}, names) == [] and layer_count_problems({"num_hidden_layers": bad}, names) == []
    assert count_type_problems({"num_hidden_layers": 2, "num_experts": 4, "num_nextn_predict_layers": None}) == []


@pytest.mark.parametrize(
    "key", ["hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"]
)
@pytest.mark.parametrize("reference", [False, True])
def test_a_size_that_is_not_an_integer_fails_verify(tiny_llama, tmp_path, key, reference):
    """A size written as a float equal to the tensors' (``256.0``), a string or a boolean: vLLM refuses the config
    (a trial's ``hidden_size: 256.0`` passed verify, with or without a reference, as 256.0 == 256); an error naming the
    key, with or without a reference, the config written as a writer would (its record too: the check is this one)."""
    from ctconvert.checkpoint.depth import count_type_problems

    from conftest import save_config

    assert key in SIZE_KEYS
    out = tmp_path / "out"
    api.quantize(tiny_llama, out, "W4A16")
    cfg = json.loads((out / "config.json").read_text())
    good = cfg.get(key, 64)
    for bad in (float(good), str(good), True):
        (p,) = count_type_problems({key: bad}, "cfg")
        assert p.message.startswith(f"config.json's {key} is {json.dumps(bad)}, not an integer") and p.file == "cfg"
    save_config(out, {**cfg, key: float(good)})
    errors = _errors(api.verify(out, tiny_llama if reference else None))
    assert any(p["message"].startswith(f"config.json's {key} is {float(good)}, not an integer") for p in errors), errors
    assert count_type_problems({**cfg, key: good}) == [] and count_type_problems({key: None}) == []


def _errors(report: dict) -> list[dict]:
    return [p for p in report["problems"] if p["severity"] == "error"]


@pytest.mark.parametrize("edit", ["num_experts", "num_hidden_layers"])
@pytest.mark.parametrize("reference", [False, True])
def test_verify_fails_a_config_whose_counts_the_tensors_contradict(tmp_path, edit, reference):
    """The trial's edits: num_experts or num_hidden_layers changed in config.json after the run (vLLM refuses the
    output) fail verify with and without --reference (exit 5), naming config.json; the unedited output passes."""
    from ctconvert.cli import main

    src = moe_checkpoint(tmp_path)
    out = tmp_path / "out"
    api.quantize(src, out, "W4A16")
    ref = src if reference else None
    report = api.verify(out, ref)
    assert report["ok"] and COUNTS_CHECK in report["checked"]["checks"], _errors(report)
    cfg = json.loads((out / "config.json").read_text())
    cfg[edit] += 1 if edit == "num_experts" else -1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    errors = _errors(api.verify(out, ref))
    assert any(f"config.json's {edit} is" in p["message"] and p["file"].endswith("config.json") for p in errors), errors
    args = ["verify", str(out), *(["--reference", str(src)] if reference else [])]
    assert CliRunner().invoke(main, args).exit_code == 5


# ---- the vision tower's depth (vision_depth_problems) ----

#: (model_type, the stored block stack's prefix, the vision_config depth key) of each judged family, as its HF checkpoints
#: name the blocks (transformers 4 and 5 namings where they differ)
VISION_FAMILIES = [
    ("qwen2_vl", "visual.blocks.", "depth"),
    ("qwen2_vl", "model.visual.blocks.", "depth"),
    ("qwen2_5_vl", "visual.blocks.", "depth"),
    ("qwen3_vl", "model.visual.blocks.", "depth"),
    ("qwen3_vl_moe", "model.visual.blocks.", "depth"),
    ("llama4", "vision_model.model.layers.", "num_hidden_layers"),
    ("gemma3", "vision_tower.vision_model.encoder.layers.", "num_hidden_layers"),
    ("gemma3", "model.vision_tower.vision_model.encoder.layers.", "num_hidden_layers"),
    ("gemma3", "vision_tower.encoder.layers.", "num_hidden_layers"),  # as transformers 5.25 saves it
    ("llava", "vision_tower.vision_model.encoder.layers.", "num_hidden_layers"),
    ("llava_next", "model.vision_tower.vision_model.encoder.layers.", "num_hidden_layers"),
    ("llava_next_video", "vision_tower.vision_model.encoder.layers.", "num_hidden_layers"),
    ("llava", "vision_tower.encoder.layers.", "num_hidden_layers"),
    ("llava_onevision", "model.vision_tower.vision_model.encoder.layers.", "num_hidden_layers"),
]


def _vlm(model_type: str, prefix: str, key: str, depth, blocks, **extra) -> tuple[dict, dict[str, TensorInfo]]:
    """A VLM's config (vision depth ``depth`` under ``key``) and tensors: a 2-layer text decoder and vision ``blocks``."""
    names = _stack("model.language_model." if prefix.startswith("model.") else "language_model.model.", range(2))
    for i in blocks:
        names.update({f"{prefix}{i}.layer_norm1.weight": (8,), f"{prefix}{i}.mlp.fc1.weight": (16, 8)})
    names[prefix.split("blocks.")[0].split("layers.")[0] + "post_layernorm.weight"] = (8,)  # a tower tensor outside the stack
    config = {"model_type": model_type, "text_config": {"num_hidden_layers": 2}, "vision_config": {key: depth}, **extra}
    return config, _infos(names)


@pytest.mark.parametrize(("model_type", "prefix", "key"), VISION_FAMILIES)
def test_vision_depth_against_the_stored_blocks(model_type, prefix, key):
    """Each judged family: the stored blocks 0..n-1 and the config's depth agree (silent); the depth edited up or down,
    or a block's tensors deleted, is one error naming config.json, the key, its value and the stored indices."""
    from ctconvert.checkpoint.depth import vision_depth_problems

    n = random.Random(model_type).randint(4, 32)
    fl = {"vision_feature_layer": -1} if model_type.startswith("llava") else {}  # LLaVA built to its last layer: all n (below: -2)
    assert vision_depth_problems(*_vlm(model_type, prefix, key, n, range(n), **fl), "cfg") == []
    (p,) = vision_depth_problems(*_vlm(model_type, prefix, key, n + 2, range(n), **fl), "cfg")  # edited up
    assert p.severity == "error" and p.file == "cfg" and p.message.startswith(f"config.json's vision_config.{key} is {n + 2} (")
    assert f"stores vision blocks 0..{n - 1}" in p.message and f"2 of the {n + 2} blocks vLLM 0.33 builds ({n}..{n + 1}) have no tensors" in p.message
    (p,) = vision_depth_problems(*_vlm(model_type, prefix, key, n - 1, range(n), **fl), "cfg")  # edited down
    assert p.message.startswith(f"config.json's vision_config.{key} is {n - 1} ({prefix}0 .. {prefix}{n - 2};")
    assert f"1 of those stored ({n - 1}) is at or past {n - 1}" in p.message
    assert ("loader skips it" if model_type.startswith(("gemma3", "llava")) else "refuses the checkpoint") in p.message
    gone = n // 2  # a block's tensors deleted
    (p,) = vision_depth_problems(*_vlm(model_type, prefix, key, n, [i for i in range(n) if i != gone], **fl), "cfg")
    assert f"vision_config.{key} is {n}" in p.message and f"stores vision blocks 0..{gone - 1}, {gone + 1}..{n - 1}:" in p.message
    assert f"1 of the {n} blocks vLLM 0.33 builds ({gone}) has no tensors and would run with random weights" in p.message
    for bad in (str(n), float(n), True):
        (p,) = vision_depth_problems(*_vlm(model_type, prefix, key, bad, range(n), **fl), "cfg")
        assert p.message == f"config.json's vision_config.{key} is {json.dumps(bad)}, not an integer: vLLM cannot build the vision tower from it"


def test_vision_depth_in_count_problems_and_not_judged_elsewhere():
    """count_problems includes the rule (file: the folder's config.json); a text-only model, a config without the depth
    key, an unjudged family (Pixtral's naming, GLM-4V), or a checkpoint storing no block of the stack: nothing said."""
    from ctconvert.checkpoint.depth import count_problems, vision_depth_problems

    config, tensors = _vlm("qwen2_vl", "visual.blocks.", "depth", 5, range(4))
    (p,) = count_problems(config, tensors, "out")
    assert p.file == "out/config.json" and "vision_config.depth is 5" in p.message
    assert count_problems({"model_type": "qwen2", "num_hidden_layers": 2}, _infos(_stack("model.", range(2))), "out") == []
    assert vision_depth_problems({"model_type": "qwen2_vl", "vision_config": {"embed_dim": 8}}, tensors) == []
    assert vision_depth_problems({"model_type": "qwen2_vl", "vision_config": "x"}, tensors) == []
    assert vision_depth_problems({"model_type": ["qwen2_vl"], "vision_config": {"depth": 5}}, tensors) == []
    assert vision_depth_problems(*_vlm("glm4v", "model.visual.blocks.", "depth", 9, range(4))) == []
    assert vision_depth_problems(*_vlm("mistral3", "vision_tower.transformer.layers.", "num_hidden_layers", 9, range(4))) == []
    no_tower = {n: i for n, i in tensors.items() if not n.startswith("visual.")}
    assert vision_depth_problems(config, no_tower) == []
    assert vision_depth_problems(dict(config, vision_config={"depth": 4, "num_hidden_layers": 9}), tensors) == []  # depth read first
    assert vision_depth_problems(dict(config, vision_config={"num_hidden_layers": 4}), tensors) == []  # else num_hidden_layers
    assert len(vision_depth_problems(dict(config, vision_config={"depth": None, "num_hidden_layers": 9}), tensors)) == 1


def test_llava_builds_only_up_to_its_feature_layer():
    """vLLM 0.33 builds a LLaVA tower only up to vision_feature_layer (llava.py init_vision_tower_for_llava) and skips the
    stored layers past it: a released LLaVA (-2) may leave its last layer out, and an edit up by one changes nothing
    vLLM builds; a layer vLLM builds missing, or one stored past num_hidden_layers, is an error."""
    from ctconvert.checkpoint.depth import vision_depth_problems

    p = "vision_tower.vision_model.encoder.layers."
    for stored in (range(24), range(23)):  # -2 (the default where absent): vLLM builds 23 of 24
        assert vision_depth_problems(*_vlm("llava", p, "num_hidden_layers", 24, stored)) == []
        assert vision_depth_problems(*_vlm("llava", p, "num_hidden_layers", 24, stored, vision_feature_layer=-2)) == []
    assert vision_depth_problems(*_vlm("llava", p, "num_hidden_layers", 25, range(24))) == []  # vLLM builds 24, all stored
    (e,) = vision_depth_problems(*_vlm("llava", p, "num_hidden_layers", 25, range(23)))
    assert "1 of the 24 blocks vLLM 0.33 builds (23) has no tensors" in e.message
    (e,) = vision_depth_problems(*_vlm("llava", p, "num_hidden_layers", 26, range(24)))
    assert (
        "with vision_feature_layer -2, vLLM builds" in e.message and f"{p}0 .. {p}24;" in e.message and "1 of the 25 blocks vLLM 0.33 builds (24)" in e.message
    )
    (e,) = vision_depth_problems(*_vlm("llava", p, "num_hidden_layers", 23, range(24)))
    assert "vision_config.num_hidden_layers is 23" in e.message and "1 of those stored (23) is at or past 23: vLLM 0.33 builds no layer for it" in e.message
    (e,) = vision_depth_problems(*_vlm("llava_onevision", p, "num_hidden_layers", 24, range(23)))  # OneVision's default -1: all 24
    assert "1 of the 24 blocks vLLM 0.33 builds (23)" in e.message
    deepest = {"vision_feature_layer": [-2, -5, 3]}  # a list: up to the deepest
    assert vision_depth_problems(*_vlm("llava_next", p, "num_hidden_layers", 24, range(23), **deepest)) == []
    (e,) = vision_depth_problems(*_vlm("llava_next", p, "num_hidden_layers", 24, range(20), **deepest))
    assert "with vision_feature_layer [-2, -5, 3], vLLM builds" in e.message and "3 of the 23 blocks vLLM 0.33 builds (20..22)" in e.message
    for odd in ("-2", None, [], [True]):  # not judged
        assert vision_depth_problems(*_vlm("llava", p, "num_hidden_layers", 30, range(4), vision_feature_layer=odd)) == []


def test_verify_fails_a_vlm_whose_vision_depth_was_edited(tmp_path):
    """The trial, end to end: a tiny Qwen2-VL built and saved by transformers, quantized W4A16 on the CPU through the
    CLI, passes verify (exit 0); vision_config.depth edited in the output's config.json fails it (exit 5, naming the key)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from ctconvert.cli import main

    text = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    text.update(vocab_size=256, bos_token_id=1, eos_token_id=2, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    vision = {"depth": 3, "embed_dim": 32, "hidden_size": 128, "num_heads": 4, "mlp_ratio": 2}
    ids = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253}
    cfg = transformers.AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    src, out = tmp_path / "src", tmp_path / "out"
    transformers.AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16).save_pretrained(src)
    r = CliRunner().invoke(main, ["quantize", str(src), "-o", str(out), "--scheme", "W4A16", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 0 and COUNTS_CHECK in r.output, r.output
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["depth"] == 3
    for depth, what in ((2, "1 of those stored (2) is at or past 2"), (4, "1 of the 4 blocks vLLM 0.33 builds (3) has no tensors")):
        config["vision_config"]["depth"] = depth
        (out / "config.json").write_text(json.dumps(config, indent=2))
        r = CliRunner().invoke(main, ["verify", str(out)])
        assert r.exit_code == 5 and f"config.json's vision_config.depth is {depth}" in r.output and what in r.output, r.output
