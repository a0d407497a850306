"""How vLLM 0.33 builds each family's lm_head (ctconvert/checkpoint/families.py VLLM_HEAD), judged by verify
(ctconvert/checkpoint/widths.py tied_head_problems): Gemma 2 builds none (a stored head is refused), OLMoE always its own
(a tied checkpoint without one is refused), Llama ties iff tie_word_embeddings. Checkpoints saved by transformers' classes."""

from __future__ import annotations

import pytest

from ctconvert import api
from ctconvert.checkpoint.families import VLLM_HEAD, vllm_head
from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.checkpoint.widths import tied_head_problems

from helpers import save_tiny

TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, vocab_size=256)


def _model(family: str, tied: bool):
    t = pytest.importorskip("transformers")
    if family == "gemma2":
        return t.Gemma2ForCausalLM(t.Gemma2Config(**TINY, head_dim=64, tie_word_embeddings=tied))
    if family == "olmoe":
        return t.OlmoeForCausalLM(t.OlmoeConfig(**dict(TINY, intermediate_size=128), num_experts=4, num_experts_per_tok=2, tie_word_embeddings=tied))
    assert family == "llama"
    return t.LlamaForCausalLM(t.LlamaConfig(**TINY, tie_word_embeddings=tied))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(family, tied) -> the W4A16 output of the checkpoint transformers' class saved (tied: no lm_head stored)."""
    tmp = tmp_path_factory.mktemp("heads")
    out = {}
    for family in ("gemma2", "olmoe", "llama"):
        for tied in (True, False):
            src = save_tiny(lambda: _model(family, tied), tmp / f"{family}-{'tied' if tied else 'untied'}")  # noqa: B023 - called at once
            api.quantize(src, tmp / f"{src.name}-W4A16", "W4A16", device="cpu")
            out[family, tied] = tmp / f"{src.name}-W4A16"
    return out


def _heads(folder) -> list[str]:
    return [n for n in open_checkpoint(folder).tensors if n.startswith("lm_head.")]


def _errors(folder) -> list:
    ckpt = open_checkpoint(folder)
    return [p for p in tied_head_problems(ckpt.config, ckpt.tensors, "config.json") if p.severity == "error"]


def test_table():
    """The families ctconvert knows, each with a kind vLLM's class was read for."""
    assert vllm_head({"model_type": "gemma2"})[0] == "embedding"
    assert vllm_head({"model_type": "olmoe"}) == ("own", "olmoe.py", "OlmoeForCausalLM")
    assert vllm_head({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}})[0] == "config"
    assert vllm_head({"model_type": "unknown"}) is None
    assert {k for k, _, _ in VLLM_HEAD.values()} == {"embedding", "config", "own"}


def test_gemma2_tied_passes(saved):
    out = saved["gemma2", True]
    assert _heads(out) == [] and _errors(out) == []
    assert api.verify(out)["ok"]


def test_gemma2_stored_head_refused(saved):
    """An untied Gemma 2 (lm_head.weight stored by transformers): vLLM 0.33's Gemma2ForCausalLM has no parameter for it."""
    out = saved["gemma2", False]
    assert _heads(out) == ["lm_head.weight"]
    (p,) = _errors(out)
    assert p.tensor == "lm_head.weight" and p.file == "config.json"
    assert p.message.startswith("lm_head.weight is stored (model.safetensors), but vLLM 0.33 gemma2.py Gemma2ForCausalLM builds no lm_head")
    assert "computes logits with the embedding; a stored head is refused" in p.message
    rep = api.verify(out)
    assert not rep["ok"] and "Gemma2ForCausalLM builds no lm_head" in str(rep["problems"])


def test_gemma2_tied_head_equal_to_embedding_refused(saved):
    """Tied, with lm_head.weight the embedding's bytes (the generic rule lets it pass): still no parameter for it."""
    ckpt = open_checkpoint(saved["gemma2", True])
    tensors = dict(ckpt.tensors, **{"lm_head.weight": ckpt.tensors["model.embed_tokens.weight"]})
    (p,) = tied_head_problems(ckpt.config, tensors, "config.json")
    assert p.tensor == "lm_head.weight" and "Gemma2ForCausalLM builds no lm_head" in p.message
    assert tied_head_problems(dict(ckpt.config, model_type="llama"), tensors, "config.json") == [p]  # vLLM builds architectures' Gemma2ForCausalLM
    assert tied_head_problems(dict(ckpt.config, model_type="llama", architectures=["LlamaForCausalLM"]), tensors) == []  # the generic rule: skipped


def test_olmoe_tied_without_head_refused(saved):
    out = saved["olmoe", True]
    assert _heads(out) == []
    (p,) = _errors(out)
    assert p.file == "config.json" and p.tensor is None
    assert p.message == (
        "config.json's tie_word_embeddings is true, but the checkpoint stores no lm_head: vLLM 0.33 olmoe.py OlmoeForCausalLM "
        "always builds lm_head; tie_word_embeddings is not followed: store lm_head.weight"
    )
    assert not api.verify(out)["ok"]


def test_olmoe_untied_passes(saved):
    out = saved["olmoe", False]
    assert _heads(out) == ["lm_head.weight"] and _errors(out) == []
    assert api.verify(out)["ok"]
    ckpt = open_checkpoint(out)  # a stored head with the flag true: vLLM loads it as its own head
    assert tied_head_problems(dict(ckpt.config, tie_word_embeddings=True), ckpt.tensors) == []


@pytest.mark.parametrize("tied", [True, False])
def test_llama_unchanged(saved, tied):
    out = saved["llama", tied]
    assert _heads(out) == ([] if tied else ["lm_head.weight"]) and _errors(out) == []
    assert api.verify(out)["ok"]
    ckpt = open_checkpoint(out)
    if not tied:  # a differing stored head under tie_word_embeddings true: the generic rule's error
        (p,) = tied_head_problems(dict(ckpt.config, tie_word_embeddings=True), ckpt.tensors)
        assert p.message.startswith("config.json's tie_word_embeddings is true, but lm_head.weight holds other values")
    else:  # untied with no head stored: vLLM builds a head no tensor fills
        (p,) = tied_head_problems(dict(ckpt.config, tie_word_embeddings=False), ckpt.tensors)
        assert "stores no lm_head" in p.message


def test_quantize_notes_a_head_gemma2_refuses(saved):
    """quantize's plan says a Gemma 2 output would store a head vLLM refuses (the source's, or --lm-head's); else nothing."""
    from types import SimpleNamespace

    from ctconvert.stages.plan import _no_head_note

    untied, tied = open_checkpoint(saved["gemma2", False]), open_checkpoint(saved["gemma2", True])
    for ckpt, lm_head, start in ((untied, "none", "the source stores lm_head.weight"), (tied, "fp8", "--lm-head fp8 writes lm_head")):
        plan = SimpleNamespace(notes=[], warnings=[])
        _no_head_note(plan, ckpt, lm_head)
        (note,) = plan.notes
        assert note.startswith(start) and "vLLM 0.33 gemma2.py Gemma2ForCausalLM builds no lm_head" in note
        assert plan.warnings == [note] and note.endswith("vLLM refuses this output and `ctconvert verify OUT` fails it (it is written for other loaders)")
    for ckpt, lm_head in ((tied, "none"), (open_checkpoint(saved["llama", False]), "none"), (open_checkpoint(saved["llama", True]), "fp8")):
        plan = SimpleNamespace(notes=[], warnings=[])
        _no_head_note(plan, ckpt, lm_head)
        assert plan.notes == [] == plan.warnings
