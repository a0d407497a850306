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
- mistral.py ``MistralDecoderLayer`` (a ``LlamaDecoderLayer`` with ``MistralAttention``, ``LlamaModel``'s loader):
  llama's, and ``ada_rms_norm_t_cond.0``/``.2`` (two Linears) where the config's ``ada_rms_norm_t_cond`` is set.
- phi3.py ``Phi3ForCausalLM`` (``LlamaForCausalLM``: llama.py ``LlamaDecoderLayer``): llama's, as a Phi-3 checkpoint
  stores them: ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` fused (``LlamaModel.hf_to_vllm_mapper`` maps only the
  split names, so a fused tensor fills its parameter whole).
- gemma2.py ``Gemma2DecoderLayer``: llama's and ``pre_feedforward_layernorm``/``post_feedforward_layernorm``.
- deepseek_v2.py ``DeepseekV2DecoderLayer`` (deepseek_v2, deepseek_v3 and kimi_k2, whose config vLLM reads as
  transformers' ``DeepseekV3Config``): the norms; MLA attention (``DeepseekV2MLAAttention``, or
  ``DeepseekV2Attention`` where MLA is off: the same names): ``q_proj`` where ``q_lora_rank`` is None, else
  ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
  ``o_proj``; a MoE block (``DeepseekV2MoE``: ``mlp.gate``, its ``e_score_correction_bias`` where ``topk_method`` is
  ``noaux_tc``, the experts' ``gate_proj``/``up_proj``/``down_proj``, ``mlp.shared_experts.*`` where
  ``n_shared_experts`` is not None) where ``n_routed_experts`` is not None, the index is at least
  ``first_k_dense_replace`` and a multiple of ``moe_layer_freq`` (getattr default 1), else a dense ``mlp``
  (``DeepseekV2MLP``). Defaults of absent keys are transformers' config classes' (``q_lora_rank`` 1536; V2:
  ``first_k_dense_replace`` 0, ``n_shared_experts`` 2; V3: 3, 1). No set (the layer-alike rule judges) where the
  layer is not MLA (``qk_nope_head_dim`` and ``qk_rope_head_dim`` 0: ``DeepseekAttention``) or builds V3.2's
  indexer (``index_topk``); a stored router bias where vLLM builds none is left to the router rule (expected.py: an error).
- glm4_moe.py ``Glm4MoeDecoderLayer``: the norms, ``self_attn.{q,k,v,o}_proj`` and ``q_norm``/``k_norm`` where
  ``use_qk_norm`` is set (``Glm4MoeAttention``); a MoE block (``Glm4MoE``: ``mlp.gate`` with its
  ``e_score_correction_bias`` always, the experts, ``mlp.shared_experts.*`` where ``n_shared_experts`` is not None)
  where ``n_routed_experts`` is not None and the index is at least ``first_k_dense_replace`` (transformers'
  ``Glm4MoeConfig``: 1), else a dense ``mlp``.
- olmoe.py ``OlmoeDecoderLayer``: the norms, ``self_attn.{q,k,v,o}_proj`` and ``q_norm``/``k_norm`` (always,
  ``OlmoeAttention``), ``mlp.gate`` and the experts' ``gate_proj``/``up_proj``/``down_proj`` (``OlmoeMoE``).

A ``LlamaModel`` (llama, mistral, phi3) or Gemma-2 loader fills ``qkv_proj`` and ``gate_up_proj`` from either the
split tensors or one fused tensor (:data:`FUSED_FORMS`): each layer is judged in the form it stores
(:func:`stored_form`). A shared expert block where ``n_shared_experts`` is 0 (a zero-width MLP vLLM still builds)
is not judged.

Biases of q/k/v/o and of a dense MLP's gate/up/down are left to :mod:`.expected`'s bias rule (read from the config);
RoPE buffers an old checkpoint saved are dropped before (``utils.py`` ``AutoWeightsLoader``
``REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``: ``rotary_emb.inv_freq``, ``cos_cached``, ``sin_cached``), activation and
KV-cache scales too (:func:`.expected.parameters`).
"""

from __future__ import annotations

from .expert_count import expert_count

__all__ = ["FUSED_FORMS", "LAYER_FILES", "has_layer_set", "layer_parameters", "stored_form"]

_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_ATTN = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
_QK_NORM = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
_DENSE = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_GEMMA_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
_GUD = ("gate", "up", "down")
_EXPERTS = frozenset(f"mlp.experts.*.{p}_proj.weight" for p in _GUD)
_SHARED = frozenset(f"mlp.shared_experts.{p}_proj.weight" for p in _GUD)
_PHI3 = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")
_DEEPSEEK = ("deepseek_v2", "deepseek_v3", "kimi_k2")
#: transformers' defaults of the keys deepseek_v2.py reads, where config.json lacks them (DeepseekV2Config, DeepseekV3Config)
_DEEPSEEK_DEFAULTS = {"deepseek_v2": {"first_k_dense_replace": 0, "n_shared_experts": 2}, "v3": {"first_k_dense_replace": 3, "n_shared_experts": 1}}

#: model_type -> each fused parameter its vLLM 0.33 loader also fills whole from one stored tensor of its name, with
#: the split members that fill it otherwise (llama.py ``LlamaModel.hf_to_vllm_mapper``, gemma2.py's: ``.q_proj`` ...
#: map onto ``.qkv_proj``; a stored ``qkv_proj`` maps onto itself)
_FUSED = {
    "self_attn.qkv_proj.weight": frozenset(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "mlp.gate_up_proj.weight": frozenset(("mlp.gate_proj.weight", "mlp.up_proj.weight")),
}
FUSED_FORMS = dict.fromkeys(("llama", "mistral", "phi3", "gemma2"), _FUSED)

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
    "mistral": "mistral.py MistralDecoderLayer",
    "phi3": "llama.py LlamaDecoderLayer (phi3.py Phi3ForCausalLM)",
    "gemma2": "gemma2.py Gemma2DecoderLayer",
    **dict.fromkeys(_DEEPSEEK, "deepseek_v2.py DeepseekV2DecoderLayer"),
    "glm4_moe": "glm4_moe.py Glm4MoeDecoderLayer",
    "olmoe": "olmoe.py OlmoeDecoderLayer",
}


def _sparse(cfg: dict, layer: int, family: str) -> bool:
    """qwen3_moe.py / qwen2_moe.py ``...DecoderLayer``: whether layer ``layer`` builds the sparse MoE block. The expert
    count as vLLM reads it (:func:`.expert_count.expert_count`: a Qwen3-MoE's ``num_local_experts`` over its
    ``num_experts``); a value of another type than the config class declares (which vLLM refuses:
    :mod:`.config_types`) is read as its class default would be, so that the other checks still run."""
    step = cfg.get("decoder_sparse_step")
    step = step if isinstance(step, int) and not isinstance(step, bool) and step > 0 else 1
    counted = expert_count({**cfg, "model_type": family})
    only = cfg.get("mlp_only_layers")
    return layer not in (only if isinstance(only, list) else []) and (counted is None or counted[1] > 0) and (layer + 1) % step == 0


def _qwen_moe(cfg: dict, layer: int, always_shared_gate: bool) -> set[str]:
    """Layer ``layer``'s MLP; ``always_shared_gate``: qwen2_moe.py (whose config defaults a shared expert: transformers'
    ``Qwen2MoeConfig`` ``shared_expert_intermediate_size`` 5632; Qwen3-MoE's has none, vLLM's getattr default 0)."""
    if not _sparse(cfg, layer, "qwen2_moe" if always_shared_gate else "qwen3_moe"):
        return set(_DENSE)
    out = {"mlp.gate.weight"} | {f"mlp.experts.*.{p}_proj.weight" for p in ("gate", "up", "down")}
    shared = (cfg.get("shared_expert_intermediate_size", 5632 if always_shared_gate else 0) or 0) > 0
    if shared:
        out |= {f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
    if shared or always_shared_gate:
        out.add("mlp.shared_expert_gate.weight")
    return out


def _deepseek(family: str, cfg: dict, layer: int) -> tuple[set[str], tuple[str, ...]] | None:
    """deepseek_v2.py ``DeepseekV2DecoderLayer`` (module docstring); None where it is not MLA or builds an indexer."""
    if "index_topk" in cfg or (cfg.get("qk_nope_head_dim", 128) == 0 and cfg.get("qk_rope_head_dim", 64) == 0):
        return None
    defaults = _DEEPSEEK_DEFAULTS["deepseek_v2" if family == "deepseek_v2" else "v3"]
    out = set(_NORMS) | {f"self_attn.{p}" for p in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")}
    if cfg.get("q_lora_rank", 1536) is None:
        out.add("self_attn.q_proj.weight")
    else:
        out |= {"self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight"}
    freq = cfg.get("moe_layer_freq", 1)
    moe = cfg.get("n_routed_experts", 64) is not None and layer >= cfg.get("first_k_dense_replace", defaults["first_k_dense_replace"]) and layer % freq == 0
    if not moe:
        return out | set(_DENSE), ()
    router_bias = cfg.get("topk_method") == "noaux_tc"
    shared, delegated = _shared(cfg.get("n_shared_experts", defaults["n_shared_experts"]))
    out |= {"mlp.gate.weight"} | _EXPERTS | shared | ({"mlp.gate.e_score_correction_bias"} if router_bias else set())
    return out, delegated + (() if router_bias else ("mlp.gate.e_score_correction_bias",))


def _shared(n) -> tuple[set[str], tuple[str, ...]]:
    """The shared expert's parameters for ``n_shared_experts`` ``n`` (None: none built), and the prefixes left unjudged
    (0: a zero-width MLP vLLM builds all the same)."""
    if n is None:
        return set(), ()
    return (set(_SHARED), ()) if n else (set(), ("mlp.shared_experts.",))


def _glm4_moe(cfg: dict, layer: int) -> tuple[set[str], tuple[str, ...]]:
    """glm4_moe.py ``Glm4MoeDecoderLayer`` (module docstring)."""
    out = set(_NORMS) | set(_ATTN) | (set(_QK_NORM) if cfg.get("use_qk_norm", False) else set())
    if cfg.get("n_routed_experts", 128) is None or layer < cfg.get("first_k_dense_replace", 1):
        return out | set(_DENSE), ()
    shared, delegated = _shared(cfg.get("n_shared_experts", 1))
    return out | {"mlp.gate.weight", "mlp.gate.e_score_correction_bias"} | _EXPERTS | shared, delegated


def has_layer_set(family: str | None, cfg: dict) -> bool:
    """Whether :func:`layer_parameters` gives ``family``'s layers a set under this config (DeepSeek: not where the
    layer is not MLA, or builds an indexer)."""
    return family in LAYER_FILES and layer_parameters(family, cfg, 0) is not None


def stored_form(family: str, want: set[str], held) -> set[str]:
    """``want`` with each fused parameter of :data:`FUSED_FORMS` in the form the layer stores (``held``: its relative
    names): its fused tensor where it holds that, else its split members where it holds any of them."""
    out = set(want)
    for fused, members in FUSED_FORMS.get(family, {}).items():
        if fused in held and members <= out:
            out = (out - members) | {fused}
        elif fused in out and fused not in held and any(m in held for m in members):
            out = (out - {fused}) | members
    return out


def layer_parameters(family: str, cfg: dict, layer: int) -> tuple[set[str], tuple[str, ...]] | None:
    """The parameters (relative names, experts' index ``*``) vLLM 0.33 builds in decoder layer ``layer`` of ``family``
    from the text config ``cfg``, and the prefixes whose names another rule judges (gpt-oss's experts); None where the
    family has no set here (:data:`LAYER_FILES`) or not under this config (:func:`has_layer_set`). Biases of q/k/v/o
    and of a dense MLP are not in it (the bias rule's)."""
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
    if family == "mistral":
        ada = {"ada_rms_norm_t_cond.0.weight", "ada_rms_norm_t_cond.2.weight"} if cfg.get("ada_rms_norm_t_cond", False) else set()
        return base | set(_DENSE) | ada, ()
    if family == "phi3":
        return set(_NORMS) | set(_PHI3), ()
    if family == "gemma2":
        return base | set(_DENSE) | set(_GEMMA_NORMS), ()
    if family in _DEEPSEEK:
        return _deepseek(family, cfg, layer)
    if family == "glm4_moe":
        return _glm4_moe(cfg, layer)
    if family == "olmoe":
        return base | set(_QK_NORM) | {"mlp.gate.weight"} | _EXPERTS, ()
    return None
