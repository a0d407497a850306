"""The other tensors of an output against its reference (ctconvert.checkpoint.comparison): bytes, casts, missing tensors."""

from __future__ import annotations

import torch

from ctconvert.checkpoint.comparison import compare_others, same_bytes
from ctconvert.checkpoint.reader import open_checkpoint

from conftest import write_checkpoint

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def _pair(tmp_path, out_tensors):
    g = torch.Generator().manual_seed(0)
    ref = {"model.norm.weight": torch.randn(16, generator=g).float(), "model.embed_tokens.weight": torch.randn(8, 16, generator=g).bfloat16()}
    r = open_checkpoint(write_checkpoint(tmp_path / "ref", ref, CONFIG))
    o = open_checkpoint(write_checkpoint(tmp_path / "out", out_tensors(ref), CONFIG))
    return o, r


def test_equal_bytes_pass(tmp_path):
    out, ref = _pair(tmp_path, lambda ref: dict(ref))
    assert compare_others(out, {}, ref) == []
    assert same_bytes(out.tensors["model.norm.weight"], ref.tensors["model.norm.weight"])


def test_a_cast_copy_is_a_note_and_changed_bytes_an_error(tmp_path):
    def changed(ref):
        return {"model.norm.weight": ref["model.norm.weight"].bfloat16(), "model.embed_tokens.weight": ref["model.embed_tokens.weight"] + 1}

    out, ref = _pair(tmp_path, changed)
    problems = compare_others(out, {}, ref)
    assert [p.severity for p in problems] == ["error", "note"]
    assert problems[0].tensor == "model.embed_tokens.weight" and "bytes differ" in problems[0].message
    assert "--dense-dtype" in problems[1].message


def test_missing_and_unexplained_tensors(tmp_path):
    out, ref = _pair(tmp_path, lambda ref: {"model.norm.weight": ref["model.norm.weight"], "extra.weight": torch.zeros(2)})
    messages = {p.tensor: p.message for p in compare_others(out, {}, ref)}
    assert "not in the reference" in messages["extra.weight"]
    assert "missing from the output" in messages["model.embed_tokens.weight"]
