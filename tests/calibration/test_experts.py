"""Fused MoE experts as per-expert Linear modules (ctconvert.calibration.experts): what is recognised as fused."""

from __future__ import annotations

import torch
from torch import nn

from ctconvert.calibration.experts import EXPERT_NAMES, is_fused_experts, is_llama4_experts


class _Fused(nn.Module):
    def __init__(self, e=4, h=8, i=6, llama4=False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i) if llama4 else torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, i, h) if llama4 else torch.zeros(e, h, i))
        self.act_fn = nn.SiLU()


def test_fused_experts_are_recognised():
    assert is_fused_experts(_Fused()) and is_fused_experts(_Fused(llama4=True))
    assert not is_fused_experts(nn.Linear(4, 4))
    assert is_llama4_experts(_Fused(llama4=True)) and not is_llama4_experts(_Fused())


def test_expert_names():
    assert ("gate_proj", "up_proj", "down_proj") in EXPERT_NAMES and ("w1", "w3", "w2") in EXPERT_NAMES
