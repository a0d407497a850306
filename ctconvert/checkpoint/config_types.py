"""``config.json`` values vLLM 0.33 refuses when it parses the config, before it builds anything (``verify``, no reference).

vLLM 0.33 parses ``config.json`` into transformers 5.20's config class for its ``model_type`` (``vllm/transformers_utils/
config.py`` ``get_config``: ``AutoConfig``, the class of ``CONFIG_MAPPING``). Those classes are strict dataclasses
(``configuration_utils.py`` ``PreTrainedConfig``, ``@strict`` of huggingface_hub 2.4 ``dataclasses.py``): each declared
field's value is checked against its annotation as it is set (``type_validator``: ``int`` takes no boolean, ``float``
takes no integer, ``bool`` no ``0``/``1``, a ``list[int]`` no ``"1"`` item; ``None`` only where the annotation admits it),
and after ``__init__`` the class validators run. A failure is ``StrictDataclassFieldValidationError`` or
``StrictDataclassClassValidationError``, and ``vllm serve`` stops there (new-user trials: ``rms_norm_eps: "1e-6"``,
"Field 'rms_norm_eps' expected float, got str"; ``hidden_act: 5``, ``max_position_embeddings: "512"``,
``initializer_range: "0.02"``, gpt-oss ``sliding_window: "128"``). Two rules are judged here, one error per value,
naming config.json, the key, the value and what vLLM requires:

- **Types** (:func:`config_type_problems`): every field the class of each family ctconvert knows declares
  (:data:`DECLARED`, written from transformers 5.20.2's ``models/<family>/configuration_*.py`` classes into the
  package data :data:`FIELDS_FILE` by ``scripts/config_fields.py``, which builds each class with a wrong and a right
  value of every key) whose annotation is one judged exactly here: ``int``, ``float``, ``bool``, ``str``, ``list[int]``,
  ``list[str]``, ``float | int`` (a number, no boolean) and the token ids' ``int | list[int]``, each with or without
  ``| None``. ``float`` takes no integer (``rms_norm_eps: 1`` is refused: write ``1.0``), ``int`` and ``float | int``
  no boolean, ``bool`` no ``0``/``1``, ``str`` no number. The other fields are not judged: a dict (``rope_parameters``),
  a ``Literal``, Jamba's ``mamba_dt_rank: int | str``, and ``PreTrainedConfig``'s own fields (``dtype``,
  ``architectures``, ``transformers_version`` ...: ``configuration_utils.py`` has ``from __future__ import
  annotations``, and huggingface_hub's ``type_validator`` skips a string annotation). A key the class does not
  declare is set without a check (an ``attribute_map`` alias such as DeepSeek-V3's ``num_local_experts`` too), so it
  is not judged here; :func:`.depth.count_type_problems` judges the counts and sizes of every family, and its keys
  are left to it where their value is not null, but ``head_dim``, worded here from the class that declares it (an
  integer: ``head_dim: 32.0`` is refused as ``max_position_embeddings: "512"`` is).
- **Layer types** (:func:`layer_types_problems`): ``PreTrainedConfig.validate_layer_type``, which every strict class
  runs, whether or not it declares ``layer_types``: ``layer_types``, where it is not null, is a list of names of
  ``ALLOWED_ATTN_LAYER_TYPES`` (after ``_LEGACY_LAYER_TYPE_REMAP``: ``"attention"`` is ``"full_attention"``) with one entry
  per layer, ``num_hidden_layers`` (a trial's gpt-oss with one of two: "`num_hidden_layers` (2) must be equal to the
  number of `layer_types` (1)").

The levels judged: the config itself where its ``model_type`` is a listed family (DeepSeek-V3.2's and Kimi-K2's as
``DeepseekV3Config``, which vLLM parses them with: :data:`_PARSED_AS`), and its ``text_config`` as the class
the composite builds it with (:data:`_TEXT_CLASS`: Gemma 3's ``Gemma3TextConfig`` whatever its ``model_type`` says;
LLaVA's by its ``model_type``, ``llama`` where absent); Qwen2-VL and Qwen2.5-VL without a ``text_config`` pass their
flat keys to their text class (``Qwen2VLConfig.__post_init__``). A family not listed, a ``vision_config``, and the
other class validators (Llama's ``hidden_size % num_attention_heads``) are not judged.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import plural
from .depth import EXPERT_KEYS, SIZE_KEYS, count_type_problems
from .reader import CONFIG_NAME, Problem

__all__ = [
    "DECLARED",
    "FIELDS_FILE",
    "PARSE_CHECK",
    "architectures_problems",
    "config_type_problems",
    "declared",
    "head_dim",
    "kv_head_count",
    "kv_heads",
    "layer_types_problems",
    "parse_problems",
    "rope_problems",
]

#: the line ``verify`` lists among its checks
PARSE_CHECK = "config.json's values of the types transformers 5.20 declares, its layer_types, architectures and RoPE base, as vLLM 0.33 parses them"

#: what a type code of :data:`FIELDS_FILE` requires, in words, and the annotation it stands for (a trailing ``?``
#: admits null: ``int | None``); ``n`` is transformers' ``float | int`` (or ``int | float``), ``t`` a token id's ``int | list[int]``
_WORDS = {"i": "an integer", "f": "a float", "b": "a boolean", "s": "a string", "I": "a list of integers", "S": "a list of strings"}
_WORDS |= {"n": "a number", "t": "an integer or a list of integers"}
_ANNOTATION = {"i": "int", "f": "float", "b": "bool", "s": "str", "I": "list[int]", "S": "list[str]", "n": "float | int", "t": "int | list[int]"}
#: the table, package data: one line per listed family, ``model_type class key:code ...``, every field of transformers
#: 5.20.2's class whose annotation is one of :data:`_WORDS`' (written by ``scripts/config_fields.py``, which confirms
#: each by building the class)
FIELDS_FILE = "transformers_520_fields.txt"


def _load_declared() -> dict[str, tuple[str, dict[str, str]]]:
    """:data:`FIELDS_FILE` read: model_type -> (its class's name, its judged keys -> their codes)."""
    out = {}
    for line in Path(__file__).with_name(FIELDS_FILE).read_text().splitlines():
        if line and not line.startswith("#"):
            family, cls, *fields = line.split()
            out[family] = (cls, dict(f.split(":") for f in fields))
    return out


#: model_type -> (transformers 5.20's class, the keys it declares with an annotation :func:`_fits` judges exactly ->
#: their code): every such field of the class, those inherited included (``PreTrainedConfig``'s own are string
#: annotations, which huggingface_hub's ``type_validator`` skips: not listed), but ``layer_types``
#: (:func:`layer_types_problems`); read from :data:`FIELDS_FILE`
DECLARED: dict[str, tuple[str, dict[str, str]]] = _load_declared()
#: model_types vLLM 0.33 parses with another type's class (transformers_utils/config.py ``_CONFIG_REGISTRY``:
#: ``deepseek_v32`` and ``kimi_k2`` as transformers' ``DeepseekV3Config``)
_PARSED_AS = {"deepseek_v32": "deepseek_v3", "kimi_k2": "deepseek_v3"}
#: a composite's ``model_type`` -> the class its ``text_config`` is built with (transformers 5.20
#: ``sub_configs_defaults["text_config"]``: a fixed class; LLaVA's is ``AutoConfig``, by the text config's model_type)
_TEXT_CLASS = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "llama4": "llama4_text",
    "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "glm4v_moe": "glm4v_moe_text",
}
_AUTO_TEXT = {"llava": "llama", "llava_next": "llama", "llava_next_video": "llama", "llava_onevision": "qwen2"}
#: transformers 5.20 configuration_utils.py ``ALLOWED_ATTN_LAYER_TYPES`` and ``_LEGACY_LAYER_TYPE_REMAP``
_LAYER_TYPES = (
    "full_attention sliding_attention chunked_attention window_attention indexed_attention compressed_sparse_attention "
    "heavily_compressed_attention minimax_m3_sparse conv moe hybrid hybrid_sliding reference_sliding_attention linear_attention"
).split()
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention", "deepseek_sparse_attention": "indexed_attention"}
_LEGACY["qwen_sparse_attention"] = "indexed_attention"
#: the count and size keys a class declaring them judges here, worded from the class as the other typed fields are
#: (``head_dim: 32.0``: "LlamaConfig declares head_dim: int | None", as ``max_position_embeddings: "512"``); where the
#: class declares it an integer, :func:`.depth.count_type_problems` (which refuses the same values) leaves it to this
_CLASS_WORDED = frozenset(("head_dim",))
#: the keys :func:`.depth.count_type_problems` judges (any family, any value but null), :data:`_CLASS_WORDED`'s aside
_COUNTED = frozenset(("num_hidden_layers", "num_nextn_predict_layers", *EXPERT_KEYS, *SIZE_KEYS)) - _CLASS_WORDED


def declared(family: str) -> dict[str, str]:
    """The keys :data:`DECLARED`'s class of ``family`` declares -> their type code (``"i"``, ``"f?"`` ...)."""
    return dict(DECLARED[family][1])


def _levels(config: dict) -> list[tuple[str, dict, str]]:
    """``(key prefix, level, listed family)`` of each level of ``config`` a listed class parses (module docstring)."""
    outer, tc = config.get("model_type"), config.get("text_config")
    outer = _PARSED_AS.get(outer, outer) if isinstance(outer, str) else outer
    out = [("", config, outer)] if outer in DECLARED else []
    text = _TEXT_CLASS.get(outer) if isinstance(outer, str) else None
    if isinstance(tc, dict) and isinstance(outer, str) and (outer in _TEXT_CLASS or outer in _AUTO_TEXT):
        family = text or tc.get("model_type", _AUTO_TEXT[outer])
        if family in DECLARED:
            out.append(("text_config.", tc, family))
    elif outer in ("qwen2_vl", "qwen2_5_vl"):
        out.append(("", config, text))
    return out


#: configuration_utils.py ``_FLOAT_TAG_KEY`` / ``_FLOAT_TAG_VALUES``: ``{"__float__": "NaN"}`` is read as a float
#: (``_decode_special_floats``) before the class sees it
_FLOAT_TAGS = ("NaN", "Infinity", "-Infinity")


def _is(value, base: str) -> bool:
    """Whether ``value`` (not null) is of the kind of ``base``, a code of :data:`_WORDS` without ``?``, as
    huggingface_hub 2.4's ``type_validator`` checks it (``_validate_simple_type``: ``int`` takes no boolean, ``float``
    no integer; ``_validate_list`` each item; ``_validate_union`` any member)."""
    if base in "IS":
        return isinstance(value, list) and all(_is(v, base.lower()) for v in value)
    if base in "nt":
        return _is(value, "i") or _is(value, "f" if base == "n" else "I")
    if base == "f" and isinstance(value, dict) and len(value) == 1 and value.get("__float__") in _FLOAT_TAGS:
        return True
    kind = {"i": int, "f": float, "b": bool, "s": str}[base]
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _fits(value, code: str) -> bool:
    """Whether ``value`` passes huggingface_hub's ``type_validator`` for the annotation of ``code``."""
    return code.endswith("?") if value is None else _is(value, code.rstrip("?"))


def config_type_problems(config: dict, file: str | None = None) -> list[Problem]:
    """An error for each value of a key a listed class declares (:data:`DECLARED`) whose type its annotation refuses
    (module docstring), at each level of the config a listed class parses; ``file``: the config's path, named by the
    error. Empty for a family not listed or a config that is not a dict."""
    out = []
    for prefix, level, family in _levels(config) if isinstance(config, dict) else []:
        cls = DECLARED[family][0]
        for key, code in declared(family).items():
            value = level.get(key)
            if key not in level or _fits(value, code) or (key in _COUNTED and value is not None):
                continue
            want = _WORDS[code.rstrip("?")].replace(" or ", ", ") + " or null" if code.endswith("?") else _WORDS[code]
            note = f" (write {float(value)!r})" if code.rstrip("?") == "f" and isinstance(value, int) and not isinstance(value, bool) else ""
            annotation = _ANNOTATION[code.rstrip("?")] + (" | None" if code.endswith("?") else "")
            why = f"vLLM 0.33 refuses the config when it parses it (transformers 5.20 {cls} declares {key}: {annotation}; its strict validation fails)"
            out.append(Problem("error", f"config.json's {prefix}{key} is {json.dumps(value)}, not {want}{note}: {why}", file))
    return out


def layer_types_problems(config: dict, file: str | None = None) -> list[Problem]:
    """An error for a ``layer_types`` that transformers 5.20's ``PreTrainedConfig.validate_layer_type`` refuses, at each
    level of the config a listed class parses (module docstring): not a list, an entry that is not a layer type it
    knows, or another number of entries than ``num_hidden_layers`` (judged where that is an integer)."""
    out = []
    why = "vLLM 0.33 refuses the config when it parses it (transformers 5.20 PreTrainedConfig.validate_layer_type)"
    for prefix, level, _ in _levels(config) if isinstance(config, dict) else []:
        types, n = level.get("layer_types"), level.get("num_hidden_layers")
        key = f"config.json's {prefix}layer_types"
        if types is None:
            continue
        if not isinstance(types, list):
            out.append(Problem("error", f"{key} is {json.dumps(types)}, not a list of layer types or null: {why}", file))
            continue
        bad = next(((i, t) for i, t in enumerate(types) if not isinstance(t, str) or _LEGACY.get(t, t) not in _LAYER_TYPES), None)
        if bad is not None:
            known = ", ".join(_LAYER_TYPES[:3])
            out.append(Problem("error", f"{key}[{bad[0]}] is {json.dumps(bad[1])}, not a layer type transformers 5.20 knows ({known} ...): {why}", file))
        if isinstance(n, int) and not isinstance(n, bool) and len(types) != n:
            entries = plural(len(types), "entry", "entries")
            out.append(Problem("error", f"{key} has {entries}, but {prefix}num_hidden_layers is {n}: one per layer: {why}", file))
    return out


def architectures_problems(config: dict, file: str | None = None) -> list[Problem]:
    """An error for a top-level ``architectures`` that vLLM 0.33 refuses when it builds its model config: anything but a
    list of strings, null or absent (``vllm/config/model_arch.py`` ``ModelArchitectureConfig.architectures:
    list[str]``, a pydantic dataclass, given ``hf_config.architectures or []`` by
    ``model_arch_config_convertor.py`` ``get_architectures``; a string is "not a valid list", a number in the list "not
    a valid string"). An empty list passes: vLLM then takes the class from ``model_type``."""
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not archs:
        return []
    why = "vLLM 0.33 refuses the config (ModelArchitectureConfig.architectures is a list of class names)"
    if not isinstance(archs, list):
        hint = f"; write [{json.dumps(archs)}]" if isinstance(archs, str) else ""
        return [Problem("error", f"config.json's architectures is {json.dumps(archs)}, not a list of strings: {why}{hint}", file)]
    bad = next(((i, a) for i, a in enumerate(archs) if not isinstance(a, str)), None)
    if bad is not None:
        return [Problem("error", f"config.json's architectures[{bad[0]}] is {json.dumps(bad[1])}, not a string: {why}", file)]
    return []


def rope_problems(config: dict, file: str | None = None) -> list[Problem]:
    """An error for a RoPE base that is not a number, in the config or its ``text_config``: ``rope_parameters.rope_theta``
    (of each layer type where ``rope_parameters`` holds one dict per type), else the top-level ``rope_theta`` that
    transformers 5.20 moves into ``rope_parameters`` (``PreTrainedConfig`` rope handling; the dict is not type-checked
    when the config is parsed). vLLM 0.33 computes its rotary frequencies from it and fails building the model on a
    string (the new-user trial: ``rope_parameters.rope_theta: "10000"``, "unsupported operand type(s) for ** or pow():
    'str' and 'Tensor'")."""
    out = []
    levels = [("", config)] + ([("text_config.", config["text_config"])] if isinstance(config.get("text_config"), dict) else [])
    for prefix, level in levels:
        rp = level.get("rope_parameters")
        dicts = {"": rp} if isinstance(rp, dict) and "rope_theta" in rp else {}
        if isinstance(rp, dict) and not dicts:
            dicts = {f"{k}.": v for k, v in rp.items() if isinstance(v, dict) and "rope_theta" in v}  # one per layer type
        found = [(f"{prefix}rope_parameters.{k}rope_theta", d["rope_theta"]) for k, d in dicts.items()]
        if not found and "rope_theta" in level:
            found = [(f"{prefix}rope_theta", level["rope_theta"])]
        for key, v in found:
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                why = "vLLM 0.33 computes the rotary frequencies from it and fails building the model"
                out.append(Problem("error", f"config.json's {key} is {json.dumps(v)}, not a number: {why}", file))
    return out


def parse_problems(config: dict, folder: str) -> list[Problem]:
    """Every value of ``config`` that vLLM 0.33 refuses when it parses it: :func:`.depth.count_type_problems` (but a key
    of :data:`_CLASS_WORDED` its level's class declares an integer: :func:`config_type_problems` words it),
    :func:`config_type_problems`, :func:`layer_types_problems`, :func:`architectures_problems`, :func:`rope_problems`;
    ``folder``: the checkpoint's path (the errors name its config.json). Empty where the config is not a dict (a broken config.json, reported by the reader)."""
    if not isinstance(config, dict):
        return []
    file = f"{folder}/{CONFIG_NAME}"
    worded = {f"{prefix}{k}" for prefix, _, family in _levels(config) for k in _CLASS_WORDED if declared(family).get(k, "").rstrip("?") == "i"}
    return (
        count_type_problems(config, file, worded)
        + config_type_problems(config, file)
        + layer_types_problems(config, file)
        + architectures_problems(config, file)
        + rope_problems(config, file)
    )


#: transformers 5.20 (which vLLM 0.33 parses config.json with), per model_type: its config class, the
#: ``num_key_value_heads`` it holds where config.json has none (None: ``num_attention_heads``), and whether a null is
#: read as ``num_attention_heads`` (``__post_init__``; elsewhere a null is refused, :func:`config_type_problems`, or kept).
#: Read in each ``models/<family>/configuration_*.py`` and by building the class with and without the key.
_KV_DEFAULTS = {
    "llama": ("LlamaConfig", None, True),
    "mistral": ("MistralConfig", 8, False),
    "qwen2": ("Qwen2Config", 32, True),
    "qwen3": ("Qwen3Config", 32, True),
    "phi3": ("Phi3Config", None, True),
    "olmoe": ("OlmoeConfig", None, True),
    "mixtral": ("MixtralConfig", 8, False),
    "qwen2_moe": ("Qwen2MoeConfig", 16, False),
    "qwen3_moe": ("Qwen3MoeConfig", 4, False),
    "gemma2": ("Gemma2Config", 4, False),
    "gemma3_text": ("Gemma3TextConfig", 4, False),
    "glm4_moe": ("Glm4MoeConfig", 8, False),
    "gpt_oss": ("GptOssConfig", 8, False),
    "qwen2_vl_text": ("Qwen2VLTextConfig", 8, True),
    "qwen2_5_vl_text": ("Qwen2_5_VLTextConfig", 8, True),
    "qwen3_vl_text": ("Qwen3VLTextConfig", 32, True),
    "qwen3_next": ("Qwen3NextConfig", 2, False),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", 2, False),
    "llama4_text": ("Llama4TextConfig", 8, False),
    "glm4v_moe_text": ("Glm4vMoeTextConfig", 8, False),
    "gemma4_text": ("Gemma4TextConfig", 4, False),
    "minimax_m2": ("MiniMaxM2Config", 8, False),
}


def _class_type(model_type: str | None) -> str | None:
    """The model_type of the class vLLM 0.33 parses a level of a config with: another type's (:data:`_PARSED_AS`), a
    composite's text class (:data:`_TEXT_CLASS`), else its own."""
    mt = _PARSED_AS.get(model_type, model_type) if model_type else None
    return _TEXT_CLASS.get(mt, mt) if mt else None


#: transformers 5.20's class value of ``head_dim`` where config.json has none, for the classes whose value is a fixed
#: number and not ``hidden_size // num_attention_heads`` (read by building each class with ``hidden_size=256,
#: num_attention_heads=8`` and no ``head_dim``); vLLM 0.33 builds attention with the class's value (``qwen3.py``,
#: ``qwen3_moe.py``: ``getattr(config, "head_dim", None) or hidden_size // num_heads``; ``gemma2.py``, ``gemma3.py``,
#: ``gpt_oss.py``: ``config.head_dim``). Classes not listed give ``hidden_size // num_attention_heads`` or nothing, which
#: vLLM's files then compute.
_HEAD_DIM_DEFAULTS = {
    "qwen3": ("Qwen3Config", 128),
    "qwen3_vl_text": ("Qwen3VLTextConfig", 128),
    "minimax_m2": ("MiniMaxM2Config", 128),
    "llama4_text": ("Llama4TextConfig", 128),
    "gemma2": ("Gemma2Config", 256),
    "gemma3_text": ("Gemma3TextConfig", 256),
    "qwen3_next": ("Qwen3NextConfig", 256),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", 256),
    "gpt_oss": ("GptOssConfig", 64),
}


def head_dim(cfg: dict, model_type: str | None) -> tuple[int | None, str]:
    """``(head_dim, how config.json gives it)`` as vLLM 0.33 builds attention from ``cfg`` (a config or its
    ``text_config``) parsed as ``model_type``'s class: ``head_dim`` where it is a positive integer; where config.json
    has none, the class's fixed value (:data:`_HEAD_DIM_DEFAULTS`: a Qwen3 without it has 128, a gpt-oss 64, a Gemma 2
    or 3 256), else ``hidden_size // num_attention_heads``; ``(None, "")`` where none of these is known."""
    n = cfg.get("head_dim")
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return n, "head_dim"
    mt = _class_type(model_type)
    if "head_dim" not in cfg and mt in _HEAD_DIM_DEFAULTS:
        cls, default = _HEAD_DIM_DEFAULTS[mt]
        return default, f"head_dim, absent: transformers' {cls} default"
    h, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if isinstance(h, int) and isinstance(heads, int) and not isinstance(h, bool) and not isinstance(heads, bool) and heads > 0 and h % heads == 0:
        return h // heads, "hidden_size / num_attention_heads"
    return None, ""


def kv_head_count(config: dict) -> int | None:
    """The key/value heads of a model's attention (its ``text_config``'s where it has one): ``num_key_value_heads``, or
    where that is null or absent the number transformers 5.20's class gives (:func:`kv_heads`: a Qwen2 without it has
    32, not ``num_attention_heads``), else ``num_attention_heads`` (a type whose default is not known here); None where
    neither is an integer. For the TP plan and the KV-cache scales' shape, which must count the heads vLLM builds."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads = cfg.get("num_attention_heads")
    heads = heads if isinstance(heads, int) and not isinstance(heads, bool) else None
    _, n = kv_heads(cfg, cfg.get("model_type") or config.get("model_type"), heads)
    return n if n is not None else heads


def kv_heads(cfg: dict, model_type: str | None, heads: int | None) -> tuple[str, int | None]:
    """``(how config.json gives it, the number)`` of key/value heads vLLM 0.33 builds from ``cfg`` (a config, or its
    ``text_config``, parsed as ``model_type``'s class; ``heads``: its ``num_attention_heads``): ``num_key_value_heads``
    where it is an integer; where it is null or absent, the value transformers 5.20's class gives it
    (:data:`_KV_DEFAULTS`: a Llama without the key, or with null, has ``num_attention_heads`` of them; a Qwen2 without
    it 32, worded with the number: ``num_key_value_heads (absent: transformers' Qwen2Config default, 32)``), else None
    (not judged: another type is :func:`config_type_problems`')."""
    n = cfg.get("num_key_value_heads")
    if isinstance(n, int) and not isinstance(n, bool):
        return "num_key_value_heads", n
    cls, default, null_is_heads = _KV_DEFAULTS.get(_class_type(model_type), (None, 0, False))
    if cls is None or (n is not None) or ("num_key_value_heads" in cfg and not null_is_heads):
        return "num_key_value_heads", None
    if heads is None and ("num_key_value_heads" in cfg or default is None):  # the class takes num_attention_heads: unknown here
        return "num_key_value_heads", None
    if "num_key_value_heads" in cfg or default is None:
        what = "null" if "num_key_value_heads" in cfg else "absent"
        return f"num_key_value_heads ({what}: transformers' {cls} takes num_attention_heads)", heads
    return f"num_key_value_heads (absent: transformers' {cls} default, {default})", default  # (the number: in no config.json)
