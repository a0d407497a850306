"""DeepSeek's MLA attention projections against ``config.json``'s head sizes and LoRA ranks (``verify``, no reference
needed).

vLLM 0.33 ``deepseek_v2.py`` ``DeepseekV2DecoderLayer`` builds ``DeepseekV2MLAAttention`` (or, without MLA kernels,
``DeepseekV2Attention``, the same projections) from ``num_attention_heads``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``, ``q_lora_rank`` and ``kv_lora_rank``, with ``qk_head_dim = qk_nope_head_dim +
qk_rope_head_dim``. Its Linears, ``[N, K]`` as stored (``linear.py`` ``weight_loader`` asserts each shape):

- ``q_a_proj`` ``[q_lora_rank, hidden_size]`` (in ``fused_qkv_a_proj``) and ``q_b_proj`` ``[num_attention_heads *
  qk_head_dim, q_lora_rank]`` where ``q_lora_rank`` is set, else ``q_proj`` ``[num_attention_heads * qk_head_dim,
  hidden_size]``;
- ``kv_a_proj_with_mqa`` ``[kv_lora_rank + qk_rope_head_dim, hidden_size]``;
- ``kv_b_proj`` ``[num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``;
- ``o_proj`` ``[hidden_size, num_attention_heads * v_head_dim]``.

The ``hidden_size`` sides are :mod:`.widths`' (judged there); this module judges the others, in every layer of the
decoder stack (:func:`.naming.decoder_layers_prefix`; the MTP layers after it are built alike). Not judged: a family
other than DeepSeek-V2/V3 and Kimi-K2 (the class vLLM builds from ``architectures``, as :mod:`.param_shapes` reads
it: :func:`.architectures.vllm_types`), a layer vLLM builds
without MLA (``qk_nope_head_dim`` and ``qk_rope_head_dim`` both 0: ``DeepseekAttention``), a config key that is absent
or not an integer (each size that needs it; a key left out is transformers 5.20's default, as vLLM reads it),
and a quantized module whose dense shape cannot be read
(:func:`.widths.dense_dims`). One error per projection and disagreeing side, naming the shard file, the module, both
sizes and the config keys.
"""

from __future__ import annotations

import re

from .architectures import vllm_types
from .modules import Module
from .naming import decoder_layers_prefix
from .reader import Problem
from .safetensors_io import TensorInfo
from .widths import config_size, dense_dims

__all__ = ["MLA_FAMILIES", "mla_shape_problems"]

#: the model types built by vLLM 0.33 deepseek_v2.py (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, and Kimi-K2 as V3)
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
_PROJ = re.compile(r"\d+\.self_attn\.(?P<proj>q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)$")


def mla_shape_problems(mods: dict[str, Module], config: dict, tensors: dict[str, TensorInfo]) -> list[Problem]:
    """One error per MLA projection side (N rows or K columns) whose size is not the one vLLM 0.33 builds from
    ``config`` (module docstring). ``mods``: the checkpoint's modules (:func:`.modules.modules_of`); ``tensors``: its
    tensors by name. Empty for a family not judged, a layer built without MLA, or no decoder stack found."""
    if not isinstance(config, dict) or not any(t in MLA_FAMILIES for t in vllm_types(config)):
        return []
    cfg = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    stack = decoder_layers_prefix(tensors)
    if stack is None or (cfg.get("qk_nope_head_dim") == 0 and cfg.get("qk_rope_head_dim") == 0):
        return []
    want = _sizes(cfg)
    out = []
    for name in sorted(mods):
        m = _PROJ.fullmatch(name[len(stack) :]) if name.startswith(stack) else None
        dims = dense_dims(mods[name]) if m else None
        if dims is None:
            continue
        for side, have in zip(("rows", "columns"), dims):
            rule = want.get((m["proj"], side))
            if rule is not None and rule[0] != have:
                size, formula = rule
                msg = (
                    f"{name} has {have} {side}, where vLLM 0.33 deepseek_v2.py DeepseekV2MLAAttention builds {formula} = {size} "
                    f"(config.json): vLLM refuses the checkpoint"
                )
                out.append(Problem("error", msg, mods[name].file, name))
    return out


#: transformers 5.20's DeepseekV2Config and DeepseekV3Config (Kimi-K2's too) defaults, which vLLM 0.33 builds from where
#: config.json leaves a key out (``deepseek_v2.py`` reads them with ``getattr``; ``q_lora_rank`` null: ``q_proj``)
_DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}


def _sizes(cfg: dict) -> dict[tuple[str, str], tuple[int, str]]:
    """(projection, "rows" or "columns") -> (the size vLLM builds, its formula of config keys with their values; a key
    config.json leaves out is transformers' default, :data:`_DEFAULTS`, and says so)."""
    v: dict[str, int | None] = {"num_attention_heads": config_size(cfg, "num_attention_heads")}
    w: dict[str, str] = {"num_attention_heads": f"num_attention_heads {v['num_attention_heads']}"}
    for key, default in _DEFAULTS.items():
        v[key] = config_size(cfg, key) if key in cfg else default
        w[key] = f"{key} {v[key]}" + ("" if key in cfg else " (absent: transformers' default)")
    keys = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank")
    heads, nope, rope, vd, q_rank, kv_rank = (v[k] for k in keys)
    out: dict[tuple[str, str], tuple[int, str]] = {}
    h = w["num_attention_heads"]
    if heads is not None and nope is not None and rope is not None:
        qk = (heads * (nope + rope), f"{h} x ({w['qk_nope_head_dim']} + {w['qk_rope_head_dim']})")
        out[("q_b_proj" if q_rank is not None else "q_proj", "rows")] = qk
    if q_rank is not None:
        out[("q_a_proj", "rows")] = out[("q_b_proj", "columns")] = (q_rank, w["q_lora_rank"])
    if kv_rank is not None:
        out[("kv_b_proj", "columns")] = (kv_rank, w["kv_lora_rank"])
        if rope is not None:
            out[("kv_a_proj_with_mqa", "rows")] = (kv_rank + rope, f"{w['kv_lora_rank']} + {w['qk_rope_head_dim']}")
    if heads is not None and nope is not None and vd is not None:
        out[("kv_b_proj", "rows")] = (heads * (nope + vd), f"{h} x ({w['qk_nope_head_dim']} + {w['v_head_dim']})")
    if heads is not None and vd is not None:
        out[("o_proj", "columns")] = (heads * vd, f"{h} x {w['v_head_dim']}")
    return out
