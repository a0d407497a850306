"""The plan's fused-experts phases (ctconvert.plan.experts) and the record they share (ctconvert.plan.decisions)."""

from __future__ import annotations

import pytest
import torch

from ctconvert.checkpoint.reader import open_checkpoint
from ctconvert.errors import UnsupportedError
from ctconvert.plan import planner
from ctconvert.plan.decisions import Decisions, TensorDecision
from ctconvert.plan.experts import fused_experts, settle_experts

from conftest import write_checkpoint

CONFIG = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 16, "num_experts": 2, "num_hidden_layers": 1}


def _ckpt(tmp_path, config=CONFIG):
    t = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 32, 16).bfloat16(),
        "model.layers.0.mlp.experts.down_proj": torch.zeros(2, 16, 16).bfloat16(),
    }
    return open_checkpoint(write_checkpoint(tmp_path / "moe", t, config))


def test_fused_experts_unquantized_are_copied_whole(tmp_path):
    ckpt = _ckpt(tmp_path)
    d = Decisions()
    fused = fused_experts(ckpt, False, d)
    assert set(fused) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    for fe in fused.values():
        for p in fe.parts:
            d.rows[p.name] = TensorDecision(p.name, "model.safetensors", "BF16", (1,), "copy")
    assert settle_experts(d, fused, ckpt.tensors) == {}
    assert all(d.rows[n].action == "copy" and d.rows[n].reason.startswith("fused experts kept dense") for n in fused)


def test_an_unknown_family_is_refused_or_noted(tmp_path):
    ckpt = _ckpt(tmp_path, dict(CONFIG, model_type="frobnicate_moe", architectures=["FrobnicateForCausalLM"]))
    with pytest.raises(UnsupportedError):
        fused_experts(ckpt, False, Decisions())
    d = Decisions()
    assert fused_experts(ckpt, True, d) == {} and d.notes[0].startswith("fused experts not split")


def test_planner_keeps_tensor_decision():
    assert planner.TensorDecision is TensorDecision
