"""Fused MoE experts as per-expert ``nn.Linear`` modules, for calibration: the forward the fused module computes.

transformers builds a MoE layer's experts as one fused module (3-D ``gate_up_proj``/``down_proj``); the checkpoint
(and the quantized output) names one 2-D weight per expert. :class:`UnfusedExperts` (experts called with the
routed tokens) and :class:`ScoredExperts` (Llama-4's: every token, scaled by its router score) hold per-expert
``nn.Linear`` modules named as in the checkpoint, so that the observers' forward-pre hooks see each expert's own
input; :func:`is_fused_experts` and :func:`is_llama4_experts` recognise the fused modules. Used by
:class:`ctconvert.calibration.model.CalibrationModel`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["EXPERT_NAMES", "ScoredExperts", "UnfusedExperts", "is_fused_experts", "is_llama4_experts"]

#: the per-expert gate, up and down names a checkpoint may use
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class UnfusedExperts(nn.Module):
    """Per-expert ``nn.Linear`` modules standing in for transformers' fused ``*Experts``, named as the checkpoint
    (or the plan's per-expert parts of fused 3-D experts) names them (``experts.3.gate_proj`` or ``experts.3.w1``).
    The forward is the fused module's loop (transformers 5.24 ``Qwen3MoeExperts.forward``, ``GptOssExperts.forward``):
    each expert sees the tokens routed to it, its output is weighted and summed, every value as the fused module
    computes it (so that the next layer's router sees transformers' own hidden states, and routes as it does).

    Two layouts (transformers 5.24): ``gate_up_proj`` ``[E, 2I, H]`` (``x @ W.T``, gate then up, ``act_fn(gate) * up``:
    Qwen3-MoE, Mixtral ...), and gpt-oss's ``[E, H, 2I]`` (``x @ W``, gate and up interleaved, with biases, the
    clamped SwiGLU of ``GptOssExperts._apply_gate``, which this module calls on the re-interleaved halves)."""

    def __init__(self, fused: nn.Module, names: tuple[str, str, str]):
        super().__init__()
        self.gpt_oss = _is_gpt_oss_experts(fused)
        if self.gpt_oss:
            e, h, two_i = fused.gate_up_proj.shape
            self.apply_gate = fused._apply_gate
        else:
            e, two_i, h = fused.gate_up_proj.shape
            self.act_fn = fused.act_fn
        self.names = names
        self.num_experts = e
        _add_expert_linears(self, names, e, h, two_i // 2, self.gpt_oss, fused.gate_up_proj.dtype)

    def _expert(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Expert ``mod``'s output for its tokens ``x``, computed as the fused module computes it (one matmul with the
        expert's ``gate_up_proj`` slice, rebuilt from the gate and up weights, so that every value has the fused
        module's rounding); the gate and up Linear modules observe ``x``, the down Linear the activation."""
        g, u, d = (getattr(mod, n) for n in self.names)
        _observe(g, x)
        _observe(u, x)
        if self.gpt_oss:  # x @ gate_up_proj[e] + gate_up_proj_bias[e], [H, 2I] with gate at ::2 and up at 1::2
            w = torch.stack((g.weight.T, u.weight.T), dim=-1).flatten(-2)
            b = torch.stack((g.bias, u.bias), dim=-1).flatten(-2)
            h = self.apply_gate(x @ w + b)
            _observe(d, h)
            return h @ d.weight.T.contiguous() + d.bias
        gate, up = nn.functional.linear(x, torch.cat((g.weight, u.weight))).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        _observe(d, h)
        return nn.functional.linear(h, d.weight)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for idx in hit:
            e = int(idx[0])
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            y = self._expert(self._modules[str(e)], hidden_states[tok])
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class ScoredExperts(nn.Module):
    """Per-expert ``nn.Linear`` modules standing in for Llama-4's fused ``Llama4TextExperts`` (``gate_up_proj``
    ``[E, H, 2I]``, gate then up, ``down_proj`` ``[E, I, H]``, ``x @ W``), named as the plan's per-expert parts name
    them. transformers 5.24's ``Llama4TextMoe.forward`` hands it every token once per expert, scaled by the router's
    score (``sigmoid`` of the top-k logits, 0 for an expert the token is not routed to: a zero row), as ``[E * T, H]``;
    each expert's output is computed as ``Llama4TextExperts.forward`` computes it. The observers see, per expert, the
    rows it gets a non-zero input for: the tokens routed to it, scaled by their score, which is the input vLLM 0.33
    quantizes (``vllm/model_executor/models/llama4.py`` ``Llama4MoE``: ``FusedMoE(apply_router_weight_on_input=True)``;
    llm-compressor's ``modeling/llama4.py`` ``SequentialLlama4TextMoe`` runs every token unscaled through every expert)."""

    def __init__(self, fused: nn.Module, names: tuple[str, str, str]):
        super().__init__()
        e, h, two_i = fused.gate_up_proj.shape
        self.act_fn, self.names, self.num_experts, self.hidden = fused.act_fn, names, e, h
        _add_expert_linears(self, names, e, h, two_i // 2, False, fused.gate_up_proj.dtype)

    def forward(self, hidden_states):
        per = hidden_states.view(self.num_experts, -1, self.hidden)
        out = []
        for e in range(self.num_experts):
            g, u, d = (getattr(self._modules[str(e)], n) for n in self.names)
            x = per[e]
            gate, up = (x @ torch.cat((g.weight.T, u.weight.T), dim=1)).chunk(2, dim=-1)
            h = up * self.act_fn(gate)
            routed = x.ne(0).any(-1)
            _observe(g, x[routed])
            _observe(u, x[routed])
            _observe(d, h[routed])
            out.append(h @ d.weight.T.contiguous())
        return torch.stack(out).view(-1, self.hidden)


def _add_expert_linears(owner: nn.Module, names: tuple[str, str, str], e: int, h: int, i: int, bias: bool, dtype: torch.dtype) -> None:
    """Children ``"0"`` .. ``str(e - 1)`` of ``owner``, each with gate/up ``nn.Linear(h, i)`` and down ``nn.Linear(i, h)``
    named ``names``, on the meta device (loaded from the checkpoint layer by layer)."""
    for j in range(e):
        m = nn.Module()
        setattr(m, names[0], nn.Linear(h, i, bias=bias, device="meta", dtype=dtype))
        setattr(m, names[1], nn.Linear(h, i, bias=bias, device="meta", dtype=dtype))
        setattr(m, names[2], nn.Linear(i, h, bias=bias, device="meta", dtype=dtype))
        owner.add_module(str(j), m)


def _observe(m: nn.Module, x: torch.Tensor) -> None:
    """Call ``m``'s forward-pre hooks (the observers) with input ``x``, as calling ``m(x)`` would."""
    for hook in m._forward_pre_hooks.values():
        hook(m, (x,))


def is_llama4_experts(m: nn.Module) -> bool:
    """Llama-4's fused experts (transformers 5.24 ``Llama4TextExperts``): ``gate_up_proj`` ``[E, H, 2I]``,
    ``down_proj`` ``[E, I, H]``, called with every token once per expert (``forward(hidden_states)``)."""
    gu, down = m.gate_up_proj, m.down_proj
    return gu.dim() == 3 and down.dim() == 3 and gu.shape[0] == down.shape[0] and gu.shape[1] == down.shape[2] and gu.shape[2] == 2 * down.shape[1]


def _is_gpt_oss_experts(m: nn.Module) -> bool:
    return hasattr(m, "_apply_gate") and isinstance(getattr(m, "gate_up_proj_bias", None), nn.Parameter)


def is_fused_experts(m: nn.Module) -> bool:
    p = getattr(m, "gate_up_proj", None)
    fused = isinstance(p, nn.Parameter) and p.dim() == 3 and isinstance(getattr(m, "down_proj", None), nn.Parameter)
    return fused and (hasattr(m, "act_fn") or _is_gpt_oss_experts(m))
