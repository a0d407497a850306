"""The class vLLM 0.33 builds, read from ``architectures`` before ``model_type`` (ctconvert/checkpoint/architectures.py),
and the loadability checks judging by it: the new-user trial's Llama checkpoint named ``Qwen3ForCausalLM`` passed
verify while vLLM refused it (Qwen3's q/k norms filled by no tensor), and one whose ``model_type`` said ``qwen3``
failed verify while vLLM loaded it as Llama."""

from __future__ import annotations

import pytest
import torch

from ctconvert import api
from ctconvert.checkpoint.architectures import ARCHITECTURES, family_class, mismatch_problems, resolve, vllm_types
from ctconvert.checkpoint.expected import JUDGED, expected_problems
from ctconvert.checkpoint.families import vllm_head
from ctconvert.checkpoint.loadable import loadability_problems
from ctconvert.checkpoint.modules import modules_of
from ctconvert.checkpoint.reader import open_checkpoint

from conftest import LLAMA_CONFIG, llama_tensors, write_checkpoint

L = "model.layers."


def _warning(arch: str, model_type: str, where: str) -> str:
    return (
        f"config.json's architectures ['{arch}'] and model_type '{model_type}' name different families: vLLM 0.33 builds {where} "
        "(the first entry of architectures its registry holds: registry.py resolve_model_cls; model_type only picks the config class), "
        f"so verify judges the tensors as {where.rpartition(' ')[2]} builds them"
    )


def test_every_judged_family_has_its_class():
    """Each family the checks judge is built by a class of the table, and the table names no other family."""
    assert {t for c in ARCHITECTURES.values() for t in c.families} == set(JUDGED)
    for family in JUDGED:
        assert family in family_class(family, {"model_type": family}).families
    assert family_class("kimi_k2", {"model_type": "kimi_k2"}).where == "deepseek_v2.py DeepseekV3ForCausalLM"
    assert family_class("llama", {"model_type": "llava", "text_config": {"model_type": "llama"}}) is None  # a wrapper verify does not know


@pytest.mark.parametrize(
    "config, types, mismatch",
    [
        ({"model_type": "qwen3"}, ["qwen3"], False),  # no architectures: model_type, as before
        ({"model_type": "qwen3", "architectures": []}, ["qwen3"], False),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, ["llama"], False),
        ({"model_type": "llama", "architectures": ["Qwen3ForCausalLM"]}, ["qwen3"], True),
        ({"model_type": "qwen3", "architectures": ["LlamaForCausalLM"]}, ["llama"], True),
        ({"model_type": "llama", "architectures": ["Qwen3ForCausalLM", "LlamaForCausalLM"]}, ["qwen3"], True),  # the first entry wins
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM", "Qwen3ForCausalLM"]}, ["llama"], False),
        ({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}, ["kimi_k2"], False),  # one class, two model types
        ({"architectures": ["Qwen3ForCausalLM"]}, ["qwen3"], False),  # no model_type: vLLM reads it from the architecture
        ({"model_type": "llama", "architectures": ["CohereForCausalLM"]}, ["llama"], False),  # a class verify does not know: as before
        ({"model_type": "llama", "architectures": ["FooBarForCausalLM", "Qwen3ForCausalLM"]}, ["qwen3"], True),  # vLLM skips what it does not hold
        ({"model_type": "llama", "architectures": ["FooBarForCausalLM"]}, ["llama"], False),  # none held: the first, unknown: as before
        ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification", "Qwen3ForCausalLM"]}, ["llama"], False),  # held (an adapter)
        ({"model_type": "cohere", "architectures": ["CohereForCausalLM"]}, ["cohere"], False),
        (
            {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}, "architectures": ["Gemma3ForConditionalGeneration"]},
            ["gemma3", "gemma3_text"],
            False,
        ),
    ],
)
def test_resolve_follows_vllm(config, types, mismatch):
    """vLLM 0.33 registry.py resolve_model_cls: the first entry of architectures it holds; model_type where there is none."""
    assert vllm_types(config) == types
    assert resolve(config).mismatch == mismatch
    assert bool([p for p in mismatch_problems(config) if "name different families" in p.message]) == mismatch


def test_head_follows_architectures():
    """The lm_head rule is the class's: a Llama config named Gemma2ForCausalLM builds no head at all."""
    assert vllm_head({"model_type": "llama", "architectures": ["Gemma2ForCausalLM"]})[0] == "embedding"
    assert vllm_head({"model_type": "gemma2", "architectures": ["LlamaForCausalLM"]})[0] == "config"
    assert vllm_head({"model_type": "gemma2"})[0] == "embedding"


def _source(tmp_path, **config) -> object:
    cfg = dict(LLAMA_CONFIG, **config)
    return write_checkpoint(tmp_path / "src", llama_tensors(cfg), cfg)


def _found(folder) -> list[tuple[str, str | None, str]]:
    ck = open_checkpoint(folder, strict=False)
    return [(p.severity, p.tensor, p.message) for p in loadability_problems(ck, modules_of(ck), folder)]


def test_llama_named_qwen3_fails(tmp_path):
    """Llama tensors under architectures Qwen3ForCausalLM: vLLM 0.33 builds qwen3.py Qwen3DecoderLayer, whose q/k norms
    no tensor fills. quantize warns, and the output fails verify with the warning and both norms."""
    src = _source(tmp_path, architectures=["Qwen3ForCausalLM"])
    warning = _warning("Qwen3ForCausalLM", "llama", "qwen3.py Qwen3ForCausalLM")
    res = api.quantize(src, tmp_path / "out", "W4A16", device="cpu")
    assert f"the source {src}: {warning}; the output keeps this config.json" in res.warnings
    missing = "missing: 2 decoder layers (0, 1) of 2 lack self_attn.{}_norm.weight, which vLLM 0.33 qwen3.py Qwen3DecoderLayer builds in every such layer: "
    missing += "vLLM refuses a parameter no tensor fills"
    assert _found(tmp_path / "out") == [
        ("warning", None, warning),
        ("error", f"{L}0.self_attn.k_norm.weight", missing.format("k")),
        ("error", f"{L}0.self_attn.q_norm.weight", missing.format("q")),
    ]
    rep = api.verify(tmp_path / "out")
    assert not rep["ok"]
    assert {(p["severity"], p.get("tensor")) for p in rep["problems"]} >= {("warning", None), ("error", f"{L}0.self_attn.q_norm.weight")}
    inspected = api.inspect(tmp_path / "out")["problems"]
    assert {"severity": "warning", "message": warning, "file": str(tmp_path / "out" / "config.json")} in inspected


def test_llama_tensors_under_model_type_qwen3_pass(tmp_path):
    """model_type qwen3 under architectures LlamaForCausalLM: vLLM 0.33 builds llama.py LlamaForCausalLM, which the
    tensors fill; the warning says so, and nothing fails."""
    src = _source(tmp_path, model_type="qwen3")
    warning = _warning("LlamaForCausalLM", "qwen3", "llama.py LlamaForCausalLM")
    res = api.quantize(src, tmp_path / "out", "W4A16", device="cpu")
    assert f"the source {src}: {warning}; the output keeps this config.json" in res.warnings
    assert _found(tmp_path / "out") == [("warning", None, warning)]
    rep = api.verify(tmp_path / "out")
    assert rep["ok"], rep["problems"]
    assert [p["message"] for p in rep["problems"] if p["severity"] != "note"] == [warning]


def test_without_architectures_model_type_judges(tmp_path):
    """No architectures: judged by model_type as before (Qwen3's norms missing), and no warning."""
    cfg = {k: v for k, v in LLAMA_CONFIG.items() if k != "architectures"}
    src = write_checkpoint(tmp_path / "src", llama_tensors(cfg), dict(cfg, model_type="qwen3"))
    found = _found(src)
    assert [s for s, _, _ in found] == ["error", "error"]
    assert [t for _, t, _ in found] == [f"{L}0.self_attn.k_norm.weight", f"{L}0.self_attn.q_norm.weight"]


def test_correct_llama_has_no_problem(tmp_path):
    src = _source(tmp_path)
    res = api.quantize(src, tmp_path / "out", "W4A16", device="cpu")
    assert not [w for w in res.warnings if "architectures" in w]
    assert _found(tmp_path / "out") == []
    assert api.verify(tmp_path / "out")["ok"]


def test_unknown_first_architecture_keeps_model_type(tmp_path):
    """architectures' first entry a class verify does not know: the decoder layers judged by model_type as before, and
    nothing outside them (a note says why), so no false failure for a tensor the class may build."""
    cfg = dict(LLAMA_CONFIG, architectures=["CohereForCausalLM", "LlamaForCausalLM"])
    t = llama_tensors(cfg)
    del t[f"{L}1.input_layernorm.weight"]
    src = write_checkpoint(tmp_path / "src", {**t, "model.foo": torch.ones(8, dtype=torch.bfloat16)}, cfg)
    ck = open_checkpoint(src)
    found = expected_problems(ck, modules_of(ck))
    assert [p.tensor for p in found if p.severity == "error"] == [f"{L}1.input_layernorm.weight"]
    (note,) = [p.message for p in found if p.severity == "note"]
    assert note == (
        "the tensors outside the decoder layers are not judged: architectures' first entry 'CohereForCausalLM' is not a class whose modules "
        "verify knows (vLLM 0.33 builds it if its registry holds it)"
    )


def test_registered_names_are_vllms():
    """The registry list (vLLM 0.33.0 registry.py _VLLM_MODELS): every class verify judges is in it, a name with another
    of vLLM's suffixes is found through its base (_normalize_arch), an unknown name is not."""
    from ctconvert.checkpoint.architectures import ARCHITECTURES, registered

    assert all(registered(a) for a in ARCHITECTURES)
    assert registered("Qwen2ForSequenceClassification") and registered("MistralModel")
    assert not registered("FooBarForCausalLM") and not registered("LlamaForCausalLMX")


def test_architectures_vllm_does_not_hold_are_warned_of():
    """No entry vLLM 0.33 registers (a new-user trial's FooBarForCausalLM, which vLLM refused): one warning naming them."""
    (p,) = mismatch_problems({"model_type": "llama", "architectures": ["FooBarForCausalLM"]}, "config.json")
    assert p.severity == "warning" and p.file == "config.json"
    assert p.message.startswith("config.json's architectures ['FooBarForCausalLM'] names no class vLLM 0.33's registry holds")
    assert mismatch_problems({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) == []
