"""The tensors the architecture builds, judged without a reference (ctconvert/checkpoint/expected.py): unit, and
through verify on foreign outputs (no ctconvert records in the index, no provenance file)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ctconvert import api
from ctconvert.checkpoint.expected import EXPECTED_CHECK, expected_problems, expert_problems, layer_problems, set_problems
from ctconvert.checkpoint.layer_params import LAYER_FILES, has_layer_set, layer_parameters
from ctconvert.checkpoint.modules import modules_of
from ctconvert.checkpoint.reader import INDEX_NAME, open_checkpoint
from ctconvert.cli import main

from conftest import LLAMA_CONFIG, llama_tensors, moe_checkpoint, write_checkpoint
from helpers import save_tiny

LLAMA3 = dict(LLAMA_CONFIG, num_hidden_layers=3)
L = "model.layers."


QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
#: family -> (architecture, config keys, per-layer norms added to the tiny Llama, per-layer biases (name -> width),
#: how the MLP is renamed); each as its vLLM 0.33 decoder layer holds it (ctconvert/checkpoint/layer_params.py)
FAMILY_LAYERS = {
    "qwen3": ("Qwen3ForCausalLM", {}, QK_NORMS, {}, None),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        {"tie_word_embeddings": True, "attention_bias": False},
        QK_NORMS + ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
        {},
        None,
    ),
    "qwen2": ("Qwen2ForCausalLM", {}, (), {"self_attn.q_proj.bias": 256, "self_attn.k_proj.bias": 128, "self_attn.v_proj.bias": 128}, None),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}, (), {}, "mixtral"),
}


def _with_norms(path: Path, rels, biases: dict | None = None) -> Path:
    """``path``'s checkpoint with ``rels`` (norms of head_dim 64, or of hidden 256 for a layer norm) and ``biases``
    added to every decoder layer."""
    t = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    for i in range(cfg["num_hidden_layers"]):
        t.update({f"{L}{i}.{r}": torch.ones(64 if "_norm." in r else 256, dtype=torch.bfloat16) for r in rels})
        t.update({f"{L}{i}.{r}": _bias(n) for r, n in (biases or {}).items()})
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _family_checkpoint(tmp: Path, family: str) -> Path:
    """The tiny Llama named as ``family`` (:data:`FAMILY_LAYERS`), its layers holding what the family's do."""
    arch, keys, rels, biases, mlp = FAMILY_LAYERS[family]
    cfg = dict(LLAMA_CONFIG, architectures=[arch], model_type=family, **keys)
    t = llama_tensors(cfg)
    if mlp == "mixtral":  # block_sparse_moe.gate and experts.N.w1/w2/w3 (gate, down, up)
        t = {k: v for k, v in t.items() if ".mlp." not in k}
        for i in range(cfg["num_hidden_layers"]):
            t[f"{L}{i}.block_sparse_moe.gate.weight"] = torch.randn(4, 256).bfloat16() * 0.02
            for e in range(4):
                for w, shape in (("w1", (512, 256)), ("w2", (256, 512)), ("w3", (512, 256))):
                    t[f"{L}{i}.block_sparse_moe.experts.{e}.{w}.weight"] = torch.randn(*shape).bfloat16() * 0.02
    return _with_norms(write_checkpoint(tmp / family, t, cfg), rels, biases)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Correct outputs: the tiny Llama (2 layers, untied) W4A16 and NVFP4A16, a 3-layer one W4A16, a tied one
    FP8_DYNAMIC, a Qwen3-MoE-named one W4A16; each also stripped to a foreign checkpoint (``<name>-foreign``)."""
    tmp = tmp_path_factory.mktemp("expected")
    out = {}
    llama = write_checkpoint(tmp / "llama", llama_tensors(LLAMA_CONFIG), LLAMA_CONFIG)
    llama3 = write_checkpoint(tmp / "llama3", llama_tensors(LLAMA3), LLAMA3)
    tied_cfg = dict(LLAMA_CONFIG, tie_word_embeddings=True)
    tied = write_checkpoint(tmp / "tied", {k: v for k, v in llama_tensors(tied_cfg).items() if k != "lm_head.weight"}, tied_cfg)
    for name, src, scheme in (
        ("llama-W4A16", llama, "W4A16"),
        ("llama-NVFP4A16", llama, "NVFP4A16"),
        ("llama3-W4A16", llama3, "W4A16"),
        ("tied-FP8_DYNAMIC", tied, "FP8_DYNAMIC"),
        ("moe-W4A16", moe_checkpoint(tmp), "W4A16"),
        *((f"{family}-W4A16", _family_checkpoint(tmp, family), "W4A16") for family in FAMILY_LAYERS),
    ):
        api.quantize(src, tmp / name, scheme, device="cpu")
        out[name] = tmp / name
        out[name + "-foreign"] = damaged(tmp / name, tmp / (name + "-foreign"))
    out["tmp"] = tmp
    return out


def damaged(src: Path, dst: Path, drop=(), add: dict | None = None, rename: dict | None = None) -> Path:
    """A foreign copy of ``src`` (the index keeps only ``total_size``, no provenance file) without the tensors whose
    name starts with one of ``drop``, with ``add`` (name -> tensor) and ``rename`` (old -> new) applied."""
    shutil.copytree(src, dst)
    (dst / "ctconvert-provenance.json").unlink(missing_ok=True)
    t = load_file(dst / "model.safetensors")
    t = {rename.get(k, k) if rename else k: v for k, v in t.items() if not k.startswith(tuple(drop))}
    t.update(add or {})
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    index = dst / INDEX_NAME
    if index.exists():
        doc = json.loads(index.read_text())
        index.write_text(json.dumps({"metadata": {"total_size": doc["metadata"]["total_size"]}, "weight_map": dict.fromkeys(t, "model.safetensors")}))
    return dst


def errors_of(path: Path) -> list[tuple[str, str]]:
    """``(tensor, first word of the message)`` of every error :func:`expected_problems` finds in ``path``."""
    ckpt = open_checkpoint(path, strict=False)
    return [(p.tensor, p.message.split(":")[0]) for p in expected_problems(ckpt, modules_of(ckpt)) if p.severity == "error"]


@pytest.mark.parametrize("name", ["llama-W4A16", "llama-NVFP4A16", "llama3-W4A16", "tied-FP8_DYNAMIC", "moe-W4A16", *(f"{f}-W4A16" for f in FAMILY_LAYERS)])
def test_correct_outputs_pass(outputs, name):
    """No false failure: every correct output passes verify, with ctconvert's records and as a foreign checkpoint."""
    for path in (outputs[name], outputs[name + "-foreign"]):
        rep = api.verify(path)
        assert rep["ok"], rep["problems"]
        assert EXPECTED_CHECK in rep["checked"]["checks"]
        assert errors_of(path) == []


def _bias(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.bfloat16)


DAMAGES = {
    # name: (output, drop, add, rename, the expected errors)
    "layer-norm": ("llama-W4A16", [f"{L}1.post_attention_layernorm.weight"], None, None, [(f"{L}1.post_attention_layernorm.weight", "missing")]),
    "final-norm": ("llama-W4A16", ["model.norm.weight"], None, None, [("model.norm.weight", "missing")]),
    "embedding": ("llama-W4A16", ["model.embed_tokens.weight"], None, None, [("model.embed_tokens.weight", "missing")]),
    "embedding-tied": ("tied-FP8_DYNAMIC", ["model.embed_tokens.weight"], None, None, [("model.embed_tokens.weight", "missing")]),
    "linear": ("llama-NVFP4A16", [f"{L}0.mlp.down_proj."], None, None, [(f"{L}0.mlp.down_proj.weight", "missing")]),
    "linear-3": ("llama3-W4A16", [f"{L}2.self_attn.o_proj."], None, None, [(f"{L}2.self_attn.o_proj.weight", "missing")]),
    "norm-3": ("llama3-W4A16", [f"{L}1.input_layernorm."], None, None, [(f"{L}1.input_layernorm.weight", "missing")]),
    "extra-3": ("llama3-W4A16", [], {f"{L}1.self_attn.q_norm.weight": _bias(64)}, None, [(f"{L}1.self_attn.q_norm.weight", "extra")]),
    "expert": ("moe-W4A16", [f"{L}0.mlp.experts.3.up_proj."], None, None, [(f"{L}0.mlp.experts.3.up_proj.weight", "missing")]),
    "router": ("moe-W4A16", [f"{L}1.mlp.gate.weight"], None, None, [(f"{L}1.mlp.gate.weight", "missing")]),
    "bias-one": ("llama-W4A16", [], {f"{L}0.self_attn.q_proj.bias": _bias(256)}, None, [(f"{L}0.self_attn.q_proj.bias", "extra")]),
    "bias-all": (
        "llama3-W4A16",
        [],
        {f"{L}{i}.mlp.down_proj.bias": _bias(256) for i in range(3)},
        None,
        [(f"{L}{i}.mlp.down_proj.bias", "extra") for i in range(3)],
    ),
    # every layer alike, wrong in each (the trial's: vLLM 0.33 rejects each, the layer-alike rule saw none)
    "o_proj-all": ("llama-W4A16", [f"{L}{i}.self_attn.o_proj." for i in range(2)], None, None, [(f"{L}0.self_attn.o_proj.weight", "missing")]),
    "norm-all": ("llama-W4A16", [f"{L}{i}.post_attention_layernorm." for i in range(2)], None, None, [(f"{L}0.post_attention_layernorm.weight", "missing")]),
    "k_norm-all": ("llama-W4A16", [], {f"{L}{i}.self_attn.k_norm.weight": _bias(64) for i in range(2)}, None, [(f"{L}0.self_attn.k_norm.weight", "extra")]),
    "extra_scale-all": ("llama-W4A16", [], {f"{L}{i}.self_attn.extra_scale": _bias(8) for i in range(2)}, None, [(f"{L}0.self_attn.extra_scale", "extra")]),
    "extra_scale-l0": ("llama-W4A16", [], {f"{L}0.self_attn.extra_scale": _bias(8)}, None, [(f"{L}0.self_attn.extra_scale", "extra")]),
    "gemma-k_norm-all": ("gemma3_text-W4A16", [f"{L}{i}.self_attn.k_norm." for i in range(2)], None, None, [(f"{L}0.self_attn.k_norm.weight", "missing")]),
    "qwen3-q_norm": ("qwen3-W4A16", [f"{L}1.self_attn.q_norm."], None, None, [(f"{L}1.self_attn.q_norm.weight", "missing")]),
    "qwen2-k_bias-all": (
        "qwen2-W4A16",
        [f"{L}{i}.self_attn.k_proj.bias" for i in range(2)],
        None,
        None,
        [(f"{L}{i}.self_attn.k_proj.bias", "missing") for i in range(2)],
    ),
    "layer-gone": ("llama-W4A16", [f"{L}1."], None, None, [(f"{L}1", "missing")]),
    "expert-renamed": (
        "moe-W4A16",
        [],
        None,
        {f"{L}0.mlp.experts.1.up_proj.{p}": f"{L}0.mlp.experts.1.upp_proj.{p}" for p in ("weight_packed", "weight_scale", "weight_shape")},
        [(f"{L}0.mlp.experts.1.upp_proj.weight", "extra"), (f"{L}0.mlp.experts.1.up_proj.weight", "missing")],
    ),
    "mixtral-w2": ("mixtral-W4A16", [f"{L}0.block_sparse_moe.experts.3.w2."], None, None, [(f"{L}0.block_sparse_moe.experts.3.w2.weight", "missing")]),
    "mixtral-router-all": (
        "mixtral-W4A16",
        [f"{L}{i}.block_sparse_moe.gate." for i in range(2)],
        None,
        None,
        [(f"{L}{i}.block_sparse_moe.gate.weight", "missing") for i in range(2)],
    ),
    "renamed": (
        "llama3-W4A16",
        [],
        None,
        {f"{L}1.mlp.up_proj.{p}": f"{L}1.mlp.up_prj.{p}" for p in ("weight_packed", "weight_scale", "weight_shape")},
        [(f"{L}1.mlp.up_prj.weight", "extra"), (f"{L}1.mlp.up_proj.weight", "missing")],
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damages_fail(outputs, damage):
    """Each damage of a foreign output is an error naming the tensor (exactly these), and verify fails on it."""
    name, drop, add, rename, want = DAMAGES[damage]
    path = damaged(outputs[name], outputs["tmp"] / f"d-{damage}", drop, add, rename)
    assert sorted(errors_of(path)) == sorted(want)
    rep = api.verify(path)
    assert not rep["ok"]
    assert {p.get("tensor") for p in rep["problems"] if p["severity"] == "error"} >= {t for t, _ in want}


def test_cli_names_file_and_tensor(outputs):
    """verify exits 5 with one line naming the shard and the missing tensor."""
    path = damaged(outputs["llama-W4A16"], outputs["tmp"] / "cli", [f"{L}1.post_attention_layernorm.weight"])
    r = CliRunner().invoke(main, ["verify", str(path)])
    assert r.exit_code == 5, r.output
    line = next(x for x in r.output.splitlines() if "post_attention_layernorm" in x)
    want = f"{L}1.post_attention_layernorm.weight: missing: 1 decoder layer (1) of 2 lacks post_attention_layernorm.weight"
    assert f"{path / 'model.safetensors'}: {want}" in line


def test_unknown_family_is_not_judged(outputs):
    """A family verify does not know: a note, no error, though a layer lacks a norm."""
    path = damaged(outputs["llama-W4A16"], outputs["tmp"] / "unknown", [f"{L}1.post_attention_layernorm.weight"])
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, model_type="cohere", architectures=["CohereForCausalLM"])))
    ckpt = open_checkpoint(path, strict=False)
    found = expected_problems(ckpt, modules_of(ckpt))
    assert [p.severity for p in found] == ["note"] and "model_type 'cohere' is not among the families" in found[0].message


def _params(names):
    return {n: n for n in names}


def test_layer_rule_majority_mtp_and_kinds():
    """Most layers hold a parameter: the others miss it; few hold it: extra; layers past num_hidden_layers (MTP) and
    dense vs MoE MLPs are not compared with each other."""
    rel = ("input_layernorm.weight", "self_attn.q_proj.weight")
    names = [f"{L}{i}.{r}" for i in range(4) for r in rel if (i, r) != (2, "input_layernorm.weight")]
    names += [f"{L}3.self_attn.sinks", f"{L}4.eh_proj.weight"]  # an extra in one of four; an MTP layer past 4
    names += [f"{L}{i}.mlp.down_proj.weight" for i in (0, 2, 3)] + [f"{L}1.mlp.gate.weight", f"{L}1.mlp.experts.0.down_proj.weight"]
    found = [(p.tensor, p.message.split(":")[0]) for p in layer_problems(_params(names), L, 4, lambda n: "f")]
    assert found == [(f"{L}2.input_layernorm.weight", "missing"), (f"{L}3.self_attn.sinks", "extra")]


def test_expert_rule_fused_and_per_expert():
    """Per-expert blocks whose experts differ, and fused 3-D experts (gpt-oss) without both members or both biases."""
    cfg = {"model_type": "gpt_oss"}
    fused = _params([f"{L}0.mlp.experts.gate_up_proj", f"{L}0.mlp.experts.gate_up_proj_bias", f"{L}0.mlp.experts.down_proj_bias"])
    assert [p.tensor for p in expert_problems(fused, cfg, lambda n: "f", True)] == [f"{L}0.mlp.experts.down_proj"]
    per = _params([f"{L}0.mlp.experts.{e}.{p}.weight" for e in range(3) for p in ("w1", "w2", "w3") if (e, p) != (1, "w2")])
    assert [p.tensor for p in expert_problems(per, {"model_type": "unknown"}, lambda n: "f", False)] == [f"{L}0.mlp.experts.1.w2.weight"]
    assert expert_problems(_params([f"{L}0.mlp.experts.{e}.w1.weight" for e in range(2)]), {"model_type": "unknown"}, lambda n: "f", False) == []


def test_rope_buffers_pass(outputs):
    """RoPE buffers an old checkpoint saved in every layer (vLLM 0.33 utils.py AutoWeightsLoader drops them) are no error."""
    add = {f"{L}{i}.self_attn.rotary_emb.{b}": torch.ones(32) for i in range(2) for b in ("inv_freq", "cos_cached", "sin_cached")}
    path = damaged(outputs["llama-W4A16"], outputs["tmp"] / "rope", add=add)
    assert errors_of(path) == []
    assert api.verify(path)["ok"]


def test_rope_buffers_vllm_keeps_fail(outputs):
    """A RoPE buffer under a name vLLM 0.33's loader does not drop (utils.py REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER names
    rotary_emb and rotary_pos_emb only): its attention has no parameter for it, and vllm_accept refuses it; an error."""
    path = damaged(outputs["llama-W4A16"], outputs["tmp"] / "rope-kept", add={f"{L}{i}.self_attn.rope.inv_freq": torch.ones(32) for i in range(2)})
    assert errors_of(path) == [(f"{L}0.self_attn.rope.inv_freq", "extra")]


def test_layer_rule_message_agrees():
    """Two layers that disagree (a family without a parameter set): the count agrees with its verb, the holder is named a layer."""
    names = [f"{L}0.input_layernorm.weight", f"{L}0.self_attn.q_proj.weight", f"{L}1.self_attn.q_proj.weight"]
    (p,) = layer_problems(_params(names), L, 2, lambda n: "f")
    assert p.message.startswith("missing: 1 layer (1) of the 2 decoder layers lacks input_layernorm.weight, which layer 0 holds (or that holds it extra)")


def test_expert_rule_minority_is_the_stray():
    """One expert's projection renamed, in a family without a set: that expert holds an extra and lacks the other's name;
    no other expert is blamed, and no message doubles a word."""
    names = [f"{L}0.mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("w1", "w2", "w3")]
    names = [n.replace("experts.1.w3", "experts.1.w33") for n in names]
    found = expert_problems(_params(names), {"model_type": "unknown"}, lambda n: "f", False)
    assert [(p.tensor, p.message.split(":")[0]) for p in found] == [
        (f"{L}0.mlp.experts.1.w3.weight", "missing"),
        (f"{L}0.mlp.experts.1.w33.weight", "extra"),
    ]
    assert all("hold hold" not in p.message for p in found)
    assert "which the other experts of this block hold:" in found[0].message


def test_set_rule_dense_and_sparse_layers():
    """Qwen3-MoE: a layer in mlp_only_layers builds a dense MLP, the others the sparse block (qwen3_moe.py); each is
    judged against its own kind; a whole layer missing below num_hidden_layers is one error."""
    cfg = {"num_experts": 2, "mlp_only_layers": [0], "decoder_sparse_step": 1}
    common = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    common += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    dense = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    sparse = ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up", "down")]
    names = [f"{L}0.{r}" for r in common + dense] + [f"{L}1.{r}" for r in common + sparse] + [f"{L}2.{r}" for r in common + dense]
    found = [(p.tensor, p.message.split(":")[0]) for p in set_problems(_params(names), L, "qwen3_moe", cfg, 4, lambda n: "f")]
    assert found == [(f"{L}3", "missing"), (f"{L}2.mlp.gate.weight", "missing"), (f"{L}2.mlp.down_proj.weight", "extra"),
                     (f"{L}2.mlp.gate_proj.weight", "extra"), (f"{L}2.mlp.up_proj.weight", "extra")]  # fmt: skip


# Families saved by transformers' own classes (save_pretrained: the names a real checkpoint has), 3 layers; DeepSeek and
# GLM-4.5 with layer 0 dense (first_k_dense_replace=1). Widths multiples of 128 (W4A16's group).
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3, vocab_size=256)
TINY_MOE = dict(moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)
TINY_MLA = dict(kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64)


def _saved_model(family: str):
    t = transformers_or_skip()
    if family == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**TINY, head_dim=64))
    if family == "phi3":  # stores self_attn.qkv_proj and mlp.gate_up_proj fused
        return t.Phi3ForCausalLM(t.Phi3Config(**TINY, pad_token_id=0))
    if family == "gemma2":
        return t.Gemma2ForCausalLM(t.Gemma2Config(**TINY, head_dim=64))
    if family == "deepseek_v2":  # q_lora_rank None: q_proj (DeepSeek-V2-Lite's); config saved with topk_method 'greedy'
        return t.DeepseekV2ForCausalLM(t.DeepseekV2Config(**dict(TINY, num_key_value_heads=2), **TINY_MOE, **TINY_MLA, q_lora_rank=None, n_shared_experts=2))
    if family == "deepseek_v3":  # q_a_proj/q_a_layernorm/q_b_proj; router bias stored: topk_method noaux_tc as the Hub's config
        cfg = t.DeepseekV3Config(**dict(TINY, num_key_value_heads=2), **TINY_MOE, **TINY_MLA, q_lora_rank=128, n_shared_experts=1, topk_method="noaux_tc")
        return t.DeepseekV3ForCausalLM(cfg)
    if family == "glm4_moe":
        return t.Glm4MoeForCausalLM(t.Glm4MoeConfig(**TINY, head_dim=64, **TINY_MOE, n_shared_experts=1, use_qk_norm=True))
    assert family == "olmoe"
    return t.OlmoeForCausalLM(t.OlmoeConfig(**dict(TINY, intermediate_size=128), num_experts=4, num_experts_per_tok=2))


def transformers_or_skip():
    return pytest.importorskip("transformers")


SAVED = ("mistral", "phi3", "gemma2", "deepseek_v2", "deepseek_v3", "glm4_moe", "olmoe")


@pytest.fixture(scope="module")
def saved_families(tmp_path_factory):
    """family -> {"src": transformers' save_pretrained, "W4A16"/"NVFP4A16": ctconvert's outputs of it, "<scheme>-foreign"}."""
    tmp = tmp_path_factory.mktemp("saved")
    out = {}
    for family in SAVED:
        src = save_tiny(lambda: _saved_model(family), tmp / family)  # noqa: B023 - called at once
        out[family] = {"src": src, "tmp": tmp}
        for scheme in ("W4A16", "NVFP4A16"):
            api.quantize(src, tmp / f"{family}-{scheme}", scheme, device="cpu")
            out[family][scheme] = tmp / f"{family}-{scheme}"
            out[family][scheme + "-foreign"] = damaged(tmp / f"{family}-{scheme}", tmp / f"{family}-{scheme}-foreign")
    return out


@pytest.mark.parametrize("family", SAVED)
def test_saved_family_passes(saved_families, family):
    """No false failure: the checkpoint transformers' own class saved, and ctconvert's W4A16 and NVFP4A16 outputs of it
    (with records and foreign), hold exactly the family's layer set: no error from the expected-tensor rules."""
    got = saved_families[family]
    ckpt = open_checkpoint(got["src"], strict=False)
    assert [p for p in expected_problems(ckpt, modules_of(ckpt)) if p.severity != "note"] == []
    for key in ("W4A16", "NVFP4A16", "W4A16-foreign", "NVFP4A16-foreign"):
        rep = api.verify(got[key])
        assert rep["ok"], (key, rep["problems"])
        assert errors_of(got[key]) == []


#: family -> (what is dropped from every layer (a prefix), the errors expected (layer, relative name, first word)):
#: each a parameter vLLM 0.33 builds in every such layer, so no layer differs from another
SAVED_MISSING = {
    "mistral": (["post_attention_layernorm.weight"], [(0, "post_attention_layernorm.weight")]),
    "phi3": (["self_attn.qkv_proj."], [(0, "self_attn.qkv_proj.weight")]),
    "gemma2": (["pre_feedforward_layernorm.weight"], [(0, "pre_feedforward_layernorm.weight")]),
    "deepseek_v2": (["self_attn.kv_a_layernorm.weight"], [(0, "self_attn.kv_a_layernorm.weight")]),
    "deepseek_v3": (["self_attn.q_a_layernorm.weight"], [(0, "self_attn.q_a_layernorm.weight")]),
    "glm4_moe": (["self_attn.k_norm.weight"], [(0, "self_attn.k_norm.weight")]),
    "olmoe": (["self_attn.q_norm.weight"], [(0, "self_attn.q_norm.weight")]),
}


def _every_layer(rels, n=3):
    return [f"{L}{i}.{r}" for i in range(n) for r in rels]


@pytest.mark.parametrize("family", SAVED)
def test_saved_family_parameter_missing_from_every_layer(saved_families, family):
    """A parameter gone from every layer (the layer-alike rule sees no difference): one error naming it and the vLLM
    0.33 decoder layer that builds it; verify fails."""
    rels, want = SAVED_MISSING[family]
    got = saved_families[family]
    path = damaged(got["W4A16-foreign"], got["tmp"] / f"{family}-missing", _every_layer(rels))
    assert errors_of(path) == [(f"{L}{i}.{r}", "missing") for i, r in want]
    ckpt = open_checkpoint(path, strict=False)
    (msg,) = [p.message for p in expected_problems(ckpt, modules_of(ckpt)) if p.severity == "error"]
    rel = want[0][1]
    assert msg.startswith(f"missing: 3 decoder layers (0, 1, 2) of 3 lack {rel}, which vLLM 0.33 {LAYER_FILES[family]} builds in every such layer")
    assert not api.verify(path)["ok"]


#: family -> (the router dropped from every MoE layer, the MoE layers, the message's start)
SAVED_ROUTERS = {
    "deepseek_v3": ("mlp.gate.weight", (1, 2), "missing: MoE block {b} stores experts but no router (gate.weight), which vLLM 0.33 deepseek_v2.py builds"),
    "deepseek_v2": ("mlp.gate.weight", (1, 2), "missing: MoE block {b} stores experts but no router (gate.weight), which vLLM 0.33 deepseek_v2.py builds"),
    "glm4_moe": ("mlp.gate.e_score_correction_bias", (1, 2), "missing: the router lacks e_score_correction_bias, which vLLM 0.33 glm4_moe.py builds"),
    "olmoe": ("mlp.gate.weight", (0, 1, 2), "missing: MoE block {b} stores experts but no router (gate.weight), which vLLM 0.33 olmoe.py builds"),
}


@pytest.mark.parametrize("family", list(SAVED_ROUTERS))
def test_saved_family_router_missing_from_every_moe_layer(saved_families, family):
    """A MoE family's router (or GLM-4.5's router bias, built always) gone from every MoE layer: one error per layer."""
    rel, layers, start = SAVED_ROUTERS[family]
    got = saved_families[family]
    path = damaged(got["W4A16-foreign"], got["tmp"] / f"{family}-router", [f"{L}{i}.{rel}" for i in layers])
    ckpt = open_checkpoint(path, strict=False)
    found = [(p.tensor, p.message) for p in expected_problems(ckpt, modules_of(ckpt)) if p.severity == "error"]
    assert [t for t, _ in found] == [f"{L}{i}.{rel}" for i in layers]
    assert all(m.startswith(start.format(b=f"{L}{i}.mlp")) for (_, m), i in zip(found, layers))
    assert not api.verify(path)["ok"]


#: family -> a parameter its vLLM 0.33 decoder layer does not build, added to every layer (as another family has it)
SAVED_EXTRA = {
    "mistral": "self_attn.q_norm.weight",
    "phi3": "pre_feedforward_layernorm.weight",
    "gemma2": "self_attn.q_norm.weight",
    "deepseek_v2": "self_attn.q_a_layernorm.weight",  # q_lora_rank None: vLLM builds q_proj, no q_a_layernorm
    "deepseek_v3": "self_attn.q_norm.weight",
    "glm4_moe": "self_attn.sinks",
    "olmoe": "post_feedforward_layernorm.weight",
}


@pytest.mark.parametrize("family", SAVED)
def test_saved_family_extra_parameter_in_every_layer(saved_families, family):
    """A parameter the family's vLLM 0.33 decoder layer does not build, stored in every layer: one error naming it."""
    rel = SAVED_EXTRA[family]
    got = saved_families[family]
    path = damaged(got["W4A16-foreign"], got["tmp"] / f"{family}-extra", add={n: _bias(64) for n in _every_layer([rel])})
    ckpt = open_checkpoint(path, strict=False)
    found = [(p.tensor, p.message) for p in expected_problems(ckpt, modules_of(ckpt)) if p.severity == "error"]
    assert [t for t, _ in found] == [f"{L}0.{rel}"]
    assert found[0][1].startswith(f"extra: {rel} is stored in 3 decoder layers (0, 1, 2) of 3, which vLLM 0.33 {LAYER_FILES[family]} does not build")
    assert not api.verify(path)["ok"]


def test_fused_or_split_as_stored(saved_families):
    """llama.py's loader (Phi-3, Mistral, Llama) and gemma2.py's fill qkv_proj and gate_up_proj from one fused tensor
    or from the split ones: a Phi-3 stored split passes, and a member the split form lacks is missing; a Mistral stored
    fused passes. A fused bias follows the bias rule of its members."""
    t = load_file(saved_families["phi3"]["src"] / "model.safetensors")
    cfg = json.loads((saved_families["phi3"]["src"] / "config.json").read_text())
    split = {}
    for k, v in t.items():
        if k.endswith("self_attn.qkv_proj.weight"):
            q, kk, vv = v.split([128, 64, 64])
            split.update({k.replace("qkv_proj", p): w for p, w in (("q_proj", q), ("k_proj", kk), ("v_proj", vv))})
        elif k.endswith("mlp.gate_up_proj.weight"):
            split.update(dict(zip((k.replace("gate_up_proj", "gate_proj"), k.replace("gate_up_proj", "up_proj")), v.chunk(2))))
        else:
            split[k] = v
    tmp = saved_families["phi3"]["tmp"]
    assert errors_of(write_checkpoint(tmp / "phi3-split", split, cfg)) == []
    no_k = {k: v for k, v in split.items() if "k_proj" not in k}
    assert errors_of(write_checkpoint(tmp / "phi3-split-no-k", no_k, cfg)) == [(f"{L}0.self_attn.k_proj.weight", "missing")]
    biased = dict(t, **{f"{L}{i}.self_attn.qkv_proj.bias": _bias(256) for i in range(3)})
    assert errors_of(write_checkpoint(tmp / "phi3-qkv-bias", biased, cfg)) == [(f"{L}{i}.self_attn.qkv_proj.bias", "extra") for i in range(3)]
    assert errors_of(write_checkpoint(tmp / "phi3-qkv-bias-wanted", biased, dict(cfg, attention_bias=True))) == [
        (f"{L}{i}.self_attn.o_proj.bias", "missing") for i in range(3)
    ]
    m = load_file(saved_families["mistral"]["src"] / "model.safetensors")
    fused = {k: v for k, v in m.items() if not re.search(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.", k)}
    for i in range(3):
        p = f"{L}{i}."
        fused[p + "self_attn.qkv_proj.weight"] = torch.cat([m[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        fused[p + "mlp.gate_up_proj.weight"] = torch.cat([m[p + "mlp.gate_proj.weight"], m[p + "mlp.up_proj.weight"]])
    mcfg = json.loads((saved_families["mistral"]["src"] / "config.json").read_text())
    assert errors_of(write_checkpoint(tmp / "mistral-fused", fused, mcfg)) == []


def test_deepseek_and_glm_sets_follow_the_config():
    """deepseek_v2.py / glm4_moe.py read the config as vLLM 0.33 does, absent keys at transformers' config defaults."""
    mla = {"self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"}
    lora = {"self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"}
    dense = {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    experts = {f"mlp.experts.*.{p}_proj.weight" for p in ("gate", "up", "down")}
    shared = {f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}
    norms = {"input_layernorm.weight", "post_attention_layernorm.weight"}
    router = {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"}
    # V3 (and Kimi-K2, read as DeepseekV3Config): first_k_dense_replace 3, q_lora_rank 1536, one shared expert
    for family in ("deepseek_v3", "kimi_k2"):
        assert layer_parameters(family, {}, 2) == (norms | mla | lora | dense, ())
        assert layer_parameters(family, {"topk_method": "noaux_tc"}, 3) == (
            norms | mla | lora | {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"} | experts | shared,
            (),
        )
    # V2: first_k_dense_replace 0; q_lora_rank null: q_proj; greedy: no router bias (a stored one left to the router rule)
    want, delegated = layer_parameters("deepseek_v2", {"q_lora_rank": None, "n_shared_experts": None}, 0)
    assert want == norms | mla | {"self_attn.q_proj.weight", "mlp.gate.weight"} | experts and delegated == ("mlp.gate.e_score_correction_bias",)
    assert "mlp.gate.weight" not in layer_parameters("deepseek_v2", {"moe_layer_freq": 2}, 1)[0]
    assert not has_layer_set("deepseek_v3", {"index_topk": 2048}) and not has_layer_set("deepseek_v2", {"qk_nope_head_dim": 0, "qk_rope_head_dim": 0})
    # GLM-4.5: first_k_dense_replace 1, router bias always, q/k norms where use_qk_norm
    glm = set(norms) | {f"self_attn.{p}_proj.weight" for p in "qkvo"}
    assert layer_parameters("glm4_moe", {}, 0) == (glm | dense, ())
    assert layer_parameters("glm4_moe", {"use_qk_norm": True}, 1)[0] == glm | set(QK_NORMS) | router | experts | shared
    assert layer_parameters("mistral", {"ada_rms_norm_t_cond": True}, 0)[0] >= {"ada_rms_norm_t_cond.0.weight", "ada_rms_norm_t_cond.2.weight"}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_past_num_hidden_layers_is_not_judged(saved_families, family):
    """An MTP layer (index num_hidden_layers: a decoder layer and enorm/hnorm/eh_proj/shared_head) is no layer-set error."""
    got = saved_families[family]
    t = load_file(got["src"] / "model.safetensors")
    t.update({k.replace(f"{L}2.", f"{L}3."): v.clone() for k, v in t.items() if k.startswith(f"{L}2.")})
    t.update({f"{L}3.{n}": torch.ones(128, dtype=torch.bfloat16) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    t[f"{L}3.eh_proj.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    cfg = dict(json.loads((got["src"] / "config.json").read_text()), num_nextn_predict_layers=1)
    assert errors_of(write_checkpoint(got["tmp"] / f"{family}-mtp", t, cfg)) == []


def test_router_bias_problem_names_the_first_router_whose_bias_disagrees_with_vllm():
    """quantize's plan note: DeepSeek-V2/V3 and Kimi-K2 with topk_method not noaux_tc (absent included) and a stored
    router bias (extra), or with noaux_tc and a router without one (missing; GLM-4.5 always builds it), with how many
    routers are so; nothing where they agree, for another family, or for a config that is no dict."""
    from ctconvert.checkpoint.expected import router_bias_problem

    L = "model.layers."
    routers = [f"{L}{i}.mlp.gate.weight" for i in (1, 2, 10)] + [f"{L}1.mlp.experts.0.gate_proj.weight", f"{L}0.mlp.gate_proj.weight"]
    biases = [f"{L}{i}.mlp.gate.e_score_correction_bias" for i in (10, 2)]  # layer 1's missing; stored out of order
    names = routers + biases
    for family in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        absent, n = router_bias_problem({"model_type": family}, names)
        assert absent.startswith(f"extra: {L}2.mlp.gate.e_score_correction_bias is stored, but vLLM 0.33 deepseek_v2.py") and n == 2
        assert "(config.json topk_method: absent)" in absent and "DeepseekV3Config saves none" in absent
        greedy, _ = router_bias_problem({"model_type": family, "topk_method": "greedy"}, names)
        assert "(config.json topk_method: 'greedy')" in greedy and "DeepseekV3Config" not in greedy
        assert router_bias_problem({"model_type": family}, routers) is None
        noaux = {"model_type": family, "topk_method": "noaux_tc"}
        why = "the router lacks e_score_correction_bias, which vLLM 0.33 deepseek_v2.py builds (topk_method 'noaux_tc') and refuses unfilled"
        assert router_bias_problem(noaux, names) == (f"missing: {L}1.mlp.gate.e_score_correction_bias: {why}", 1)
        assert router_bias_problem(noaux, names + [f"{L}1.mlp.gate.e_score_correction_bias"]) is None
    glm, n = router_bias_problem({"model_type": "glm4_moe"}, names)
    assert glm.startswith(f"missing: {L}1.mlp.gate.e_score_correction_bias: the router lacks") and n == 1
    assert router_bias_problem({"model_type": "glm4_moe"}, routers)[1] == 3
    assert router_bias_problem({"model_type": "qwen3_moe"}, names) is None
    assert router_bias_problem(None, names) is None and router_bias_problem([], names) is None


def test_is_router_bias_tells_the_router_bias_problems_from_others_of_the_same_tensor():
    """quantize's source warning leaves out what the router note says already: expected_problems' missing/extra router
    bias, found by its tensor and kind, not another problem of the same tensor (its size) or of another tensor."""
    from ctconvert.checkpoint.expected import is_router_bias
    from ctconvert.checkpoint.reader import Problem

    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert is_router_bias(Problem("error", f"extra: {bias} is stored, but vLLM 0.33 ...", "m.safetensors", bias))
    assert is_router_bias(Problem("error", "missing: the router lacks e_score_correction_bias, ...", "m.safetensors", bias))
    assert not is_router_bias(Problem("error", "config.json's n_routed_experts is 8, but it holds 4 values", "m.safetensors", bias))
    assert not is_router_bias(Problem("error", "extra: model.layers.1.mlp.gate.bias is stored, ...", "m.safetensors", "model.layers.1.mlp.gate.bias"))
    assert not is_router_bias(Problem("error", "missing: e_score_correction_bias", None, None))
