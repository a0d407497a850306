"""config.json's layer and expert counts against the stored tensors (ctconvert/checkpoint/depth.py), unit and through verify."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from ctconvert import api
from ctconvert.checkpoint.depth import COUNTS_CHECK, expert_count_problems, layer_count_problems
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
    assert f"1 of them ({n})" in p.message and "random weights" in p.message
    mtp = {"num_hidden_layers": n - 1, "num_nextn_predict_layers": 1}  # DeepSeek-V3's MTP layer after the decoder: stored or not
    assert layer_count_problems(mtp, _infos(_stack(prefix, range(n)))) == layer_count_problems(mtp, _infos(_stack(prefix, range(n - 1)))) == []
    (p,) = layer_count_problems(dict(mtp, num_hidden_layers=n - 2), _infos(_stack(prefix, range(n))))
    assert f"1 layers past them ({n - 1}) (after the decoder, num_nextn_predict_layers 1 MTP layers may be stored)" in p.message
    names = _stack(prefix, range(n))
    names[f"{prefix}layers.{n - 1}.eh_proj.weight"] = (8, 16)  # an MTP layer stored after the decoder
    assert layer_count_problems(mtp, _infos(names)) == []
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
    assert f"{key} is {n + 4}" in p.message and "2 of 2 MoE blocks" in p.message and f"model.layers.1.mlp.experts holds {n} (0..{n - 1})" in p.message
    gap = {**experts, 2: [e for e in range(n) if e != n // 2]}
    (p,) = expert_count_problems({key: n}, _infos(_stack("model.", range(3), gap)))
    assert "1 of 2 MoE blocks" in p.message and f"model.layers.2.mlp.experts holds {n - 1}" in p.message
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
