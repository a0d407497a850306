"""The sizes of a decoder layer's non-quantized parameters (norms, router, biases) against ``config.json``, as vLLM 0.33
builds them (``verify``, no reference needed).

vLLM 0.33 builds each of these parameters from the config and its weight loaders assert the stored shape
(``default_weight_loader``, ``linear.py`` ``weight_loader``), so a norm, a router or a bias of another size is a
checkpoint vLLM refuses, which neither the quantized modules nor :mod:`.widths` see. Read in each model file
(``vllm/model_executor/models/``), per family: the class vLLM builds from ``architectures``, else ``model_type``
(:func:`.architectures.vllm_types`; the ``text_config``'s sizes where there is one):

- ``self_attn.q_norm``/``k_norm`` ``[head_dim]``: ``qwen3.py`` ``Qwen3Attention``, ``qwen3_moe.py``
  ``Qwen3MoeAttention``, ``gemma3.py`` ``Gemma3Attention`` and ``glm4_moe.py`` ``Glm4MoeAttention`` (``config.head_dim``,
  judged only where ``config.json`` holds it: transformers fills its class default otherwise), ``qwen2.py`` ``Qwen2Attention`` (``hidden_size /
  num_attention_heads``, never ``head_dim``). OLMoE's span every head: ``olmoe.py`` ``OlmoeAttention`` builds
  ``RMSNorm(num_heads * head_dim)`` and ``RMSNorm(num_kv_heads * head_dim)`` (``head_dim = hidden_size /
  num_attention_heads``).
- ``self_attn.q_proj.bias`` ``[num_attention_heads * head_dim]``, ``k_proj``/``v_proj.bias`` ``[num_key_value_heads *
  head_dim]`` (``QKVParallelLinear``; head_dim as above, Qwen2 and Qwen2-MoE ``hidden_size / num_attention_heads``,
  Gemma 2 ``config.head_dim``, Llama and Mistral ``head_dim`` else ``hidden_size / num_attention_heads``), and Llama's
  and Mistral's ``o_proj.bias`` ``[hidden_size]`` (``llama.py`` ``LlamaAttention``: ``RowParallelLinear``).
- The MoE router ``gate.weight`` ``[experts, hidden_size]`` (``GateLinear``): ``mixtral.py`` ``MixtralMoE``
  (``num_local_experts``), ``qwen2_moe.py`` ``Qwen2MoeSparseMoeBlock``, ``qwen3_moe.py`` ``Qwen3MoeSparseMoeBlock``,
  ``olmoe.py`` ``OlmoeMoE`` (``num_experts``), ``deepseek_v2.py`` ``DeepseekV2MoE`` and ``glm4_moe.py`` ``Glm4MoE``
  (``n_routed_experts``), the count read from ``config.json`` as transformers 5.20 resolves its aliases
  (:func:`.expert_count.expert_count`); its ``e_score_correction_bias`` ``[n_routed_experts]`` (the last two).
- Qwen2-MoE's ``mlp.shared_expert_gate.weight`` ``[1, hidden_size]`` (``qwen2_moe.py`` ``Qwen2MoeSparseMoeBlock``:
  ``ReplicatedLinear(hidden_size, 1)``, built whatever ``shared_expert_intermediate_size`` says; a 1-D
  ``[hidden_size]`` loads too: its ``load_weights`` reshapes a 1-D gate, ``_maybe_reshape``).
- DeepSeek's MLA norms (``deepseek_v2.py`` ``DeepseekV2MLAAttention``): ``kv_a_layernorm`` ``[kv_lora_rank]``,
  ``q_a_layernorm`` ``[q_lora_rank]``.
- gpt-oss (``gpt_oss.py`` ``MLPBlock``): its router ``mlp.router`` (``torch.nn.Linear(hidden_size,
  num_local_experts)``: weight ``[num_local_experts, hidden_size]``, bias ``[num_local_experts]``; the count as
  :func:`.expert_count.expert_count` reads it: a ``num_experts`` key wins over ``num_local_experts``) and the biases of its
  fused experts (``FusedMoE`` with biases, ``fused_moe/layer.py``: ``w13_bias`` ``[num_local_experts, 2 *
  intermediate_size]`` from ``experts.gate_up_proj_bias``, ``w2_bias`` ``[num_local_experts, hidden_size]`` from
  ``experts.down_proj_bias``), stored fused as transformers saves them.

Each only where the family builds the parameter under this config (:func:`_built`; DeepSeek's router bias where
``topk_method`` is ``noaux_tc``): one stored where vLLM builds none is :mod:`.expected`'s error (extra), not a size.
A family not listed, a config without the key (or not an integer), a tensor outside the language model's decoder stack
(:func:`.naming.decoder_layers_prefix`), and a quantized router whose dense shape cannot be read are not judged.
"""

from __future__ import annotations

import re

from .architectures import vllm_types
from .config_types import head_dim, kv_heads
from .expected import builds_bias
from .expert_count import expert_count
from .mla_shapes import MLA_FAMILIES
from .modules import Module
from .naming import decoder_layers_prefix
from .reader import Problem
from .safetensors_io import TensorInfo
from .widths import dense_dims

__all__ = ["PARAM_SHAPES_CHECK", "param_shape_problems"]

#: the line ``verify`` lists among its checks
PARAM_SHAPES_CHECK = "q/k norms, MoE routers, attention biases and MLA norms sized as config.json says"

#: model_type -> (vLLM 0.33 file, attention class, MoE class, how head_dim is read: "cfg" and "key", the config's
#: ``head_dim``, where config.json has none the class's value (Qwen3's 128, Gemma 3's 256: :func:`.config_types.head_dim`,
#: which vLLM's ``getattr(config, "head_dim", None)`` reads), else hidden/heads; "hidden" hidden/heads only)
_FAMILIES = {
    "qwen3": ("qwen3.py", "Qwen3Attention", None, "key"),
    "qwen3_moe": ("qwen3_moe.py", "Qwen3MoeAttention", "Qwen3MoeSparseMoeBlock", "key"),
    "gemma3": ("gemma3.py", "Gemma3Attention", None, "key"),
    "gemma3_text": ("gemma3.py", "Gemma3Attention", None, "key"),
    "gemma2": ("gemma2.py", "Gemma2Attention", None, "key"),
    "glm4_moe": ("glm4_moe.py", "Glm4MoeAttention", "Glm4MoE", "key"),
    "qwen2": ("qwen2.py", "Qwen2Attention", None, "hidden"),
    "qwen2_moe": ("qwen2_moe.py", "Qwen2MoeAttention", "Qwen2MoeSparseMoeBlock", "hidden"),
    "olmoe": ("olmoe.py", "OlmoeAttention", "OlmoeMoE", "hidden"),
    "mixtral": ("mixtral.py", "MixtralAttention", "MixtralMoE", None),
    "llama": ("llama.py", "LlamaAttention", None, "cfg"),
    "mistral": ("mistral.py", "MistralAttention (LlamaAttention)", None, "cfg"),
    "deepseek_v2": ("deepseek_v2.py", "DeepseekV2MLAAttention", "DeepseekV2MoE", None),
    "deepseek_v3": ("deepseek_v2.py", "DeepseekV2MLAAttention", "DeepseekV2MoE", None),
    "kimi_k2": ("deepseek_v2.py", "DeepseekV2MLAAttention", "DeepseekV2MoE", None),
    "gpt_oss": ("gpt_oss.py", "OAIAttention", "MLPBlock", None),
}
_PER_HEAD_NORM = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "glm4_moe", "qwen2")
_QKV_BIAS = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "gemma2", "glm4_moe", "qwen2", "qwen2_moe", "llama", "mistral")
_O_BIAS = ("llama", "mistral")
#: the families whose MoE router ``gate.weight`` is judged (module docstring)
_ROUTERS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe")
_ESCORE = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe")
_LAYER = re.compile(r"\d+\.(?P<rel>.+)$")


def param_shape_problems(config: dict, tensors: dict[str, TensorInfo], mods: dict[str, Module]) -> list[Problem]:
    """One error per stored parameter of the decoder stack whose size is not the one vLLM 0.33 builds from
    ``config`` (module docstring), naming its shard file, the tensor, the size stored, the size built and the config
    keys it comes from. ``tensors``: the checkpoint's tensors by name; ``mods``: its modules (a quantized router's dense
    shape). Empty for a family not judged, a broken config, or no decoder stack found."""
    if not isinstance(config, dict):
        return []
    family = next((t for t in reversed(vllm_types(config)) if t in _FAMILIES), None)  # architectures' class, as vLLM builds it
    stack = decoder_layers_prefix(tensors)
    if family is None or stack is None:
        return []
    cfg = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    counted = expert_count(config)
    rules = _rules(family, cfg, counted if counted is not None and counted[1] > 0 else None, cfg.get("model_type") or config.get("model_type"))
    out = []
    for name in sorted(tensors):
        m = _LAYER.fullmatch(name[len(stack) :]) if name.startswith(stack) else None
        rule = rules.get(m["rel"].removesuffix("_packed")) if m else None  # a quantized router: its dense shape
        if rule is None:
            continue
        want, keys = rule
        have = _stored(name, tensors[name], mods)
        loaded = [1, *have] if family == "qwen2_moe" and rule is rules.get("mlp.shared_expert_gate.weight") and have and len(have) == 1 else have
        if have is not None and loaded != want:  # (loaded: qwen2_moe.py load_weights makes a 1-D gate [1, hidden_size])
            file, attn, moe = _FAMILIES[family][:3]
            cls = attn if m["rel"].startswith("self_attn.") else moe
            msg = f"{name} is {have}, where vLLM 0.33 {file} {cls} builds {keys[0]} = {want} (config.json {keys[1]}): vLLM refuses the checkpoint"
            out.append(Problem("error", msg, str(tensors[name].file), name))
    return out


def _stored(name: str, info: TensorInfo, mods: dict[str, Module]) -> list[int] | None:
    """The parameter's size: a 1-D tensor's, a dense router weight's; a quantized router's dense ``[N, K]``."""
    if name.endswith(".weight_packed") or name.endswith(".weight") and info.dtype not in ("BF16", "F16", "F32"):
        dims = dense_dims(mods[name.rpartition(".")[0]]) if name.rpartition(".")[0] in mods else None
        return list(dims) if dims is not None else None
    return [int(d) for d in info.shape]


def _rules(family: str, cfg: dict, counted: tuple[str, int] | None, model_type: str | None) -> dict[str, tuple[list[int], tuple[str, str]]]:
    """Relative name in a layer -> (the size vLLM builds, (its formula, the config keys read)); ``counted``: the
    routed experts vLLM builds and the key they come from (:func:`.expert_count.expert_count`); ``model_type``: the
    class ``cfg`` is parsed as (its ``num_key_value_heads`` where null or absent: :func:`.config_types.kv_heads`)."""
    out: dict[str, tuple[list[int], tuple[str, str]]] = {}
    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    kv_words, kv = kv_heads(cfg, model_type, heads)
    hd, hd_keys = _head_dim(_FAMILIES[family][3], cfg, hidden, heads, model_type)
    if hd is not None and family in _PER_HEAD_NORM and _built(family, cfg, "qk_norm"):
        for p in ("q_norm", "k_norm"):
            out[f"self_attn.{p}.weight"] = ([hd], ("[head_dim]", hd_keys))
    if hd is not None and heads is not None and family == "olmoe":
        out["self_attn.q_norm.weight"] = ([heads * hd], ("[num_attention_heads * head_dim]", f"num_attention_heads, {hd_keys}"))
        if kv is not None:
            out["self_attn.k_norm.weight"] = ([kv * hd], ("[num_key_value_heads * head_dim]", f"{kv_words}, {hd_keys}"))
    if hd is not None and family in _QKV_BIAS and _built(family, cfg, "qkv_bias"):
        if heads is not None:
            out["self_attn.q_proj.bias"] = ([heads * hd], ("[num_attention_heads * head_dim]", f"num_attention_heads, {hd_keys}"))
        if kv is not None:
            for p in ("k_proj", "v_proj"):
                out[f"self_attn.{p}.bias"] = ([kv * hd], ("[num_key_value_heads * head_dim]", f"{kv_words}, {hd_keys}"))
    if hidden is not None and family in _O_BIAS and _built(family, cfg, "o_bias"):
        out["self_attn.o_proj.bias"] = ([hidden], ("[hidden_size]", "hidden_size"))
    if counted is not None and family in _ROUTERS:
        key, experts = counted
        root = "block_sparse_moe" if family == "mixtral" else "mlp"
        if hidden is not None:
            out[f"{root}.gate.weight"] = ([experts, hidden], (f"[{key}, hidden_size]", f"{key}, hidden_size"))
        if family == "glm4_moe" or family in _ESCORE and cfg.get("topk_method") == "noaux_tc":  # else none built: expected.py
            out[f"{root}.gate.e_score_correction_bias"] = ([experts], (f"[{key}]", key))
    if family == "qwen2_moe" and hidden is not None:  # ReplicatedLinear(hidden_size, 1), in every MoE block
        out["mlp.shared_expert_gate.weight"] = ([1, hidden], ("[1, hidden_size]", "hidden_size"))
    if family == "gpt_oss" and counted is not None:
        out.update(_gpt_oss_rules(cfg, hidden, counted))
    if family in MLA_FAMILIES:
        for p, key in (("kv_a_layernorm", "kv_lora_rank"), ("q_a_layernorm", "q_lora_rank")):
            if (n := _int(cfg, key)) is not None:
                out[f"self_attn.{p}.weight"] = ([n], (f"[{key}]", key))
    return out


def _gpt_oss_rules(cfg: dict, hidden: int | None, counted: tuple[str, int]) -> dict[str, tuple[list[int], tuple[str, str]]]:
    """gpt-oss's router and fused expert biases (module docstring), where ``config.json`` holds the sizes; ``counted``:
    the experts and the key they come from (``num_local_experts``, or ``num_experts`` where it holds both)."""
    key, experts = counted
    out: dict[str, tuple[list[int], tuple[str, str]]] = {"mlp.router.bias": ([experts], (f"[{key}]", key))}
    if hidden is not None:
        for rel in ("mlp.router.weight", "mlp.experts.down_proj_bias"):
            out[rel] = ([experts, hidden], (f"[{key}, hidden_size]", f"{key}, hidden_size"))
    if (inter := _int(cfg, "intermediate_size")) is not None:
        out["mlp.experts.gate_up_proj_bias"] = ([experts, 2 * inter], (f"[{key}, 2 * intermediate_size]", f"{key}, intermediate_size"))
    return out


def _built(family: str, cfg: dict, what: str) -> bool:
    """Whether the family's vLLM file builds the q/k norms (``qk_norm``: Qwen2 only with ``qk_norm``, ``qwen2.py``;
    GLM-4.5 only with ``use_qk_norm``) or the q/k/v biases (``qkv_bias``) or o's (``o_bias``) under this config (the
    biases as :func:`.expected.builds_bias` reads the family's file). One stored where none is built is
    :mod:`.expected`'s (an extra tensor), not a size."""
    if what == "qk_norm":
        return cfg.get("qk_norm") is True if family == "qwen2" else cfg.get("use_qk_norm") is True if family == "glm4_moe" else True
    return builds_bias(family, "o_proj" if what == "o_bias" else "q_proj", cfg) is True


def _head_dim(how: str | None, cfg: dict, hidden: int | None, heads: int | None, model_type: str | None) -> tuple[int | None, str]:
    """``head_dim`` as the family's vLLM file reads it (:data:`_FAMILIES`), and the config keys it comes from: ``key``
    and ``cfg``, the config's value or, where it has none, the class's (``head_dim or hidden_size // num_heads`` of the
    config transformers 5.20 builds: :func:`.config_types.head_dim`; a Qwen3 without it has 128); ``hidden``, always
    ``hidden_size / num_attention_heads``."""
    if how in ("cfg", "key"):
        return head_dim(cfg, model_type)
    if how == "hidden" and hidden is not None and heads and hidden % heads == 0:
        return hidden // heads, "hidden_size / num_attention_heads"
    return None, ""


def _int(cfg: dict, key: str) -> int | None:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
