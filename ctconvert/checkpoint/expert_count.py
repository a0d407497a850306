"""Which ``config.json`` key gives a MoE family's routed-expert count, as vLLM 0.33 reads it.

vLLM 0.33 reads one attribute of the parsed config per family (``vllm/model_executor/models/``: qwen3_moe.py
``Qwen3MoeSparseMoeBlock`` ``config.num_experts``, gpt_oss.py ``MLPBlock`` ``config.num_local_experts``, deepseek_v2.py
``DeepseekV2MoE`` ``config.n_routed_experts`` ...), and the config is transformers 5.20's class for the ``model_type``,
whose ``attribute_map`` aliases one key onto another (configuration_qwen3_moe.py ``Qwen3MoeConfig``:
``{"num_experts": "num_local_experts"}``). Where ``config.json`` holds both keys of an alias, the one the class does
not declare as a field wins: transformers 5.20 configuration_utils.py ``wrap_init_to_accept_kwargs`` sets the declared
fields first and the other keys after them, through ``__setattr__``, which follows the alias. So a Qwen3-MoE config with
``num_experts: 8`` (its field) and ``num_local_experts: 4`` builds 4 experts (a new-user trial: vLLM built 4 and loaded
the checkpoint). :data:`EXPERT_COUNT` records, per family, the keys in that order (the winner first) and where vLLM
reads the count; :func:`expert_count` resolves a config by it. ``tests/checkpoint/test_expert_count.py`` compares the
table with the installed transformers' classes.

A family not in the table is judged on every expert key it holds (:data:`EXPERT_KEYS`, :func:`expert_count_keys`):
which one its loader reads is not known.
"""

from __future__ import annotations

__all__ = ["EXPERT_COUNT", "EXPERT_KEYS", "expert_count", "expert_count_keys", "expert_family"]

#: the config keys naming the routed experts of each MoE block, in the order they are looked up for a family not in
#: :data:`EXPERT_COUNT` (Qwen-MoE, Mixtral/gpt-oss/Llama-4 and DeepSeek spell it so)
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

_QWEN3_MOE = (("num_local_experts", "num_experts"), "qwen3_moe.py Qwen3MoeSparseMoeBlock (config.num_experts)")
_DEEPSEEK_V3 = (("num_local_experts", "n_routed_experts"), "deepseek_v2.py DeepseekV2MoE (config.n_routed_experts)")
_GLM4_MOE = (("num_local_experts", "n_routed_experts"), "glm4_moe.py Glm4MoE (config.n_routed_experts)")
_QWEN3_5 = (("num_experts",), "qwen3_5.py, qwen3_next.py Qwen3NextSparseMoeBlock (config.num_experts)")
_BACKEND = (("num_local_experts", "num_experts"), "the Transformers backend (transformers/moe.py, CONFIG_FIELD_ALIASES['num_experts'])")

#: model_type -> (the keys that set the count vLLM 0.33 builds, the winner first where ``config.json`` holds more than
#: one, and where vLLM reads it). The keys: transformers 5.20 ``configuration_<family>.py``, its declared field and its
#: ``attribute_map`` alias (the alias, not a field, wins: module docstring); a family without an alias has one key
#: (Qwen2-MoE's ``num_local_experts`` is no alias of ``num_experts``: vLLM never reads it).
EXPERT_COUNT: dict[str, tuple[tuple[str, ...], str]] = {
    "qwen2_moe": (("num_experts",), "qwen2_moe.py Qwen2MoeSparseMoeBlock (config.num_experts)"),
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_vl_moe": _QWEN3_MOE,  # qwen3_vl_moe.py builds qwen3_moe.py's blocks from text_config
    "qwen3_vl_moe_text": _QWEN3_MOE,
    "qwen3_next": (("num_experts",), "qwen3_next.py Qwen3NextSparseMoeBlock (config.num_experts)"),
    "qwen3_5_moe": _QWEN3_5,
    "qwen3_5_moe_text": _QWEN3_5,
    "olmoe": (("num_local_experts", "num_experts"), "olmoe.py OlmoeMoE (config.num_experts)"),
    "flex_olmo": _BACKEND,
    "hunyuan_v1_moe": _BACKEND,
    "deepseek_v2": (("num_experts", "n_routed_experts"), "deepseek_v2.py DeepseekV2MoE (config.n_routed_experts)"),
    "deepseek_v3": _DEEPSEEK_V3,
    "deepseek_v32": _DEEPSEEK_V3,  # vLLM 0.33 transformers_utils/config.py: transformers' DeepseekV3Config
    "kimi_k2": _DEEPSEEK_V3,  # the same
    "glm4_moe": _GLM4_MOE,
    "glm4v_moe": _GLM4_MOE,  # glm4_1v.py Glm4vMoeForConditionalGeneration builds Glm4MoeForCausalLM from text_config
    "glm4v_moe_text": _GLM4_MOE,
    "glm4_moe_lite": (("num_local_experts", "n_routed_experts"), "glm4_moe_lite.py (config.n_routed_experts)"),
    "dots1": (("num_local_experts", "n_routed_experts"), "no vLLM 0.33 model (Dots1ForCausalLM removed in 0.23); transformers 5.20 Dots1Config"),
    "ernie4_5_moe": (("num_experts", "moe_num_experts"), "ernie45_moe.py Ernie4_5_MoeMoE (config.moe_num_experts)"),
    "mixtral": (("num_experts", "num_local_experts"), "mixtral.py MixtralMoE (config.num_local_experts)"),
    "minimax": (("num_experts", "num_local_experts"), "no vLLM 0.33 model (MiniMaxForCausalLM removed in 0.23); transformers 5.20 MiniMaxConfig"),
    "minimax_m2": (("num_experts", "num_local_experts"), "minimax_m2.py MiniMaxM2MoE (config.num_local_experts)"),
    "phimoe": (("num_local_experts",), "phimoe.py PhiMoE (config.num_local_experts)"),
    "granitemoe": (("num_local_experts",), "granitemoe.py GraniteMoeMoE (config.num_local_experts)"),
    "gemma4": (("num_experts",), "gemma4.py (config.num_experts)"),
    "gemma4_text": (("num_experts",), "gemma4.py (config.num_experts)"),
    "llama4": (("num_local_experts",), "llama4.py Llama4MoE (config.num_local_experts)"),
    "llama4_text": (("num_local_experts",), "llama4.py Llama4MoE (config.num_local_experts)"),
    "gpt_oss": (("num_experts", "num_local_experts"), "gpt_oss.py MLPBlock (config.num_local_experts)"),
}


def _level(config: dict) -> dict:
    """The config level vLLM builds the language model from: ``text_config`` where it is a dict, else the config."""
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config


def expert_family(config: dict) -> str | None:
    """The :data:`EXPERT_COUNT` family of ``config``: its ``text_config``'s ``model_type`` where listed, else its own; None
    for a family not listed (or a config that is not a dict)."""
    if not isinstance(config, dict):
        return None
    types = [_level(config).get("model_type"), config.get("model_type")]
    return next((t for t in types if isinstance(t, str) and t in EXPERT_COUNT), None)


def expert_count_keys(config: dict) -> tuple[str, ...]:
    """The expert keys of ``config`` to judge: for a listed family, the one whose value vLLM 0.33 builds (the first of
    its :data:`EXPERT_COUNT` keys the config's level holds, whatever its value: a value that is no integer is a type
    error of its own), or none; else every key of :data:`EXPERT_KEYS` (a family not listed)."""
    family = expert_family(config)
    if family is None:
        return EXPERT_KEYS
    level = _level(config)
    return next(((k,) for k in EXPERT_COUNT[family][0] if k in level), ())


def expert_count(config: dict) -> tuple[str, int] | None:
    """``(key, n)``: the routed experts per MoE block vLLM 0.33 builds for a listed family (:data:`EXPERT_COUNT`) and the
    ``config.json`` key that gives them; None for a family not listed, a config without the key, or a value that is not
    an integer (a boolean neither)."""
    family = expert_family(config)
    keys = expert_count_keys(config) if family is not None else ()
    if not keys:
        return None
    n = _level(config)[keys[0]]
    return (keys[0], n) if isinstance(n, int) and not isinstance(n, bool) else None
