"""The parameters vLLM 0.33 builds in one decoder layer, per family whose decoder layer the architecture fixes
(:func:`layer_parameters`), for :mod:`.expected`'s per-layer rule.

Each set is read in the family's vLLM 0.33 file (``vllm/model_executor/models/``), by the checkpoint names its loader
maps onto those parameters (``q_proj``/``k_proj``/``v_proj`` fill ``qkv_proj``, ``gate_proj``/``up_proj`` fill
``gate_up_proj``: each file's ``hf_to_vllm_mapper`` or ``stacked_params_mapping``), relative to ``<P>layers.N.``, each
expert's index written ``*``:

- llama.py ``LlamaDecoderLayer``: ``input_layernorm``, ``post_attention_layernorm``, ``self_attn.{q,k,v,o}_proj``,
  ``mlp.{gate,up,down}_proj``.
- qwen2.py ``Qwen2DecoderLayer`` (qwen2_vl.py and qwen2_5_vl.py build their text model with it): llama's, and
  ``self_attn.q_norm``/``k_norm`` where the config's ``qk_norm`` is set (``Qwen2Attention``).
- qwen3.py ``Qwen3DecoderLayer``: llama's and ``self_attn.q_norm``/``k_norm`` (``Qwen3Attention``).
- gemma3.py ``Gemma3DecoderLayer`` (gemma3_mm.py's language model is ``Gemma3ForCausalLM``): qwen3's and
  ``pre_feedforward_layernorm``/``post_feedforward_layernorm``.
- mixtral.py ``MixtralDecoderLayer``: the norms, the attention, ``block_sparse_moe.gate`` and the experts' ``w1``,
  ``w2``, ``w3`` (``MixtralMoE``).
- qwen3_moe.py ``Qwen3MoeDecoderLayer``: qwen3's norms and attention; a sparse block (``Qwen3MoeSparseMoeBlock``:
  ``mlp.gate``, experts' ``gate_proj``/``up_proj``/``down_proj``, and ``mlp.shared_expert.*`` with
  ``mlp.shared_expert_gate`` where ``shared_expert_intermediate_size`` > 0) in a layer not in ``mlp_only_layers``
  whose index + 1 is a multiple of ``decoder_sparse_step`` (with ``num_experts`` > 0), else a dense ``mlp``.
- qwen2_moe.py ``Qwen2MoeDecoderLayer``: qwen2's attention and norms; the same sparse/dense choice; the sparse block
  (``Qwen2MoeSparseMoeBlock``) always builds ``shared_expert_gate``, ``shared_expert`` where
  ``shared_expert_intermediate_size`` > 0.
- gpt_oss.py ``TransformerBlock``: the norms, ``self_attn.{q,k,v,o}_proj`` (biases: :mod:`.expected`'s bias rule),
  ``self_attn.sinks`` (``OAIAttention``), ``mlp.router.weight`` and ``.bias`` (``MLPBlock``: ``GateLinear(bias=True)``);
  its experts (``mlp.experts.``) are judged by the expert rule alone (fused or per expert).

Biases of q/k/v/o and of a dense MLP's gate/up/down are left to :mod:`.expected`'s bias rule (read from the config);
RoPE buffers an old checkpoint saved are dropped before (``utils.py`` ``AutoWeightsLoader``
``REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``: ``rotary_emb.inv_freq``, ``cos_cached``, ``sin_cached``), activation and
KV-cache scales too (:func:`.expected.parameters`).
"""

from __future__ import annotations

__all__ = ["LAYER_FILES", "layer_parameters"]

_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_ATTN = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
_QK_NORM = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
_DENSE = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_GEMMA_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")

#: model_type -> the vLLM 0.33 decoder layer whose parameters :func:`layer_parameters` gives (module docstring)
LAYER_FILES = {
    "llama": "llama.py LlamaDecoderLayer",
    "qwen2": "qwen2.py Qwen2DecoderLayer",
    "qwen2_vl": "qwen2.py Qwen2DecoderLayer",
    "qwen2_5_vl": "qwen2.py Qwen2DecoderLayer",
    "qwen3": "qwen3.py Qwen3DecoderLayer",
    "gemma3": "gemma3.py Gemma3DecoderLayer",
    "gemma3_text": "gemma3.py Gemma3DecoderLayer",
    "mixtral": "mixtral.py MixtralDecoderLayer",
    "qwen3_moe": "qwen3_moe.py Qwen3MoeDecoderLayer",
    "qwen2_moe": "qwen2_moe.py Qwen2MoeDecoderLayer",
    "gpt_oss": "gpt_oss.py TransformerBlock",
}


def _sparse(cfg: dict, layer: int) -> bool:
    """qwen3_moe.py / qwen2_moe.py ``...DecoderLayer``: whether layer ``layer`` builds the sparse MoE block."""
    step = cfg.get("decoder_sparse_step") or 1
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 1))  # transformers 5 saves Qwen3-MoE's as num_local_experts
    return layer not in (cfg.get("mlp_only_layers") or []) and (experts or 0) > 0 and (layer + 1) % step == 0


def _qwen_moe(cfg: dict, layer: int, always_shared_gate: bool) -> set[str]:
    """Layer ``layer``'s MLP; ``always_shared_gate``: qwen2_moe.py (whose config defaults a shared expert: transformers'
    ``Qwen2MoeConfig`` ``shared_expert_intermediate_size`` 5632; Qwen3-MoE's has none, vLLM's getattr default 0)."""
    if not _sparse(cfg, layer):
        return set(_DENSE)
    out = {"mlp.gate.weight"} | {f"mlp.experts.*.{p}_proj.weight" for p in ("gate", "up", "down")}
    shared = (cfg.get("shared_expert_intermediate_size", 5632 if always_shared_gate else 0) or 0) > 0
    if shared:
        out |= {f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
    if shared or always_shared_gate:
        out.add("mlp.shared_expert_gate.weight")
    return out


def layer_parameters(family: str, cfg: dict, layer: int) -> tuple[set[str], tuple[str, ...]] | None:
    """The parameters (relative names, experts' index ``*``) vLLM 0.33 builds in decoder layer ``layer`` of ``family``
    from the text config ``cfg``, and the prefixes whose names another rule judges (gpt-oss's experts); None where the
    family has no set here (:data:`LAYER_FILES`). Biases of q/k/v/o and of a dense MLP are not in it (the bias rule's)."""
    base = set(_NORMS) | set(_ATTN)
    if family == "llama":
        return base | set(_DENSE), ()
    if family in ("qwen2", "qwen2_vl", "qwen2_5_vl"):
        return base | set(_DENSE) | (set(_QK_NORM) if cfg.get("qk_norm") else set()), ()
    if family == "qwen3":
        return base | set(_DENSE) | set(_QK_NORM), ()
    if family in ("gemma3", "gemma3_text"):
        return base | set(_DENSE) | set(_QK_NORM) | set(_GEMMA_NORMS), ()
    if family == "mixtral":
        return base | {"block_sparse_moe.gate.weight"} | {f"block_sparse_moe.experts.*.w{i}.weight" for i in (1, 2, 3)}, ()
    if family == "qwen3_moe":
        return base | set(_QK_NORM) | _qwen_moe(cfg, layer, always_shared_gate=False), ()
    if family == "qwen2_moe":
        return base | _qwen_moe(cfg, layer, always_shared_gate=True), ()
    if family == "gpt_oss":
        return base | {"self_attn.sinks", "mlp.router.weight", "mlp.router.bias"}, ("mlp.experts.",)
    return None
